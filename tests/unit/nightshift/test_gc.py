"""`nightshift gc` on real parts: an MLflow store with registered and unregistered runs, real run folders (one staged
by DVC), real trainer checkpoints; after a collection the previous champion still loads and a killed run resumes."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
import torch

from nightshift import gc, ledger, registry, settings, tracking
from nightshift.retention import RetentionPolicy
from nightshift.train.checkpoint import CheckpointStore
from tests.trained_model import write_trained_output

pytestmark = pytest.mark.slow  # MLflow, DVC and trainer processes

DAY = 86400.0
DAG = "nightly_retrain"
MODEL = "nightshift-digits"
# A single-process run of the small dense model with a checkpoint every 10 of its 40 steps (1 torch thread).
MLP_RUN = ["--model", "mlp", "--epochs", "1", "--checkpoint-every", "10", "--keep-checkpoints", "10", "--seed", "3",
           "--threads", "1", "--code-version", "gc-test"]  # fixed: others edit this checkout meanwhile


def train(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "nightshift.train", *map(str, args)], capture_output=True,
                          text=True, timeout=300)


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory, demo_data: Path) -> Path:
    return write_trained_output(tmp_path_factory.mktemp("trained"), demo_data, epochs=2)


def aged(path: Path, days: float) -> Path:
    """Set the mtime of `path` and of everything under it `days` into the past."""
    then = time.time() - days * DAY
    for parent, dirs, files in os.walk(path):
        for name in [*dirs, *files]:
            os.utime(os.path.join(parent, name), (then, then), follow_symlinks=False)
    os.utime(path, (then, then))
    return path


def run_folders(run_id: str, days: float) -> tuple[Path, Path]:
    workspace = settings.workspaces_dir() / DAG / run_id
    (workspace / "model").mkdir(parents=True)
    (workspace / "model" / "model.pt").write_bytes(b"w" * 1000)
    checkpoints = settings.checkpoints_dir() / DAG / run_id / "train"
    checkpoints.mkdir(parents=True)
    (checkpoints / "ckpt-00000010.pt").write_bytes(b"c" * 1000)
    return aged(workspace, days), aged(checkpoints.parent, days)


def log_run(trained: Path, tmp_path: Path, run_id: str, ended_days_ago: float) -> str:
    out = tmp_path / f"out-{run_id}"
    shutil.copytree(trained, out)
    mlflow_run = tracking.log_training_run(out, experiment=DAG, run_name=run_id, tags={
        "nightshift.run_key": f"{DAG}/{run_id}", "nightshift.dag_run_id": run_id})
    tracking.client().set_terminated(mlflow_run, end_time=int((time.time() - ended_days_ago * DAY) * 1000))
    return mlflow_run


def promote(mlflow_run: str, run_id: str) -> str:
    version = registry.register(mlflow_run, model_name=MODEL, lineage={"dag_id": DAG, "dag_run_id": run_id})
    registry.set_alias(MODEL, registry.CHAMPION, version["version"])
    return str(version["version"])


@pytest.fixture
def season(trained: Path, tmp_path: Path, demo_data: Path, digits_pipeline: Any) -> dict[str, Any]:
    """Six finished nights r1..r6 (40 days old; r2 promoted v1, r4 promoted v2, the champion), then a night that
    failed 40 days ago (r0) and one killed minutes ago (r7, real trainer checkpoints). MLflow: r2 and r4
    registered, r3 an unregistered challenger of 40 days ago, r6 one of today. r1's workspace is staged by DVC."""
    from nightshift.data.stage import stage_dataset

    tracking.configure()
    folders = {run_id: run_folders(run_id, 40) for run_id in ("r0", "r2", "r3", "r4", "r5", "r6")}
    staged = settings.workspaces_dir() / DAG / "r1"
    stage_dataset(demo_data, staged, roots=[demo_data])
    checkpoints_r1 = settings.checkpoints_dir() / DAG / "r1" / "train"
    checkpoints_r1.mkdir(parents=True)
    (checkpoints_r1 / "ckpt-00000010.pt").write_bytes(b"c")
    folders["r1"] = (aged(staged, 40), aged(checkpoints_r1.parent, 40))
    runs = {"r2": log_run(trained, tmp_path, "r2", 45), "r3": log_run(trained, tmp_path, "r3", 40),
            "r4": log_run(trained, tmp_path, "r4", 35), "r6": log_run(trained, tmp_path, "r6", 0.5)}
    versions = {"r2": promote(runs["r2"], "r2"), "r4": promote(runs["r4"], "r4")}
    for run_id in ("r1", "r2", "r3", "r4", "r5", "r6"):
        promoted = {"deploy_status": "promoted", "model_version": versions[run_id]} if run_id in versions else {}
        ledger.append_record(DAG, {"dag_id": DAG, "run_id": run_id, "status": "success", **promoted})
    ledger.append_record(DAG, {"dag_id": DAG, "run_id": "r0", "status": "failed", "failed_task": "train"})
    # r7: killed at step ~25 of 40: its newest checkpoint is step 20.
    killed = settings.checkpoints_dir() / DAG / "r7" / "train"
    result = train("--data", demo_data, "--out", tmp_path / "full", "--checkpoint-dir", killed, *MLP_RUN)
    assert result.returncode == 0, result.stderr
    for checkpoint in CheckpointStore(killed).files():
        if checkpoint.step > 20:
            checkpoint.path.unlink()
    pipeline = dataclasses.replace(digits_pipeline, retention=RetentionPolicy(keep_runs=2))
    return {"pipeline": pipeline, "folders": folders, "runs": runs, "versions": versions, "killed": killed,
            "reference": tmp_path / "full" / "model.pt"}


