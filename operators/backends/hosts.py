"""The `hosts` backend: the MPIJob the kubernetes backend would submit, run on emulated hosts of this machine.

`nightshift run-mpijob` (nightshift.mpijob_local) runs it as the MPI Operator and the kubelets would: one
network, UTS and mount namespace per pod, sshd in the workers, horovodrun in the launcher, real TCP between
them. Here it is a child process of the Airflow task, in its own process group, whose output is the task's
log. What the pods share with the task:

- the workspace claim: NIGHTSHIFT_HOME (`--volume CLAIM=NIGHTSHIFT_HOME`), mounted at the same path in every
  pod, so the staged data, the model and the checkpoints (the per-task directory the kubernetes backend uses,
  shared by every try: a retry resumes) are the task's own files;
- MLflow: a `--service` MLflow server on the job's network, over the task's own tracking store (the SQLite
  store and artifact root nightshift.tracking uses for the task); the pods' MLFLOW_TRACKING_URI is its URL,
  so the operator's `collect_results` finds the run in the task's store.

Nothing else of the task's environment reaches run-mpijob (the local launcher's allowlist), so no secret of
the worker reaches a pod or the MLflow service. Cancel (on_kill) sends SIGTERM to run-mpijob, whose clean-up
removes every namespace and process of the run, then SIGKILL after a grace period; what a SIGKILLed run
leaves is removed at once. It needs root, `ip`, `unshare` and `sshd`, and refuses before starting anything,
naming what is missing, without them.
"""

from __future__ import annotations

import json
import os
import queue
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Mapping
from contextlib import suppress
from pathlib import Path
from typing import Any, ClassVar

from operators.backends.base import BackendRun, TrainingBackend
from operators.errors import HostsBackendUnavailable, InvalidJobConfig, MPIJobFailed, TaskInterrupted
from operators.mpijob_spec import TaskIdentity

BIN = Path(sys.executable).parent
MLFLOW_HOST = "mlflow.nightshift.svc"  # the service's name on the job's network
MLFLOW_PORT = 5000
SERVICE_URL = f"http://{MLFLOW_HOST}:{MLFLOW_PORT}"  # the pods' MLFLOW_TRACKING_URI
# In the task's checkpoint directory (shared by its tries): the run-mpijob of the try that started last, so a
# try stops an earlier try's job that outlived its task (SIGKILLed by the supervisor before on_kill ended).
PIDFILE = "run-mpijob.pid"
# run-mpijob's own clean-up after SIGTERM: each pod's processes get 10 s, its namespaces 10 s more.
KILL_GRACE_SECONDS = 45.0
TAIL_LINES = 40
# How long workers and the MLflow service may take to accept connections: an MLflow server takes 100 s to
# start on a loaded 2-core machine (run-mpijob's default is 120 s).
READY_TIMEOUT_SECONDS = 600.0
EXIT_REFUSED = 2  # run-mpijob refused the manifest or the machine (one line)
EXIT_TIMEOUT = 124


def check_machine() -> None:
    """HostsBackendUnavailable, naming what this machine lacks for emulated hosts, before anything starts."""
    from nightshift.mpijob_local.requirements import missing

    lacking = missing()
    if lacking:
        raise HostsBackendUnavailable(
            f"backend=hosts runs the MPIJob on emulated hosts (network namespaces), and this machine lacks "
            f"{'; '.join(lacking)}: use backend=local (horovodrun here), or run the Airflow worker as root on a "
            f"Linux machine with those tools")


def mlflow_service(tracking_uri: str, artifact_root: str) -> tuple[str, str]:
    """(the URL the pods log to, run-mpijob's `--service` argument): an MLflow server over the task's store."""
    from nightshift.mpijob_local.requirements import served_store_problem

    problem = served_store_problem(tracking_uri)
    if problem:
        raise InvalidJobConfig(f"backend=hosts: {problem}")
    target = f"{MLFLOW_HOST}:{MLFLOW_PORT}"
    mlflow = shutil.which("mlflow", path=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}") or "mlflow"
    server = [mlflow, "server", "--host", "0.0.0.0", "--port", str(MLFLOW_PORT), "--workers", "1",
              "--allowed-hosts", target, "--backend-store-uri", tracking_uri, "--artifacts-destination",
              artifact_root]
    return f"http://{target}", f"{target}={shlex.join(server)}"


