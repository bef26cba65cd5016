"""`nightshift gc` on dataset versions, with a real staging DVC project, a real local remote and a real MLflow
registry: a version no registered model version names goes from the cache and the remote after its days, the
objects it shares with a version that stays do not, and a registered version's data still pulls with `dvc pull`."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from nightshift import gc, ledger, registry, settings, tracking
from nightshift.data.demo import write_demo_dataset
from nightshift.data.stage import project_dir, stage_dataset
from nightshift.retention import DeclaredRules, RetentionPolicy
from tests.unit.nightshift.test_gc import DAG, MODEL, log_run, trained  # noqa: F401  (trained: a fixture)

pytestmark = pytest.mark.slow  # DVC, MLflow and `dvc pull` processes

DAY = 86400.0


def md5(path: Path) -> str:
    return hashlib.md5(path.read_bytes()).hexdigest()


def remote_object(oid: str) -> Path:
    return Path(settings.dvc_remote()) / "files" / "md5" / oid[:2] / oid[2:]


def cache_object(oid: str) -> Path:
    return project_dir() / ".dvc" / "cache" / "files" / "md5" / oid[:2] / oid[2:]


def dataset(root: Path, seed: int, *, test_from: Path | None = None) -> Path:
    """The digits splits of `seed`; `test_from`: another dataset whose test split this one shares."""
    out = root / f"data-{seed}"
    write_demo_dataset(out, seed=seed)
    if test_from is not None:
        shutil.copyfile(test_from / "test.parquet", out / "test.parquet")
    return out


def age_version(version: str, days: float) -> None:
    then = time.time() - days * DAY
    os.utime(project_dir() / "versions" / f"{version}.json", (then, then))


@pytest.fixture
def store(trained: Path, tmp_path: Path, digits_pipeline: Any,  # noqa: F811
          monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """Three versions staged 40 days ago: `registered` (a registered model version's lineage names it; its
    workspace is gone), `old` (shares its test split with `registered`; used by a run 35 days ago, nothing names
    it now) and `current` (a workspace stages it). The remote is declared this machine's alone (collected too)."""
    monkeypatch.setenv("NIGHTSHIFT_DVC_REMOTE_EXCLUSIVE", "1")
    tracking.configure()
    registered_data = dataset(tmp_path, 1)
    old_data = dataset(tmp_path, 2, test_from=registered_data)
    current_data = dataset(tmp_path, 3)
    roots = [tmp_path]
    workspaces = settings.workspaces_dir() / DAG
    versions = {}
    for name, data in (("registered", registered_data), ("old", old_data), ("current", current_data)):
        versions[name] = stage_dataset(data, workspaces / name, roots=roots)["hash"]
        age_version(versions[name], 40)
    shutil.rmtree(workspaces / "registered")
    shutil.rmtree(workspaces / "old")
    run = log_run(trained, tmp_path, "registered", 40)
    registry.register(run, model_name=MODEL, lineage={"dag_id": DAG, "dag_run_id": "registered",
                                                      "dataset_version": versions["registered"]})
    then = time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime(time.time() - 35 * DAY))
    ledger.append_record(DAG, {"dag_id": DAG, "run_id": "old", "status": "success", "recorded_at": then,
                               "dataset_version": versions["old"]})
    pipeline = dataclasses.replace(digits_pipeline, retention=RetentionPolicy(data_versions_days=30))
    return {"pipeline": pipeline, "versions": versions, "data": {"registered": registered_data, "old": old_data,
                                                                   "current": current_data}}


def data_entries(result: dict[str, Any], action: str) -> dict[str, str]:
    return {e["what"]: e["reason"] for e in result[action] if e["kind"] == "data_version"}


