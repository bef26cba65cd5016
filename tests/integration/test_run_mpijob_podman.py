"""`nightshift run-mpijob --runtime podman`: the MPIJob `nightshift plan` renders, in containers of the trainer image.

Each pod is a container of `localhost/nightshift/trainer:cpu` (built by `make images`) inside its emulated host's
network namespace; MLflow is a `--service` of this machine on the job's network. The same job by the host runtime
(this machine's venv: the same torch, CPU, the same data) is the yardstick, bit for bit. The elastic trainer
(`bench.bench_elastic.trainer_job`) loses a worker container to `--chaos` and takes a new one back, the launcher's
container reading each rewrite of discover_hosts.sh. Needs root and podman, skips, saying which, without them; the
image comes from this test run's one build (tests/images_build.py), which the first test waits for.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from bench.bench_elastic import trainer_job
from nightshift.mpijob_local import network, podman
from nightshift.mpijob_local.manifest import DISCOVER_HOSTS
from tests import images_build
from tests.integration.horovod_helpers import processes_mentioning
from tests.integration.test_run_mpijob import (
    CONF,
    NIGHTSHIFT,
    THREADS,
    Site,
    assert_bitwise_equal,
    finish,
    host_links,
    make_site,
    namespace_pids,
    trainer_arg,
    wait_for,
    without_mlflow,
)
from tests.integration.test_run_mpijob import _missing as _missing_host
from tests.integration.test_run_mpijob import assert_nothing_left as assert_nothing_left_by_host_runs
from tests.integration.test_run_mpijob_elastic import CHAOS_AFTER, TRAIN_ARGS

IMAGE = "localhost/nightshift/trainer:cpu"
SETTINGS = podman.PodmanSettings.from_environment()
CONF_1 = {**CONF, "epochs": 1, "batch_size": 16}  # 1 epoch of 40 steps (2 ranks x 16): small
# The elastic trainer's chaos, seconds from rank 0's first line (`--chaos-after`: every rank has joined, however long
# podman runs, ssh into the containers and torch's import took; 15 s to more than 24 s here under load). The ranks
# still train when the restored host is taken back: the ranks left reset up to the collective timeout after the kill,
# Horovod blacklists the lost host then, and takes it back (listed again 6 s after the kill) after the cool-down of
# 4-6 s and a rank's start. 100 epochs: about 75 s of training on an idle machine.
KILL_AT, RESTORE_AT = 5, 11
ELASTIC_TRAIN_ARGS = ["--epochs", "100", *TRAIN_ARGS[TRAIN_ARGS.index("--epochs") + 2:]]
CHAOS = f"kill worker-1 at {KILL_AT}s; restore worker-1 at {RESTORE_AT}s"


def _missing() -> str | None:
    """What this machine lacks for these tests (root, ip, sshd, podman, runc): never the image, which this test
    run builds (`image`, below)."""
    why = _missing_host()
    if why:
        return why
    lacking = podman.missing(SETTINGS, [])
    if not lacking:
        why = images_build.why_podman_cannot_build()
        lacking = [why] if why else []
    return f"--runtime podman: {'; '.join(lacking)}" if lacking else None


MISSING = _missing()
pytestmark = [pytest.mark.integration, pytest.mark.images]
if MISSING:
    pytestmark.append(pytest.mark.skip(reason=MISSING))


@pytest.fixture(scope="module", autouse=True)
def image() -> str:
    """The trainer image, from this test run's one build (waited for; a failed build fails these tests)."""
    try:
        images_build.ensure_images()
    except images_build.ImagesBuildFailed as err:
        pytest.fail(str(err))
    lacking = podman.missing(SETTINGS, [IMAGE])
    assert not lacking, lacking
    return IMAGE


CLAIM_OWNER = 4242  # not root (refused: see podman.idmapped_bind), not the pods' user: they write through a view


class ImageSite(Site):
    """The plan renders the trainer image into every pod template; the claim's directory is a non-root user's."""

    def plan(self, run_id: str, conf: dict[str, Any]) -> dict[str, Any]:
        job = super().plan(run_id, conf)
        for path in (self.home, *self.home.rglob("*")):  # what this test (root) wrote there, the claim owner's
            os.lchown(path, CLAIM_OWNER, CLAIM_OWNER)
        return job

    def env(self) -> dict[str, str]:
        env = {**super().env(), "NIGHTSHIFT_TRAINER_IMAGE": IMAGE}
        if SETTINGS.containers_conf:
            env["NIGHTSHIFT_CONTAINERS_CONF"] = SETTINGS.containers_conf
        return env


def containers_of(pid: int) -> list[str]:
    done = subprocess.run(SETTINGS.command("ps", "-a", "--format", "{{.Names}}"), capture_output=True, text=True,
                          env=SETTINGS.env(), check=True)
    return [n for n in done.stdout.split() if n.startswith(f"{podman.CONTAINER_PREFIX}{pid}-")]