def run_mpijob_argv(manifest: Path, claim: str, home: str, service: str, timeout: float | None) -> list[str]:
    nightshift = shutil.which("nightshift", path=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}")
    if nightshift is None:
        raise InvalidJobConfig(f"backend=hosts needs the `nightshift` command beside {sys.executable} or on PATH")
    argv = [nightshift, "run-mpijob", str(manifest), "--volume", f"{claim}={home}", "--service", service,
            "--ready-timeout", str(READY_TIMEOUT_SECONDS)]
    if timeout:
        argv += ["--timeout", str(timeout)]
    return argv


def shared_claim(body: Mapping[str, Any]) -> str:
    """The claim of the shared volume (NIGHTSHIFT_HOME) in the MPIJob the operator built."""
    from operators.horovod import SHARED_VOLUME

    template = body["spec"]["mpiReplicaSpecs"]["Launcher"]["template"]["spec"]
    for volume in template.get("volumes") or []:
        if volume.get("name") == SHARED_VOLUME:
            return str(volume["persistentVolumeClaim"]["claimName"])
    raise InvalidJobConfig(f"backend=hosts: the MPIJob has no {SHARED_VOLUME} volume (NIGHTSHIFT_HOME)")


def launcher_command(body: Mapping[str, Any]) -> list[str]:
    containers = body["spec"]["mpiReplicaSpecs"]["Launcher"]["template"]["spec"]["containers"]
    return [str(arg) for arg in containers[0].get("command") or []]


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


def _write_pidfile(path: Path, pid: int) -> None:
    from nightshift.fsutil import atomic_write_json
    from nightshift.processes import identity

    atomic_write_json(path, identity(pid))


def _running_from_pidfile(path: Path) -> int | None:
    """The pid the file names if that very process (this machine's, same start time: nightshift.processes; a
    run-mpijob) still runs; else None. A try on another machine names none of this machine's processes."""
    from nightshift.processes import still_running

    try:
        recorded = json.loads(path.read_text())
        pid = int(recorded["pid"])
        if not still_running(recorded) or not _alive(pid):
            return None
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return None
    return pid if b"run-mpijob" in argv[1:3] else None


