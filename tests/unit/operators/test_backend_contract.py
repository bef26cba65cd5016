"""The one backend contract (issue 35 item 4): a backend gets a `BackendRun`, never the operator; it is known by
the name it is registered as, wherever it is judged or resumed; `operators.backends` refuses what cannot be a
backend with a message naming it. `ShellBackend` below is a fourth backend written as a user would write one in
a plugin module: public names only (operators.backends, operators.backends.base, operators.errors), no edit of
`operators/`; the operator runs it end to end through execute, a deferral and its resume."""

from __future__ import annotations

import runpy
import subprocess
import sys
import types
from collections.abc import AsyncIterator, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from airflow.triggers.base import BaseTrigger, TriggerEvent

from operators.backends import register_backend
from operators.backends.base import TrainingBackend
from operators.errors import InvalidJobConfig, MPIJobFailed, TaskInterrupted
from tests.unit.operators import fake_kubernetes as fk
from tests.unit.operators.conftest import horovod_operator, make_context

if TYPE_CHECKING:
    from operators.backends.base import BackendRun

REPO = Path(__file__).resolve().parents[3]
CALLS: list[tuple[Any, ...]] = []


# --- a fourth backend, as a user writes one --------------------------------------------------------------------


class ShellTrigger(BaseTrigger):
    """Waits for the shell job's exit-code file (what a plugin's trigger would poll)."""

    def __init__(self, done_file: str) -> None:
        super().__init__()
        self.done_file = done_file

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return f"{__name__}.ShellTrigger", {"done_file": self.done_file}

    async def run(self) -> AsyncIterator[TriggerEvent]:  # pragma: no cover - the test plays the triggerer
        yield TriggerEvent({"exit_code": int(Path(self.done_file).read_text())})


class ShellBackend(TrainingBackend):
    """Runs the job's command once, here, with the task's checkpoint directory appended; waits for it here or,
    when the job's `deferrable`, in the triggerer (a trigger reading the exit code the job leaves)."""

    supports_elastic = False

    def __init__(self, run: BackendRun) -> None:
        super().__init__(run)
        self.process: subprocess.Popen[bytes] | None = None

    def submit(self, identity: Any, context: Mapping[str, Any]) -> dict[str, Any]:
        checkpoint_dir = self.run.checkpoint_dir(identity)
        Path(checkpoint_dir).mkdir(parents=True, exist_ok=True)
        done = f"{checkpoint_dir}/exit-code"
        command = [*self.run.job.command, "--checkpoint-dir", checkpoint_dir]
        CALLS.append(("submit", self.name, identity.run_id, self.run.job.num_workers))
        if self.run.killed:
            raise TaskInterrupted("the task was killed before the shell job started")
        self.log.info("shell backend: %s", command)
        self.process = subprocess.Popen(["sh", "-c", '"$@"; rc=$?; echo $rc > "$0"; exit $rc', done, *command])
        result = {"checkpoint_dir": checkpoint_dir, "done_file": done}
        if self.run.execution.deferrable:
            self.process.wait()  # a real plugin's job would run on its own; here it is quick
            self.run.defer(ShellTrigger(done), result=result, context=context)
        return result

    def wait(self, result: dict[str, Any], context: Mapping[str, Any]) -> None:
        assert self.process is not None
        CALLS.append(("wait", self.name))
        if self.process.wait() != 0:
            raise MPIJobFailed(f"the shell job exited with {self.process.returncode}")

    def complete(self, result: dict[str, Any], event: Mapping[str, Any], context: Mapping[str, Any]) -> None:
        CALLS.append(("complete", self.name, result["done_file"]))
        if event["exit_code"] != 0:
            raise MPIJobFailed(f"the shell job exited with {event['exit_code']}")

    def cancel(self) -> None:
        CALLS.append(("cancel", self.name))
        if self.process is not None and self.process.poll() is None:
            self.process.kill()

    def cleanup(self, result: dict[str, Any], *, succeeded: bool, error: BaseException | None) -> None:
        CALLS.append(("cleanup", self.name, succeeded, type(error).__name__ if error else None))
        Path(result["done_file"]).unlink(missing_ok=True)


@pytest.fixture
def registered() -> Iterator[Any]:
    """register_backend(name, Class) as a plugin module does; forgotten afterwards."""
    from operators.backends import BACKENDS

    names: list[str] = []

    def register(name: str, cls: Any) -> None:
        register_backend(name, cls)
        names.append(name)

    CALLS.clear()
    yield register
    for name in names:
        BACKENDS._factories.pop(name, None)


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("NIGHTSHIFT_HOME", str(tmp_path))
    monkeypatch.delenv("NIGHTSHIFT_CHECKPOINTS", raising=False)
    return tmp_path


