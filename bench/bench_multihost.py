"""Allreduce bus bandwidth between emulated hosts on links limited with `tc` (issue 9).

Each configuration is one MPIJob run by `nightshift run-mpijob --link-rate RATE`: N worker hosts, one
rank each, every host's veth limited to RATE in both directions (tbf). Rank 0's numbers come back on the
job's shared volume. For each tensor size the ranks run a warm-up allreduce, then REPEATS timed ones,
each after a barrier; a repeat's time is the slowest rank's; the median is reported, with the lowest
and highest repeat.

    algbw = bytes / seconds             busbw = algbw × 2(n−1)/n  (ring allreduce: each host sends and
                                                                   receives 2(n−1)/n of the tensor)
    fraction of link = busbw / (RATE / 8)

RATE is the tbf rate, which counts Ethernet frames (payload + 66 bytes of TCP/IP/Ethernet headers per
1448-byte segment), so the TCP payload ceiling is about 0.956 of it. Needs root; prints why it skips
otherwise. The 2 cores of this machine run every rank, sshd and the kernel's veth and TCP work.

A second mode, `python -m bench multihost-steps` (`main_steps`), times the trainer itself across 1, 2 and 4
hosts on the 1 Gbit/s link, with and without fp16 gradient compression, against the ideal step time (the
1-host step split over the ranks plus the ring allreduce of the gradient bytes at the link's rate).
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

SIZES_MB = (1, 4, 16, 64, 256)
REPEATS = 7
CONFIGS = (("1gbit", 2), ("1gbit", 4), ("10gbit", 2), ("10gbit", 4))
NIGHTSHIFT = str(Path(sys.executable).with_name("nightshift"))

ALLREDUCE = r"""
import json, sys, time
import torch
import horovod.torch as hvd

