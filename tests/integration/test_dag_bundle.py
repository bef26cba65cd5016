"""Runs pinned to a commit: `scripts/airflow.sh standalone` with NIGHTSHIFT_DAG_BUNDLE=git serves the DAGs of a
local bare git repository through the git provider's GitDagBundle. A run is triggered and held in flight, a
DAG change is committed and pushed, the dag-processor picks it up, a second run is triggered: each run records
its own commit (`bundle_version`) and DAG version, every task of the first run still executes the first
commit's files, and the code version the run records (check_changes' fingerprint, the report, the ledger) is
that commit. The first tests check, without Airflow running, how a task turns its bundle into that code
version and where the commit goes (training tag, model version tags)."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from tests.conftest import DIGITS_YAML
from tests.integration.airflow_helpers import REPO, Api, airflow_standalone

PROBE = "bundle_probe"
PROBE_FILE = Path(__file__).parent / "bundle" / "bundle_probe.py"
SHA = "0123456789abcdef0123456789abcdef01234567"


# -- without Airflow running ------------------------------------------------------------------------------


def test_code_version_prefers_the_bundle_commit_then_the_image_commit(monkeypatch: pytest.MonkeyPatch) -> None:
    from nightshift import ledger

    monkeypatch.setenv("NIGHTSHIFT_GIT_COMMIT", "image-commit")
    assert ledger.code_version(SHA) == SHA
    assert ledger.code_version(None) == ledger.code_version("") == "image-commit"
    monkeypatch.delenv("NIGHTSHIFT_GIT_COMMIT")
    assert ledger.code_version().split("+")[0] == subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()


def _steps() -> Any:
    import sys

    if str(REPO / "dags") not in sys.path:
        sys.path.insert(0, str(REPO / "dags"))  # as Airflow puts a bundle's root on sys.path
    from nightly_tasks import steps

    return steps


class _TI:
    def __init__(self, version: object) -> None:
        self.bundle_instance = SimpleNamespace(name="nightshift", version=version)
        self.pushed: dict[str, Any] = {}

    def xcom_push(self, key: str, value: Any) -> None:
        self.pushed[key] = value


def test_a_task_takes_its_code_version_from_its_runs_bundle(tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    steps = _steps()
    monkeypatch.setenv("NIGHTSHIFT_HOME", str(tmp_path))
    monkeypatch.setenv("NIGHTSHIFT_GIT_COMMIT", "image-commit")
    assert steps.bundle_version(_TI(SHA)) == SHA
    assert steps.bundle_version(_TI(None)) is None  # the dags-folder bundle, or versioning disabled
    assert steps.bundle_version(SimpleNamespace()) is None  # `airflow dags test` and other task stand-ins
    ti = _TI(SHA)
    from nightshift.pipelines import load_pipeline

    digits = load_pipeline(DIGITS_YAML)
    assert steps.check_changes(digits, {"hash": "md5:x"}, {"epochs": 1}, "d", "r1", ti) == "train"
    assert ti.pushed["fingerprint"]["code_version"] == SHA
    unpinned = _TI(None)
    steps.check_changes(digits, {"hash": "md5:x"}, {"epochs": 1}, "d", "r2", unpinned)
    assert unpinned.pushed["fingerprint"]["code_version"] == "image-commit"
    summary = steps.report(digits, "d", "r1", {}, {"fingerprint": ti.pushed["fingerprint"]})
    assert summary["code_version"] == SHA


def test_the_training_run_and_the_model_version_are_tagged_with_the_runs_commit(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from nightshift import registry
    from nightshift_plan.plan import load_dag

    dag = load_dag()
    train = dag.get_task("train")
    fingerprint = {"code_version": SHA}
    params = dict(dag.params.validate())
    from nightshift.pipelines import load_pipeline

    # no best.json here: the declaration's model, else the trainer's defaults
    resolved = _steps().resolve_training(load_pipeline(DIGITS_YAML), params)
    training = {**resolved["options"], "summary": resolved["summary"]}

    class RunTI:
        def xcom_pull(self, task_ids: str | None = None, key: str = "return_value", **_: Any) -> Any:
            if (task_ids, key) == ("check_changes", "fingerprint"):
                return fingerprint
            if (task_ids, key) == ("check_changes", "training"):
                return training
            return {"path": "/d", "workspace": "/w", "hash": "md5:x"}

    context = {"params": params, "run_id": "r", "dag": dag, "ti": RunTI(), "task": train}
    train.render_template_fields(context)
    assert f"nightshift.code_version={SHA}" in train.command
    flags = dict(zip(train.command[3::2], train.command[4::2], strict=False))
    assert (flags["--lr"], flags["--batch-size"], flags["--model-kwargs"]) == ("0.05", "32", "{}")

    run = SimpleNamespace(data=SimpleNamespace(params={}, metrics={}))
    monkeypatch.setattr(registry.tracking, "client", lambda: SimpleNamespace(get_run=lambda _id: run))
    monkeypatch.setenv("NIGHTSHIFT_GIT_COMMIT", "image-commit")
    tags = registry.lineage_tags("mlflow-run", {"code_version": SHA, "code_commit": SHA}, None)
    assert tags["nightshift.code_commit"] == tags["nightshift.code_version"] == SHA


# -- under airflow standalone -----------------------------------------------------------------------------


def _git(cwd: Path, *args: str) -> str:
    out = subprocess.run(["git", "-c", "user.name=Nightshift Test", "-c", "user.email=test@nightshift.invalid",
                          "-c", "commit.gpgsign=false", *args], cwd=cwd, capture_output=True, text=True,
                         timeout=60, check=True)
    return out.stdout.strip()


def _commit_and_push(work: Path, message: str) -> str:
    _git(work, "add", "-A")
    _git(work, "commit", "-q", "-m", message)
    _git(work, "push", "-q", "origin", "main")
    return _git(work, "rev-parse", "HEAD")


@pytest.fixture(scope="module")
def bundle_repo(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A bare repository holding this project's DAG, its task code and the probe DAG, and a clone to commit in."""
    root = tmp_path_factory.mktemp("dag-bundle")
    bare, work = root / "nightshift.git", root / "work"
    _git(root, "init", "-q", "--bare", "-b", "main", str(bare))
    _git(root, "clone", "-q", str(bare), str(work))
    _git(work, "checkout", "-q", "-b", "main")
    # The project's DAG and the task code the probe imports (other DAGs in dags/ are not the point here).
    shutil.copytree(REPO / "dags" / "nightly_tasks", work / "dags" / "nightly_tasks",
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "dags" / "nightly_retrain.py", work / "dags" / "nightly_retrain.py")
    shutil.copytree(REPO / "pipelines", work / "pipelines")  # nightly_retrain's declaration
    shutil.copy(PROBE_FILE, work / "dags" / f"{PROBE}.py")
    first = _commit_and_push(work, "dags and the bundle probe")
    return {"bare": bare, "work": work, "first": first}