def shell_operator(**settings: Any) -> Any:
    script = "import sys, pathlib; pathlib.Path(sys.argv[-1], 'trained').write_text('ok'); sys.exit(0)"
    settings.setdefault("command", [sys.executable, "-c", script])
    settings.setdefault("backend", "shell")
    return horovod_operator(task_id="train", num_workers="{{ params.workers }}", **settings)


def test_a_fourth_backend_runs_end_to_end_through_execute(registered: Any, home: Path) -> None:
    registered("shell", ShellBackend)
    op = shell_operator()
    op.num_workers = "2"  # as Airflow renders it
    result = op.execute(make_context(run_id="r1"))
    checkpoints = home / "checkpoints" / "nightly_retrain" / "r1" / "train"
    assert result == {"backend": "shell", "checkpoint_dir": str(checkpoints), "done_file": f"{checkpoints}/exit-code"}
    assert (checkpoints / "trained").read_text() == "ok"
    assert CALLS == [("submit", "shell", "r1", 2), ("wait", "shell"), ("cleanup", "shell", True, None)]
    op.on_kill()
    assert CALLS[-1] == ("cancel", "shell")

    CALLS.clear()
    failing = shell_operator(command=[sys.executable, "-c", "raise SystemExit(3)"])
    failing.num_workers = "1"
    with pytest.raises(MPIJobFailed, match="exited with 3"):
        failing.execute(make_context())
    assert CALLS[-1] == ("cleanup", "shell", False, "MPIJobFailed")


def test_a_fourth_backend_defers_and_is_resumed_as_itself(registered: Any, home: Path) -> None:
    from airflow.sdk.exceptions import TaskDeferred

    registered("shell", ShellBackend)
    op = shell_operator(deferrable=True)
    op.num_workers = "1"
    with pytest.raises(TaskDeferred) as deferred:
        op.execute(make_context(run_id="r2"))
    assert isinstance(deferred.value.trigger, ShellTrigger) and deferred.value.method_name == "execute_complete"
    carried = (deferred.value.kwargs or {})["result"]
    assert carried["backend"] == "shell" and Path(carried["done_file"]).read_text().strip() == "0"
    resumed = shell_operator(deferrable=True)  # a fresh worker process: the result is all it has
    result = resumed.execute_complete(make_context(run_id="r2"), {"exit_code": 0}, **(deferred.value.kwargs or {}))
    assert result["backend"] == "shell"
    assert CALLS[-2:] == [("complete", "shell", carried["done_file"]), ("cleanup", "shell", True, None)]


def test_a_backend_registered_twice_is_known_by_each_name(registered: Any, home: Path) -> None:
    registered("shell", ShellBackend)
    registered("shell-b", ShellBackend)
    op = shell_operator(backend="shell-b")
    op.num_workers = "1"
    assert op.execute(make_context())["backend"] == "shell-b"
    assert {call[1] for call in CALLS} == {"shell-b"}


# --- a subclass of a built-in, registered under its own name -------------------------------------------------------


def gke_class() -> type[TrainingBackend]:
    from operators.backends.kubernetes import KubernetesBackend

    class GkeBackend(KubernetesBackend):
        """A team's KubernetesBackend: the same MPIJob, its own bookkeeping."""

        def complete(self, result: dict[str, Any], event: Mapping[str, Any], context: Mapping[str, Any]) -> None:
            CALLS.append(("complete", self.name, type(self).__name__))
            super().complete(result, event, context)

        def cleanup(self, result: dict[str, Any], *, succeeded: bool, error: BaseException | None) -> None:
            CALLS.append(("cleanup", self.name, type(self).__name__))
            super().cleanup(result, succeeded=succeeded, error=error)

        def render(self, identity: Any, namespace: str | None = None) -> dict[str, Any]:
            job = super().render(identity, namespace)  # a team's own naming of its jobs
            job["metadata"]["name"] = "gke-" + job["metadata"]["name"][:40]
            return job

        def deferral_failed(self, context: Mapping[str, Any], error: BaseException,
                            result: Mapping[str, Any] | None = None) -> None:
            CALLS.append(("deferral_failed", self.name, type(self).__name__))
            super().deferral_failed(context, error, result)

    return GkeBackend


@pytest.fixture
def cluster_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NIGHTSHIFT_HOME", "/workspace")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://mlflow.nightshift.svc:5000")
    for name in ("NIGHTSHIFT_CLUSTER_MLFLOW_URI", "NIGHTSHIFT_SHARED_PVC", "NIGHTSHIFT_KUEUE_QUEUE"):
        monkeypatch.delenv(name, raising=False)


def gke_operator(cluster: fk.FakeCluster) -> Any:
    op = horovod_operator(task_id="train", num_workers=2, gpus_per_worker=1, image="ghcr.io/example/trainer:1",
                          command=["python", "-m", "nightshift.train", "--out", "/workspace/model"], backend="gke",
                          poll_interval=0.0, startup_timeout=30.0, deferrable=True)
    op.__dict__["hook"] = fk.FakeHook(cluster)
    return op