hvd.init()
torch.set_num_threads(1)
out, repeats = sys.argv[1], int(sys.argv[3])
results = []
for mb in (int(x) for x in sys.argv[2].split(",")):
    tensor = torch.ones(mb * 2**20 // 4)
    hvd.allreduce_(tensor, op=hvd.Sum, name=f"warm.{mb}")
    times = []
    for r in range(repeats):
        hvd.barrier()
        start = time.perf_counter()
        hvd.allreduce_(tensor, op=hvd.Sum, name=f"t.{mb}")
        times.append(time.perf_counter() - start)
    slowest = hvd.allreduce(torch.tensor(times, dtype=torch.float64), op=hvd.Max, name=f"max.{mb}")
    results.append({"mb": mb, "seconds": slowest.tolist()})
if hvd.rank() == 0:
    with open(out, "w") as f:
        json.dump({"size": hvd.size(), "results": results}, f)
"""


def manifest(name: str, hosts: int, workdir: Path, program: list[str]) -> dict[str, Any]:
    """An MPIJob as the operator builds it: `horovodrun --gloo` over /etc/mpi/hostfile runs `program` on
    `hosts` workers (one slot each, sshd as images/trainer runs it); `workdir` is the shared volume."""
    mounts = [{"name": "bench", "mountPath": str(workdir)}]
    volumes = [{"name": "bench", "persistentVolumeClaim": {"claimName": "bench"}}]

    def pod(role: str, command: list[str]) -> dict[str, Any]:
        return {"spec": {"containers": [{"name": role, "image": "nightshift-trainer", "command": command,
                                          "volumeMounts": mounts}], "volumes": volumes}}

    # The pods' eth0 named: left to find the NICs itself, horovodrun with ONE worker host finds {eth0, lo}
    # routable (that worker probes itself) and puts its rendezvous on the first of a Python set, 127.0.0.1
    # for about half of the hash seeds, where the rank cannot reach it ("HTTP GET request failed too many times").
    launcher = ["horovodrun", "--gloo", "--network-interfaces", "eth0", "-np", str(hosts),
                "--hostfile", "/etc/mpi/hostfile", *program]
    worker = ["/usr/sbin/sshd", "-De", "-f", "/home/mpiuser/.sshd_config"]
    return {"apiVersion": "kubeflow.org/v2beta1", "kind": "MPIJob", "metadata": {"name": name},
            "spec": {"slotsPerWorker": 1, "sshAuthMountPath": "/home/mpiuser/.ssh", "mpiReplicaSpecs": {
                "Launcher": {"replicas": 1, "template": pod("launcher", launcher)},
                "Worker": {"replicas": hosts, "template": pod("worker", worker)}}}}


def run_job(name: str, hosts: int, workdir: Path, program: list[str], rate: str) -> float:
    """Run one MPIJob with `nightshift run-mpijob --link-rate rate`; its wall time in seconds."""
    job = workdir / f"{name}.yaml"
    job.write_text(yaml.safe_dump(manifest(name, hosts, workdir, program)))
    start = time.perf_counter()
    done = subprocess.run([NIGHTSHIFT, "run-mpijob", str(job), "--volume", f"bench={workdir}", "--link-rate", rate,
                           "--timeout", "600"], capture_output=True, text=True, timeout=700, check=False)
    wall = time.perf_counter() - start
    if done.returncode != 0:  # the pods' own lines (ranks, sshd), not horovodrun's traceback
        lines = [line for line in done.stdout.splitlines() if "-launcher]  " not in line]
        raise JobFailed(f"{name} failed: {done.stderr.strip().splitlines()[-1:]}\n" + "\n".join(lines[-60:]))
    return wall


class JobFailed(RuntimeError):
    """`nightshift run-mpijob` exited non-zero; the message holds its last error and the pods' last lines."""


def measure(rate: str, hosts: int, workdir: Path) -> dict[str, Any]:
    from nightshift.mpijob_local.network import parse_rate

    name = f"allreduce-{rate}-{hosts}"
    result = workdir / f"{name}.json"
    run_job(name, hosts, workdir, ["python", str(workdir / "allreduce.py"), str(result),
                                   ",".join(map(str, SIZES_MB)), str(REPEATS)], rate)
    link_bytes = parse_rate(rate) / 8
    rows = []
    for entry in json.loads(result.read_text())["results"]:
        fractions = sorted(entry["mb"] * 2**20 / t * 2 * (hosts - 1) / hosts / link_bytes for t in entry["seconds"])
        seconds = statistics.median(entry["seconds"])
        busbw = entry["mb"] * 2**20 / seconds * 2 * (hosts - 1) / hosts
        rows.append({"mb": entry["mb"], "seconds": seconds, "busbw": busbw, "fraction": busbw / link_bytes,
                     "lowest": fractions[0], "highest": fractions[-1]})
    return {"rate": rate, "hosts": hosts, "rows": rows}


# ------------------------------------------------------------------ trainer step time (multihost-steps)
# `python -m bench multihost-steps`: `python -m nightshift.train` on the demo data as an MPIJob on 1, 2 and 4
# hosts (one rank each, 1 torch thread), the same global batch, every link at STEP_RATE, with and without
# `--compression fp16`. digits_cnn with a 2048-wide hidden layer: 2.14 M parameters, 8.6 MB of fp32
# gradients per step (the default 128-wide model's 0.4 MB would cross a 1 Gbit/s link in ~3 ms, hiding the
# link behind the compute), while one step of the global batch takes ~0.15–0.2 s of compute on one core.
STEP_RATE = "1gbit"
STEP_RUNS = ((1, "none"), (2, "none"), (2, "fp16"), (4, "none"), (4, "fp16"))
STEP_MODEL_KWARGS = {"channels": 32, "hidden": 2048}
STEP_GLOBAL_BATCH = 256
STEP_EPOCHS = 12  # 5 steps an epoch on the demo's 1257 training rows at every world size: 60 steps a run
STEP_REPEATS = 3
TCP_PAYLOAD_SHARE = 1448 / (1448 + 66)  # of a tbf rate (Ethernet frames): TCP payload of a full segment


def model_parameters(model_kwargs: dict[str, Any]) -> int:
    """How many parameters (hence gradient elements) the demo model has with these arguments."""
    from nightshift.models import build_model

    model = build_model("digits_cnn", input_shape=(1, 8, 8), num_classes=10, **model_kwargs)
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def gradient_bytes(parameters: int, compression: str) -> int:
    """Bytes each rank allreduces per step: fp32 gradients, or fp16 ones under `--compression fp16`."""
    if compression not in ("none", "fp16"):
        raise ValueError(f"compression must be 'none' or 'fp16', got {compression!r}")
    return parameters * (2 if compression == "fp16" else 4)


def ring_allreduce_seconds(nbytes: float, hosts: int, rate_bits: float) -> float:
    """What the link alone costs: a ring allreduce sends and receives 2(n−1)/n of the bytes on every
    host's link, at the TCP payload rate of a `rate_bits` tbf link. 0 on one host (nothing to reduce)."""
    if hosts < 1 or rate_bits <= 0 or nbytes < 0:
        raise ValueError(f"need hosts >= 1, a positive rate and bytes >= 0, got {hosts}, {rate_bits}, {nbytes}")
    if hosts == 1:
        return 0.0
    return 2 * (hosts - 1) / hosts * nbytes / (rate_bits / 8 * TCP_PAYLOAD_SHARE)


def ideal_step_seconds(one_host: float, hosts: int, link_seconds: float, cores: int | None = None) -> float:
    """The ideal step at a fixed global batch: the 1-host step's compute split over the ranks (over at most
    `cores` of them when the ranks share that many cores), plus the link's allreduce time, not overlapped."""
    if hosts < 1 or one_host <= 0 or link_seconds < 0 or (cores is not None and cores < 1):
        raise ValueError(f"need hosts >= 1, cores >= 1, a positive step and link time >= 0, "
                         f"got {hosts}, {cores}, {one_host}, {link_seconds}")
    return one_host / min(hosts, cores or hosts) + link_seconds


def scaling_efficiency(one_host: float, hosts: int, step: float) -> float:
    """Strong-scaling efficiency at a fixed global batch: speed-up over 1 host / hosts."""
    if hosts < 1 or one_host <= 0 or step <= 0:
        raise ValueError(f"need hosts >= 1 and positive step times, got {hosts}, {one_host}, {step}")
    return one_host / (hosts * step)


def train_once(hosts: int, compression: str, data: Path, workdir: Path, retry: bool = False
               ) -> dict[str, float]:
    run = workdir / f"steps-{hosts}-{compression}-{len(list(workdir.glob('steps-*.yaml')))}"
    out, ckpt = run / "out", run / "ckpt"
    program = ["python", "-m", "nightshift.train", "--data", str(data), "--out", str(out), "--checkpoint-dir",
               str(ckpt), "--epochs", str(STEP_EPOCHS), "--batch-size", str(STEP_GLOBAL_BATCH // hosts),
               "--model-kwargs", json.dumps(STEP_MODEL_KWARGS), "--threads", "1", "--device", "cpu",
               "--compression", compression, "--log-every", "1000", "--checkpoint-every", "1000"]
    load_before = os.getloadavg()[0]
    try:
        wall = run_job(run.name, hosts, workdir, program, STEP_RATE)
    except JobFailed as err:  # counted and shown; the run is repeated once in fresh directories
        if retry:
            raise
        print(f"  ! {err}\n  ! running {run.name} again", flush=True)
        result = train_once(hosts, compression, data, workdir, retry=True)
        return {**result, "failed": 1}
    summary = json.loads((out / "metrics.json").read_text())
    if summary["steps_run"] != summary["steps"] or summary["world_size"] != hosts:
        raise RuntimeError(f"{run.name}: ran {summary['steps_run']} of {summary['steps']} steps on "
                           f"{summary['world_size']} ranks; expected a fresh run on {hosts}")
    loop = summary["seconds"] - summary["checkpoint_seconds"]
    return {"step": loop / summary["steps_run"], "wall": wall, "load": load_before, "steps": summary["steps_run"]}


def _spread(values: list[float], scale: float = 1.0, digits: int = 0) -> str:
    return (f"{statistics.median(values) * scale:.{digits}f} "
            f"({min(values) * scale:.{digits}f}–{max(values) * scale:.{digits}f})")


def main_steps() -> None:
    from nightshift.data.demo import write_demo_dataset
    from nightshift.mpijob_local.network import parse_rate

    reason = _why_not()
    if reason:
        print(f"bench_multihost steps skipped: {reason}")
        return
    parameters = model_parameters(STEP_MODEL_KWARGS)
    rate = parse_rate(STEP_RATE)
    cores = os.cpu_count() or 1
    print(f"trainer step time: digits_cnn {STEP_MODEL_KWARGS} ({parameters:,} parameters, "
          f"{gradient_bytes(parameters, 'none') / 1e6:.1f} MB fp32 gradients), global batch {STEP_GLOBAL_BATCH}, "
          f"{STEP_EPOCHS} epochs, links {STEP_RATE}, {STEP_REPEATS} repeats in rotated order; "
          f"load {'/'.join(f'{x:.1f}' for x in os.getloadavg())} (1/5/15 min) on {cores} cores", flush=True)
    runs: dict[tuple[int, str], list[dict[str, float]]] = {config: [] for config in STEP_RUNS}
    with tempfile.TemporaryDirectory(prefix="bench-multihost-steps-") as tmp:
        workdir = Path(tmp)
        data = workdir / "data"
        write_demo_dataset(data, rows=1797, seed=0)
        for repeat in range(STEP_REPEATS):
            order = STEP_RUNS[repeat % len(STEP_RUNS):] + STEP_RUNS[:repeat % len(STEP_RUNS)]
            for hosts, compression in order:
                result = train_once(hosts, compression, data, workdir)
                runs[(hosts, compression)].append(result)
                print(f"  repeat {repeat + 1}: {hosts} host(s) compression {compression:4s} "
                      f"step {result['step'] * 1e3:7.1f} ms  end to end {result['wall']:6.1f} s  "
                      f"({result['steps']:.0f} steps, load {result['load']:.1f} before)", flush=True)
    failed = sum(r.get("failed", 0) for results in runs.values() for r in results)
    print(f"after the runs: load {'/'.join(f'{x:.1f}' for x in os.getloadavg())} (1/5/15 min); "
          f"{failed} job(s) failed and ran again")
    one_host = statistics.median(r["step"] for r in runs[(1, "none")])
    print("| hosts | compression | bytes allreduced | link alone ms | step ms | ideal ms (n cores / "
          f"{cores} cores) | efficiency | ideal efficiency (n / {cores} cores) | end to end s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for hosts, compression in STEP_RUNS:
        results = runs[(hosts, compression)]
        step = statistics.median(r["step"] for r in results)
        nbytes = gradient_bytes(parameters, compression)
        link = ring_allreduce_seconds(nbytes, hosts, rate)
        ideal = ideal_step_seconds(one_host, hosts, link)
        ideal_cores = ideal_step_seconds(one_host, hosts, link, cores)
        sent = f"{nbytes / 1e6:.1f} MB" if hosts > 1 else "— (1 rank)"
        print(f"| {hosts} | {compression} | {sent} | {link * 1e3:.0f} | "
              f"{_spread([r['step'] for r in results], 1e3)} | {ideal * 1e3:.0f} / {ideal_cores * 1e3:.0f} | "
              f"{scaling_efficiency(one_host, hosts, step):.2f} | "
              f"{scaling_efficiency(one_host, hosts, ideal):.2f} / "
              f"{scaling_efficiency(one_host, hosts, ideal_cores):.2f} | "
              f"{_spread([r['wall'] for r in results], digits=1)} |")


def _why_not() -> str | None:
    if os.geteuid() != 0:
        return "needs root (network namespaces)"
    for tool in ("ip", "tc", "unshare", "ssh"):
        if shutil.which(tool) is None:
            return f"`{tool}` not found"
    if not os.access("/usr/sbin/sshd", os.X_OK):
        return "/usr/sbin/sshd not found (apt-get install -y openssh-server)"
    return None


def main() -> None:
    reason = _why_not()
    if reason:
        print(f"bench_multihost skipped: {reason}")
        return
    with tempfile.TemporaryDirectory(prefix="bench-multihost-") as tmp:
        workdir = Path(tmp)
        (workdir / "allreduce.py").write_text(ALLREDUCE)
        print(f"busbw / link rate: median of {REPEATS} (lowest–highest); load average {os.getloadavg()[0]:.1f}")
        print("| link | hosts | " + " | ".join(f"{mb} MB" for mb in SIZES_MB) + " |")
        print("|---|---|" + "---|" * len(SIZES_MB))
        for rate, hosts in CONFIGS:
            measured = measure(rate, hosts, workdir)
            cells = [f"{r['fraction']:.2f} ({r['lowest']:.2f}–{r['highest']:.2f})" for r in measured["rows"]]
            print(f"| {rate} | {hosts} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
