"""The retention plan (nightshift.retention.plan) and the `retention` block of a declaration."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml

from nightshift.errors import UsageError
from nightshift.retention import (
    CHECKPOINTS,
    DATA_VERSION,
    DECISION_PAGE,
    LINEAGE_RUNS,
    MLFLOW_RUN,
    SERVED_MODEL,
    WORKSPACE,
    DeclaredRules,
    Facts,
    Item,
    RetentionPolicy,
    plan,
)

POLICY = RetentionPolicy(keep_runs=2, resumable_days=7, challenger_days=30)
# r1..r8 finished in that order; r5 failed; r2 trained the previous champion (v1), r3 the champion (v2).
FACTS = Facts(finished=("r1", "r2", "r3", "r4", "r5", "r6", "r7", "r8"),
              succeeded=frozenset({"r1", "r2", "r3", "r4", "r6", "r7"}),
              champion_run="r3", previous_champion_run="r2", champion="2", previous_champion="1",
              registered={"m2": ("1",), "m3": ("2",)})


def decided(items: list[Item], facts: Facts = FACTS, policy: RetentionPolicy = POLICY) -> dict[str, tuple[bool, str]]:
    return {d.item.ident: (d.remove, d.reason) for d in plan(items, facts, policy)}


def test_workspaces_beyond_the_last_n_go_and_every_referenced_run_stays() -> None:
    items = [Item(WORKSPACE, f"ws/{r}", r, age_days=40.0) for r in FACTS.finished]
    items.append(Item(CHECKPOINTS, "ck/r9", "r9", age_days=0.1))  # running now: no ledger record
    result = decided(items)
    assert result["ws/r1"] == (True, "a successful run older than the last 2 finished runs, nothing written for "
                                      "40.0 d")
    assert result["ws/r4"][0] is True
    assert result["ws/r5"] == (True, "failed, nothing written for 40.0 d (over 7 d)")
    assert result["ws/r2"] == (False, "the previous champion's run (v1): a rollback may need it")
    assert result["ws/r3"] == (False, "the champion's run (v2)")
    assert result["ws/r6"][0] is True  # succeeded, not the last success (r7), not within the last 2 (r7, r8)
    assert result["ws/r7"] == (False, "the last successful run")
    assert result["ws/r8"] == (False, "within the last 2 finished runs")  # r8 has no success record but is recent
    assert result["ck/r9"][0] is False and result["ck/r9"][1].startswith("resumable or running: not finished")


def test_a_failed_or_killed_run_stays_resumable_for_resumable_days() -> None:
    facts = Facts(finished=("a", "b", "c", "failed"), succeeded=frozenset({"a", "b", "c"}))
    policy = RetentionPolicy(keep_runs=1)
    result = decided([Item(CHECKPOINTS, "failed", "failed", age_days=2.0),
                      Item(CHECKPOINTS, "killed", "killed", age_days=6.9),
                      Item(CHECKPOINTS, "old-killed", "old-killed", age_days=7.5)], facts, policy)
    assert result["failed"] == (False, "within the last 1 finished runs")
    assert result["killed"] == (False, "resumable or running: not finished (running, or killed), last written "
                                       "6.9 d ago (within 7 d)")
    assert result["old-killed"][0] is True


def test_registered_mlflow_runs_stay_and_old_unregistered_challengers_go() -> None:
    result = decided([Item(MLFLOW_RUN, "m2", "r2", age_days=400.0),
                      Item(MLFLOW_RUN, "m4", "r4", age_days=31.0),
                      Item(MLFLOW_RUN, "m6", "r6", age_days=29.0),
                      Item(MLFLOW_RUN, "m9", "r9", age_days=90.0)])
    assert result["m2"] == (False, "registered (v1): lineage and rollback need it")
    assert result["m4"] == (True, "unregistered challenger, ended 31.0 d ago (over 30 d)")
    assert result["m6"][0] is False
    assert result["m9"] == (False, "its DAG run has not finished: it may still be registered")


def test_served_folders_of_the_champion_and_the_previous_one_stay() -> None:
    facts = Facts(champion="5", previous_champion="4", served_paths=frozenset({"s/m-v5-9000"}))
    items = [Item(SERVED_MODEL, f"s/m-v{v}-9000", version=str(v)) for v in (3, 4, 5)]
    items.append(Item(SERVED_MODEL, "s/m-v5-9001", version="5"))
    result = decided(items, facts)
    assert result["s/m-v3-9000"][0] is True
    assert result["s/m-v4-9000"] == (False, "the previous champion's (v4)")
    assert result["s/m-v5-9000"] == (False, "served now (the serving record names it)")
    assert result["s/m-v5-9001"] == (False, "the champion's (v5)")
    assert not any(remove for remove, _ in decided(items, Facts(deploying=True)).values())


def test_a_disabled_policy_keeps_everything() -> None:
    items = [Item(WORKSPACE, "ws/r1", "r1", age_days=900.0), Item(MLFLOW_RUN, "m4", "r4", age_days=900.0),
             Item(DATA_VERSION, "d0", age_days=900.0)]
    assert not any(remove for remove, _ in decided(items, policy=RetentionPolicy(enabled=False)).values())


@pytest.mark.parametrize("field, value", [("keep_runs", 0), ("keep_runs", 2.5), ("resumable_days", 0.5),
                                          ("challenger_days", True), ("data_versions_days", 0),
                                          ("data_versions_days", "30")])
def test_a_policy_that_could_take_a_running_run_is_refused_naming_the_field(field: str, value: object) -> None:
    with pytest.raises(UsageError, match=f"retention.{field}"):
        RetentionPolicy(**{field: value})  # type: ignore[arg-type]


def test_a_declaration_carries_its_retention_with_defaults_for_what_it_leaves_out(tmp_path: Path) -> None:
    from nightshift.pipelines import PipelineInvalid, load_pipeline
    from tests.conftest import DIGITS_YAML

    data = yaml.safe_load(DIGITS_YAML.read_text())
    data.pop("retention", None)
    (tmp_path / "a.yaml").write_text(yaml.safe_dump(data))
    assert load_pipeline(tmp_path / "a.yaml").retention == RetentionPolicy()
    data["retention"] = {"keep_runs": 12}
    (tmp_path / "a.yaml").write_text(yaml.safe_dump(data))
    pipeline = load_pipeline(tmp_path / "a.yaml")
    assert pipeline.retention == RetentionPolicy(keep_runs=12)
    assert pipeline.to_dict()["retention"] == {"enabled": True, "keep_runs": 12, "resumable_days": 7,
                                               "challenger_days": 30, "data_versions_days": 30}
    data["retention"] = {"data_versions_days": 90}
    (tmp_path / "a.yaml").write_text(yaml.safe_dump(data))
    assert load_pipeline(tmp_path / "a.yaml").retention == RetentionPolicy(data_versions_days=90)
    data["retention"] = {"keep_runs": 0, "months": 3}
    (tmp_path / "a.yaml").write_text(yaml.safe_dump(data))
    with pytest.raises(PipelineInvalid) as caught:
        load_pipeline(tmp_path / "a.yaml")
    assert any("retention.months: unknown key" in line for line in caught.value.problems)


def test_a_successful_run_written_lately_is_kept_however_old_its_record() -> None:
    """Review finding: a cleared Airflow run keeps its run id and its old success record; while it stages and
    trains again, a gc (the CLI, or another run's last task) removed its live workspace and checkpoints."""
    result = decided([Item(WORKSPACE, "ws/r1", "r1", age_days=0.0), Item(CHECKPOINTS, "ck/r1", "r1", age_days=0.0)])
    assert result["ws/r1"][0] is False and result["ws/r1"][1].startswith("resumable or running: succeeded")
    assert result["ck/r1"][0] is False


def test_a_runs_workspace_and_checkpoints_are_judged_by_its_newest_write() -> None:
    """Review finding: a failed run staged 8 days ago and retried yesterday lost its workspace (8 d old) while its
    checkpoints (1 d) stayed: the next retry's --data was gone."""
    result = decided([Item(WORKSPACE, "ws/r5", "r5", age_days=8.0), Item(CHECKPOINTS, "ck/r5", "r5", age_days=1.0)])
    assert result["ws/r5"] == result["ck/r5"] == (
        False, "resumable or running: failed, last written 1.0 d ago (within 7 d)")


def test_a_data_version_a_registered_version_or_a_workspace_names_stays_and_an_unused_old_one_goes() -> None:
    facts = dataclasses.replace(FACTS, data_registered={"d1": ("m v1", "other v4")}, data_in_use={"d2": "ws/r8"})
    items = [Item(DATA_VERSION, d, age_days=400.0) for d in ("d1", "d2", "d3")]
    items.append(Item(DATA_VERSION, "d4", age_days=29.5))
    result = decided(items, facts, RetentionPolicy(data_versions_days=30))
    assert result["d1"] == (False, "named by registered m v1, other v4: a rollback or a retrain of it needs its data")
    assert result["d2"] == (False, "staged in workspace ws/r8 (a run that is kept, or running)")
    assert result["d3"] == (True, "no registered version names it and no workspace stages it; every rule lets it go: "
                                  "staged 400.0 d ago by a run no ledger records (the longest declared rule, 30 d, "
                                  "applies: over it)")
    assert result["d4"] == (False, "no registered version names it; kept by a pipeline's rule: staged 29.5 d ago by "
                                   "a run no ledger records (the longest declared rule, 30 d, applies: within it)")


# ---- dataset versions: each pipeline's own rule (the store is shared) ---------------------------------------

RULES = DeclaredRules({"nightly": RetentionPolicy(data_versions_days=30),
                       "churn": RetentionPolicy(data_versions_days=90), "frozen": RetentionPolicy(enabled=False)})


def test_a_data_version_is_kept_while_the_rule_of_any_pipeline_that_used_it_keeps_it() -> None:
    """Issue 36 item 1 (b): the collecting pipeline's days decided every version of the shared store. `churn` keeps
    its data 90 days: a version it used 40 days ago stays whichever pipeline collects, and a version only `nightly`
    (30 days) used 40 days ago goes even when `churn` collects."""
    facts = Facts(data_uses={"shared": {"nightly": 40.0, "churn": 40.0}, "nightly-only": {"nightly": 40.0},
                             "churn-only": {"churn": 40.0}}, data_rules=RULES)
    items = [Item(DATA_VERSION, d, age_days=45.0) for d in ("shared", "nightly-only", "churn-only")]
    for collecting in (RULES.policies["nightly"], RULES.policies["churn"]):
        result = decided(items, facts, collecting)
        assert result["shared"] == (False, "no registered version names it; kept by a pipeline's rule: churn used "
                                           "it 40.0 d ago (within its 90 d)")
        assert result["churn-only"][0] is False
        assert result["nightly-only"] == (True, "no registered version names it and no workspace stages it; every "
                                                "rule lets it go: nightly used it 40.0 d ago (over its 30 d)")


def test_a_disabled_unknown_or_unreadable_pipelines_versions_are_judged_as_declared() -> None:
    facts = Facts(data_uses={"frozen": {"frozen": 400.0}, "gone": {"retired": 60.0}, "gone-old": {"retired": 95.0}},
                  data_rules=RULES)
    items = [Item(DATA_VERSION, d, age_days=400.0) for d in ("frozen", "gone", "gone-old")]
    result = decided(items, facts, RULES.policies["nightly"])
    assert result["frozen"][0] is False and "its retention is disabled" in result["frozen"][1]
    # a pipeline whose declaration is gone: the longest declared rule (churn's 90 days)
    assert result["gone"] == (False, "no registered version names it; kept by a pipeline's rule: retired used it "
                                     "60.0 d ago and no declaration of retired was found: the longest declared "
                                     "rule, 90 d, applies (within it)")
    assert result["gone-old"][0] is True
    # while a declaration cannot be read, which pipeline it declares cannot be told: nothing undeclared goes
    unreadable = dataclasses.replace(facts, data_rules=dataclasses.replace(RULES, unreadable=("pipelines/bad.yaml",)))
    assert decided(items, unreadable, RULES.policies["nightly"])["gone-old"] == (
        False, "no registered version names it; kept by a pipeline's rule: retired used it 95.0 d ago and no "
               "readable declaration of retired was found while pipelines/bad.yaml cannot be read: its rule "
               "cannot be told")
    # a declaration of `retired` that is not valid: its rule cannot be told either
    invalid = dataclasses.replace(facts, data_rules=dataclasses.replace(RULES, invalid={"retired": "retired.yaml"}))
    assert decided(items, invalid, RULES.policies["nightly"])["gone-old"] == (
        False, "no registered version names it; kept by a pipeline's rule: retired used it 95.0 d ago and its "
               "declaration retired.yaml is not valid: its rule cannot be told")


def test_a_version_no_ledger_records_goes_by_the_longest_declared_rule_from_its_staging() -> None:
    """Staged by a run that recorded nothing (killed, failed, by hand), or staged again since its last recorded
    use: which pipeline's it is cannot be told, so the longest rule applies."""
    facts = Facts(data_uses={"restaged": {"nightly": 80.0}}, data_rules=RULES)
    items = [Item(DATA_VERSION, "unrecorded", age_days=60.0), Item(DATA_VERSION, "old", age_days=100.0),
             Item(DATA_VERSION, "restaged", age_days=20.0)]
    result = decided(items, facts, RULES.policies["nightly"])
    assert result["unrecorded"] == (False, "no registered version names it; kept by a pipeline's rule: staged "
                                           "60.0 d ago by a run no ledger records (the longest declared rule, 90 d, "
                                           "applies: within it)")
    assert result["old"][0] is True
    assert result["restaged"][0] is False and "staged 20.0 d ago by a run no ledger records" in result["restaged"][1]


# ---- decision pages -----------------------------------------------------------------------------------------

def test_decision_pages_go_with_their_runs_but_registered_and_lineage_shown_ones_stay() -> None:
    """Issue 36 item 1 (a): one page per evaluated night, never removed. A page goes with its DAG run's workspace;
    a registered run's page and the pages the lineage page shows by default stay."""
    facts = dataclasses.replace(FACTS, lineage_runs=frozenset({"m7", "m8"}))
    items = [Item(DECISION_PAGE, f"pages/m{r[1]}", r, age_days=40.0, mlflow_run_id=f"m{r[1]}")
             for r in ("r1", "r2", "r3", "r4", "r7", "r8")]
    items += [Item(DECISION_PAGE, "pages/orphan", None, age_days=40.0, mlflow_run_id="orphan"),
              Item(DECISION_PAGE, "pages/new", None, age_days=0.5, mlflow_run_id="new"),
              Item(WORKSPACE, "ws/r4", "r4", age_days=1.0)]  # r4 retried yesterday: its page stays with it
    result = decided(items, facts)
    assert result["pages/m1"] == (True, "a successful run older than the last 2 finished runs, nothing written "
                                        "for 40.0 d")
    assert result["pages/m2"] == (False, "the decision page of registered v1: the lineage of the version links it")
    assert result["pages/m3"][1].startswith("the decision page of registered v2")
    assert result["pages/m4"][0] is False and result["pages/m4"][1].startswith("resumable or running")
    assert result["pages/m7"] == (False, f"linked by the lineage page (one of the newest {LINEAGE_RUNS} runs it "
                                         f"shows)")
    assert result["pages/orphan"][0] is True and "no ledger record or MLflow run names its DAG run" in \
        result["pages/orphan"][1]
    assert result["pages/new"][0] is False
