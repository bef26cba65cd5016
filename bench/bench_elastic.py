"""Training time lost to one host failure: elastic training against the retry path (issue 26).

The same training job, an MPIJob of 2 worker hosts (one rank each) run by `nightshift run-mpijob` on emulated
hosts, with the launcher command the operator renders (`operators.mpijob_spec.launcher_command`):
- elastic: `elastic: {min_workers: 1, max_workers: 2}`; `--chaos "kill worker-1 at 30s; restore worker-1 at
  60s"`: Horovod goes on with 1 rank from the last commit and takes the host back;
- retry: the fixed-size job; `--chaos "kill worker-1 at 30s"` fails it (as the MPI Operator would fail the
  launcher), and a new job with the same checkpoint directory resumes from the last checkpoint on disk, as the
  task's next try does; Airflow's retry delay (the train task's, 60 s by default) is reported beside it.
Each path also runs undisturbed; time lost = time to finish with the failure − the undisturbed run's time,
end to end (`run-mpijob` wall time: namespaces, sshd, horovodrun, imports, training). Repetitions alternate the
order of the runs. Goal: elastic loses at most 1/5 of what the retry path loses. Also reported: final
validation accuracy of the disturbed run against the undisturbed one (the issue asks ≤ 0.5 points).

Needs root, `ip`, `unshare` and sshd (network namespaces); prints why it skips otherwise. Two workers, not
three, because this machine has 2 cores, and each worker host pinned to a core of its own (`run-mpijob
--pin-cpus`: every process of worker i, sshd and the rank it starts, on core i), as a cluster gives each host its
own devices: unpinned, the ranks shared both cores and losing a host looked like a gain (the rank left trained
faster alone). Pinned, losing a host halves the throughput, as it does on a cluster.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

NIGHTSHIFT = str(Path(sys.executable).with_name("nightshift"))
WORKERS = 2
REPEATS = 3
KILL_AT, RESTORE_AT = 30, 60
# About 85 s undisturbed here (a wider digits_cnn than the demo's): still training when the host comes back
# at 60 s.
TRAIN_ARGS = ["--epochs", "100", "--batch-size", "16", "--lr", "0.02", "--threads", "1", "--seed", "5",
              "--model-kwargs", '{"channels": 64, "hidden": 256}',
              "--log-every", "40", "--checkpoint-every", "100", "--commit-every", "10", "--device", "cpu",
              "--collective-timeout", "10"]


def trainer_job(name: str, workdir: Path, data: Path, out: Path, ckpt: Path, *, elastic: bool,
                train_args: list[str] = TRAIN_ARGS, env: dict[str, str] | None = None,
                workers: int = WORKERS, wrapper: list[str] | None = None) -> dict[str, Any]:
    """The MPIJob: `workers` sshd workers of the trainer image's shape, the launcher command the operator
    renders for it (elastic: min `workers` - 1, max `workers`), the shared volume `bench` at `workdir`;
    `wrapper`: a command every rank's trainer runs under (its arguments follow)."""
    from operators.mpijob_spec import MPIJobConfig, launcher_command

    program = [*(wrapper or []), "python", "-m", "nightshift.train", "--data", str(data), "--out", str(out),
               "--checkpoint-dir", str(ckpt), *train_args]
    config = MPIJobConfig(image="nightshift-trainer", command=program, num_workers=workers,
                          min_workers=workers - 1 if elastic else None, network_interfaces="eth0")
    mounts = [{"name": "bench", "mountPath": str(workdir)}]
    volumes = [{"name": "bench", "persistentVolumeClaim": {"claimName": "bench"}}]

    def pod(role: str, command: list[str], pod_env: dict[str, str] | None = None) -> dict[str, Any]:
        container: dict[str, Any] = {"name": role, "image": "nightshift-trainer", "command": command,
                                     "volumeMounts": mounts}
        if pod_env:
            container["env"] = [{"name": k, "value": v} for k, v in pod_env.items()]
        return {"spec": {"containers": [container], "volumes": volumes}}

    worker = ["/usr/sbin/sshd", "-De", "-f", "/home/mpiuser/.sshd_config"]
    return {"apiVersion": "kubeflow.org/v2beta1", "kind": "MPIJob", "metadata": {"name": name},
            "spec": {"slotsPerWorker": 1, "sshAuthMountPath": "/home/mpiuser/.ssh", "mpiReplicaSpecs": {
                "Launcher": {"replicas": 1, "template": pod("launcher", launcher_command(config), env)},
                "Worker": {"replicas": workers, "template": pod("worker", worker)}}}}