@pytest.fixture(scope="module")
def standalone_on_git(tmp_path_factory: pytest.TempPathFactory,
                      bundle_repo: dict[str, Any]) -> Iterator[dict[str, Any]]:
    env = {
        "AIRFLOW__DAG_PROCESSOR__BUNDLE_REFRESH_CHECK_INTERVAL": "2",
        "NIGHTSHIFT_RETRAIN_CRON": "none",
        "NIGHTSHIFT_DAG_BUNDLE": "git",
        "NIGHTSHIFT_DAG_BUNDLE_REPO": str(bundle_repo["bare"]),
        "NIGHTSHIFT_DAG_BUNDLE_BRANCH": "main",
        "NIGHTSHIFT_DAG_BUNDLE_REFRESH": "3",
    }
    unset = ("AIRFLOW__CORE__DAGS_FOLDER", "AIRFLOW__DAG_PROCESSOR__DAG_BUNDLE_CONFIG_LIST",
             "AIRFLOW_CONN_NIGHTSHIFT_GIT", "NIGHTSHIFT_GIT_COMMIT")
    with airflow_standalone(tmp_path_factory.mktemp("nightshift-bundle"), ready=[PROBE], env=env, unset=unset,
                            database_prefix="nightshift_bundle") as running:
        running.api.call("PATCH", f"/dags/{PROBE}", {"is_paused": False})
        yield {"api": running.api, "home": running.home, "log": running.log}


