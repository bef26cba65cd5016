"""A hostile review of issue 36 item 1 (retention and `nightshift gc`): attempts to make a collection lose what
lineage, resume or rollback needs, or crash, with the real parts (an MLflow store, a DVC-staged workspace, real
declarations)."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from nightshift import gc, ledger, removals, settings

DAY = 86400.0

# ---- declarations as Airflow loads them ----------------------------------------------------------------------

def _declaration(folder: Path, dag_id: str, retention: dict[str, Any]) -> Path:
    import yaml

    from tests.conftest import DIGITS_YAML

    declared = yaml.safe_load(DIGITS_YAML.read_text())
    declared.update(dag_id=dag_id, model_name=dag_id, retention=retention)
    declared["dataset"]["asset"] = dag_id
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{dag_id}.yaml"
    path.write_text(yaml.safe_dump(declared))
    return path


def test_a_declaration_in_a_linked_subfolder_of_the_dag_folder_counts_as_airflow_loads_it(tmp_path: Path) -> None:
    """Airflow walks the DAG folder following links (file_discovery: os.walk(followlinks=True)): a team's folder
    linked into it (`dags/churn -> /srv/churn/dags`) loads its stub and declaration. gc did not enter it: churn's
    90 days (or `enabled: false`) were unknown, and its dataset versions went by the longest rule gc saw."""
    from nightshift.retention import RetentionPolicy

    _declaration(tmp_path / "srv" / "churn", "churn_model", {"data_versions_days": 90})
    _declaration(tmp_path / "srv" / "frozen", "frozen_model", {"enabled": False})
    dags = tmp_path / "dags"
    dags.mkdir()
    (dags / "churn").symlink_to(tmp_path / "srv" / "churn", target_is_directory=True)
    (dags / "teams").mkdir()
    (dags / "teams" / "frozen").symlink_to(tmp_path / "srv" / "frozen", target_is_directory=True)
    (dags / "teams" / "loop").symlink_to(dags, target_is_directory=True)  # a loop: entered once, never again

    rules = gc.declared_rules([dags])
    assert rules.policies == {"churn_model": RetentionPolicy(data_versions_days=90),
                              "frozen_model": RetentionPolicy(enabled=False)}
    assert not rules.invalid and not rules.unreadable


# ---- Data Docs static assets ---------------------------------------------------------------------------------

def test_a_shared_static_asset_changed_in_place_is_not_handed_to_the_next_sites(nightshift_home: Path) -> None:
    """GX writes a site's static files with open(path, "wb") (TupleFilesystemStoreBackend._set): a GX build run
    again on a site, or a person editing its CSS, writes through the hard link into the one shared copy. The copy is
    named by the hash of the content it had: the next sites of that content were linked to the changed bytes."""
    import hashlib

    from nightshift.data.validate import SHARED_STATIC, share_static
    from nightshift.settings import data_docs_dir

    original = b"body { color: black }\n"

    def site(name: str) -> Path:
        css = data_docs_dir() / name / "static" / "styles" / "data_docs_custom_styles.css"
        css.parent.mkdir(parents=True)
        css.write_bytes(original)
        share_static(data_docs_dir() / name)
        return css

    first = site("first")
    shared = data_docs_dir() / SHARED_STATIC / hashlib.sha256(original).hexdigest()
    assert shared.samefile(first)
    with first.open("wb") as rewritten:  # as GX's store backend writes it
        rewritten.write(b"body { color: red }\n")

    later = site("later")
    assert later.read_bytes() == original, "a new site got another site's edited file"
    assert shared.read_bytes() == original and shared.samefile(later)
    assert hashlib.sha256(shared.read_bytes()).hexdigest() == shared.name


# ---- the removal log ---------------------------------------------------------------------------------------

KILLED_AT_SECOND_REMOVAL = """
import dataclasses, os, signal, sys
from nightshift import gc, tracking
from nightshift.pipelines import load_pipeline
from nightshift.retention import RetentionPolicy

tracking.configure()
pipeline = dataclasses.replace(load_pipeline(sys.argv[1]), retention=RetentionPolicy(keep_runs=1))
remove, calls = gc._rmtree, []

