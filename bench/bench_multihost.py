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
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
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


def manifest(name: str, hosts: int, workdir: Path, result: Path) -> dict[str, Any]:
    mounts = [{"name": "bench", "mountPath": str(workdir)}]
    volumes = [{"name": "bench", "persistentVolumeClaim": {"claimName": "bench"}}]

    def pod(role: str, command: list[str]) -> dict[str, Any]:
        return {"spec": {"containers": [{"name": role, "image": "nightshift-trainer", "command": command,
                                          "volumeMounts": mounts}], "volumes": volumes}}

    launcher = ["horovodrun", "--gloo", "-np", str(hosts), "--hostfile", "/etc/mpi/hostfile",
                "python", str(workdir / "allreduce.py"), str(result), ",".join(map(str, SIZES_MB)), str(REPEATS)]
    worker = ["/usr/sbin/sshd", "-De", "-f", "/home/mpiuser/.sshd_config"]
    return {"apiVersion": "kubeflow.org/v2beta1", "kind": "MPIJob", "metadata": {"name": name},
            "spec": {"slotsPerWorker": 1, "sshAuthMountPath": "/home/mpiuser/.ssh", "mpiReplicaSpecs": {
                "Launcher": {"replicas": 1, "template": pod("launcher", launcher)},
                "Worker": {"replicas": hosts, "template": pod("worker", worker)}}}}


def measure(rate: str, hosts: int, workdir: Path) -> dict[str, Any]:
    from nightshift.mpijob_local.network import parse_rate

    name = f"allreduce-{rate}-{hosts}"
    result = workdir / f"{name}.json"
    job = workdir / f"{name}.yaml"
    job.write_text(yaml.safe_dump(manifest(name, hosts, workdir, result)))
    done = subprocess.run([NIGHTSHIFT, "run-mpijob", str(job), "--volume", f"bench={workdir}", "--link-rate", rate,
                           "--timeout", "600"], capture_output=True, text=True, timeout=700, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{name} failed: {done.stderr.strip().splitlines()[-1:]}\n{done.stdout[-2000:]}")
    link_bytes = parse_rate(rate) / 8
    rows = []
    for entry in json.loads(result.read_text())["results"]:
        fractions = sorted(entry["mb"] * 2**20 / t * 2 * (hosts - 1) / hosts / link_bytes for t in entry["seconds"])
        seconds = statistics.median(entry["seconds"])
        busbw = entry["mb"] * 2**20 / seconds * 2 * (hosts - 1) / hosts
        rows.append({"mb": entry["mb"], "seconds": seconds, "busbw": busbw, "fraction": busbw / link_bytes,
                     "lowest": fractions[0], "highest": fractions[-1]})
    return {"rate": rate, "hosts": hosts, "rows": rows}


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
