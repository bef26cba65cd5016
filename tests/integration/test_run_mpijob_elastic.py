"""`nightshift run-mpijob --chaos` for real: an elastic Horovod job loses a worker host and takes it back.

The launcher runs the elastic horovodrun of the shared contract (`--host-discovery-script
/etc/mpi/discover_hosts.sh --blacklist-cooldown-range 2 120`) over `elastic_toy.py` on 3 emulated hosts;
`--chaos` kills worker 1's host 12 s after the launcher starts and restores it 4 s later. Horovod must see
both through discover_hosts.sh (3 ranks, then 2, then 3 again) and the job must succeed. A job that is not
elastic still fails when chaos kills a worker, naming it. Needs root, `ip`, `unshare` and `sshd`, as
test_run_mpijob; skips, saying which, without them.
"""

from __future__ import annotations

import itertools
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.integration.test_run_mpijob import MISSING, NIGHTSHIFT, _job, assert_nothing_left, finish, host_links

pytestmark = [pytest.mark.integration]
if MISSING:
    pytestmark.append(pytest.mark.skip(reason=MISSING))

TOY = str(Path(__file__).with_name("elastic_toy.py"))
# 60 steps at 3 ranks, 0.25 s apart: the toy cannot finish before the lost host is back.
TOY_ARGS = ["60", "3", "0.25"]
ELASTIC_HOROVODRUN = ["horovodrun", "--gloo", "-np", "3", "--min-np", "2", "--max-np", "3", "--slots-per-host", "1",
                      "--host-discovery-script", "/etc/mpi/discover_hosts.sh", "--blacklist-cooldown-range", "2",
                      "120"]


@pytest.fixture(scope="module")
def links_before() -> set[str]:
    return host_links()


def run_mpijob(tmp_path: Path, job: dict[str, Any], *extra: str) -> subprocess.Popen[str]:
    manifest = tmp_path / f"{job['metadata']['name']}.yaml"
    manifest.write_text(yaml.safe_dump(job))
    return subprocess.Popen([NIGHTSHIFT, "run-mpijob", str(manifest), "--timeout", "180", *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_an_elastic_job_loses_a_worker_host_and_takes_it_back_without_a_restart(
        tmp_path: Path, links_before: set[str]) -> None:
    job = _job("elastic", [*ELASTIC_HOROVODRUN, sys.executable, TOY, *TOY_ARGS], workers=3)
    # A rank waiting on a peer that is still alive but has given up on the lost one only learns of the loss
    # when its receive times out (Gloo's default: 30 s): 10 s, passed by horovodrun to every rank.
    job["spec"]["mpiReplicaSpecs"]["Launcher"]["template"]["spec"]["containers"][0]["env"] = [
        {"name": "HOROVOD_GLOO_TIMEOUT_SECONDS", "value": "10"}]
    proc = run_mpijob(tmp_path, job, "--chaos", "kill worker-1 at 12s; restore worker-1 at 16s")
    code, out, err = finish(proc, timeout=240)
    assert code == 0, err[-3000:] + out[-3000:]
    assert "MPIJob elastic succeeded" in err
    assert "elastic toy done: " in out and " 60 at size 3" in out

    steps = re.findall(r"step \d+ size (\d+) sum (\d+)", out)
    assert all(size == total for size, total in steps), "an allreduce did not sum one per rank"
    sizes = [int(size) for size, _ in steps]
    assert [size for size, _ in itertools.groupby(sizes)] == [3, 2, 3], sizes

    said = [line for line in err.splitlines() if line.startswith(("run-mpijob: chaos at", "run-mpijob: discover"))]
    assert re.search(r"chaos at 1\d\.\ds \(kill worker-1 at 12s\): killed elastic-worker-1 \(\d+ process\(es\), "
                     r"SIGKILL\); discover_hosts.sh lists 2 worker\(s\) \(-elastic-worker-1\): elastic-worker-0, "
                     r"elastic-worker-2$", said[0]), said
    assert "(restore worker-1 at 16s): restored elastic-worker-1 in its host" in said[1], said
    assert said[-1].endswith("discover_hosts.sh lists 3 worker(s) (+elastic-worker-1): elastic-worker-0, "
                             "elastic-worker-1, elastic-worker-2"), said
    assert "elastic-worker-1 runs again" in err
    assert "the job fails" not in err
    assert_nothing_left(proc.pid, links_before, TOY)
    print(next(line for line in err.splitlines() if "succeeded in" in line))


def test_chaos_killing_a_worker_of_a_job_that_is_not_elastic_fails_it_naming_the_worker(
        tmp_path: Path, links_before: set[str]) -> None:
    marker = "600.43"  # `sleep 600.43`: a process only this test starts, over ssh on the workers
    job = _job("plain", ["horovodrun", "--gloo", "-np", "2", "--hostfile", "/etc/mpi/hostfile", "sleep", marker])
    proc = run_mpijob(tmp_path, job, "--chaos", "kill worker-1 at 3s; restore worker-1 at 60s")
    code, _, err = finish(proc, timeout=120)
    assert code != 0
    assert "chaos at 3." in err and "(kill worker-1 at 3s): killed plain-worker-1" in err
    assert "worker plain-worker-1 stopped (killed by SIGKILL): the job fails" in err
    last = err.strip().splitlines()[-1]
    assert "lost host plain-worker-1 (its processes are gone: killed by SIGKILL)" in last, last
    assert "plain-worker-0" not in last
    assert "discover_hosts.sh" not in err
    assert_nothing_left(proc.pid, links_before, f"sleep {marker}")