def killed_at_the_second(*args, **kwargs):
    calls.append(args[0])
    if len(calls) == 2:
        os.kill(os.getpid(), signal.SIGKILL)  # the worker is lost (OOM, a node gone): no finally runs
    return remove(*args, **kwargs)

gc._rmtree = killed_at_the_second
gc.collect(pipeline)
"""


def test_a_collection_killed_half_way_has_logged_what_it_removed_before(nightshift_home: Path) -> None:
    """The removal log answers "where did my workspace (decision page) go?" and turns the page's 404 into a 410. It
    was written once, after every removal: a collect_garbage task killed half-way (SIGKILL: an OOM kill, a lost
    worker, the season's killed worker) left what it had removed in no log at all."""
    from tests.conftest import DIGITS_YAML

    dag = "nightly_retrain"
    then = time.time() - 40 * DAY
    for run_id in ("r1", "r2", "r3"):
        ledger.append_record(dag, {"dag_id": dag, "run_id": run_id, "status": "success"})
        workspace = settings.workspaces_dir() / dag / run_id
        (workspace / "model").mkdir(parents=True)
        for path in (workspace / "model", workspace):
            os.utime(path, (then, then))
    done = subprocess.run([sys.executable, "-c", KILLED_AT_SECOND_REMOVAL, str(DIGITS_YAML)], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == -signal.SIGKILL, done.stderr[-3000:]
    assert not (settings.workspaces_dir() / dag / "r1").exists(), "removed before the kill"
    assert [(e["kind"], e["run_id"]) for e in removals.read(dag)] == [("workspace", "r1")]


# ---- the shared dataset store -------------------------------------------------------------------------------

def test_a_pipeline_whose_declaration_gc_cannot_see_keeps_its_versions_by_the_rule_its_runs_recorded(
        nightshift_home: Path, demo_data: Path, digits_pipeline: Any) -> None:
    """A pipeline's DAG file may point at its declaration anywhere (`pipeline_dag("/srv/churn/churn.yaml")`), a git
    DAG bundle checks the DAG files out away from [core] dags_folder, and `nightshift gc` by hand finds the DAG folder
    only through AIRFLOW__CORE__DAGS_FOLDER or $AIRFLOW_HOME/dags (not an airflow.cfg's dags_folder). Such a
    pipeline's versions went by the longest rule gc saw: churn_model declares `enabled: false` (nothing of it is
    collected), yet nightly_retrain's 30 days took the version churn's run used 35 days ago."""
    from dags.nightly_tasks import steps
    from nightshift import tracking
    from nightshift.data.stage import project_dir, stage_dataset
    from nightshift.retention import RetentionPolicy
    from tests.conftest import DIGITS_YAML

    tracking.configure()
    workspace = settings.workspaces_dir() / "churn_model" / "c1"
    version = stage_dataset(demo_data, workspace, roots=[demo_data])["hash"]
    shutil.rmtree(workspace)
    then = time.time() - 40 * DAY
    os.utime(project_dir() / "versions" / f"{version}.json", (then, then))
    churn = dataclasses.replace(digits_pipeline, dag_id="churn_model", model_name="churn",
                                retention=RetentionPolicy(enabled=False))
    steps.report(churn, "churn_model", "c1", {}, {"stage_dataset": {"hash": version, "rows": 1797}})
    path = ledger.ledger_path("churn_model")
    (record,) = [json.loads(line) for line in path.read_text().splitlines()]
    record["recorded_at"] = time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime(time.time() - 35 * DAY))
    path.write_text(json.dumps(record) + "\n")

    nightly = dataclasses.replace(digits_pipeline, retention=RetentionPolicy(data_versions_days=30))
    result = gc.collect(nightly, dry_run=True, rules=gc.declared_rules([DIGITS_YAML.parent]))
    kept = {e["what"]: e["reason"] for e in result["keep"] if e["kind"] == "data_version"}
    assert version in kept, result["remove"]
    assert "churn_model used it 35.0 d ago and its retention is disabled" in kept[version]