class HostsBackend(TrainingBackend):
    """The kubernetes backend's MPIJob, run across `num_workers` emulated hosts by `nightshift run-mpijob`."""

    renders_mpijob: ClassVar[bool] = True
    supports_elastic: ClassVar[bool] = True  # run-mpijob keeps /etc/mpi/discover_hosts.sh current

    def __init__(self, run: BackendRun) -> None:
        super().__init__(run)
        self.process: subprocess.Popen[bytes] | None = None
        self.tail: deque[str] = deque(maxlen=TAIL_LINES)
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._reader: threading.Thread | None = None
        self._tmp: Path | None = None
        self._cancelled = False
        self._lock = threading.RLock()  # cancel() may run in a signal handler while submit() holds it

    # -- submit ------------------------------------------------------------------------------------
    def submit(self, identity: TaskIdentity, context: Any) -> dict[str, Any]:
        from nightshift import settings

        check_machine()
        run = self.run
        url, service = mlflow_service(settings.mlflow_tracking_uri(), settings.mlflow_artifact_root())
        assert url == SERVICE_URL, url  # what render() gives the pods
        from nightshift.tracking import configure, ensure_experiment

        # The store made (its tables, under its lock) before the service opens it: `mlflow server` migrates a
        # new store unlocked, racing another task's first use of the same store.
        configure()
        experiment = run.tracking.mlflow_experiment
        if experiment:
            # Made here, on the task's store, so its artifacts go where the task reads them (a local path the
            # pods see too), not behind the service's artifact proxy, which is gone once the job ends.
            ensure_experiment(str(experiment))
        namespace = run.cluster.namespace or "default"
        body = self.render(identity, namespace)
        name = body["metadata"]["name"]
        checkpoint_dir = run.checkpoint_dir(identity)
        Path(checkpoint_dir).mkdir(parents=True, exist_ok=True)
        self._stop_earlier_try(Path(checkpoint_dir) / PIDFILE)
        self._tmp = Path(tempfile.mkdtemp(prefix="nightshift-hosts-"))
        try:
            return self._start(body, name, namespace, checkpoint_dir, url, service)
        except BaseException:
            # execute() cleans up only after a submit that returned: nothing may be left running or on disk.
            if self.process is not None and self.process.poll() is None:
                self.cancel()
            if self._reader is not None:
                self._reader.join(timeout=10)
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None
            raise

    def _start(self, body: dict[str, Any], name: str, namespace: str, checkpoint_dir: str, url: str,
               service: str) -> dict[str, Any]:
        import yaml

        from nightshift import settings
        from operators.local_launcher import child_environment

        run = self.run
        assert self._tmp is not None
        manifest = self._tmp / "mpijob.yaml"
        manifest.write_text(yaml.safe_dump(body, sort_keys=False))
        manifest.chmod(0o600)
        argv = run_mpijob_argv(manifest, shared_claim(body), str(settings.home()), service,
                               run.execution.timeout)
        self.log.info("MPIJob %s/%s on %s emulated host(s); checkpoints of this task (every try): %s; MLflow "
                      "for the pods: %s over %s", namespace, name, run.job.num_workers, checkpoint_dir, url,
                      settings.mlflow_tracking_uri())
        self.log.info("MPIJob %s launcher command: %s", name, json.dumps(launcher_command(body)))
        if self._cancelled or run.killed:
            raise TaskInterrupted(f"the task was killed before MPIJob {name} started on emulated hosts")
        # Only the allowlisted part of the worker's environment: run-mpijob passes its own to the services. The
        # MLflow service without MLflow's job execution: by default `mlflow server` starts eight huey consumers
        # for MLflow's own server-side jobs, which Nightshift never submits (10 processes and ~47 s of CPU in its
        # first 1.5 minutes on a loaded 2-core machine, against 2 and ~15 s without); scripts/airflow.sh's
        # MLflow UI runs without them too.
        env = child_environment(os.environ, {"PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '/usr/bin:/bin')}"
                                                     f"{os.pathsep}/usr/sbin{os.pathsep}/sbin",
                                             "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"})
        with self._lock:
            self.process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                            stderr=subprocess.STDOUT, env=env, start_new_session=True)
        _write_pidfile(Path(checkpoint_dir) / PIDFILE, self.process.pid)
        self._reader = threading.Thread(target=self._read, daemon=True, name=f"run-mpijob-{name}")
        self._reader.start()
        self.log.info("run-mpijob (pid %d): %s", self.process.pid, shlex.join(argv))
        if self._cancelled or run.killed:  # on_kill ran while it started: its cancel may have found no process
            self.cancel()
            raise TaskInterrupted(f"the task was killed while MPIJob {name} started on emulated hosts; stopped")
        return {"backend": self.name, "name": name, "namespace": namespace, "checkpoint_dir": checkpoint_dir,
                "num_workers": run.job.num_workers, "gpus_per_worker": run.job.gpus_per_worker}

    def _stop_earlier_try(self, pidfile: Path) -> None:
        """An earlier try's run-mpijob that outlived its task (the supervisor SIGKILLs a task 5 s after SIGTERM,
        and run-mpijob runs in a session of its own) would train beside this try, into the same checkpoints
        and MLflow run key: stop it (SIGTERM, then SIGKILL) and remove what it leaves, as the kubernetes
        backend deletes an earlier try's MPIJob."""
        earlier = _running_from_pidfile(pidfile)
        if earlier is None:
            return
        self.log.warning("An earlier try's run-mpijob (pid %d) is still running: stopping it before this try "
                         "starts", earlier)
        with suppress(ProcessLookupError):
            os.killpg(earlier, signal.SIGTERM)
        deadline = time.monotonic() + KILL_GRACE_SECONDS
        while _alive(earlier) and time.monotonic() < deadline:
            time.sleep(0.5)
        if _alive(earlier):
            self.log.error("run-mpijob (pid %d) did not stop in %.0fs: SIGKILL", earlier, KILL_GRACE_SECONDS)
            with suppress(ProcessLookupError):
                os.killpg(earlier, signal.SIGKILL)
            while _alive(earlier):
                time.sleep(0.2)
        self._remove_leftovers()

    def render(self, identity: TaskIdentity, namespace: str | None = None) -> dict[str, Any]:
        """The kubernetes backend's MPIJob, its pods logging to the MLflow service on the job's network."""
        return self.run.render_mpijob(identity, namespace or self.run.cluster.namespace or "default",
                                      tracking_uri=SERVICE_URL)

    def _read(self) -> None:
        process = self.process
        assert process is not None and process.stdout is not None
        for raw in iter(process.stdout.readline, b""):
            self._lines.put(raw.decode("utf-8", errors="replace").rstrip("\n"))
        self._lines.put(None)

    # -- wait --------------------------------------------------------------------------------------
    def wait(self, result: dict[str, Any], context: Any) -> None:
        process = self.process
        if process is None:
            raise MPIJobFailed(f"MPIJob {result.get('name')} was never started on emulated hosts")
        while True:
            try:
                line = self._lines.get(timeout=0.5)
            except queue.Empty:
                continue
            if line is None:
                break
            self.tail.append(line)
            self.log.info("%s", line)
        code = process.wait()
        name = f"{result.get('namespace')}/{result.get('name')}"
        if code == 0:
            self.log.info("MPIJob %s succeeded on emulated hosts", name)
            return
        if self._cancelled:
            raise TaskInterrupted(f"the task was killed: MPIJob {name} on emulated hosts was stopped")
        last = self._last_word()
        if code == EXIT_REFUSED and last.startswith(("nightshift run-mpijob:", "nightshift: ")):
            raise InvalidJobConfig(f"run-mpijob refused MPIJob {name}: {last}")
        what = "ran out of time" if code == EXIT_TIMEOUT else f"failed (run-mpijob exit code {code})"
        raise MPIJobFailed(f"MPIJob {name} on emulated hosts {what}: {last}; last log lines:\n"
                           + "\n".join(self.tail))

    def _last_word(self) -> str:
        """run-mpijob's own last line (its verdict), else the last line of the log."""
        mine = [line for line in self.tail if line.startswith(("nightshift run-mpijob:", "nightshift: "))]
        return (mine or [line for line in self.tail if line.strip()] or ["no output"])[-1]

    # -- cancel, clean up --------------------------------------------------------------------------
    def cancel(self) -> None:
        """SIGTERM to run-mpijob (its clean-up removes the run's namespaces and processes), SIGKILL after
        KILL_GRACE_SECONDS; what a SIGKILLed run left is removed."""
        self._cancelled = True
        with self._lock:
            process = self.process
            if process is None or process.poll() is not None:
                return
            self.log.warning("Stopping run-mpijob (pid %d) and its emulated hosts", process.pid)
            with suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=KILL_GRACE_SECONDS)
            except subprocess.TimeoutExpired:
                self.log.error("run-mpijob (pid %d) did not stop in %.0fs: SIGKILL", process.pid,
                               KILL_GRACE_SECONDS)
                with suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        if process.returncode < 0:
            self._remove_leftovers()

    def _remove_leftovers(self) -> None:
        from nightshift.mpijob_local.runner import remove_stale_runs

        try:
            for name in remove_stale_runs():
                self.log.warning("Removed %s, left by a run-mpijob that was killed", name)
        except Exception as err:  # best effort: the next run-mpijob removes them too
            self.log.error("Could not remove what a killed run-mpijob left (%s); the next run removes it", err)

    def cleanup(self, result: dict[str, Any], *, succeeded: bool, error: BaseException | None) -> None:
        process = self.process
        if process is not None and process.poll() is None:
            self.cancel()
        if self._reader is not None:
            self._reader.join(timeout=10)
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None
        if process is not None and not self._cancelled and (process.returncode or 0) < 0:
            self._remove_leftovers()  # run-mpijob was killed (SIGKILL) from outside: it cleaned nothing up