def mlflow_state(run_id: str) -> str:
    return str(tracking.client().get_run(run_id).info.lifecycle_stage)


def artifact_dirs(run_id: str) -> list[Path]:
    client = tracking.client()
    run = client.get_run(run_id)
    models = client.search_logged_models([run.info.experiment_id], filter_string=f"source_run_id = '{run_id}'")
    return [Path(run.info.artifact_uri.removeprefix("file://")), *(Path(m.artifact_location.removeprefix("file://"))
                                                                    for m in models)]


def test_gc_removes_what_the_policy_lets_go_keeps_every_reference_and_a_dry_run_removes_nothing(
        season: dict[str, Any], demo_data: Path) -> None:
    pipeline, folders, runs = season["pipeline"], season["folders"], season["runs"]
    r3_artifacts = artifact_dirs(runs["r3"])
    assert r3_artifacts and all(path.is_dir() for path in r3_artifacts)

    dry = gc.collect(pipeline, dry_run=True)
    removed = {(entry["kind"], entry["run_id"]) for entry in dry["remove"]}
    # the last 2 finished runs are r6 and r0 (failed 40 days ago): r1, r3 and r5 go, r2 and r4 are champions'
    assert removed == {("workspace", "r1"), ("checkpoints", "r1"), ("workspace", "r3"), ("checkpoints", "r3"),
                       ("workspace", "r5"), ("checkpoints", "r5"), ("mlflow_run", "r3")}
    kept = {(entry["kind"], entry["run_id"]): entry["reason"] for entry in dry["keep"]}
    assert kept[("workspace", "r4")] == "the champion's run (v2)"
    assert kept[("checkpoints", "r2")] == "the previous champion's run (v1): a rollback may need it"
    assert kept[("workspace", "r6")] == "the last successful run"
    assert kept[("checkpoints", "r0")] == "within the last 2 finished runs"
    assert kept[("checkpoints", "r7")].startswith("resumable or running: not finished")
    assert kept[("mlflow_run", "r2")].startswith("registered (v1)")
    assert kept[("mlflow_run", "r6")].startswith("unregistered challenger, ended 0.5 d ago")
    # the dry run removed nothing
    assert all(path.is_dir() for pair in folders.values() for path in pair)
    assert mlflow_state(runs["r3"]) == "active" and all(path.is_dir() for path in r3_artifacts)

    done = gc.collect(pipeline)
    assert done["remove"] == dry["remove"] and done["removed_bytes"] > 0
    for run_id in ("r1", "r3", "r5"):
        assert not any(path.exists() for path in folders[run_id])
    for run_id in ("r0", "r2", "r4", "r6"):
        assert all(path.is_dir() for path in folders[run_id])
    assert mlflow_state(runs["r3"]) == "deleted" and not any(path.exists() for path in r3_artifacts)
    assert all(mlflow_state(runs[r]) == "active" for r in ("r2", "r4", "r6"))
    # removing the DVC-staged workspace (links into the cache) left the cache whole: the version stages again
    from nightshift.data.stage import stage_dataset

    again = stage_dataset(demo_data, settings.workspaces_dir() / DAG / "r8", roots=[demo_data])
    assert pd.read_parquet(Path(again["path"]) / "test.parquet").equals(pd.read_parquet(demo_data / "test.parquet"))
    # a second collection finds nothing more to remove
    assert gc.collect(pipeline)["remove"] == []