def assert_nothing_left(pid: int, links_before: set[str]) -> None:
    """No container or claim view of the run-mpijob with this pid, and nothing the host runtime's runs may leave
    either (namespace, link, process, temporary directory)."""
    assert containers_of(pid) == []
    assert f"nightshift-mpijob-{pid}-" not in Path("/proc/self/mountinfo").read_text()
    assert_nothing_left_by_host_runs(pid, links_before)


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> ImageSite:
    return make_site(tmp_path_factory, "run-mpijob-podman", ImageSite)


@pytest.fixture(scope="module")
def links_before() -> set[str]:
    return host_links()


def test_plans_job_trains_in_trainer_containers_like_the_host_venv_and_logs_to_mlflow(
        site: ImageSite, links_before: set[str]) -> None:
    job = site.plan("in-containers", CONF_1)
    name = job["metadata"]["name"]
    containers = job["spec"]["mpiReplicaSpecs"]["Worker"]["template"]["spec"]["containers"]
    assert containers[0]["image"] == IMAGE
    started = time.monotonic()
    proc = site.run_mpijob(site.write(job, "in-containers"), "--runtime", "podman", *site.mlflow_service())
    wait_for(lambda: len(containers_of(proc.pid)) == 3 or proc.poll() is not None, 120, "three containers", proc)
    code, out, err = finish(proc)
    elapsed = time.monotonic() - started
    assert code == 0, err[-3000:] + out[-3000:]
    assert f"MPIJob {name} succeeded" in err
    model = site.workspace("in-containers") / "model"
    summary = json.loads((model / "metrics.json").read_text())
    assert summary["world_size"] == 2
    assert f"{THREADS} torch threads" in out
    for i in range(2):  # each rank came in over ssh as the image's user, with the job's key
        assert f"[{name}-worker-{i}] Accepted publickey for mpiuser from 10.231.0.10" in out
    # The pods wrote the claim as mpiuser; on this machine the files are the claim owner's.
    assert (model / "model.pt").stat().st_uid == site.home.stat().st_uid == CLAIM_OWNER

    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{site.mlflow / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("nightly_retrain").experiment_id],
                                "tags.`nightshift.run_key` = 'nightly_retrain/in-containers'")
    assert run.data.metrics["val_accuracy"] == pytest.approx(summary["val_accuracy"])
    assert_nothing_left(proc.pid, links_before)
    print(f"2 hosts in containers: {elapsed:.1f}s end to end (MLflow service start included)")

    # The same job by the host runtime (this machine's venv): the same weights, bit for bit.
    host_job = without_mlflow(site.plan("on-host", CONF_1))
    host = site.run_mpijob(site.write(host_job, "on-host"))
    code, out, err = finish(host)
    assert code == 0, err[-3000:] + out[-3000:]
    assert_bitwise_equal(model / "model.pt", site.workspace("on-host") / "model" / "model.pt")


def test_a_killed_worker_container_fails_the_job_naming_it_and_a_rerun_resumes(
        site: ImageSite, links_before: set[str]) -> None:
    job = without_mlflow(site.plan("killed-container", CONF))
    name = job["metadata"]["name"]
    manifest = site.write(job, "killed-container")
    checkpoints = Path(trainer_arg(job, "--checkpoint-dir"))
    proc = site.run_mpijob(manifest, "--runtime", "podman")
    wait_for(lambda: checkpoints.exists() and any(checkpoints.glob("ckpt-*.pt")), 300, "checkpoint", proc)
    victims = subprocess.run(["ip", "netns", "pids", f"nsmj{proc.pid}-w1"], capture_output=True, text=True,
                             check=True).stdout.split()
    assert victims, "worker 1 runs nothing"
    for pid in victims:  # every process of the host: its sshd and its rank
        os.kill(int(pid), signal.SIGKILL)
    code, _, err = finish(proc)
    assert code != 0
    assert f"lost host {name}-worker-1 (its processes are gone: killed by SIGKILL)" in err
    assert_nothing_left(proc.pid, links_before)

    again = site.run_mpijob(manifest, "--runtime", "podman")  # the operator's retry: the same job again
    code, out, err = finish(again)
    assert code == 0, err[-3000:]
    assert "resumed from checkpoint" in out
    assert_nothing_left(again.pid, links_before)


def _job(name: str, launcher_args: list[str]) -> dict[str, Any]:
    """A 1-worker MPIJob of the image's contract: workers give no command (the image's sshd)."""
    return {"apiVersion": "kubeflow.org/v2beta1", "kind": "MPIJob", "metadata": {"name": name},
            "spec": {"slotsPerWorker": 1, "sshAuthMountPath": "/home/mpiuser/.ssh", "mpiReplicaSpecs": {
                "Launcher": {"replicas": 1, "template": {"spec": {"containers": [
                    {"name": "launcher", "image": IMAGE, "args": launcher_args}]}}},
                "Worker": {"replicas": 1, "template": {"spec": {"containers": [
                    {"name": "worker", "image": IMAGE}]}}}}}}