def test_gc_collects_an_unneeded_version_from_cache_and_remote_and_keeps_what_others_need(
        store: dict[str, Any], tmp_path: Path) -> None:
    versions, data = store["versions"], store["data"]
    old_only = {versions["old"] + ".dir", md5(data["old"] / "train.parquet"), md5(data["old"] / "validation.parquet")}
    shared = md5(data["old"] / "test.parquet")
    assert shared == md5(data["registered"] / "test.parquet")
    assert all(remote_object(oid).is_file() and cache_object(oid).is_file() for oid in old_only | {shared})

    dry = gc.collect(store["pipeline"], dry_run=True)
    assert data_entries(dry, "remove") == {versions["old"]: "no registered version names it and no workspace stages "
                                                           "it; every rule lets it go: nightly_retrain used it 35.0 d "
                                                           "ago (over its 30 d)"}
    kept = data_entries(dry, "keep")
    assert kept[versions["registered"]] == (f"named by registered {MODEL} v1: a rollback or a retrain of it needs "
                                            f"its data")
    assert kept[versions["current"]].startswith("staged in workspace ")
    (entry,) = [e for e in dry["remove"] if e["kind"] == "data_version"]
    assert entry["size"] == sum(cache_object(oid).stat().st_size for oid in old_only)
    assert all(remote_object(oid).is_file() and cache_object(oid).is_file() for oid in old_only), "a dry run"

    done = gc.collect(store["pipeline"])
    assert data_entries(done, "remove") == data_entries(dry, "remove")
    assert not any(remote_object(oid).exists() or cache_object(oid).exists() for oid in old_only)
    assert remote_object(shared).is_file() and cache_object(shared).is_file(), "the registered version's split"
    assert not (project_dir() / "versions" / f"{versions['old']}.json").exists()
    for name in ("registered", "current"):
        assert remote_object(versions[name] + ".dir").is_file()
        assert all(remote_object(md5(f)).is_file() for f in data[name].iterdir())
    assert data_entries(gc.collect(store["pipeline"]), "remove") == {}

    # Roll back to the registered version's data from the remote alone: a fresh DVC project, `dvc pull`.
    shutil.rmtree(project_dir() / ".dvc" / "cache")
    clone = tmp_path / "rollback"
    clone.mkdir()
    dvc = [str(Path(sys.executable).with_name("dvc"))]
    env = dict(os.environ, DVC_NO_ANALYTICS="1")
    for command in (["init", "--no-scm"], ["remote", "add", "-d", "store", settings.dvc_remote()]):
        subprocess.run([*dvc, *command], cwd=clone, env=env, check=True, capture_output=True, timeout=120)
    (clone / "data.dvc").write_text(f"outs:\n- md5: {versions['registered']}.dir\n  path: data\n  hash: md5\n")
    pulled = subprocess.run([*dvc, "pull"], cwd=clone, env=env, capture_output=True, text=True, timeout=300)
    assert pulled.returncode == 0, pulled.stdout + pulled.stderr
    for split in data["registered"].iterdir():
        assert md5(clone / "data" / split.name) == md5(split)

    # The collected version stages again: its objects are copied and pushed anew.
    again = stage_dataset(data["old"], settings.workspaces_dir() / DAG / "again", roots=[tmp_path])
    assert again["hash"] == versions["old"] and all(remote_object(oid).is_file() for oid in old_only)


def test_a_registered_version_is_kept_whatever_its_age_and_a_young_one_by_its_days(store: dict[str, Any]) -> None:
    versions = store["versions"]
    shutil.rmtree(settings.workspaces_dir() / DAG / "current")
    lenient = dataclasses.replace(store["pipeline"], retention=RetentionPolicy(data_versions_days=36))
    result = gc.collect(lenient, dry_run=True)
    assert data_entries(result, "remove") == {versions["current"]: "no registered version names it and no "
                                                                   "workspace stages it; every rule lets it go: "
                                                                   "staged 40.0 d ago by a run no ledger records "
                                                                   "(the longest declared rule, 36 d, applies: over "
                                                                   "it)"}
    assert data_entries(result, "keep")[versions["old"]].endswith("nightly_retrain used it 35.0 d ago (within its "
                                                                  "36 d)")
    assert versions["registered"] in data_entries(result, "keep")