def test_after_a_gc_the_previous_champion_rolls_back_and_a_killed_run_resumes(
        season: dict[str, Any], demo_data: Path, tmp_path: Path) -> None:
    import mlflow.artifacts
    import mlflow.pyfunc

    pipeline = dataclasses.replace(season["pipeline"], retention=RetentionPolicy(keep_runs=1, challenger_days=1))
    pages = [write_page(season["runs"][run_id], 40) for run_id in ("r2", "r4")]  # the two champions' decisions
    assert gc.collect(pipeline)["remove"]
    assert all(page.is_file() for page in pages), "the decisions of the champion and the previous one stay"
    # roll back: what `nightshift deploy --version 1` does first, download the previous champion and serve it
    previous = season["versions"]["r2"]
    where = Path(mlflow.artifacts.download_artifacts(artifact_uri=f"models:/{MODEL}/{previous}",
                                                     dst_path=str(tmp_path / "rollback"),
                                                     tracking_uri=tracking.tracking_uri()))
    frame = pd.read_parquet(demo_data / "test.parquet")
    answers = mlflow.pyfunc.load_model(str(where)).predict(frame.drop(columns=["label"]).head(50))
    assert (answers["predicted_label"].to_numpy() == frame["label"].head(50).to_numpy()).mean() > 0.5
    # the killed run resumes from its step-20 checkpoint and ends where the uninterrupted run ended
    result = train("--data", demo_data, "--out", tmp_path / "resumed", "--checkpoint-dir", season["killed"], *MLP_RUN)
    assert result.returncode == 0, result.stderr
    assert "resumed from checkpoint" in result.stderr
    assert json.loads((tmp_path / "resumed" / "metrics.json").read_text())["resumed_from_step"] == 20
    resumed = torch.load(tmp_path / "resumed" / "model.pt", weights_only=True)
    reference = torch.load(season["reference"], weights_only=True)
    assert all(torch.equal(resumed[name], reference[name]) for name in reference)


def test_gc_keeps_a_run_a_registered_version_of_any_model_names(season: dict[str, Any]) -> None:
    """Review finding: a run registered under another model's name was planned for removal, refused, and the
    refusal (GcFailed) stopped every later collection: now it is kept, saying why."""
    kept = gc._remove_mlflow_run(season["runs"]["r2"])
    assert kept is not None and kept.startswith("registered as ") and kept.endswith(": kept")
    assert mlflow_state(season["runs"]["r2"]) == "active"