def test_a_signal_mid_job_removes_every_container(site: ImageSite, links_before: set[str]) -> None:
    job = _job("sleepy", ["horovodrun", "--gloo", "-np", "1", "--hostfile", "/etc/mpi/hostfile", "sleep", "600.41"])
    proc = site.run_mpijob(site.write(job, "sleepy-podman"), "--runtime", "podman")
    def rank_running() -> bool:
        pids = subprocess.run(["ip", "netns", "pids", f"nsmj{proc.pid}-w0"], capture_output=True, text=True,
                              check=False).stdout.split()
        return bool(processes_mentioning("sleep 600.41", pids=pids))

    wait_for(rank_running, 120, "the rank on the worker", proc)
    proc.send_signal(signal.SIGTERM)
    code, _, err = finish(proc, timeout=120)
    assert code == 128 + signal.SIGTERM
    assert "MPIJob sleepy stopped by SIGTERM" in err
    assert_nothing_left(proc.pid, links_before)


def launcher_views(pid: int, seen: list[str], done: threading.Event) -> None:
    """Every new text of /etc/mpi/discover_hosts.sh as the launcher's container reads it (through the root of a
    process in the launcher's host), until `done`."""
    namespace = network.namespace_name(pid, "launcher")
    while not done.is_set():
        for process in namespace_pids(namespace):
            with contextlib.suppress(OSError):
                text = Path(f"/proc/{process}/root{DISCOVER_HOSTS}").read_text()
                if not seen or seen[-1] != text:
                    seen.append(text)
                break
        time.sleep(0.1)


def test_the_elastic_trainer_loses_a_worker_container_and_takes_a_new_one_back(
        tmp_path: Path, demo_data: Path, links_before: set[str]) -> None:
    workdir = tmp_path / "bench"  # the claim: the job's data, output and checkpoints, a non-root user's
    shutil.copytree(demo_data, workdir / "data")
    out, ckpt = workdir / "out", workdir / "ckpt"
    for path in (workdir, *workdir.rglob("*")):
        os.lchown(path, CLAIM_OWNER, CLAIM_OWNER)
    job = trainer_job("elastic-podman", workdir, workdir / "data", out, ckpt, elastic=True,
                      train_args=ELASTIC_TRAIN_ARGS, workers=3)
    for role in ("Launcher", "Worker"):
        job["spec"]["mpiReplicaSpecs"][role]["template"]["spec"]["containers"][0]["image"] = IMAGE
    manifest = tmp_path / "elastic-podman.yaml"
    manifest.write_text(yaml.safe_dump(job))
    proc = subprocess.Popen([NIGHTSHIFT, "run-mpijob", str(manifest), "--runtime", "podman", "--timeout", "300",
                             "--volume", f"bench={workdir}", "--chaos", CHAOS, "--chaos-after", CHAOS_AFTER],
                            stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=SETTINGS.env())
    seen: list[str] = []
    done = threading.Event()
    watcher = threading.Thread(target=launcher_views, args=(proc.pid, seen, done), daemon=True)
    watcher.start()
    try:
        code, stdout, err = finish(proc, timeout=420)
    finally:
        done.set()
        watcher.join(timeout=10)
    ranks = [line for line in stdout.splitlines() if "<stderr>:" in line and "step " not in line]
    assert code == 0, err[-3000:] + "\n".join(ranks[-40:])
    assert "MPIJob elastic-podman succeeded" in err and "the job fails" not in err
    summary = json.loads((out / "metrics.json").read_text())
    assert summary["elastic"]["world_sizes"] == [3, 2, 3], summary
    assert (out / "metrics.json").stat().st_uid == CLAIM_OWNER  # written by mpiuser through the claim's view

    said = [line for line in err.splitlines() if line.startswith(("run-mpijob: chaos at", "run-mpijob: discover"))]
    container = f"{podman.CONTAINER_PREFIX}{proc.pid}-elastic-podman-worker-1"
    assert re.search(rf"\(kill worker-1 at {KILL_AT}s\): killed elastic-podman-worker-1 \(\d+ process\(es\), "
                     rf"SIGKILL\); its container {container} exited; discover_hosts.sh lists 2 worker\(s\) "
                     rf"\(-elastic-podman-worker-1\)", said[0]), said
    assert f"(restore worker-1 at {RESTORE_AT}s): restored elastic-podman-worker-1 as a new container " \
           f"{container} in its host" in said[1], said
    assert said[-1].endswith("discover_hosts.sh lists 3 worker(s) (+elastic-podman-worker-1): "
                             "elastic-podman-worker-0, elastic-podman-worker-1, elastic-podman-worker-2"), said
    assert "run-mpijob: worker elastic-podman-worker-1 runs again" in err
    # The launcher's container read each rewrite (a rename in the directory it binds at /etc/mpi).
    listed = [sorted(re.findall(r"elastic-podman-worker-(\d)", text)) for text in seen]
    assert listed == [["0", "1", "2"], ["0", "2"], ["0", "1", "2"]], seen
    assert_nothing_left(proc.pid, links_before)
