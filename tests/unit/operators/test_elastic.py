"""Elastic training on the operator side (issue 26): `JobConfig.elastic` -> the MPIJob (max_workers worker replicas,
horovodrun's elastic driver over the MPI Operator's discover_hosts.sh), the local backend's elastic horovodrun,
and every refusal, made before anything is submitted and naming the setting."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from operators.errors import InvalidJobConfig
from operators.horovod_config import JobConfig
from operators.mpijob_spec import MPIJobConfig, TaskIdentity, build_mpijob, launcher_command
from tests.unit.operators.conftest import horovod_operator, make_context
from tests.unit.operators.test_backends import forget_toy_plugin, install_toy_plugin

IDENTITY = TaskIdentity(dag_id="nightly_retrain", task_id="train", run_id="manual__1")
TRAIN = ["python", "-m", "nightshift.train", "--data", "/nightshift/data"]
ELASTIC = {"min_workers": 1, "max_workers": 3}


@pytest.fixture
def cluster_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NIGHTSHIFT_HOME", "/nightshift")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://mlflow.nightshift.svc:5000")
    for name in ("NIGHTSHIFT_CLUSTER_MLFLOW_URI", "NIGHTSHIFT_KUEUE_QUEUE", "NIGHTSHIFT_GPUS_PER_NODE",
                 "NIGHTSHIFT_INSTANCE"):
        monkeypatch.delenv(name, raising=False)


def operator(**settings: Any) -> Any:
    return horovod_operator(**{"task_id": "train", "command": TRAIN, "image": "trainer:1", "backend": "kubernetes",
                               **settings})


# --- the MPIJob --------------------------------------------------------------------------------------------


def test_an_elastic_mpijob_has_max_workers_replicas_and_runs_the_elastic_driver(validate_mpijob: Any) -> None:
    config = MPIJobConfig(image="trainer:1", command=TRAIN, num_workers=3, min_workers=1, gpus_per_worker=2)
    job = build_mpijob(config, IDENTITY)
    validate_mpijob(job)
    assert job["spec"]["mpiReplicaSpecs"]["Worker"]["replicas"] == 3
    assert job["spec"]["slotsPerWorker"] == 2
    assert job["spec"]["mpiReplicaSpecs"]["Launcher"]["replicas"] == 1  # the MPI Operator's rule
    command = job["spec"]["mpiReplicaSpecs"]["Launcher"]["template"]["spec"]["containers"][0]["command"]
    assert command == ["horovodrun", "--gloo", "-np", "6", "--min-np", "2", "--max-np", "6", "--slots-per-host", "2",
                       "--host-discovery-script", "/etc/mpi/discover_hosts.sh", "--blacklist-cooldown-range", "2",
                       "120", "--network-interfaces", "eth0", *TRAIN, "--elastic"]
    assert "--hostfile" not in command
    # Review finding: with Never, a worker whose container failed stayed Failed (the operator recreates only
    # pods that are gone) and never came back to the elastic job.
    assert job["spec"]["mpiReplicaSpecs"]["Worker"]["restartPolicy"] == "OnFailure"
    assert job["spec"]["mpiReplicaSpecs"]["Launcher"]["restartPolicy"] == "Never"


def test_the_elastic_flag_is_not_given_twice_and_a_fixed_job_never_gets_it() -> None:
    elastic = MPIJobConfig(image="i", command=[*TRAIN, "--elastic", "--commit-every", "5"], num_workers=2,
                           min_workers=2)
    assert launcher_command(elastic)[-4:] == [*TRAIN[-1:], "--elastic", "--commit-every", "5"]
    assert launcher_command(elastic).count("--elastic") == 1
    fixed = launcher_command(MPIJobConfig(image="i", command=TRAIN, num_workers=2))
    assert fixed == ["horovodrun", "--gloo", "-np", "2", "--hostfile", "/etc/mpi/hostfile", "--network-interfaces",
                     "eth0", *TRAIN]


def test_the_operator_builds_the_elastic_mpijob_and_ignores_num_workers(cluster_env: None,
                                                                         validate_mpijob: Any) -> None:
    op = operator(num_workers=5, gpus_per_worker=1, elastic={"min_workers": 2, "max_workers": 4})
    assert op.pool_slots == 4  # max_workers x gpus_per_worker, not num_workers
    job = op.build_manifest(IDENTITY)
    validate_mpijob(job)
    assert job["spec"]["mpiReplicaSpecs"]["Worker"]["replicas"] == 4
    command = job["spec"]["mpiReplicaSpecs"]["Launcher"]["template"]["spec"]["containers"][0]["command"]
    assert command[command.index("--min-np") + 1] == "2" and command[command.index("--max-np") + 1] == "4"
    assert command[-1] == "--elastic" and "--checkpoint-dir" in command
    assert op.job.num_workers == 4 and op.job.elastic_range() == (2, 4)


@pytest.mark.parametrize(("flag", "value"), [("--out", "model"), ("--out", "/scratch/model"),
                                             ("--checkpoint-dir", "ckpt"), ("--data", "data/digits")])
def test_an_elastic_job_off_the_shared_claim_is_refused(cluster_env: None, flag: str, value: str) -> None:
    """Issue 35 item 7: a relative path (each pod's working directory) or a pod's own volume split an elastic
    job's outputs and checkpoints across hosts when rank 0's host was lost."""
    command = ["python", "-m", "nightshift.train", "--data", "/nightshift/data", "--out", "/nightshift/model"]
    command = [*command, flag, value] if flag == "--checkpoint-dir" else [
        value if i > 0 and command[i - 1] == flag else arg for i, arg in enumerate(command)]
    op = operator(command=command, elastic={"min_workers": 1, "max_workers": 2},
                  volumes=[{"name": "scratch", "emptyDir": {}}], volume_mounts=[{"name": "scratch",
                                                                                 "mountPath": "/scratch"}])
    with pytest.raises(InvalidJobConfig, match=rf"must be on the shared claim, as absolute paths under /nightshift: "
                                               rf"{flag} {value} would be each host's own"):
        op.build_manifest(IDENTITY)
    fixed = operator(command=command, volumes=[{"name": "scratch", "emptyDir": {}}],
                     volume_mounts=[{"name": "scratch", "mountPath": "/scratch"}])
    if value.startswith("/"):
        fixed.build_manifest(IDENTITY)  # a fixed-size job's pods keep their own outputs: no refusal


def test_the_builder_takes_the_elastic_range_from_the_job_config() -> None:
    from operators.horovod_config import ClusterConfig, ExecutionConfig, mpijob_config

    job = JobConfig(command=TRAIN, num_workers="2", image="i", elastic={"min_workers": "2", "max_workers": "5"})
    config = mpijob_config(job.settled(), ClusterConfig().settled(), ExecutionConfig(deferrable=False).settled(),
                           command=TRAIN, namespace="ns", queue_name=None, volumes=[], volume_mounts=[], env={})
    assert (config.min_workers, config.num_workers) == (2, 5)


@pytest.mark.parametrize("off", [None, {"min_workers": None, "max_workers": None},
                                 {"min_workers": "None", "max_workers": "None"},  # Params left empty, rendered
                                 {"min_workers": "", "max_workers": " "}])
def test_without_elastic_the_manifest_is_the_fixed_size_one(cluster_env: None, off: Any) -> None:
    plain = operator(num_workers=2, gpus_per_worker=1).build_manifest(IDENTITY)
    assert operator(num_workers=2, gpus_per_worker=1, elastic=off).build_manifest(IDENTITY) == plain
    assert plain["spec"]["mpiReplicaSpecs"]["Launcher"]["template"]["spec"]["containers"][0]["command"][:6] == [
        "horovodrun", "--gloo", "-np", "2", "--hostfile", "/etc/mpi/hostfile"]
    assert plain["spec"]["mpiReplicaSpecs"]["Worker"]["restartPolicy"] == "Never"


def test_templated_elastic_settles_from_the_rendered_params(cluster_env: None) -> None:
    op = operator(num_workers="{{ params.workers }}",
                  elastic={"min_workers": "{{ params.min_workers }}", "max_workers": "{{ params.max_workers }}"})
    assert op.pool_slots == 1  # unknown at parse time: the cluster policy sizes it per run
    assert op.elastic == {"min_workers": "{{ params.min_workers }}", "max_workers": "{{ params.max_workers }}"}
    op.num_workers, op.elastic = "2", {"min_workers": "1", "max_workers": "3"}  # as Airflow renders them
    op.settle()
    assert op.job.elastic == {"min_workers": 1, "max_workers": 3} and op.job.num_workers == 3


# --- refusals ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("elastic", "message"), [
    ({"min_workers": 4, "max_workers": 3}, "min_workers (4) is more than max_workers (3): set min_workers at most "
                                           "max_workers"),
    ({"min_workers": 0, "max_workers": 3}, "min_workers must be at least 1, got 0"),
    ({"min_workers": -1, "max_workers": 3}, "min_workers must be at least 1, got -1"),
    ({"min_workers": 1, "max_workers": 300}, "max_workers must be at most 256, got 300"),
    ({"min_workers": None, "max_workers": 3}, "elastic training needs both min_workers and max_workers, and "
                                              "min_workers is empty (max_workers=3): set min_workers, or clear "
                                              "max_workers for a fixed-size job"),
    ({"min_workers": 2}, "and max_workers is empty (min_workers=2)"),
    ({"min_workers": "two", "max_workers": 3}, "min_workers must be an integer, got 'two'"),
    ({"min": 1, "max_workers": 3}, "elastic must be None or {'min_workers': MIN, 'max_workers': MAX}"),
    ("1-3", "elastic must be None or {'min_workers': MIN, 'max_workers': MAX}"),
])
def test_a_bad_range_is_refused_when_the_dag_is_parsed(elastic: Any, message: str) -> None:
    with pytest.raises(InvalidJobConfig) as err:
        JobConfig(command=TRAIN, elastic=elastic)
    assert message in str(err.value)


def test_a_bad_rendered_range_names_the_params_to_change(cluster_env: None) -> None:
    op = operator(elastic={"min_workers": "{{ params.min_workers }}", "max_workers": "{{ params.max_workers }}"})
    op.elastic = {"min_workers": "3", "max_workers": "2"}
    with pytest.raises(InvalidJobConfig, match=r"min_workers \(3\) is more than max_workers \(2\): set min_workers "
                                               r"at most max_workers \(rendered from the run's Params 'min_workers', "
                                               r"'max_workers'\)"):
        op.settle()


def test_an_elastic_mpijob_needs_the_pods_interface() -> None:
    with pytest.raises(InvalidJobConfig, match=r"elastic training needs network_interfaces \(e.g. 'eth0'\): without "
                                               r"it horovodrun's elastic driver waits for two worker hosts"):
        MPIJobConfig(image="i", command=TRAIN, num_workers=2, min_workers=1, network_interfaces=None)
    assert MPIJobConfig(image="i", command=TRAIN, num_workers=2, network_interfaces=None).min_workers is None


def test_a_gpu_total_cannot_be_combined_with_elastic() -> None:
    with pytest.raises(InvalidJobConfig, match=r"gpus=8 \(a total, packed into workers\) cannot be combined with "
                                               r"elastic training .* set gpus_per_worker and max_workers"):
        JobConfig(command=TRAIN, gpus=8, elastic=ELASTIC)
    templated = JobConfig(command=TRAIN, gpus="{{ params.gpus }}", elastic=ELASTIC)
    with pytest.raises(InvalidJobConfig, match="cannot be combined with elastic"):
        templated.settled({"gpus": "8"})
    assert templated.settled({"gpus": "0"}).elastic_range() == (1, 3)


def test_elastic_with_a_kueue_queue_is_refused_before_anything_is_submitted(cluster_env: None) -> None:
    from tests.unit.operators.fake_kubernetes import FakeCluster, FakeHook

    op = operator(elastic=ELASTIC, kueue_queue="nightly")
    cluster = FakeCluster()
    op.__dict__["hook"] = FakeHook(cluster, namespace="team")
    with pytest.raises(InvalidJobConfig) as err:
        op.execute(make_context())
    assert str(err.value) == (
        "elastic training (min_workers=1, max_workers=3) cannot wait in Kueue queue 'nightly': Kueue admits the "
        "job's full size (max_workers) as one unit and does not resize it as workers come and go; set kueue_queue "
        "to \"\" (the Param 'queue' empty) or clear min_workers and max_workers for a fixed-size job")
    assert cluster.jobs == {} and op.job_name is None  # nothing submitted, not even looked up
    with pytest.raises(InvalidJobConfig, match="cannot wait in Kueue queue 'nightly'"):  # plan's path refuses too
        operator(elastic=ELASTIC, kueue_queue="nightly").build_manifest(IDENTITY)


def test_the_deployment_queue_counts_and_the_local_backend_ignores_kueue(cluster_env: None,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NIGHTSHIFT_KUEUE_QUEUE", "team-queue")
    op = operator(elastic=ELASTIC)
    op.settle()
    with pytest.raises(InvalidJobConfig, match="cannot wait in Kueue queue 'team-queue'"):
        op.check_elastic(op.make_backend("kubernetes"))
    op.check_elastic(op.make_backend("local"))  # horovodrun here: no Kueue object is made
    cleared = operator(elastic=ELASTIC, kueue_queue="")
    cleared.settle()
    cleared.check_elastic(cleared.make_backend("hosts"))


@pytest.fixture
def toy_plugin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[ModuleType]:
    install_toy_plugin(tmp_path, monkeypatch)
    from operators.backends import backend_names

    backend_names()
    yield sys.modules["nightshift_toy_plugin"]
    forget_toy_plugin()


def test_a_backend_that_does_not_declare_elastic_is_refused_naming_those_that_can(
        toy_plugin: ModuleType) -> None:
    from operators.backends import backend_class, elastic_backends

    assert {name: backend_class(name).supports_elastic for name in ("kubernetes", "hosts", "local", "toy")} == {
        "kubernetes": True, "hosts": True, "local": True, "toy": False}
    assert elastic_backends() == ("hosts", "kubernetes", "local")
    op = horovod_operator(task_id="train", command=["true"], backend="toy", elastic=ELASTIC)
    with pytest.raises(InvalidJobConfig) as err:
        op.execute(make_context())  # type: ignore[arg-type]
    assert str(err.value) == ("backend=toy cannot run elastic training (min_workers=1, max_workers=3): use a backend "
                              "that can (hosts, kubernetes, local), or clear min_workers and max_workers for a "
                              "fixed-size job")
    assert toy_plugin.CALLS == []  # never submitted
    horovod_operator(task_id="train", command=["true"], backend="toy").execute(make_context())  # type: ignore[arg-type]
    assert toy_plugin.CALLS[0][0] == "submit"


# --- the local backend -------------------------------------------------------------------------------------


def test_the_local_elastic_command_runs_the_elastic_driver_on_this_host(tmp_path: Path) -> None:
    from operators.local_launcher import horovodrun_argv, write_discovery_script

    script = write_discovery_script(tmp_path, 4)
    import subprocess

    assert subprocess.run([str(script)], capture_output=True, text=True, check=True).stdout == "localhost:4\n"
    argv = horovodrun_argv(4, ["python", "train.py"], horovodrun="horovodrun", min_processes=2,
                           discovery_script=str(script))
    assert argv == ["horovodrun", "-np", "4", "--min-np", "2", "--max-np", "4", "--host-discovery-script",
                    str(script), "--blacklist-cooldown-range", "2", "120", "--network-interfaces", "lo", "--gloo",
                    sys.executable, "train.py", "--elastic"]
    assert horovodrun_argv(2, ["python", "train.py"], horovodrun="horovodrun") == [
        "horovodrun", "-np", "2", "-H", "localhost:2", "--gloo", sys.executable, "train.py"]


ELASTIC_TOY = '''
import sys
import horovod.torch as hvd
import torch
from horovod.common.elastic import ObjectState

hvd.init()
state = ObjectState(bcast_object=hvd.broadcast_object, get_rank=hvd.rank, step=0)


@hvd.elastic.run
def train(state):
    while state.step < 3:
        total = hvd.allreduce(torch.tensor([1.0]), op=hvd.Sum).item()
        state.step += 1
        state.commit()
    return int(total)


size = train(state)
assert "--elastic" in sys.argv, sys.argv
print(f"elastic rank {hvd.rank()} of {hvd.size()}: allreduce over {size} ranks, steps {state.step}", flush=True)
'''


@pytest.mark.slow
def test_the_local_backend_runs_an_elastic_job_with_real_horovodrun(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Two ranks of a toy `hvd.elastic.run` (an ObjectState) under horovodrun's elastic driver, through execute;
    the discovery script is gone afterwards."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)  # mkdtemp reads TMPDIR again
    script = tmp_path / "toy.py"
    script.write_text(ELASTIC_TOY)
    op = horovod_operator(task_id="train", command=["python", str(script)], backend="local", elastic=ELASTIC | {
        "max_workers": 2}, checkpoint_dir=str(tmp_path / "ckpt"), timeout=120)
    lines: list[str] = []
    monkeypatch.setattr(op.log, "info", lambda message, *args: lines.append(message % args if args else message))
    result = op.execute(make_context())  # type: ignore[arg-type]
    assert result["num_workers"] == 2 and result["min_workers"] == 1
    said = "\n".join(lines)
    assert "--min-np 1 --max-np 2 --host-discovery-script" in said and "--network-interfaces lo" in said
    for rank in (0, 1):
        assert f"elastic rank {rank} of 2: allreduce over 2 ranks, steps 3" in said, said[-3000:]
    assert not list(tmp_path.glob("nightshift-elastic-*"))  # the discovery script was removed


def test_a_discovery_folder_left_by_a_killed_task_is_removed_by_the_next_elastic_try(tmp_path: Path,
                                                                                   monkeypatch: Any) -> None:
    """Review finding: a task process killed outright (SIGKILL, OOM) never ran its clean-up."""
    import subprocess

    from operators.backends import local

    monkeypatch.setattr(local.tempfile, "gettempdir", lambda: str(tmp_path))
    gone = subprocess.Popen(["true"])
    gone.wait()
    stale = tmp_path / f"{local.DISCOVERY_PREFIX}{gone.pid}-abc"
    live = tmp_path / f"{local.DISCOVERY_PREFIX}{os.getpid()}-def"
    other = tmp_path / "nightshift-elastic-notapid-x"
    # Review finding: names anyone can make in /tmp that isdigit() accepts and os.kill() cannot take crashed the
    # sweep, and every elastic try with it.
    huge = tmp_path / "nightshift-elastic-2147483648-x"
    superscript = tmp_path / "nightshift-elastic-\u00b2-x"
    for folder in (stale, live, other, huge, superscript):
        folder.mkdir()
        (folder / "discover_hosts.sh").write_text("#!/bin/sh\necho localhost:2\n")
    assert local.remove_stale_discovery_folders() == [str(stale)]
    assert not stale.exists() and live.exists() and other.exists() and huge.exists() and superscript.exists()
