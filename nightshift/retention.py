"""Retention: which of a pipeline's leftovers may go, and why each one stays. Pure: no file, MLflow or clock.

What a pipeline leaves behind, and what refers to it (found in the code, issue 36):

- run workspaces `workspaces_dir()/<dag_id>/<run_id>/` (fsutil.safe_name of each): the staged dataset (`data/`,
  links into the DVC cache, or copies), `dataset.json`, and the trained output `model/` (weights, metrics,
  `mlflow_run.json`). Read by the run's own tasks only; the registered model is a copy in MLflow.
- checkpoints `checkpoints_dir()/<dag_id>/<run_id>/<task_id>[/<map_index>]/`: what a retry or a cleared run
  resumes from (its resume key: dataset version, parameters, code, device). Needed until the run succeeded.
- MLflow runs of the experiment named by the dag_id (tag `nightshift.dag_run_id`; the model as a LoggedModel
  of the run, artifacts under `mlartifacts/<experiment>/`). A registered model version names its run
  (`ModelVersion.run_id`): rolling back (`nightshift deploy --version N`) downloads `models:/<name>/<N>`, so
  a registered run is never removed. An unregistered one is a rejected challenger.
- served-model folders `serving_dir()/models/<model>-v<version>-<port>` (local target): the serving record
  `serving_dir()/<model>.json` names the live one; `.<model>-v<version>.*` are downloads of a deploy at work.
- decision pages `NIGHTSHIFT_HOME/decisions/<dag_id>/<MLflow run id>/decision.html` (nightshift.decision_page, one per
  evaluated night): the Airflow plugin serves them, linked from the `evaluate` task and from the lineage page's row of
  the run (its ledger record's `mlflow_run_id`). A page goes with its DAG run's workspace (same reasons), except that
  the page of a registered run (the champion's among them) and the pages of the newest LINEAGE_RUNS ledger records
  (the lineage page's default view) always stay. A removal is written to the pipeline's removal log
  (nightshift.removals), by which the lineage page and the plugin's route show the page as removed, never a bare 404.
  The season view (nightshift.season) draws the ledger only and links nothing.
- the run ledger `NIGHTSHIFT_HOME/airflow/<dag_id>/runs.jsonl`: which runs finished, which succeeded, which
  version each promoted. It is the lineage page and is never collected.
- dataset versions: the staging DVC project's cache and its remote (`nightshift.data.stage`), one machine-wide
  store shared by every pipeline. A registered model version names its data (tag `nightshift.dataset_version`):
  rolling back, or retraining it, pulls that version, so it is never collected; nor is a version a workspace under
  `workspaces_dir()` stages (a run kept above, or one running). Any other version is kept while the rule of any
  pipeline that used it keeps it: each pipeline's own `data_versions_days` after its newest ledger record naming the
  version (a pipeline whose retention is disabled keeps the versions it used; one whose declaration is not found goes
  by the retention its newest run record carries, else by the longest declared rule, and while a declaration cannot
  be read, the versions of undeclared pipelines stay). A
  version no ledger names (or staged again since its last recorded use: a run that recorded nothing) goes by the
  longest declared rule from its staging. The objects it shares with a version that stays stay too, and the remote is
  collected only when NIGHTSHIFT_DVC_REMOTE_EXCLUSIVE=1 says it is this machine's alone (`nightshift.data.collect`).

`plan` takes an inventory (`Item`s) and what refers to it (`Facts`) and returns a `Decision` per item.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from nightshift.errors import UsageError

WORKSPACE = "workspace"
CHECKPOINTS = "checkpoints"
MLFLOW_RUN = "mlflow_run"
SERVED_MODEL = "served_model"
DATA_VERSION = "data_version"
DECISION_PAGE = "decision_page"
KINDS = (WORKSPACE, CHECKPOINTS, MLFLOW_RUN, SERVED_MODEL, DATA_VERSION, DECISION_PAGE)
RUN_KINDS = (WORKSPACE, CHECKPOINTS, DECISION_PAGE)  # judged by their DAG run, as one
LINEAGE_RUNS = 50  # ledger records the lineage page shows by default (the plugin's RECENT): their pages stay


@dataclass(frozen=True)
class RetentionPolicy:
    """A pipeline's retention (its declaration's `retention` block; these defaults when left out).

    keep_runs: workspaces and checkpoints of this many most recent finished runs are kept (besides those of the
      champion's run, the previous champion's, the last successful run and any run still resumable).
    resumable_days: a run that did not succeed (failed, killed, or still running) keeps its workspace and
      checkpoints this many days after its last write, so that clearing it in Airflow resumes it.
    challenger_days: MLflow runs of challengers never registered are kept this many days after they ended.
    data_versions_days: a dataset version no registered model version names and no workspace stages is kept this
      many days after this pipeline last used it (the store is shared: a version is kept while any pipeline's own
      rule keeps it).
    enabled: false turns collection off for the pipeline (the plan then keeps everything).
    """

    enabled: bool = True
    keep_runs: int = 5
    resumable_days: float = 7.0
    challenger_days: float = 30.0
    data_versions_days: float = 30.0

    def __post_init__(self) -> None:
        if isinstance(self.keep_runs, bool) or not isinstance(self.keep_runs, int) or self.keep_runs < 1:
            raise UsageError(f"retention.keep_runs: {self.keep_runs!r} is not a whole number of runs of at least 1")
        for name in ("resumable_days", "challenger_days", "data_versions_days"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 1:
                raise UsageError(f"retention.{name}: {value!r} is not a number of days of at least 1 (a run "
                                 f"in progress must never look abandoned)")

    def to_dict(self) -> dict[str, object]:
        return {"enabled": self.enabled, "keep_runs": self.keep_runs, "resumable_days": self.resumable_days,
                "challenger_days": self.challenger_days, "data_versions_days": self.data_versions_days}


@dataclass(frozen=True)
class DeclaredRules:
    """The retention each declared pipeline gives its dataset versions, as gc found the declarations.

    policies: dag_id -> its declared retention; invalid: dag_id -> a declaration of it that is not valid (its rule
    cannot be told: what it used stays); unreadable: declarations whose dag_id cannot even be read (any pipeline no
    valid declaration names might be theirs: what those pipelines used stays); recorded: dag_id -> the retention its
    newest run record carries (what its declaration said then), for a pipeline whose declaration was not found (its
    DAG file points elsewhere, a DAG bundle, `nightshift gc` run where the DAG folder is not known)."""

    policies: Mapping[str, RetentionPolicy] = field(default_factory=dict)
    invalid: Mapping[str, str] = field(default_factory=dict)
    unreadable: tuple[str, ...] = ()
    recorded: Mapping[str, RetentionPolicy] = field(default_factory=dict)


@dataclass(frozen=True)
class Item:
    """One thing that could be removed. `ident`: its path, the MLflow run id, or the dataset version's hash;
    `run_id`: the DAG run it belongs to (None when it names none); `age_days`: days since it was last written (a run:
    since it ended; a dataset version: since it was first staged); `version`: a served folder's model version;
    `mlflow_run_id`: the MLflow run a decision page shows."""

    kind: str
    ident: str
    run_id: str | None = None
    age_days: float = 0.0
    size: int = 0
    version: str | None = None
    mlflow_run_id: str | None = None


@dataclass(frozen=True)
class Facts:
    """What refers to a pipeline's items, read from the ledger, the registry and the serving record.

    finished: DAG run ids with a ledger record, oldest first (a run recorded twice counts at its last record);
    succeeded: those whose last record is a success; champion_run / previous_champion_run: the DAG runs that
    trained `@champion` and the champion before it (champion / previous_champion: their versions);
    registered: MLflow run id -> the versions registered from it; served_paths: folders a serving record names;
    deploying: a deployment of the model holds its lock now; data_registered: dataset version -> the registered
    model versions (of any model, "name vN") that name it; data_in_use: dataset version -> a workspace staging it;
    data_uses: dataset version -> {dag_id: days since that pipeline's newest ledger record naming it};
    data_rules: the declared retention of every pipeline gc could read (DeclaredRules; when it holds none, the
    policy `plan` is given is the only rule); lineage_runs: the MLflow run ids of the ledger records the lineage
    page shows by default (the newest LINEAGE_RUNS).
    """

    finished: Sequence[str] = ()
    succeeded: frozenset[str] = frozenset()
    champion_run: str | None = None
    previous_champion_run: str | None = None
    champion: str | None = None
    previous_champion: str | None = None
    registered: Mapping[str, Sequence[str]] = field(default_factory=dict)
    served_paths: frozenset[str] = frozenset()
    deploying: bool = False
    data_registered: Mapping[str, Sequence[str]] = field(default_factory=dict)
    data_in_use: Mapping[str, str] = field(default_factory=dict)
    data_uses: Mapping[str, Mapping[str, float]] = field(default_factory=dict)
    data_rules: DeclaredRules = field(default_factory=DeclaredRules)
    lineage_runs: frozenset[str] = frozenset()

    @property
    def last_successful(self) -> str | None:
        for run_id in reversed(self.finished):
            if run_id in self.succeeded:
                return run_id
        return None


@dataclass(frozen=True)
class Decision:
    item: Item
    remove: bool
    reason: str

    def to_dict(self) -> dict[str, object]:
        return {"kind": self.item.kind, "what": self.item.ident, "run_id": self.item.run_id,
                "size": self.item.size, "action": "remove" if self.remove else "keep", "reason": self.reason}


def _days(value: float) -> str:
    return f"{value:.1f} d"


def _run_reason(item: Item, policy: RetentionPolicy, facts: Facts, recent: frozenset[str],
                age_days: float) -> tuple[bool, str]:
    """(remove?, why) for a workspace or a checkpoint folder of DAG run `item.run_id`; `age_days`: since the
    newest write to any folder of that run (its workspace and its checkpoints are judged as one)."""
    run_id = item.run_id
    if run_id is not None and run_id == facts.champion_run:
        return False, f"the champion's run (v{facts.champion})"
    if run_id is not None and run_id == facts.previous_champion_run:
        return False, f"the previous champion's run (v{facts.previous_champion}): a rollback may need it"
    if run_id is not None and run_id == facts.last_successful:
        return False, "the last successful run"
    if run_id is not None and run_id in recent:
        return False, f"within the last {policy.keep_runs} finished runs"
    # Whatever the ledger's last word on it: a run written to lately may be running again (a cleared Airflow run
    # keeps its run id and its old success record) or about to be retried.
    state = ("succeeded" if run_id in facts.succeeded else "failed" if run_id in facts.finished
             else "not finished (running, or killed)")
    if age_days < policy.resumable_days:
        return False, (f"resumable or running: {state}, last written {_days(age_days)} ago "
                       f"(within {policy.resumable_days:g} d)")
    if run_id is None or run_id not in facts.succeeded:
        return True, f"{state}, nothing written for {_days(age_days)} (over {policy.resumable_days:g} d)"
    return True, (f"a successful run older than the last {policy.keep_runs} finished runs, nothing written for "
                  f"{_days(age_days)}")


def _mlflow_reason(item: Item, policy: RetentionPolicy, facts: Facts) -> tuple[bool, str]:
    versions = facts.registered.get(item.ident)
    if versions:
        return False, f"registered (v{', v'.join(str(v) for v in versions)}): lineage and rollback need it"
    if item.run_id is not None and item.run_id not in facts.finished:
        return False, "its DAG run has not finished: it may still be registered"
    if item.age_days < policy.challenger_days:
        return False, f"unregistered challenger, ended {_days(item.age_days)} ago (within {policy.challenger_days:g} d)"
    return True, f"unregistered challenger, ended {_days(item.age_days)} ago (over {policy.challenger_days:g} d)"


def _served_reason(item: Item, facts: Facts) -> tuple[bool, str]:
    if item.ident in facts.served_paths:
        return False, "served now (the serving record names it)"
    if facts.deploying:
        return False, "a deployment of this model is running"
    if item.version is not None and item.version == facts.champion:
        return False, f"the champion's (v{item.version})"
    if item.version is not None and item.version == facts.previous_champion:
        return False, f"the previous champion's (v{item.version})"
    return True, f"v{item.version}: neither the champion (v{facts.champion}) nor the previous one, and not served"


def _data_rule(dag_id: str, age: float, policy: RetentionPolicy, facts: Facts) -> tuple[bool, str]:
    """(keeps it?, what the rule of pipeline `dag_id`, which last used the version `age` days ago, says)."""
    rules = facts.data_rules
    rule = rules.policies.get(dag_id) or (policy if not rules.policies else None)
    if rule is not None and not rule.enabled:
        return True, f"{dag_id} used it {_days(age)} ago and its retention is disabled (retention.enabled: false)"
    if rule is not None:
        within = age < rule.data_versions_days
        return within, (f"{dag_id} used it {_days(age)} ago ({'within' if within else 'over'} its "
                        f"{rule.data_versions_days:g} d)")
    if dag_id in rules.invalid:
        return True, (f"{dag_id} used it {_days(age)} ago and its declaration {rules.invalid[dag_id]} is not valid: "
                      f"its rule cannot be told")
    if rules.unreadable:
        return True, (f"{dag_id} used it {_days(age)} ago and no readable declaration of {dag_id} was found while "
                      f"{', '.join(rules.unreadable)} cannot be read: its rule cannot be told")
    recorded = rules.recorded.get(dag_id)
    if recorded is not None and not recorded.enabled:
        return True, (f"{dag_id} used it {_days(age)} ago and its retention is disabled (retention.enabled: false, "
                      f"as its last run recorded: its declaration was not found)")
    if recorded is not None:
        within = age < recorded.data_versions_days
        return within, (f"{dag_id} used it {_days(age)} ago ({'within' if within else 'over'} its "
                        f"{recorded.data_versions_days:g} d, as its last run recorded: its declaration was not "
                        f"found)")
    longest = _longest_data_days(policy, facts)
    within = age < longest
    return within, (f"{dag_id} used it {_days(age)} ago and no declaration of {dag_id} was found: the longest "
                    f"declared rule, {longest:g} d, applies ({'within' if within else 'over'} it)")


def _longest_data_days(policy: RetentionPolicy, facts: Facts) -> float:
    rules = [r for r in (facts.data_rules.policies.values() or [policy]) if r.enabled]
    return max([r.data_versions_days for r in rules] or [policy.data_versions_days])


def _data_reason(item: Item, policy: RetentionPolicy, facts: Facts) -> tuple[bool, str]:
    registered = facts.data_registered.get(item.ident)
    if registered:
        return False, f"named by registered {', '.join(registered)}: a rollback or a retrain of it needs its data"
    workspace = facts.data_in_use.get(item.ident)
    if workspace is not None:
        return False, f"staged in workspace {workspace} (a run that is kept, or running)"
    uses = dict(facts.data_uses.get(item.ident) or {})
    said = [_data_rule(dag_id, age, policy, facts) for dag_id, age in sorted(uses.items(), key=lambda u: u[1])]
    if not uses or item.age_days < min(uses.values()):
        # Staged since its last recorded use, or never recorded: by a run that recorded nothing (killed, failed, or
        # by hand), of a pipeline that cannot be told.
        unknown = [*facts.data_rules.unreadable, *facts.data_rules.invalid.values()]
        if unknown:
            said.append((True, f"staged {_days(item.age_days)} ago by a run no ledger records, while "
                               f"{', '.join(unknown)} cannot be read: its rule cannot be told"))
        else:
            longest = _longest_data_days(policy, facts)
            within = item.age_days < longest
            said.append((within, f"staged {_days(item.age_days)} ago by a run no ledger records (the longest "
                                 f"declared rule, {longest:g} d, applies: {'within' if within else 'over'} it)"))
    keeping = [why for keeps, why in said if keeps]
    if keeping:
        return False, "no registered version names it; kept by a pipeline's rule: " + "; ".join(keeping)
    return True, ("no registered version names it and no workspace stages it; every rule lets it go: "
                  + "; ".join(why for _, why in said))


def _page_reason(item: Item, policy: RetentionPolicy, facts: Facts, recent: frozenset[str],
                 age_days: float) -> tuple[bool, str]:
    """A decision page: kept for a registered run and for the lineage page's default view, else with its DAG run's
    workspace."""
    versions = facts.registered.get(item.mlflow_run_id or "")
    if versions:
        return False, (f"the decision page of registered v{', v'.join(str(v) for v in versions)}: the lineage of the "
                       f"version links it")
    if item.mlflow_run_id in facts.lineage_runs:
        return False, f"linked by the lineage page (one of the newest {LINEAGE_RUNS} runs it shows)"
    if item.run_id is None:
        if age_days < policy.resumable_days:
            return False, (f"no ledger record or MLflow run names its DAG run yet; written {_days(age_days)} ago "
                           f"(within {policy.resumable_days:g} d)")
        return True, (f"no ledger record or MLflow run names its DAG run (nothing links it); written "
                      f"{_days(age_days)} ago (over {policy.resumable_days:g} d)")
    return _run_reason(item, policy, facts, recent, age_days)


def plan(items: Iterable[Item], facts: Facts, policy: RetentionPolicy) -> list[Decision]:
    """A Decision for each item, in the order given: removed with the reason, or kept with why."""
    items = list(items)
    recent = frozenset(list(facts.finished)[-policy.keep_runs:])
    run_age: dict[str | None, float] = {}
    for item in items:
        if item.kind in RUN_KINDS and item.run_id is not None:
            run_age[item.run_id] = min(item.age_days, run_age.get(item.run_id, item.age_days))
    decisions = []
    for item in items:
        if item.kind not in KINDS:
            raise UsageError(f"{item.ident}: unknown kind {item.kind!r} (one of {', '.join(KINDS)})")
        if not policy.enabled:
            remove, reason = False, "retention is disabled for this pipeline (retention.enabled: false)"
        elif item.kind in (WORKSPACE, CHECKPOINTS):
            age = item.age_days if item.run_id is None else run_age[item.run_id]
            remove, reason = _run_reason(item, policy, facts, recent, age)
        elif item.kind == DECISION_PAGE:
            age = item.age_days if item.run_id is None else run_age[item.run_id]
            remove, reason = _page_reason(item, policy, facts, recent, age)
        elif item.kind == MLFLOW_RUN:
            remove, reason = _mlflow_reason(item, policy, facts)
        elif item.kind == DATA_VERSION:
            remove, reason = _data_reason(item, policy, facts)
        else:
            remove, reason = _served_reason(item, facts)
        decisions.append(Decision(item, remove, reason))
    return decisions