def test_a_failure_of_the_remote_fails_the_collection_loudly_and_keeps_the_version_record(
        store: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    from dvc_objects.db import ObjectDB

    def refuse(self: Any, oid: str) -> None:
        raise PermissionError(13, "Permission denied", self.oid_to_path(oid))

    monkeypatch.setattr(ObjectDB, "delete", refuse)
    with pytest.raises(gc.GcFailed, match=r"removing object \w+ from the DVC remote .*Permission denied"):
        gc.collect(store["pipeline"])
    assert (project_dir() / "versions" / f"{store['versions']['old']}.json").is_file(), "tried again next time"


def test_a_workspace_whose_dataset_record_is_unreadable_stops_the_collection(store: dict[str, Any]) -> None:
    """A workspace that may stage a version nobody can tell: nothing is collected rather than its data."""
    (settings.workspaces_dir() / DAG / "current" / "dataset.json").write_text("{torn")
    with pytest.raises(gc.GcFailed, match=r"current: its dataset record cannot be read"):
        gc.collect(store["pipeline"], dry_run=True)


def test_a_version_registered_without_its_lineage_tag_keeps_the_data_its_training_run_was_tagged_with(
        store: dict[str, Any], trained: Path, tmp_path: Path) -> None:  # noqa: F811
    """`nightshift register` by hand tags no dataset version; the DAG's train task tagged the training run with
    it: the version's data is kept all the same."""
    old = store["versions"]["old"]
    run = log_run(trained, tmp_path, "by-hand", 40)
    tracking.client().set_tag(run, "nightshift.dataset_version", old)
    registry.register(run, model_name="by-hand-model")
    kept = data_entries(gc.collect(store["pipeline"]), "keep")
    assert kept[old] == "named by registered by-hand-model v1: a rollback or a retrain of it needs its data"
    assert (project_dir() / "versions" / f"{old}.json").is_file()


def test_a_remote_shared_with_the_repositorys_own_dvc_data_keeps_it_after_a_gc(
        tmp_path: Path, digits_pipeline: Any) -> None:
    """Issue 36 review: the repository's `.dvc/config` pushes `dvc repro`'s data/digits to the default staging
    remote, and staging that folder gives a version with the very same `.dir`. A gc of the version (no registered
    model names it, 40 days old) removed the `.dir` from the remote: `dvc pull` of the repository then failed. By
    default the remote is not collected (it may be shared): only the staging cache is."""
    tracking.configure()
    dvc = [str(Path(sys.executable).with_name("dvc"))]
    env = dict(os.environ, DVC_NO_ANALYTICS="1")
    repo = tmp_path / "repo"
    repo.mkdir()
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True, timeout=60)
    write_demo_dataset(repo / "data" / "digits", seed=0)
    for command in (["init"], ["remote", "add", "-d", "local", settings.dvc_remote()], ["add", "data/digits"],
                    ["push"]):
        subprocess.run([*dvc, *command], cwd=repo, env=env, check=True, capture_output=True, timeout=300)
    workspace = settings.workspaces_dir() / DAG / "r1"
    version = stage_dataset(repo / "data" / "digits", workspace, roots=[repo])["hash"]
    assert f"md5: {version}.dir" in (repo / "data" / "digits.dvc").read_text(), "the same .dir as the repository's"
    shutil.rmtree(workspace)
    age_version(version, 40)

    result = gc.collect(dataclasses.replace(digits_pipeline, retention=RetentionPolicy(data_versions_days=30)))
    assert data_entries(result, "remove")[version].endswith("from the staging cache only: the DVC remote is kept "
                                                            "(it may be shared; NIGHTSHIFT_DVC_REMOTE_EXCLUSIVE=1 "
                                                            "collects it too)")
    assert not cache_object(version + ".dir").exists()
    shutil.rmtree(repo / ".dvc" / "cache")
    shutil.rmtree(repo / "data" / "digits")
    pulled = subprocess.run([*dvc, "pull"], cwd=repo, env=env, capture_output=True, text=True, timeout=300)
    assert pulled.returncode == 0, pulled.stdout + pulled.stderr
    assert (repo / "data" / "digits" / "train.parquet").is_file()


