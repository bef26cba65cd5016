"""backend=hosts without emulated hosts: what it asks of the machine, the run-mpijob command it builds, and the
life of its child process (streamed, judged, cancelled, cleaned up), with a stand-in for run-mpijob."""

from __future__ import annotations

import json
import os
import shutil
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from nightshift.mpijob_local.requirements import missing, served_store_problem
from operators import errors
from operators.backends import hosts
from operators.backends.hosts import HostsBackend
from operators.mpijob_spec import TaskIdentity
from tests.unit.operators.conftest import horovod_operator

IDENTITY = TaskIdentity("nightly_retrain", "train", "manual__1", 2)


def present(tool: str, path: str | None = None) -> str:
    return f"/usr/sbin/{tool}"


def test_missing_names_what_the_machine_lacks() -> None:
    assert missing(platform="linux", euid=0, which=present, probe=lambda: None) == []
    assert missing(platform="darwin") == ["Linux (network namespaces)"]
    lacking = missing(platform="linux", euid=1000, probe=lambda: None,
                      which=lambda tool, path=None: None if tool == "sshd" else present(tool))
    assert lacking == ["root (network namespaces and mounts)", "`sshd` (apt-get install -y openssh-server)"]
    # The namespace probe runs only when the rest is there, and says why it failed.
    probed: list[bool] = []
    assert missing(platform="linux", euid=1000, which=present, probe=lambda: probed.append(True) or None) == [
        "root (network namespaces and mounts)"]
    assert probed == []
    (why,) = missing(platform="linux", euid=0, which=present, probe=lambda: "Operation not permitted")
    assert "unshare --net" in why and "Operation not permitted" in why


def test_only_a_store_on_this_machines_disk_can_be_served_to_the_hosts() -> None:
    for uri in ("sqlite:////srv/home/mlflow.db", "/srv/home/mlruns", "file:///srv/home/mlruns"):
        assert served_store_problem(uri) is None
    for uri in ("http://mlflow:5000", "postgresql://user:hunter2@db/mlflow"):
        problem = served_store_problem(uri)
        assert problem and uri.split(":")[0] in problem and "hunter2" not in problem