def test_a_subclass_registered_as_gke_is_resumed_judged_and_cleaned_up_as_gke(registered: Any,
                                                                              cluster_env: None) -> None:
    """It was resumed as the built-in: its result said "kubernetes", the name its class inherited."""
    from airflow.sdk.exceptions import TaskDeferred

    registered("gke", gke_class())
    cluster = fk.FakeCluster(lambda name: fk.succeeding(name, ["epoch 1", "done"]))
    with pytest.raises(TaskDeferred) as deferred:
        gke_operator(cluster).execute(make_context())
    assert (deferred.value.kwargs or {})["result"]["backend"] == "gke"
    (name,) = cluster.created
    for _ in range(4):  # the job runs to the end while the task is deferred
        cluster.get_namespaced_custom_object("kubeflow.org", "v2beta1", "default", "mpijobs", name)
    event = {"status": "success", "name": name, "namespace": "default", "phase": "Succeeded", "message": ""}
    result = gke_operator(cluster).execute_complete(make_context(), event, **(deferred.value.kwargs or {}))
    assert result["backend"] == "gke"
    assert CALLS == [("complete", "gke", "GkeBackend"), ("cleanup", "gke", "GkeBackend")]


def test_a_failed_deferral_of_gke_is_given_to_gke(registered: Any, cluster_env: None) -> None:
    from airflow.sdk.exceptions import TaskDeferralTimeout, TaskDeferred

    registered("gke", gke_class())
    cluster = fk.FakeCluster(lambda name: fk.running_forever(name, ["step 1"]))
    with pytest.raises(TaskDeferred):
        gke_operator(cluster).execute(make_context())
    from airflow.sdk import BaseOperator

    def timed_out(*args: object, **kwargs: object) -> None:
        raise TaskDeferralTimeout("deferral timed out")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(BaseOperator, "resume_execution", timed_out)
        # What the scheduler really writes on a timeout: the deferral's kwargs replaced by the error (Airflow 3.3,
        # scheduler_job_runner: next_kwargs = {"error": ...}); the result comes back from the XCom defer kept.
        with pytest.raises(TaskDeferralTimeout):
            gke_operator(cluster).resume_execution("execute_complete", {"error": "TRIGGER_TIMEOUT"}, make_context())
    assert CALLS == [("deferral_failed", "gke", "GkeBackend")]
    assert cluster.created and all(name.startswith("gke-") for name in cluster.created)
    # a timed-out task leaves nothing running: the job gke named its own way, not the default name
    assert [deleted[1] for deleted in cluster.deleted] == cluster.created


# --- names and refusals ---------------------------------------------------------------------------------------------


class NamelessFixedSize(ShellBackend):
    """Declares no name and no elastic support."""


def test_a_nameless_backend_is_refused_for_elastic_by_its_registered_name(registered: Any, home: Path) -> None:
    """The refusal read the class's `name`: a plugin that declared none crashed it with AttributeError."""
    registered("fixed", NamelessFixedSize)
    op = shell_operator(backend="fixed", elastic={"min_workers": 1, "max_workers": 2})
    op.num_workers = "1"
    with pytest.raises(InvalidJobConfig, match=r"backend=fixed cannot run elastic training .* use a backend that "
                                               r"can \(hosts, kubernetes, local\)"):
        op.execute(make_context())
    assert CALLS == []  # refused before submitting


class Abstract(TrainingBackend):
    """Implements submit only."""

    def submit(self, identity: Any, context: Mapping[str, Any]) -> dict[str, Any]:
        return {}


class ReadOnlyName(ShellBackend):
    @property
    def name(self) -> str:  # type: ignore[override]
        return "mine"


@pytest.mark.parametrize(("cls", "why"), [
    (Abstract, r"training backend 'odd' \(.*Abstract\) cannot be made: .*abstract.*; a backend implements submit, "
               r"wait, cancel and cleanup"),
    (ReadOnlyName, r"training backend 'odd' \(.*ReadOnlyName\) has a read-only `name`; leave `name` to the "
                   r"registry"),
])
def test_what_cannot_be_a_backend_is_refused_naming_it(registered: Any, home: Path, cls: type, why: str) -> None:
    registered("odd", cls)
    op = shell_operator(backend="odd")
    op.num_workers = "1"
    with pytest.raises(InvalidJobConfig, match=why):
        op.execute(make_context())


