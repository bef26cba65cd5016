"""Training backends and deployment targets by name (operators.backends, nightshift.deploy): a plugin module
named in NIGHTSHIFT_PLUGINS registers a toy backend and a toy target, which then are choices of the operator's
backend check and of `nightshift deploy --target`, and which `HorovodKubernetesOperator.execute` drives through
the TrainingBackend interface. The DAG's Param enums: tests/dags/test_backend_plugins.py."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from tests.unit.operators.conftest import horovod_operator, make_context

REPO = Path(__file__).resolve().parents[3]
PLUGIN = "nightshift_toy_plugin"
TOY_SOURCE = '''
from nightshift.deploy import register_target
from operators.backends import register_backend
from operators.backends.base import TrainingBackend

CALLS = []


class ToyBackend(TrainingBackend):
    def submit(self, identity, context):
        CALLS.append(("submit", identity.task_id, self.run.job.num_workers))
        return {"backend": self.name, "checkpoint_dir": "/toy/" + identity.run_id}

    def wait(self, result, context):
        CALLS.append(("wait", result["checkpoint_dir"]))
        if (self.run.job.env or {}).get("TOY_FAIL"):
            raise RuntimeError("the toy job failed")

    def cancel(self):
        CALLS.append(("cancel",))

    def cleanup(self, result, *, succeeded, error):
        CALLS.append(("cleanup", succeeded, type(error).__name__ if error else None))


def toy_target(model_name, *, version, alias, **options):
    CALLS.append(("deploy", model_name, version, alias))
    return {"status": "created", "model_name": model_name, "version": version}


register_backend("toy", ToyBackend)
register_target("toy-serve", toy_target)
'''


def install_toy_plugin(folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Write the toy plugin module into `folder`, put it on sys.path and name it in NIGHTSHIFT_PLUGINS."""
    (folder / f"{PLUGIN}.py").write_text(TOY_SOURCE)
    monkeypatch.syspath_prepend(str(folder))
    monkeypatch.setenv("NIGHTSHIFT_PLUGINS", PLUGIN)


def forget_toy_plugin() -> None:
    from nightshift.deploy import TARGETS
    from operators.backends import BACKENDS

    BACKENDS._factories.pop("toy", None)
    TARGETS._factories.pop("toy-serve", None)
    sys.modules.pop(PLUGIN, None)


@pytest.fixture
def toy_plugin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[ModuleType]:
    install_toy_plugin(tmp_path, monkeypatch)
    from operators.backends import backend_names

    backend_names()  # imports the plugin
    yield sys.modules[PLUGIN]
    forget_toy_plugin()


def test_a_plugin_backend_and_target_are_choices(toy_plugin: ModuleType) -> None:
    from nightshift.cli import build_parser
    from nightshift.deploy import deploy, target_names
    from operators.backends import backend_choices
    from operators.horovod_config import ClusterConfig

    assert backend_choices() == ("hosts", "kubernetes", "local", "toy", "auto")
    assert ClusterConfig(backend="toy").settled().backend == "toy"
    assert target_names() == ("local", "kserve", "toy-serve")
    args = build_parser().parse_args(["deploy", "--target", "toy-serve", "--model-name", "m", "--version", "3"])
    assert args.target == "toy-serve"
    assert deploy("toy-serve", "m", version="3")["status"] == "created"
    assert toy_plugin.CALLS == [("deploy", "m", "3", "challenger")]


def test_without_the_plugin_its_names_are_refused_listing_the_known_ones(monkeypatch: pytest.MonkeyPatch,
                                                                         capsys: pytest.CaptureFixture[str]) -> None:
    from nightshift.cli import build_parser
    from nightshift.deploy import deploy
    from nightshift.errors import UsageError
    from operators.errors import InvalidJobConfig
    from operators.horovod_config import ClusterConfig

    monkeypatch.delenv("NIGHTSHIFT_PLUGINS", raising=False)
    with pytest.raises(InvalidJobConfig, match=r"backend: unknown training backend 'toy'; choose one of hosts, "
                                                r"kubernetes, local, auto"):
        ClusterConfig(backend="toy")
    with pytest.raises(UsageError, match=r"unknown deployment target 'toy-serve'; use one of local, kserve"):
        deploy("toy-serve", "m")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["deploy", "--target", "toy-serve"])
    assert "invalid choice: 'toy-serve' (choose from 'local', 'kserve')" in capsys.readouterr().err


def test_execute_drives_the_registered_backend(toy_plugin: ModuleType) -> None:
    op = horovod_operator(task_id="train", command=["true"], num_workers="{{ params.workers }}", backend="toy")
    op.num_workers = "3"  # as Airflow renders it
    result = op.execute(make_context(run_id="r1"))  # type: ignore[arg-type]
    assert result == {"backend": "toy", "checkpoint_dir": "/toy/r1"}
    assert toy_plugin.CALLS == [("submit", "train", 3), ("wait", "/toy/r1"), ("cleanup", True, None)]
    op.on_kill()
    assert toy_plugin.CALLS[-1] == ("cancel",)

    toy_plugin.CALLS.clear()
    failing = horovod_operator(task_id="train", command=["true"], backend="toy", env={"TOY_FAIL": "1"})
    with pytest.raises(RuntimeError, match="the toy job failed"):
        failing.execute(make_context())  # type: ignore[arg-type]
    assert [call[0] for call in toy_plugin.CALLS] == ["submit", "wait", "cleanup"]
    assert toy_plugin.CALLS[-1] == ("cleanup", False, "RuntimeError")