def run_job(job: dict[str, Any], workdir: Path, chaos: str | None = None, timeout: float = 900
            ) -> tuple[int, float, str, str]:
    """`nightshift run-mpijob` the job; (exit status, wall seconds, stdout, stderr)."""
    manifest = workdir / f"{job['metadata']['name']}.yaml"
    manifest.write_text(yaml.safe_dump(job))
    argv = [NIGHTSHIFT, "run-mpijob", str(manifest), "--volume", f"bench={workdir}", "--timeout", str(int(timeout)),
            "--pin-cpus"]
    if chaos:
        argv += ["--chaos", chaos]
    start = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout + 120, check=False)
    return done.returncode, time.perf_counter() - start, done.stdout, done.stderr


def _summary(out: Path) -> dict[str, Any]:
    return json.loads((out / "metrics.json").read_text())


def one_path(kind: str, data: Path, workdir: Path, index: int) -> dict[str, float]:
    """One repetition of one path: its undisturbed and its disturbed run."""
    elastic = kind == "elastic"
    results: dict[str, float] = {"load": os.getloadavg()[0]}
    base = workdir / f"{kind}-{index}"
    calm_out = base / "calm-out"
    code, calm_s, out, err = run_job(trainer_job(f"{kind}-calm-{index}", workdir, data, calm_out, base / "calm-ckpt",
                                                 elastic=elastic), workdir)
    if code:
        raise RuntimeError(f"{kind} undisturbed run failed: {err.strip().splitlines()[-1:]}\n{out[-3000:]}")
    hit_out, hit_ckpt = base / "hit-out", base / "hit-ckpt"
    job = trainer_job(f"{kind}-hit-{index}", workdir, data, hit_out, hit_ckpt, elastic=elastic)
    if elastic:
        code, hit_s, out, err = run_job(job, workdir, f"kill worker-1 at {KILL_AT}s; restore worker-1 at {RESTORE_AT}s")
        if code:
            raise RuntimeError(f"elastic disturbed run failed: {err.strip().splitlines()[-1:]}\n{out[-3000:]}")
        summary = _summary(hit_out)
        results["resets"] = summary["elastic"]["resets"]
    else:
        code, first_s, out, err = run_job(job, workdir, f"kill worker-1 at {KILL_AT}s")
        if code == 0:
            raise RuntimeError("the fixed-size job survived a lost host: the retry path was not exercised")
        code, second_s, out, err = run_job(job, workdir)
        if code:
            raise RuntimeError(f"retry failed: {err.strip().splitlines()[-1:]}\n{out[-3000:]}")
        hit_s = first_s + second_s
        summary = _summary(hit_out)
        results["resumed_from"] = summary["resumed_from_step"] or 0
    calm = _summary(calm_out)
    results.update(calm_s=calm_s, calm_loop_s=calm["seconds"], hit_s=hit_s, lost_s=hit_s - calm_s,
                   accuracy_delta=summary["val_accuracy"] - calm["val_accuracy"],
                   calm_accuracy=calm["val_accuracy"], hit_accuracy=summary["val_accuracy"])
    return results