def test_a_machine_without_emulated_hosts_is_refused_naming_what_lacks_and_suggesting_local(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("nightshift.mpijob_local.requirements.missing", lambda: ["root (x)", "`sshd` (y)"])
    with pytest.raises(errors.HostsBackendUnavailable, match=r"lacks root \(x\); `sshd` \(y\): use backend=local"):
        hosts.check_machine()
    assert issubclass(errors.HostsBackendUnavailable, errors.InvalidJobConfig)


def test_the_mlflow_service_serves_the_tasks_store_as_run_mpijob_reads_it() -> None:
    from nightshift.mpijob_local.cli import _service

    url, argument = hosts.mlflow_service("sqlite:////srv/my home/mlflow.db", "/srv/my home/mlartifacts")
    assert url == "http://mlflow.nightshift.svc:5000"
    service = _service(argument)
    assert (service.host, service.port) == ("mlflow.nightshift.svc", 5000)
    argv = list(service.argv)
    assert argv[1:2] == ["server"] and argv[argv.index("--backend-store-uri") + 1] == "sqlite:////srv/my home/mlflow.db"
    assert argv[argv.index("--artifacts-destination") + 1] == "/srv/my home/mlartifacts"
    with pytest.raises(errors.InvalidJobConfig, match="backend=hosts: the tracking store is http"):
        hosts.mlflow_service("http://mlflow:5000", "/x")


# --- the child process, with a stand-in for run-mpijob ------------------------------------------------------

FAKE = r"""
import json, os, signal, sys, time, yaml
manifest, mode = sys.argv[1], sys.argv[2]
job = yaml.safe_load(open(manifest))
env = job["spec"]["mpiReplicaSpecs"]["Launcher"]["template"]["spec"]["containers"][0]["env"]
print("pod-env", json.dumps({e["name"]: e.get("value") for e in env}), flush=True)
print("my-env", json.dumps(sorted(os.environ)), flush=True)
print("mlflow-jobs", json.dumps(os.environ.get("MLFLOW_SERVER_ENABLE_JOB_EXECUTION")), flush=True)
if mode == "ok":
    print("[job-launcher] training", flush=True)
elif mode == "fail":
    print("[job-launcher] Traceback", flush=True)
    print("nightshift run-mpijob: MPIJob job failed after 3.0s: launcher exit code 1; lost host job-worker-1",
          flush=True)
    sys.exit(1)
elif mode == "refused":
    print("nightshift run-mpijob: the manifest asks for 3 nvidia.com/gpu, this machine has 0", flush=True)
    sys.exit(2)
elif mode in ("sleep", "stubborn"):
    if mode == "sleep":
        signal.signal(signal.SIGTERM, lambda *_: (print("stopping: pods removed", flush=True), sys.exit(143)))
    else:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    print("ready", flush=True)
    time.sleep(60)
"""


class Log:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def _add(self, message: str, *args: Any) -> None:
        self.lines.append(message % args if args else message)

    info = warning = error = _add


@pytest.fixture
def backend(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    home = tmp_path / "home"
    monkeypatch.setenv("NIGHTSHIFT_HOME", str(home))
    for name in ("MLFLOW_TRACKING_URI", "NIGHTSHIFT_CLUSTER_MLFLOW_URI", "NIGHTSHIFT_MLFLOW_ARTIFACTS",
                 "NIGHTSHIFT_SHARED_PVC", "NIGHTSHIFT_CHECKPOINTS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s3cr3t")
    monkeypatch.setenv("AIRFLOW__DATABASE__SQL_ALCHEMY_CONN", "postgresql://airflow:pw@db/airflow")
    monkeypatch.setattr(hosts, "check_machine", lambda: None)
    monkeypatch.setattr(hosts, "KILL_GRACE_SECONDS", 1.0)
    # What a SIGKILLed run-mpijob left is removed through run-mpijob's own sweep; never this machine's here.
    monkeypatch.setattr(HostsBackend, "_remove_leftovers", lambda self: self.log.lines.append("leftovers removed"))
    argvs: list[list[str]] = []

    def fake_argv(mode: str) -> Any:
        def build(manifest: Path, claim: str, where: str, service: str, timeout: float | None) -> list[str]:
            argvs.append(real(manifest, claim, where, service, timeout))
            return [sys.executable, "-c", FAKE, str(manifest), mode]
        return build

    real = hosts.run_mpijob_argv

    def make(mode: str) -> HostsBackend:
        monkeypatch.setattr(hosts, "run_mpijob_argv", fake_argv(mode))
        op = horovod_operator(task_id="train", num_workers=2, gpus_per_worker=0, backend="hosts", image="trainer",
                              command=["python", "-m", "nightshift.train", "--data", f"{home}/data", "--out",
                                       f"{home}/model"])
        made = op.make_backend("hosts")
        made.log = Log()
        made.op = op  # the task it runs for (a test's handle; the backend itself only has its BackendRun)
        backends.append(made)
        return made

    backends: list[HostsBackend] = []
    make.argvs = argvs  # type: ignore[attr-defined]
    make.home = home  # type: ignore[attr-defined]
    yield make
    for made in backends:  # a test that failed before its cleanup() leaves no scratch directory in /tmp
        if made.process is not None and made.process.poll() is None:
            made.cancel()
        if made._tmp is not None:
            shutil.rmtree(made._tmp, ignore_errors=True)


def logged(backend: HostsBackend, prefix: str) -> Any:
    (line,) = [line for line in backend.log.lines if line.startswith(prefix)]  # type: ignore[attr-defined]
    return json.loads(line[len(prefix):])


def test_the_job_runs_as_the_kubernetes_backends_mpijob_with_the_service_and_the_tasks_home(backend: Any) -> None:
    hb = backend("ok")
    result = hb.submit(IDENTITY, {})
    scratch = hb._tmp
    assert scratch is not None and (scratch / "mpijob.yaml").exists()
    # the store made under its lock before the service (which migrates a new store unlocked) opened it
    assert (backend.home / "mlflow.db").is_file() and (backend.home / "mlflow.db.init-lock").is_file()
    assert "NIGHTSHIFT_CLUSTER_MLFLOW_URI" not in os.environ  # only while the manifest was built
    hb.wait(result, {})
    hb.cleanup(result, succeeded=True, error=None)
    home = backend.home
    assert result["backend"] == "hosts" and result["name"].startswith("train-")
    assert result["checkpoint_dir"] == f"{home}/checkpoints/nightly_retrain/manual__1/train"
    pod_env = logged(hb, "pod-env ")
    assert pod_env["MLFLOW_TRACKING_URI"] == "http://mlflow.nightshift.svc:5000"
    assert pod_env["NIGHTSHIFT_HOME"] == str(home)
    child_env = logged(hb, "my-env ")
    assert "AWS_SECRET_ACCESS_KEY" not in child_env and "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN" not in child_env
    # the MLflow service (started by run-mpijob with its environment) runs no job consumers: 8 processes fewer
    assert logged(hb, "mlflow-jobs ") == "false"
    assert "[job-launcher] training" in hb.log.lines
    (argv,) = backend.argvs
    assert argv[1:3] == ["run-mpijob", str(scratch / "mpijob.yaml")]
    assert argv[argv.index("--volume") + 1] == f"nightshift-workspace={home}"
    assert float(argv[argv.index("--ready-timeout") + 1]) >= 300  # an MLflow server starts slowly
    assert f"--backend-store-uri sqlite:///{home}/mlflow.db" in argv[argv.index("--service") + 1]
    command = logged(hb, f"MPIJob {result['name']} launcher command: ")
    assert command[command.index("--checkpoint-dir") + 1] == result["checkpoint_dir"]
    assert not scratch.exists()


def test_a_failed_job_raises_with_run_mpijobs_verdict_and_a_refusal_is_a_config_error(backend: Any) -> None:
    hb = backend("fail")
    result = hb.submit(IDENTITY, {})
    with pytest.raises(errors.MPIJobFailed, match=r"failed \(run-mpijob exit code 1\): nightshift run-mpijob: "
                                                   r"MPIJob job failed .* lost host job-worker-1"):
        hb.wait(result, {})
    hb.cleanup(result, succeeded=False, error=None)
    hb = backend("refused")
    result = hb.submit(IDENTITY, {})
    with pytest.raises(errors.InvalidJobConfig, match=r"run-mpijob refused MPIJob default/train-.*: .* 3 nvidia"):
        hb.wait(result, {})
    hb.cleanup(result, succeeded=False, error=None)


@pytest.mark.parametrize("mode", ["sleep", "stubborn"])
def test_cancel_stops_run_mpijob_with_sigterm_then_sigkill(backend: Any, mode: str) -> None:
    hb = backend(mode)
    result = hb.submit(IDENTITY, {})
    raised: list[BaseException] = []

    def follow() -> None:
        try:
            hb.wait(result, {})
        except BaseException as err:
            raised.append(err)

    waiter = threading.Thread(target=follow)
    waiter.start()
    deadline = time.monotonic() + 30
    while "ready" not in hb.log.lines:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    started = time.monotonic()
    hb.cancel()
    waiter.join(timeout=30)
    assert time.monotonic() - started < 10
    assert hb.process is not None and hb.process.poll() is not None
    assert hb.process.returncode == (143 if mode == "sleep" else -9)
    assert len(raised) == 1 and isinstance(raised[0], errors.TaskInterrupted)
    if mode == "sleep":
        assert "stopping: pods removed" in hb.log.lines  # run-mpijob's own clean-up had its turn
    hb.cleanup(result, succeeded=False, error=raised[0])
    # Only a run-mpijob that never cleaned up (SIGKILL) has its leftovers swept, once.
    assert hb.log.lines.count("leftovers removed") == (0 if mode == "sleep" else 1)


def test_demo_run1_uses_hosts_where_the_machine_allows_and_says_why_not_elsewhere() -> None:
    from scripts.demo import run1_backend

    backend, why = run1_backend(lacking=[], tracking_uri="sqlite:////h/mlflow.db")
    assert backend == "hosts" and "network namespaces" in why
    backend, why = run1_backend(lacking=["root (network namespaces and mounts)"], tracking_uri="sqlite:////h/x.db")
    assert backend == "local" and why == "emulated hosts need root (network namespaces and mounts)"
    backend, why = run1_backend(lacking=[], tracking_uri="http://mlflow:5000")
    assert backend == "local" and "http://" in why


def test_the_manifest_file_is_the_operators_mpijob(backend: Any) -> None:
    hb = backend("ok")
    result = hb.submit(IDENTITY, {})
    body = yaml.safe_load((hb._tmp / "mpijob.yaml").read_text())
    hb.wait(result, {})
    hb.cleanup(result, succeeded=True, error=None)
    assert body["kind"] == "MPIJob" and body["metadata"]["name"] == result["name"]
    assert body["spec"]["mpiReplicaSpecs"]["Worker"]["replicas"] == 2


# --- review findings ---------------------------------------------------------------------------------------


def test_a_kill_while_run_mpijob_starts_stops_it(backend: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """on_kill landing just before the child exists found no process; the job then started and ran to the end."""
    hb = backend("sleep")
    real = hosts.subprocess.Popen

    def killed_meanwhile(*args: Any, **kwargs: Any) -> Any:
        hb.op.on_kill()  # the signal handler, on this thread
        hb.cancel()
        return real(*args, **kwargs)

    monkeypatch.setattr(hosts.subprocess, "Popen", killed_meanwhile)
    with pytest.raises(errors.TaskInterrupted, match=r"killed while MPIJob .* started"):
        hb.submit(IDENTITY, {})
    assert hb.process is not None and hb.process.poll() is not None
    assert hb._tmp is None  # the manifest's scratch directory is gone too


def test_an_earlier_tries_run_mpijob_that_outlived_its_task_is_stopped_first(backend: Any, tmp_path: Path) -> None:
    """The supervisor SIGKILLs a task 5 s after SIGTERM; run-mpijob (its own session) went on training, and the
    retry started a second job beside it into the same checkpoints and MLflow run key."""
    import subprocess

    script = tmp_path / "stand_in.py"
    script.write_text("import time\ntime.sleep(120)\n")
    earlier = subprocess.Popen([sys.executable, str(script), "run-mpijob", "earlier.yaml"], start_new_session=True)
    try:
        hb = backend("ok")
        checkpoints = Path(hb.op.resolve_checkpoint_dir(IDENTITY))
        checkpoints.mkdir(parents=True)
        hosts._write_pidfile(checkpoints / hosts.PIDFILE, earlier.pid)
        result = hb.submit(IDENTITY, {})
        assert earlier.wait(timeout=5) == -15  # SIGTERM, before this try's job started
        assert any(f"earlier try's run-mpijob (pid {earlier.pid})" in line for line in hb.log.lines)
        hb.wait(result, {})
        hb.cleanup(result, succeeded=True, error=None)
        assert json.loads((checkpoints / hosts.PIDFILE).read_text())["pid"] == hb.process.pid
        # A pid file naming a process that is gone, or another program, stops nothing.
        assert hosts._running_from_pidfile(checkpoints / hosts.PIDFILE) is None
        hosts._write_pidfile(checkpoints / hosts.PIDFILE, os.getpid())
        assert hosts._running_from_pidfile(checkpoints / hosts.PIDFILE) is None
    finally:
        if earlier.poll() is None:
            earlier.kill()
            earlier.wait()


def test_the_manifest_is_rendered_without_touching_the_processs_environment(backend: Any,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """render() set NIGHTSHIFT_CLUSTER_MLFLOW_URI in os.environ around build_manifest: two renders in threads
    left the hosts' URL there for good, for every later kubernetes render and child of the process."""
    monkeypatch.setenv("NIGHTSHIFT_CLUSTER_MLFLOW_URI", "http://mlflow.prod.svc:5000")
    seen: list[str | None] = []
    hb = backend("ok")
    real = hb.op.build_manifest

    def watched(*args: Any, **kwargs: Any) -> Any:
        seen.append(os.environ.get("NIGHTSHIFT_CLUSTER_MLFLOW_URI"))
        return real(*args, **kwargs)

    monkeypatch.setattr(hb.op, "build_manifest", watched)
    body = hb.render(IDENTITY)
    env = {e["name"]: e.get("value") for e in
           body["spec"]["mpiReplicaSpecs"]["Launcher"]["template"]["spec"]["containers"][0]["env"]}
    assert env["MLFLOW_TRACKING_URI"] == hosts.SERVICE_URL
    assert seen == ["http://mlflow.prod.svc:5000"]
    assert os.environ["NIGHTSHIFT_CLUSTER_MLFLOW_URI"] == "http://mlflow.prod.svc:5000"


def test_a_failing_submit_leaves_no_manifest(backend: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    hb = backend("ok")
    made: list[Path] = []
    real = hosts.tempfile.mkdtemp
    monkeypatch.setattr(hosts.tempfile, "mkdtemp", lambda **kw: made.append(Path(real(**kw))) or made[-1])

    def gone(*args: Any, **kwargs: Any) -> list[str]:
        raise errors.InvalidJobConfig("backend=hosts needs the `nightshift` command")

    monkeypatch.setattr(hosts, "run_mpijob_argv", gone)
    with pytest.raises(errors.InvalidJobConfig):
        hb.submit(IDENTITY, {})
    assert made and not made[0].exists()


def test_a_training_that_exits_2_is_a_failed_job_not_a_refusal(backend: Any,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    hb = backend("ok")
    exits_2 = "print('[job-launcher] usage error'); raise SystemExit(2)"
    monkeypatch.setattr(hosts, "run_mpijob_argv", lambda *a: [sys.executable, "-c", exits_2])
    result = hb.submit(IDENTITY, {})
    with pytest.raises(errors.MPIJobFailed, match=r"run-mpijob exit code 2\): \[job-launcher\] usage error"):
        hb.wait(result, {})
    hb.cleanup(result, succeeded=False, error=None)


def test_stores_the_service_could_not_share_are_refused() -> None:
    assert "in-memory" in (served_store_problem("sqlite://") or "")
    assert "in-memory" in (served_store_problem("sqlite:///:memory:") or "")
    assert "databricks" in (served_store_problem("databricks") or "")