def test_the_checkpoint_directory_is_the_tasks_whatever_the_backend(home: Path) -> None:
    """resolve_checkpoint_dir took a backend name and ignored it (hosts passed "kubernetes" to get the same)."""
    from operators.mpijob_spec import TaskIdentity

    op = shell_operator(backend="local")
    identity = TaskIdentity("d", "train", "r1", 2)
    assert op.resolve_checkpoint_dir(identity) == f"{home}/checkpoints/d/r1/train"
    assert {op.make_backend(name).run.checkpoint_dir(identity) for name in ("local", "kubernetes", "hosts")} == {
        f"{home}/checkpoints/d/r1/train"}


def test_a_built_in_that_cannot_be_imported_is_an_error_a_broken_plugin_a_warning(
        registered: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """elastic_backends() swallowed every exception: a broken installation (a built-in's ImportError) went
    unseen, and a broken plugin was dropped without a word."""
    from nightshift.errors import UsageError
    from operators.backends import elastic_backends

    registered("broken", "no_such_module_anywhere:Backend")
    # Review finding: a plugin whose module raises something else than ImportError at import escaped the elastic
    # refusal's message as that error.
    module = types.ModuleType("nightshift_test_exploding_plugin")
    module.__getattr__ = lambda name: (_ for _ in ()).throw(RuntimeError("the plugin's import exploded"))
    monkeypatch.setitem(sys.modules, "nightshift_test_exploding_plugin", module)
    registered("exploding", "nightshift_test_exploding_plugin:Backend")
    with caplog.at_level("WARNING", logger="operators.backends"):
        assert elastic_backends() == ("hosts", "kubernetes", "local")
    assert "training backend 'broken' left out of the elastic ones: UnknownBackend: cannot import training " \
           "backend 'broken'" in caplog.text
    assert "training backend 'exploding' left out of the elastic ones: RuntimeError: the plugin's import " \
           "exploded" in caplog.text
    monkeypatch.setitem(sys.modules, "operators.backends.hosts", None)  # import fails with ImportError
    with pytest.raises(UsageError, match="cannot import training backend 'hosts'") as raised:
        elastic_backends()
    assert isinstance(raised.value.__cause__.__cause__, ImportError)  # type: ignore[union-attr]


class NamedInInit(ShellBackend):
    """Reads its registered name in its constructor."""

    def __init__(self, run: Any) -> None:
        super().__init__(run)
        self.label = f"backend {self.name}"


def test_a_backends_constructor_already_knows_its_registered_name(registered: Any, home: Path) -> None:
    """Review finding: `name` was set after __init__, so a constructor using it failed with AttributeError."""
    from operators.backends import create_backend

    registered("named", NamedInInit)
    op = shell_operator(backend="named")
    backend = create_backend("named", op.backend_run("named"))
    assert backend.name == "named" and backend.label == "backend named"  # type: ignore[attr-defined]


def test_the_backend_params_describe_exactly_the_registered_choices(registered: Any,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Both DAGs' descriptions hard-coded the three built-ins: a plugin's backend was an enum choice the form
    never described."""
    from operators.backends import backend_choices

    registered("shell", ShellBackend)
    monkeypatch.delenv("NIGHTSHIFT_BACKEND", raising=False)
    monkeypatch.syspath_prepend(str(REPO / "dags"))  # as Airflow puts the DAG folder on sys.path
    for dag_file in ("nightly_retrain.py", "model_search.py"):
        dag = runpy.run_path(str(REPO / "dags" / dag_file), run_name=f"{dag_file}_under_test")["dag"]
        param = dag.params.get_param("backend")
        described = param.description or ""
        assert param.schema["enum"] == list(backend_choices())
        assert all(f"{name}: " in described for name in backend_choices()), described
        assert "shell: a plugin backend" in described
    from operators.backends import BUILTIN_BACKENDS, BUILTIN_SUMMARIES

    assert set(BUILTIN_SUMMARIES) == set(BUILTIN_BACKENDS)  # every built-in is described


def test_a_mapped_tries_deferred_result_is_its_own() -> None:
    """Second review: without map_indexes, a mapped task (the model search's trials) pulled every instance's
    deferred result, a list, and lost its own: its timed-out job was then looked for under the default name."""
    from operators.backends.base import DEFERRED_XCOM

    for index in (0, 1):
        make_context(map_index=index)["ti"].xcom_push(key=DEFERRED_XCOM, value={"name": f"job-{index}"})
    op = horovod_operator(task_id="train", command=["true"], backend="local")
    assert op._deferred_result(make_context(map_index=1)) == {"name": "job-1"}


class RenamesItself(ShellBackend):
    def __init__(self, run: Any) -> None:
        super().__init__(run)
        self.name = "something-else"


def test_the_registered_name_wins_over_a_constructors(registered: Any, home: Path) -> None:
    from operators.backends import create_backend

    registered("mine", RenamesItself)
    op = shell_operator(backend="mine")
    assert create_backend("mine", op.backend_run("mine")).name == "mine"