def main() -> None:
    from bench.bench_multihost import _why_not
    from nightshift.data.demo import write_demo_dataset

    reason = _why_not()  # root, ip, unshare, ssh and sshd, as the other emulated-host benchmark
    if reason:
        print(f"bench_elastic skipped: {reason}")
        return
    print(f"time lost to one host failure, {WORKERS} worker hosts, kill worker-1 at {KILL_AT}s (elastic: restore "
          f"at {RESTORE_AT}s); trainer {' '.join(TRAIN_ARGS)}; {REPEATS} repetitions; load "
          f"{'/'.join(f'{x:.1f}' for x in os.getloadavg())} (1/5/15 min) on {os.cpu_count()} cores", flush=True)
    runs: dict[str, list[dict[str, float]]] = {"elastic": [], "retry": []}
    with tempfile.TemporaryDirectory(prefix="bench-elastic-") as tmp:
        workdir = Path(tmp)
        data = workdir / "data"
        write_demo_dataset(data, seed=0)
        for repeat in range(REPEATS):
            for kind in (("elastic", "retry") if repeat % 2 == 0 else ("retry", "elastic")):
                result = one_path(kind, data, workdir, repeat)
                runs[kind].append(result)
                print(f"  repetition {repeat + 1} {kind:7s}: undisturbed {result['calm_s']:6.1f} s, with the "
                      f"failure {result['hit_s']:6.1f} s, lost {result['lost_s']:5.1f} s; val accuracy "
                      f"{result['hit_accuracy']:.4f} vs {result['calm_accuracy']:.4f} "
                      f"({result['accuracy_delta'] * 100:+.2f} points); load {result['load']:.1f} before",
                      flush=True)
    print(f"after the runs: load {'/'.join(f'{x:.1f}' for x in os.getloadavg())} (1/5/15 min)")
    lost = {kind: statistics.median(r["lost_s"] for r in results) for kind, results in runs.items()}
    ratio = lost["elastic"] / lost["retry"] if lost["retry"] > 0 else float("inf")
    delay = retry_delay_s()
    with_delay = lost["elastic"] / (lost["retry"] + delay)
    print("| path | undisturbed s | with the failure s | lost s (median, min–max) | accuracy Δ points (max |Δ|) |")
    print("|---|---|---|---|---|")
    for kind, results in runs.items():
        losses = [r["lost_s"] for r in results]
        deltas = [r["accuracy_delta"] * 100 for r in results]
        print(f"| {kind} | {statistics.median(r['calm_s'] for r in results):.1f} | "
              f"{statistics.median(r['hit_s'] for r in results):.1f} | {lost[kind]:.1f} "
              f"({min(losses):.1f}–{max(losses):.1f}) | {max(deltas, key=abs):+.2f} |")
    verdict = "met" if ratio <= 0.2 else "MISSED"
    print(f"elastic loses {ratio:.2f} of what the retry path loses between the jobs (goal ≤ 0.20: {verdict})")
    # What every elastic run pays, failure or not: its undisturbed run against the fixed-size one (same job).
    for what, key in (("end to end", "calm_s"), ("training loop", "calm_loop_s")):
        cost = statistics.median(r[key] for r in runs["elastic"]) / statistics.median(r[key] for r in runs["retry"])
        verdict = "met" if cost <= 1.05 else "MISSED"
        print(f"undisturbed elastic against fixed-size, {what}: {cost:.3f}x (goal ≤ 1.05: {verdict})")
    verdict = "met" if with_delay <= 0.2 else "MISSED"
    print(f"with the train task's retry delay ({delay:.0f} s, NIGHTSHIFT_TRAIN_RETRY_DELAY_S) that a DAG run waits "
          f"before its next try: {with_delay:.2f} (goal ≤ 0.20: {verdict})")


def retry_delay_s() -> float:
    """How long `nightly_retrain`'s train task waits before the try that resumes (its first retry)."""
    from dags.nightly_tasks.factory import train_retry_delay

    return train_retry_delay().total_seconds()