def test_an_entry_point_backend_is_found_and_loaded(toy_plugin: ModuleType, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from operators.backends import ENTRY_POINT_GROUP, backend_class, backend_names

    dist = tmp_path / "entry" / "toy_backends-0.1.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: toy-backends\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(f"[{ENTRY_POINT_GROUP}]\nep-toy = {PLUGIN}:ToyBackend\n")
    monkeypatch.syspath_prepend(str(tmp_path / "entry"))
    assert "ep-toy" in backend_names()
    assert backend_class("ep-toy") is toy_plugin.ToyBackend


def test_what_is_no_backend_is_refused(toy_plugin: ModuleType) -> None:
    from nightshift.errors import UsageError
    from operators.backends import register_backend
    from operators.errors import InvalidJobConfig

    with pytest.raises(UsageError, match="training backend name 'auto' is reserved"):
        register_backend("auto", toy_plugin.ToyBackend)
    register_backend("toy", "builtins:dict")  # importable, but no TrainingBackend
    op = horovod_operator(task_id="train", command=["true"], backend="toy")
    with pytest.raises(InvalidJobConfig, match=r"training backend 'toy' is <class 'dict'>, not a subclass of "
                                               r"operators.backends.base.TrainingBackend"):
        op.execute(make_context())  # type: ignore[arg-type]


def test_listing_the_backends_imports_no_backend_and_no_airflow() -> None:
    code = ("import sys; from operators.backends import backend_choices; from nightshift.deploy import target_names;"
            "print(backend_choices(), target_names());"
            "loaded = [m for m in sys.modules if m.startswith(('airflow', 'operators.backends.', 'nightshift.deploy.',"
            " 'kubernetes'))]; print(loaded)")
    env = {"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True, text=True,
                         timeout=120, check=True).stdout.splitlines()
    assert out == ["('hosts', 'kubernetes', 'local', 'auto') ('local', 'kserve')", "[]"]


def test_the_operator_module_knows_no_backend_by_name() -> None:
    source = (REPO / "operators" / "horovod.py").read_text()
    for name in ("local", "kubernetes", "hosts"):
        assert f'== "{name}"' not in source and f"== '{name}'" not in source
    assert "LocalHorovodLauncher" not in source and "MPIJobTrigger(" not in source




def test_the_docs_registry_table_lists_exactly_the_built_ins() -> None:
    """The docs' table of the two registries (docs/concepts/backends.md) names what they hold: a built-in added or
    removed changes the test."""
    import re

    from nightshift.deploy import BUILTIN_TARGETS
    from operators.backends import AUTO, BUILTIN_BACKENDS

    rows = {line.split("|")[1].strip(" `"): line.split("|")[2]
            for line in (REPO / "docs" / "concepts" / "backends.md").read_text().splitlines()
            if line.startswith(("| `operators.backends`", "| `nightshift.deploy`"))}
    named = {registry: set(re.findall(r"`([a-z0-9_-]+)`", cell)) for registry, cell in rows.items()}
    assert named == {"operators.backends": {*BUILTIN_BACKENDS, AUTO}, "nightshift.deploy": set(BUILTIN_TARGETS)}


@pytest.mark.parametrize("failure", ["import not_installed_anywhere", "raise RuntimeError('needs MY_PLUGIN_TOKEN')"])
def test_a_plugin_that_cannot_import_leaves_the_built_ins_usable_and_is_named(
        failure: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Review finding: a broken NIGHTSHIFT_PLUGINS module made both DAG files fail to parse (the Param enums list
    the backends), so a deferred MPIJob's resume could never run and its job was never deleted."""
    from nightshift.deploy import TARGETS, target_names
    from nightshift.errors import UsageError
    from operators.backends import backend_choices, backend_class, check_backend
    from operators.backends.kubernetes import KubernetesBackend

    (tmp_path / "broken_plugin.py").write_text(failure + "\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("NIGHTSHIFT_PLUGINS", "broken_plugin")
    sys.modules.pop("broken_plugin", None)
    with caplog.at_level("WARNING"):
        assert backend_choices() == ("hosts", "kubernetes", "local", "auto")
        assert target_names() == ("local", "kserve")
    assert "NIGHTSHIFT_PLUGINS names 'broken_plugin', which cannot be imported" in caplog.text
    assert check_backend("kubernetes") == "kubernetes" and backend_class("kubernetes") is KubernetesBackend
    assert TARGETS.get("local").__name__ == "_deploy_local"
    with pytest.raises(UsageError, match=r"NIGHTSHIFT_PLUGINS names 'broken_plugin', which cannot be imported: "
                                         r"(ModuleNotFoundError|RuntimeError)"):
        TARGETS.get("toy-serve")


def test_a_plugin_never_takes_a_built_in_name(toy_plugin: ModuleType, tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Review finding: register_backend('kubernetes', X) silently replaced the built-in (plan and clean-up
    included); an entry point named local was listed but ignored, one named auto listed auto twice."""
    from nightshift.deploy import register_target, target_names
    from nightshift.errors import UsageError
    from operators.backends import ENTRY_POINT_GROUP, backend_choices, backend_class, register_backend
    from operators.backends.kubernetes import KubernetesBackend

    with pytest.raises(UsageError, match="training backend name 'kubernetes' is a built-in"):
        register_backend("kubernetes", toy_plugin.ToyBackend)
    with pytest.raises(UsageError, match="deployment target name 'local' is a built-in"):
        register_target("local", toy_plugin.toy_target)
    assert backend_class("kubernetes") is KubernetesBackend and target_names() == ("local", "kserve", "toy-serve")
    dist = tmp_path / "entry" / "clash-0.1.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: clash\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(f"[{ENTRY_POINT_GROUP}]\nlocal = {PLUGIN}:ToyBackend\n"
                                           f"auto = {PLUGIN}:ToyBackend\nBad Name = {PLUGIN}:ToyBackend\n")
    monkeypatch.syspath_prepend(str(tmp_path / "entry"))
    assert backend_choices() == ("hosts", "kubernetes", "local", "toy", "auto")
    assert backend_class("local").__module__ == "operators.backends.local"


def test_a_kill_before_horovodrun_starts_starts_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Review finding: on_kill while the local backend prepared (check_local_capacity imports torch: seconds)
    was lost, and horovodrun then ran to the end in a session of its own."""
    import operators.local_launcher as local_launcher
    from operators.errors import TaskInterrupted

    marker = tmp_path / "started"
    fake = tmp_path / "horovodrun"
    fake.write_text(f"#!/bin/sh\ntouch {marker}\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    op = horovod_operator(task_id="train", command=["python", "-c", "pass"], backend="local")

    def killed_meanwhile(workers: int, gpus: int) -> int:
        op.on_kill()
        return workers

    monkeypatch.setattr(local_launcher, "check_local_capacity", killed_meanwhile)
    with pytest.raises(TaskInterrupted, match="nothing was started"):
        op.execute(make_context())  # type: ignore[arg-type]
    assert not marker.exists()


@pytest.mark.slow  # the check runs in a child interpreter
def test_a_horovod_without_torch_fails_the_train_task_at_once_before_horovodrun(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 37 item 4: `horovodrun --gloo` on pip's build of PyPI's Horovod sdist failed three tries over four
    minutes with "Gloo support has not been built"; the local backend checks the Horovod the ranks would import
    first (nightshift doctor's full form, in a child with the ranks' environment) and fails without a retry."""
    from airflow.sdk.exceptions import AirflowFailException

    import operators.local_launcher as local_launcher
    from operators.errors import LocalHorovodUnusable
    from tests.fake_horovod import fake_horovod

    site = fake_horovod(tmp_path / "site", torch=False)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH")) if p))
    started: list[object] = []
    monkeypatch.setattr(local_launcher.LocalHorovodLauncher, "start", lambda self: started.append(self))
    op = horovod_operator(task_id="train", command=["python", "-c", "pass"], backend="local")
    with pytest.raises(LocalHorovodUnusable) as caught:
        op.execute(make_context())  # type: ignore[arg-type]
    assert isinstance(caught.value, AirflowFailException)  # no retry: the next try would fail the same way
    message = str(caught.value)
    assert message.startswith("backend=local cannot train with this machine's Horovod: Horovod 0.28.1: `import "
                              "horovod.torch` fails: Extension horovod.torch has not been built")
    assert "Fix: run `nightshift doctor --build-horovod`" in message
    assert started == []


def test_a_failed_deferral_is_given_to_the_backend_that_deferred(toy_plugin: ModuleType,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Review finding: after a deferral timeout, "auto" was resolved again (a connection lookup could now say
    local, whose deferral_failed does nothing, so the MPIJob was never deleted), and an on_kill meanwhile was
    lost."""
    from airflow.sdk import BaseOperator
    from airflow.sdk.exceptions import TaskDeferralTimeout

    seen: list[str] = []
    monkeypatch.setattr(toy_plugin.ToyBackend, "deferral_failed",
                        lambda self, context, err, result=None: (seen.append(self.name), op.on_kill()), raising=False)

    def timed_out(*args: object, **kwargs: object) -> None:
        raise TaskDeferralTimeout("deferral timed out")

    monkeypatch.setattr(BaseOperator, "resume_execution", timed_out)
    op = horovod_operator(task_id="train", command=["true"], backend="auto")
    monkeypatch.setattr(type(op), "resolve_backend", lambda self: "local")
    with pytest.raises(TaskDeferralTimeout):
        op.resume_execution("execute_complete", {"result": {"backend": "toy"}}, make_context())  # type: ignore[arg-type]
    assert seen == ["toy"] and toy_plugin.CALLS[-1] == ("cancel",)