def test_a_removal_that_fails_half_way_is_finished_by_the_next_gc_leaving_no_orphan(
        store: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 36 review: the `.dir` went first, so a failure on one of its files left the rest of the files in the
    cache with no `.dir` listing them: the next gc found nothing to remove, dropped the version's record, and those
    objects stayed for good. The `.dir` goes last: the next gc finds the listing and finishes."""
    from dvc_objects.db import ObjectDB

    versions, data = store["versions"], store["data"]
    old_files = {md5(data["old"] / "train.parquet"), md5(data["old"] / "validation.parquet")}
    delete = ObjectDB.delete
    failed: list[str] = []

    def fail_once_in_the_cache(self: Any, oid: str) -> None:
        if oid in old_files and not failed and "dvc-remote" not in str(self.path):
            failed.append(oid)
            raise OSError(5, "Input/output error", self.oid_to_path(oid))
        delete(self, oid)

    monkeypatch.setattr(ObjectDB, "delete", fail_once_in_the_cache)
    with pytest.raises(gc.GcFailed, match="Input/output error"):
        gc.collect(store["pipeline"])
    assert data_entries(gc.collect(store["pipeline"]), "remove").keys() == {versions["old"]}
    assert not any(cache_object(oid).exists() or remote_object(oid).exists()
                   for oid in old_files | {versions["old"] + ".dir"})


def test_a_remote_that_does_not_answer_does_not_stop_collecting_the_cache_when_it_is_not_collected(
        store: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 36 review: with the remote kept (not declared exclusive), the collection still listed every object on
    it under the staging lock (a shared team remote: all of them, each night, while stagings wait), and a remote
    that did not answer failed the whole collection. Only the cache's listings protect cache objects then."""
    from dvc_objects.db import ObjectDB

    monkeypatch.delenv("NIGHTSHIFT_DVC_REMOTE_EXCLUSIVE")
    listed = ObjectDB.all

    def unreachable(self: Any, *args: Any, **kwargs: Any) -> Any:
        if str(self.path).startswith(settings.dvc_remote()):
            raise ConnectionError("the remote does not answer")
        return listed(self, *args, **kwargs)

    monkeypatch.setattr(ObjectDB, "all", unreachable)
    old = store["versions"]["old"]
    assert old in data_entries(gc.collect(store["pipeline"]), "remove")
    assert not cache_object(old + ".dir").exists() and remote_object(old + ".dir").is_file()


def test_a_version_another_pipeline_used_is_kept_by_that_pipelines_own_days(
        store: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 36 item 1 (b): the store is shared, and the collecting pipeline's data_versions_days decided every
    version. `churn_model` declares 60 days and used `old` 35 days ago: nightly_retrain's 30 days must not take it,
    neither from its DAG's collect_garbage (declared_rules of the declaration folders) nor from the CLI; once
    churn's rule lets it go too, it goes."""
    import yaml

    from nightshift.cli import main
    from tests.conftest import DIGITS_YAML

    versions = store["versions"]
    then = time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime(time.time() - 35 * DAY))
    ledger.append_record("churn_model", {"dag_id": "churn_model", "run_id": "c1", "status": "success",
                                         "recorded_at": then, "dataset_version": versions["old"]})
    declared = yaml.safe_load(DIGITS_YAML.read_text())
    declared.update(dag_id="churn_model", model_name="churn", retention={"data_versions_days": 60})
    declared["dataset"]["asset"] = "churn"
    folder = tmp_path / "declared"
    (folder / "churn").mkdir(parents=True)  # a subfolder of the DAG folder, as Airflow loads them
    (folder / "churn" / "churn.yaml").write_text(yaml.safe_dump(declared))
    (folder / "dbt_project.yml").write_text("name: not a pipeline\n")  # none of ours

    rules = gc.declared_rules([folder])
    assert rules == DeclaredRules({"churn_model": RetentionPolicy(data_versions_days=60)})
    kept = data_entries(gc.collect(store["pipeline"], rules=rules), "keep")
    assert kept[versions["old"]] == ("no registered version names it; kept by a pipeline's rule: churn_model used "
                                     "it 35.0 d ago (within its 60 d)")
    assert (project_dir() / "versions" / f"{versions['old']}.json").is_file()
    assert all(cache_object(oid).is_file() for oid in (versions["old"] + ".dir", md5(store["data"]["old"] /
                                                                                     "train.parquet")))

    assert main(["gc", "--pipeline", str(DIGITS_YAML), "--pipelines", str(folder), "--dry-run"]) == 0
    (result,) = json.loads(capsys.readouterr().out)["pipelines"]
    assert data_entries(result, "keep")[versions["old"]].endswith("churn_model used it 35.0 d ago (within its 60 d)")

    # A declaration that is not valid, or cannot even be read (it might be churn_model's): its versions stay.
    (folder / "churn" / "churn.yaml").write_text(yaml.safe_dump({**declared, "retention": {"months": 2}}))
    rules = gc.declared_rules([folder])
    assert rules == DeclaredRules(invalid={"churn_model": str(folder / "churn" / "churn.yaml")})
    kept = data_entries(gc.collect(store["pipeline"], dry_run=True, rules=rules), "keep")
    assert kept[versions["old"]].endswith("churn.yaml is not valid: its rule cannot be told")
    (folder / "churn" / "churn.yaml").write_text("dag_id: [")
    rules = gc.declared_rules([folder])
    assert rules == DeclaredRules(unreadable=(str(folder / "churn" / "churn.yaml"),))
    kept = data_entries(gc.collect(store["pipeline"], dry_run=True, rules=rules), "keep")
    assert "cannot be read: its rule cannot be told" in kept[versions["old"]]

    shorter = DeclaredRules({"churn_model": RetentionPolicy(data_versions_days=20)})
    reason = data_entries(gc.collect(store["pipeline"], rules=shorter), "remove")[versions["old"]]
    assert reason.startswith("no registered version names it and no workspace stages it; every rule lets it go: ")
    assert "churn_model used it 35.0 d ago (over its 20 d)" in reason
    assert "nightly_retrain used it 35.0 d ago (over its 30 d)" in reason
    assert not (project_dir() / "versions" / f"{versions['old']}.json").exists()