def _wait(what: str, predicate: Any, timeout: float, log: Path) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(1)
    raise AssertionError(f"{what} not within {timeout:.0f}s: {log.read_text()[-3000:]}")


def _task_state(api: Api, run_id: str, task_id: str) -> str | None:
    return api.call("GET", f"/dags/{PROBE}/dagRuns/{run_id}/taskInstances/{task_id}").get("state")


def _trigger(api: Api) -> str:
    return str(api.call("POST", f"/dags/{PROBE}/dagRuns", {"logical_date": None})["dag_run_id"])


@pytest.mark.integration
def test_each_run_records_and_runs_the_commit_it_was_created_at(standalone_on_git: dict[str, Any],
                                                                bundle_repo: dict[str, Any]) -> None:
    api, home, log = standalone_on_git["api"], standalone_on_git["home"], standalone_on_git["log"]
    first, work = bundle_repo["first"], bundle_repo["work"]
    assert api.call("GET", f"/dags/{PROBE}")["bundle_version"] == first

    run1 = _trigger(api)
    _wait("run 1 holding", lambda: _task_state(api, run1, "hold") == "running", 180, log)

    probe = work / "dags" / f"{PROBE}.py"
    probe.write_text(probe.read_text().replace('MARK = "first"', 'MARK = "second"'))
    second = _commit_and_push(work, "bundle probe: second mark")
    # The DAG's bundle version moves as soon as the dag-processor has parsed the new commit; its new DAG
    # version is written up to [core] min_serialized_dag_update_interval (30 s) after the previous one, and a
    # run created in between records the new commit (which its tasks run) with the old DAG version.
    _wait("the dag-processor on the second commit",
          lambda: api.call("GET", f"/dags/{PROBE}")["bundle_version"] == second
          and any(v["bundle_version"] == second
                  for v in api.call("GET", f"/dags/{PROBE}/dagVersions")["dag_versions"]), 120, log)
    run2 = _trigger(api)

    (home / "release-bundle-probe").touch()
    for run_id in (run1, run2):
        _wait(f"run {run_id} done",
              lambda r=run_id: api.call("GET", f"/dags/{PROBE}/dagRuns/{r}")["state"] in {"success", "failed"},
              240, log)

    runs = {r: api.call("GET", f"/dags/{PROBE}/dagRuns/{r}") for r in (run1, run2)}
    assert [runs[r]["state"] for r in (run1, run2)] == ["success", "success"], log.read_text()[-3000:]
    assert runs[run1]["bundle_version"] == first and runs[run2]["bundle_version"] == second
    (v1,), (v2,) = runs[run1]["dag_versions"], runs[run2]["dag_versions"]
    assert v1["version_number"] < v2["version_number"]
    assert (v1["bundle_name"], v1["bundle_version"]) == ("nightshift", first)
    assert (v2["bundle_name"], v2["bundle_version"]) == ("nightshift", second)

    reports = {r: api.call("GET", f"/dags/{PROBE}/dagRuns/{r}/taskInstances/report/xcomEntries/return_value")
               ["value"] for r in (run1, run2)}
    # Run 1's last task started after the second commit and still ran the first commit's file.
    assert reports[run1] == {"mark": "first", "bundle_version": first, "code_version": first}
    assert reports[run2] == {"mark": "second", "bundle_version": second, "code_version": second}
    ledger = [json.loads(line) for line in (home / "airflow" / PROBE / "runs.jsonl").read_text().splitlines()]
    assert {rec["run_id"]: rec["code_version"] for rec in ledger} == {run1: first, run2: second}