def test_the_cli_prints_the_plan_and_a_dry_run_removes_nothing(season: dict[str, Any],
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    from nightshift.cli import main
    from tests.conftest import DIGITS_YAML

    assert main(["gc", "--pipeline", str(DIGITS_YAML), "--dry-run"]) == 0
    (result,) = json.loads(capsys.readouterr().out)["pipelines"]
    assert result["dry_run"] and result["removed_bytes"] == 0
    # the declared keep_runs 5 keeps r3..r6 and r0; the 40-day-old challenger r3 is over 30 days
    assert {(e["kind"], e["run_id"]) for e in result["remove"]} == {("workspace", "r1"), ("checkpoints", "r1"),
                                                                     ("mlflow_run", "r3")}
    assert all(path.is_dir() for path in season["folders"]["r1"])
    assert main(["gc", "--pipeline", "no_such_pipeline", "--pipelines", str(DIGITS_YAML.parent)]) == 2
    assert "no valid declaration of pipeline 'no_such_pipeline'" in capsys.readouterr().err


def write_page(mlflow_run: str, days: float) -> Path:
    from nightshift.decision_page import page_path

    page = page_path(DAG, mlflow_run)
    page.parent.mkdir(parents=True)
    page.write_text(f"<html>the decision of {mlflow_run}</html>")
    aged(page.parent, days)
    return page


def test_gc_removes_decision_pages_with_their_runs_keeps_the_champions_and_logs_each_removal(
        season: dict[str, Any]) -> None:
    """Issue 36 item 1 (a): evaluate writes a page per night and nothing removed them. A page goes with its run's
    workspace; the champion's and the previous champion's (registered runs) and the last successful run's stay; the
    removal log says what went, when and why (the lineage page reads it)."""
    from nightshift import removals

    pipeline, runs = season["pipeline"], season["runs"]  # keep_runs 2: r6 and r0
    pages = {run_id: write_page(runs[run_id], 0.5 if run_id == "r6" else 40) for run_id in ("r2", "r3", "r4", "r6")}
    orphan = write_page("0123abcd" * 4, 40)  # a page whose run no ledger record or MLflow run names

    dry = gc.collect(pipeline, dry_run=True)
    going = {e["what"]: e["reason"] for e in dry["remove"] if e["kind"] == "decision_page"}
    assert going == {str(pages["r3"].parent): "a successful run older than the last 2 finished runs, nothing "
                                              "written for 40.0 d",
                     str(orphan.parent): "no ledger record or MLflow run names its DAG run (nothing links it); "
                                         "written 40.0 d ago (over 7 d)"}
    kept = {e["run_id"]: e["reason"] for e in dry["keep"] if e["kind"] == "decision_page"}
    assert kept == {"r2": "the decision page of registered v1: the lineage of the version links it",
                    "r4": "the decision page of registered v2: the lineage of the version links it",
                    "r6": "the last successful run"}
    assert all(page.is_file() for page in [*pages.values(), orphan]) and removals.read(DAG) == []

    gc.collect(pipeline)
    assert not pages["r3"].parent.exists() and not orphan.parent.exists()
    assert all(pages[run_id].is_file() for run_id in ("r2", "r4", "r6"))
    logged = removals.removed_links(DAG)
    assert logged[("decision_page", runs["r3"])]["reason"] == going[str(pages["r3"].parent)]
    assert logged[("mlflow_run", runs["r3"])]["reason"].startswith("unregistered challenger, ended 40.0 d ago")
    assert {e["kind"] for e in removals.read(DAG)} == {"workspace", "checkpoints", "mlflow_run", "decision_page"}
    assert all(e["removed_at"] for e in removals.read(DAG))


def test_the_decision_pages_the_lineage_page_shows_by_default_stay(season: dict[str, Any]) -> None:
    from nightshift.retention import LINEAGE_RUNS

    runs = season["runs"]
    page = write_page(runs["r3"], 40)
    ledger.append_record(DAG, {"dag_id": DAG, "run_id": "r3", "status": "success", "mlflow_run_id": runs["r3"]})
    for night in range(LINEAGE_RUNS - 1):
        ledger.append_record(DAG, {"dag_id": DAG, "run_id": f"n{night}", "status": "success"})
    pipeline = season["pipeline"]
    (entry,) = [e for e in gc.collect(pipeline, dry_run=True)["keep"] if e["kind"] == "decision_page"]
    assert entry["reason"] == f"linked by the lineage page (one of the newest {LINEAGE_RUNS} runs it shows)"
    ledger.append_record(DAG, {"dag_id": DAG, "run_id": "n-last", "status": "success"})  # r3's row leaves the view
    assert str(page.parent) in {e["what"] for e in gc.collect(pipeline)["remove"]}
    assert not page.exists()
