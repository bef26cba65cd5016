"""`nightshift run-mpijob --chaos` for real: the elastic trainer loses a worker host and takes it back.

The launcher runs the elastic horovodrun the operator renders (`--host-discovery-script
/etc/mpi/discover_hosts.sh --blacklist-cooldown-range 2 120`, `bench.bench_elastic.trainer_job`) over the trainer
on 3 emulated hosts; `--chaos` kills worker 1's host 5 s after the trainer's first line (`--chaos-after`: once the
ranks met, however long the machine took to start them) and restores it 6 s later.
Horovod must see both through discover_hosts.sh (3 ranks, then 2, then 3 again), every rank must log the reset,
the job must succeed without a restart and end as accurate as an undisturbed run (within two validation samples). A job
that is not elastic still fails when chaos kills a worker, naming it. Needs root, `ip`, `unshare` and `sshd`, as
test_run_mpijob; skips, saying which, without them.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
import yaml

from bench.bench_elastic import trainer_job
from tests.integration.horovod_helpers import HOROVODRUN
from tests.integration.test_run_mpijob import MISSING, NIGHTSHIFT, _job, assert_nothing_left, finish, host_links

pytestmark = [pytest.mark.integration]
if MISSING:
    pytestmark.append(pytest.mark.skip(reason=MISSING))

# About 55 s of training at 3 ranks here: still training when the lost host is taken back (the ranks left reset
# within the collective timeout after the kill; the host is listed again 6 s after the kill and taken in after the
# blacklist cool-down of 4-6 s). The chaos clock starts at rank 0's first line (CHAOS_AFTER), after the ranks' first
# rendezvous: a host lost before it fails the job (docs/how-to/elastic.md). The collective timeout is the
# trainer's default, Horovod's 30 s; the join timeout (how long the ranks wait in the rendezvous for a process
# joining) the trainer's default, 60 s.
TRAIN_ARGS = ["--epochs", "40", "--batch-size", "16", "--lr", "0.02", "--threads", "1", "--seed", "5",
              "--log-every", "40", "--checkpoint-every", "100", "--commit-every", "10", "--device", "cpu",
              "--collective-timeout", "30"]
CHAOS_AFTER = "elastic training on "  # rank 0, once every rank joined (nightshift/train/elastic.py, fit)


def slow_rejoin(workdir: Path, then: str) -> list[str]:
    """A wrapper for every rank's trainer: the first process on each host starts at once; a later one (the process
    Horovod starts for a host that comes back) runs `then` first: a joiner slow to start, or one that never comes."""
    script = (f'm="{workdir}/started-$(hostname)"; if [ -e "$m" ]; then {then}; fi; touch "$m"; exec "$@"')
    return ["sh", "-c", script, "slow-rejoin"]


@pytest.fixture(scope="module")
def links_before() -> set[str]:
    return host_links()


def run_mpijob(tmp_path: Path, job: dict[str, Any], *extra: str) -> subprocess.Popen[str]:
    manifest = tmp_path / f"{job['metadata']['name']}.yaml"
    manifest.write_text(yaml.safe_dump(job))
    return subprocess.Popen([NIGHTSHIFT, "run-mpijob", str(manifest), "--timeout", "240", *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_the_trainer_loses_a_worker_host_and_takes_it_back_without_a_restart(
        tmp_path: Path, demo_data: Path, links_before: set[str]) -> None:
    """The process started for the returning host reaches the rendezvous 40 s late, past the collective timeout
    (issue 35 item 5: upstream Horovod's ranks gave up on it after that timeout and the job failed; a slow start on a
    loaded machine did it in CI): the others wait for it up to the join timeout, and it joins."""
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    job = trainer_job("elastic", tmp_path, demo_data, out, ckpt, elastic=True, train_args=TRAIN_ARGS,
                      workers=3, wrapper=slow_rejoin(tmp_path, "sleep 40"))
    proc = run_mpijob(tmp_path, job, "--volume", f"bench={tmp_path}", "--chaos",
                      "kill worker-1 at 5s; restore worker-1 at 11s", "--chaos-after", CHAOS_AFTER)
    code, stdout, err = finish(proc, timeout=300)
    ranks = [line for line in stdout.splitlines() if "<stderr>:" in line and "step " not in line]
    assert code == 0, err[-3000:] + "\n".join(ranks[-40:])
    assert "MPIJob elastic succeeded" in err and "the job fails" not in err
    summary = json.loads((out / "metrics.json").read_text())
    assert summary["elastic"]["world_sizes"] == [3, 2, 3], summary

    # Every rank's log shows the reset: the two that went on saw both (which ranks they were depends on the order
    # Horovod gave the hosts), the process started for the returning host joined with the state.
    resets: dict[str, list[str]] = {}
    for line in stdout.splitlines():
        found = re.search(r"\[(\d+)\]<stderr>:.*(elastic reset \d: now rank \d of \d \(was rank \d of \d\))", line)
        if found:
            resets.setdefault(found.group(1), []).append(found.group(2))
    assert len(resets) == 2, resets
    for seen in resets.values():
        assert len(seen) == 2 and seen[0].startswith("elastic reset 1: ") and " of 2 (was rank " in seen[0], resets
        assert seen[1].startswith("elastic reset 2: ") and " of 3 (was rank " in seen[1] and seen[1].endswith(" of 2)")
    assert stdout.count("joined the running elastic job as rank 2 of 3 at step") == 1

    said = [line for line in err.splitlines() if line.startswith(("run-mpijob: chaos at", "run-mpijob: discover"))]
    assert "the chaos script's clock starts" in err
    assert re.search(r"chaos at 5\.\ds \(kill worker-1 at 5s\): killed elastic-worker-1 \(\d+ process\(es\), "
                     r"SIGKILL\); discover_hosts.sh lists 2 worker\(s\) \(-elastic-worker-1\): elastic-worker-0, "
                     r"elastic-worker-2$", said[0]), said
    assert "(restore worker-1 at 11s): restored elastic-worker-1 in its host" in said[1], said
    assert said[-1].endswith("discover_hosts.sh lists 3 worker(s) (+elastic-worker-1): elastic-worker-0, "
                             "elastic-worker-1, elastic-worker-2"), said
    assert_nothing_left(proc.pid, links_before, str(ckpt))  # the ranks: their command lines name it

    # The same training undisturbed (3 ranks of an elastic horovodrun on this machine): as accurate.
    discovery = tmp_path / "discover_hosts.sh"
    discovery.write_text("#!/bin/sh\necho localhost:3\n")
    discovery.chmod(0o755)
    calm_out = tmp_path / "calm"
    calm = subprocess.run([HOROVODRUN, "--gloo", "-np", "3", "--min-np", "2", "--max-np", "3",
                           "--network-interfaces", "lo", "--host-discovery-script", str(discovery), sys.executable,
                           "-m", "nightshift.train", "--data", str(demo_data), "--out", str(calm_out),
                           "--checkpoint-dir", str(tmp_path / "calm-ckpt"), *TRAIN_ARGS, "--elastic"],
                          capture_output=True, text=True, timeout=300)
    assert calm.returncode == 0, calm.stderr[-3000:]
    undisturbed = json.loads((calm_out / "metrics.json").read_text())
    assert undisturbed["elastic"]["world_sizes"] == [3]
    # Within two samples of the 270-row validation split (one is 0.37 points): the elastic run's steps group other
    # samples than the undisturbed run's once the world size changed, so the two end a sample or two apart (a cold
    # CI rehearsal: 0.9741 against 0.9815, two samples; half a point was one sample and failed on it).
    rows = len(pd.read_parquet(demo_data / "validation.parquet"))
    assert abs(summary["val_accuracy"] - undisturbed["val_accuracy"]) <= 2 / rows + 1e-9, (summary, undisturbed)


def test_a_returning_host_whose_process_never_joins_costs_a_pause_not_the_job(
        tmp_path: Path, demo_data: Path, links_before: set[str]) -> None:
    """Issue 35 item 5: the process started for the returning host dies before it joins (once: the host's next
    process, after Horovod's blacklist cool-down, joins). The ranks left wait the join timeout (15 s here) in the
    rendezvous, then join the elastic driver's next round without it, and the job goes on."""
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    wrapper = slow_rejoin(tmp_path, f'if [ ! -e "{tmp_path}/died" ]; then touch "{tmp_path}/died"; exit 1; fi')
    job = trainer_job("never", tmp_path, demo_data, out, ckpt, elastic=True,
                      train_args=[*TRAIN_ARGS, "--join-timeout", "15"], workers=3, wrapper=wrapper)
    proc = run_mpijob(tmp_path, job, "--volume", f"bench={tmp_path}", "--chaos",
                      "kill worker-1 at 5s; restore worker-1 at 11s", "--chaos-after", CHAOS_AFTER)
    code, stdout, err = finish(proc, timeout=300)
    ranks = [line for line in stdout.splitlines() if "<stderr>:" in line and "step " not in line]
    assert code == 0, err[-3000:] + "\n".join(ranks[-40:])
    assert (tmp_path / "died").exists()
    summary = json.loads((out / "metrics.json").read_text())
    sizes = summary["elastic"]["world_sizes"]
    assert sizes[:2] == [3, 2], summary
    # The two ranks left waited for the process that died, then went on: each says so once.
    assert stdout.count("Horovod's rendezvous failed (attempt 1 of 10: ") == 2, "\n".join(ranks[-40:])
    assert "rendezvous failed (attempt 2" not in stdout
    assert_nothing_left(proc.pid, links_before, str(ckpt))


def test_a_worker_restarted_in_place_stays_listed_and_the_job_takes_it_back(
        tmp_path: Path, demo_data: Path, links_before: set[str]) -> None:
    """Issue 35 item 3: as on a cluster, an elastic job's workers run with restartPolicy OnFailure (what the operator
    renders); a killed worker's container is restarted in its pod by the kubelet after its back-off (10 s), and the
    pod stays Running, so the MPI Operator keeps it in discover_hosts.sh all along. Horovod tries the listed host,
    fails while its sshd is down, blacklists it for the cool-down, and takes it back once it runs."""
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    job = trainer_job("inplace", tmp_path, demo_data, out, ckpt, elastic=True,
                      train_args=[*TRAIN_ARGS, "--join-timeout", "15"], workers=3)
    job["spec"]["mpiReplicaSpecs"]["Worker"]["restartPolicy"] = "OnFailure"
    proc = run_mpijob(tmp_path, job, "--volume", f"bench={tmp_path}", "--chaos", "kill worker-1 at 5s",
                      "--chaos-after", CHAOS_AFTER)
    code, stdout, err = finish(proc, timeout=300)
    ranks = [line for line in stdout.splitlines() if "<stderr>:" in line and "step " not in line]
    assert code == 0, err[-3000:] + "\n".join(ranks[-40:])
    said = [line for line in err.splitlines() if line.startswith(("run-mpijob: chaos at", "run-mpijob: discover",
                                                                   "run-mpijob: worker"))]
    assert re.search(r"chaos at 5\.\ds \(kill worker-1 at 5s\): killed inplace-worker-1 .*restartPolicy OnFailure: the "
                     r"kubelet restarts its container in place in 10s \(restart 1\); its pod stays Running, listed "
                     r"in discover_hosts.sh; discover_hosts.sh lists 3 worker\(s\), unchanged$", said[0]), said
    assert "run-mpijob: worker inplace-worker-1: the kubelet restarted its container in place (restart 1)" in said
    assert not any("discover_hosts.sh lists 2" in line for line in said), said  # never dropped
    summary = json.loads((out / "metrics.json").read_text())
    sizes = summary["elastic"]["world_sizes"]
    assert sizes[:2] == [3, 2] and sizes[-1] == 3, summary
    assert_nothing_left(proc.pid, links_before, str(ckpt))


def test_chaos_killing_a_worker_of_a_job_that_is_not_elastic_fails_it_naming_the_worker(
        tmp_path: Path, links_before: set[str]) -> None:
    marker = "600.43"  # `sleep 600.43`: a process only this test starts, over ssh on the workers
    job = _job("plain", ["horovodrun", "--gloo", "-np", "2", "--hostfile", "/etc/mpi/hostfile", "sleep", marker])
    # Not in the ranks' first seconds: a kill then can land in the ssh session's start-up, which on this machine runs
    # root's ~/.bashrc (`pyenv init`, a `pyenv rehash` under a lock file): a rehash killed mid-way leaves the lock,
    # and every later `pyenv` start waits 60 s for it (seen once: it failed the suite's later ssh-based tests).
    proc = run_mpijob(tmp_path, job, "--chaos", "kill worker-1 at 10s")
    code, _, err = finish(proc, timeout=120)
    assert code != 0
    assert "chaos at 10." in err and "(kill worker-1 at 10s): killed plain-worker-1" in err
    assert "worker plain-worker-1 stopped (killed by SIGKILL): the job fails" in err
    last = err.strip().splitlines()[-1]
    assert "lost host plain-worker-1 (its processes are gone: killed by SIGKILL)" in last, last
    assert "plain-worker-0" not in last
    assert "discover_hosts.sh" not in err
    assert_nothing_left(proc.pid, links_before, f"sleep {marker}")
