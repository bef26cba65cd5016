"""`nightshift gc`: find a pipeline's leftovers, plan with its retention policy (nightshift.retention), remove.

`collect(pipeline, dry_run=...)` reads what exists (workspaces, checkpoint folders, the MLflow runs of the
pipeline's experiment, served-model folders, decision pages) and what refers to it (the run ledger, the registry's
versions and `@champion`, the serving record), plans, and unless `dry_run` removes what the plan says may go. Right
before removing it reads the references again and removes only what a fresh plan still lets go, and an MLflow run
only when no registered version of any model names it; anything that fails to be removed raises GcFailed naming it.
Each removal is written to the pipeline's removal log (nightshift.removals), which the lineage page reads.
Then the dataset versions (`nightshift.data.collect`): those the plan lets go once the workspaces are gone, planned
again under the staging lock with the registry and the workspaces read afresh, leave the DVC cache (and the
remote, when NIGHTSHIFT_DVC_REMOTE_EXCLUSIVE=1 says it is this machine's alone). The store is shared: each version
is judged by the rule of every pipeline whose ledger names it (`rules`, from the declarations found:
declared_rules).

`nightshift gc --images` collects the podman images of superseded Nightshift builds (nightshift.image_retention).
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

from nightshift import ledger, removals, settings
from nightshift.errors import NightshiftError, UsageError
from nightshift.fsutil import safe_name
from nightshift.pipelines.spec import Pipeline
from nightshift.retention import (
    CHECKPOINTS,
    DECISION_PAGE,
    LINEAGE_RUNS,
    MLFLOW_RUN,
    SERVED_MODEL,
    WORKSPACE,
    Decision,
    DeclaredRules,
    Facts,
    Item,
    RetentionPolicy,
    plan,
)

DAY = 86400.0
DAG_RUN_TAG = "nightshift.dag_run_id"
PROMOTED = ("promoted", "already_serving")


class GcFailed(NightshiftError):
    """Something the retention plan removes could not be removed (a file system or MLflow error)."""


def _tree(path: Path) -> tuple[float, int]:
    """(newest mtime, total bytes) of the files and folders under `path`, links not followed."""
    newest, total = path.lstat().st_mtime, 0
    for parent, dirs, files in os.walk(path):
        for name in [*dirs, *files]:
            try:
                st = os.lstat(os.path.join(parent, name))
            except FileNotFoundError:
                continue
            newest = max(newest, st.st_mtime)
            total += st.st_size if name in files else 0
    return newest, total


def _run_folders(root: Path, kind: str, names: dict[str, str], now: float) -> list[Item]:
    """One item per run folder `root/<run>` (real directories only: a link is never followed or removed)."""
    if not root.is_dir():
        return []
    items = []
    for entry in sorted(root.iterdir()):
        if entry.is_symlink() or not entry.is_dir():
            continue
        newest, size = _tree(entry)
        items.append(Item(kind, str(entry), names.get(entry.name, entry.name), (now - newest) / DAY, size))
    return items


def _ledger(dag_id: str) -> list[dict[str, Any]]:
    try:
        return ledger.read_records(dag_id, strict=True)
    except ledger.LedgerUnreadable as err:
        raise GcFailed(f"{err}; nothing was removed: which runs finished cannot be told") from err


def _ledger_facts(dag_id: str) -> tuple[list[str], set[str], list[dict[str, Any]]]:
    last: dict[str, dict[str, Any]] = {}
    records = _ledger(dag_id)
    for record in records:
        if isinstance(record.get("run_id"), str):
            last.pop(record["run_id"], None)  # a run recorded again counts at its last record
            last[record["run_id"]] = record
    finished = list(last)
    succeeded = {run_id for run_id, record in last.items() if record.get("status") == "success"}
    promotions = [r for r in records
                  if r.get("status") == "success" and r.get("deploy_status") in PROMOTED and r.get("model_version")]
    return finished, succeeded, promotions


def _version_run(model_name: str, version: str | None, dag_id: str) -> str | None:
    """The DAG run that trained `model_name` `version` (its lineage tag), when this pipeline's DAG trained it."""
    from nightshift import registry

    if version is None:
        return None
    tags = dict(registry.get_version(model_name, version).tags or {})
    if tags.get(f"{registry.TAG_PREFIX}dag_id") not in (None, dag_id):
        return None
    return tags.get(f"{registry.TAG_PREFIX}dag_run_id")


def _deploying(model_name: str) -> bool:
    from nightshift.deploy.local import _deploy_lock
    from nightshift.errors import DeploymentFailed

    try:
        with _deploy_lock(model_name):
            return False
    except DeploymentFailed:
        return True


def facts(pipeline: Pipeline) -> Facts:
    """What refers to the pipeline's items now: the ledger, `@champion` and the one promoted before it, every
    registered version of its model, the local serving record."""
    from nightshift import registry, tracking
    from nightshift.deploy.local import read_record

    finished, succeeded, promotions = _ledger_facts(pipeline.dag_id)
    model = pipeline.model_name
    try:
        champion = registry.version_by_alias(model, registry.CHAMPION)
        champion_version = str(champion.version) if champion is not None else None
        promoted = [str(r["model_version"]) for r in promotions]
        while promoted and promoted[-1] == champion_version:
            promoted.pop()
        previous = promoted[-1] if promoted else None
        registered: dict[str, list[str]] = {}
        for version in tracking.client().search_model_versions(f"name = '{model}'"):
            registered.setdefault(str(version.run_id), []).append(str(version.version))
        champion_run = _version_run(model, champion_version, pipeline.dag_id)
        previous_run = _version_run(model, previous, pipeline.dag_id)
    except Exception as err:
        raise GcFailed(f"reading the registry of {model} failed ({type(err).__name__}: {err}); nothing was "
                       f"removed: what the champion needs cannot be told") from err
    if previous_run is None and previous is not None:
        previous_run = next((str(r["run_id"]) for r in reversed(promotions) if str(r["model_version"]) == previous),
                            None)
    record = read_record(model) or {}
    shown = frozenset(str(r["mlflow_run_id"]) for r in _ledger(pipeline.dag_id)[-LINEAGE_RUNS:]
                      if r.get("mlflow_run_id"))
    return Facts(finished=tuple(finished), succeeded=frozenset(succeeded), champion_run=champion_run,
                 previous_champion_run=previous_run, champion=champion_version, previous_champion=previous,
                 registered={k: tuple(sorted(v, key=int)) for k, v in registered.items()},
                 served_paths=frozenset({str(record["model_path"])} if record.get("model_path") else ()),
                 deploying=_deploying(model), lineage_runs=shown)


def _mlflow_runs(pipeline: Pipeline, now: float) -> list[Item]:
    from nightshift import tracking

    client = tracking.client()
    try:
        experiment = client.get_experiment_by_name(pipeline.dag_id)
        if experiment is None:
            return []
        runs: list[Any] = []
        token: str | None = None
        while True:
            page = client.search_runs([experiment.experiment_id], max_results=1000, page_token=token)
            runs.extend(page)
            token = page.token
            if not token:
                break
    except Exception as err:
        raise GcFailed(f"listing the MLflow runs of experiment {pipeline.dag_id!r} failed "
                       f"({type(err).__name__}: {err})") from err
    items = []
    for run in runs:
        dag_run = run.data.tags.get(DAG_RUN_TAG)
        if dag_run is None:
            continue  # not a pipeline run's (logged by hand into the experiment): never collected
        ended = (run.info.end_time or run.info.start_time or now * 1000) / 1000
        items.append(Item(MLFLOW_RUN, str(run.info.run_id), dag_run, (now - ended) / DAY))
    return items


def _served_folders(pipeline: Pipeline) -> list[Item]:
    root = settings.serving_dir() / "models"
    name = re.escape(pipeline.model_name)
    pattern = re.compile(rf"{name}-v(\d+)-\d+|\.{name}-v(\d+)\.[A-Za-z0-9_]+")
    items = []
    for entry in sorted(root.iterdir()) if root.is_dir() else ():
        found = pattern.fullmatch(entry.name)
        if found and entry.is_dir() and not entry.is_symlink():
            items.append(Item(SERVED_MODEL, str(entry), None, 0.0, _tree(entry)[1], found.group(1) or found.group(2)))
    return items


def decisions_root(dag_id: str) -> Path:
    """NIGHTSHIFT_HOME/decisions/<dag_id>: where `evaluate` writes the pipeline's decision pages."""
    from nightshift.decision_page import page_path

    return page_path(dag_id, "x").parent.parent


def _decision_pages(pipeline: Pipeline, dag_runs: Mapping[str, str], now: float) -> list[Item]:
    """One item per page folder `decisions/<dag_id>/<MLflow run id>/` (real folders only), with the DAG run that
    evaluated it (`dag_runs`: MLflow run id -> DAG run id, from the ledger and the MLflow runs' tags) when known."""
    from nightshift.decision_page import RUN_ID_PATTERN

    root = decisions_root(pipeline.dag_id)
    if not root.is_dir() or root.is_symlink():
        return []
    items = []
    for entry in sorted(root.iterdir()):
        if entry.is_symlink() or not entry.is_dir() or not RUN_ID_PATTERN.fullmatch(entry.name):
            continue  # not a folder `evaluate` writes: never followed or removed
        newest, size = _tree(entry)
        items.append(Item(DECISION_PAGE, str(entry), dag_runs.get(entry.name), (now - newest) / DAY, size,
                          mlflow_run_id=entry.name))
    return items


def inventory(pipeline: Pipeline, known: Facts, now: float) -> list[Item]:
    """Every workspace, checkpoint folder, MLflow run, served-model folder and decision page of `pipeline`."""
    runs = [*known.finished, *(r for r in (known.champion_run, known.previous_champion_run) if r)]
    names = {safe_name(run_id): run_id for run_id in runs}
    dag = safe_name(pipeline.dag_id)
    mlflow_runs = _mlflow_runs(pipeline, now)
    dag_runs = {item.ident: str(item.run_id) for item in mlflow_runs if item.run_id}
    for record in _ledger(pipeline.dag_id):
        if record.get("mlflow_run_id") and record.get("run_id"):
            dag_runs.setdefault(str(record["mlflow_run_id"]), str(record["run_id"]))
    return [*_run_folders(settings.workspaces_dir() / dag, WORKSPACE, names, now),
            *_run_folders(settings.checkpoints_dir() / dag, CHECKPOINTS, names, now),
            *mlflow_runs, *_served_folders(pipeline), *_decision_pages(pipeline, dag_runs, now)]


def _local_path(uri: str) -> Path | None:
    parsed = urlparse(uri)
    if parsed.scheme in ("", "file"):
        return Path(unquote(parsed.path))
    return None


def _rmtree(path: Path, root: Path, base: Path | None = None) -> None:
    """Remove the directory `path`, which must lie under `root` as written, with no link on the way from `base`
    (the configured folder, `root` by default: it may itself be a link, onto another disk) to it: a link planted
    there (`<checkpoints>/<dag>` made a link) would lead the removal elsewhere."""
    base = root if base is None else base
    links = [p for p in (path, *path.parents) if p.is_relative_to(base) and p != base and p.is_symlink()]
    if path == root or not path.is_relative_to(root) or links:
        raise GcFailed(f"refusing to remove {path}: it is not a folder under {root}"
                       f"{f' ({links[0]} is a link)' if links else ''}")
    if not path.exists():
        return
    try:
        shutil.rmtree(path)
    except OSError as err:
        raise GcFailed(f"removing {path} failed ({err}); fix its permissions and run `nightshift gc` "
                       f"again") from err


def _remove_mlflow_run(run_id: str) -> str | None:
    """Remove the run and its artifacts; or, when a registered version (of any model) names it, keep it and say
    why."""
    from nightshift import tracking

    client = tracking.client()
    artifacts = Path(settings.mlflow_artifact_root())
    try:
        versions = client.search_model_versions(f"run_id = '{run_id}'")
        if versions:
            return "registered as " + ", ".join(f"{v.name} v{v.version}" for v in versions) + ": kept"
        run = client.get_run(run_id)
        models = client.search_logged_models([run.info.experiment_id], filter_string=f"source_run_id = '{run_id}'")
        for model in models:
            local = _local_path(model.artifact_location)
            if local is not None and local.resolve().is_relative_to(artifacts.resolve()):
                _rmtree(local, artifacts)
            client.delete_logged_model(model.model_id)
        local = _local_path(run.info.artifact_uri)
        if local is not None and local.resolve().is_relative_to(artifacts.resolve()):
            _rmtree(local, artifacts)
        client.delete_run(run_id)
        return None
    except GcFailed:
        raise
    except Exception as err:
        raise GcFailed(f"removing MLflow run {run_id} failed ({type(err).__name__}: {err}); run `nightshift gc` "
                       f"again") from err


def _remove(decision: Decision, pipeline: Pipeline) -> str | None:
    """Remove the item; or None when removed, else why it was kept after all."""
    item = decision.item
    dag = safe_name(pipeline.dag_id)
    if item.kind == WORKSPACE:
        _rmtree(Path(item.ident), settings.workspaces_dir() / dag, settings.workspaces_dir())
    elif item.kind == CHECKPOINTS:
        _rmtree(Path(item.ident), settings.checkpoints_dir() / dag, settings.checkpoints_dir())
    elif item.kind == MLFLOW_RUN:
        return _remove_mlflow_run(item.ident)
    elif item.kind == DECISION_PAGE:
        _rmtree(Path(item.ident), decisions_root(pipeline.dag_id), decisions_root(pipeline.dag_id).parent)
    else:
        from nightshift.deploy.local import _deploy_lock
        from nightshift.errors import DeploymentFailed

        try:
            with _deploy_lock(pipeline.model_name):  # a deploy renames and removes these folders itself
                _rmtree(Path(item.ident), settings.serving_dir() / "models")
        except DeploymentFailed:  # a deploy started since the plan: its folders stay until the next collection
            return "a deployment of this model started: kept until the next collection"
    return None


def _data_facts(now: float, rules: DeclaredRules, skip: frozenset[str] = frozenset()) -> Facts:
    from nightshift.data import collect as data

    uses = {version: {dag_id: (now - when) / DAY for dag_id, when in by_dag.items()}
            for version, by_dag in data.last_uses().items()}
    recorded = {}
    for dag_id, block in data.recorded_rules().items():
        try:
            recorded[dag_id] = RetentionPolicy(**block)
        except (TypeError, UsageError):
            continue  # a record written by hand, or by another version: the longest declared rule applies
    return Facts(data_registered={k: tuple(v) for k, v in data.registered_data().items()},
                 data_in_use=data.in_use(skip), data_uses=uses,
                 data_rules=dataclasses.replace(rules, recorded={**rules.recorded, **recorded}))


def collect_data(policy: RetentionPolicy, *, dry_run: bool, now: float, leaving: frozenset[str] = frozenset(),
                 rules: DeclaredRules | None = None,
                 removed: Callable[[Decision], None] | None = None) -> list[Decision]:
    """Plan the dataset versions (`leaving`: workspaces a dry run's plan removes, which stage nothing then) and,
    unless `dry_run`, remove from the DVC remote and cache what the plan lets go, calling `removed` with each version
    once it is gone. Each version is judged by the rule of every pipeline whose ledger names it (`rules`:
    declared_rules; `policy` alone when None). The store is opened, and the plan made again under its lock, only when
    something may go. GcFailed when DVC, the remote, the registry or a ledger fails."""
    from nightshift.data import collect as data

    rules = rules or DeclaredRules()
    try:
        items = data.inventory(now)
        if not items:
            return []
        try:
            decisions = plan(items, _data_facts(now, rules, leaving), policy)
            if not any(d.remove for d in decisions):
                return decisions
        except data.DataCollectionFailed:
            pass  # read without the lock: a staging may be writing a workspace's record; read it again under it
        with data.store() as opened:
            items = data.inventory(now)  # under the lock: no staging records or uses a version meanwhile
            decisions = plan(items, _data_facts(now, rules, leaving), policy)
            freed = data.objects_to_remove(opened, [d.item.ident for d in decisions if d.remove])
            where = "" if opened.exclusive else ("; from the staging cache only: the DVC remote is kept (it may be "
                                                 "shared; NIGHTSHIFT_DVC_REMOTE_EXCLUSIVE=1 collects it too)")
            decisions = [dataclasses.replace(d, reason=d.reason + where,
                                             item=dataclasses.replace(d.item, size=opened.size(freed[d.item.ident])))
                         if d.remove else d for d in decisions]
            if not dry_run:
                for decision in (d for d in decisions if d.remove):
                    opened.remove(freed[decision.item.ident])
                    (data.versions_dir() / f"{decision.item.ident}.json").unlink(missing_ok=True)
                    if removed is not None:
                        removed(decision)
            return decisions
    except data.DataCollectionFailed as err:
        raise GcFailed(str(err)) from err
    except OSError as err:
        raise GcFailed(f"collecting dataset versions failed ({err}); run `nightshift gc` again") from err


def _yaml_below(folder: Path) -> list[Path]:
    # Links to folders are followed, as Airflow walks the DAG folder (a team's folder linked into it loads its
    # stubs and their declarations); each real folder is entered once, so a link loop ends.
    found: list[Path] = []
    entered: set[str] = set()
    for root, dirs, files in os.walk(folder, followlinks=True):
        real = os.path.realpath(root)
        if real in entered:
            dirs[:] = []
            continue
        entered.add(real)
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d != "__pycache__")
        found += [Path(root) / name for name in sorted(files)
                  if name.endswith((".yaml", ".yml")) and not name.startswith(".")]
    return found


def declared_rules(folders: Iterable[str | Path]) -> DeclaredRules:
    """The declared retention of every pipeline declared in `folders` (those that exist) and their subfolders, as
    Airflow loads declarations from the DAG folder: what collect_data judges each pipeline's dataset versions by.
    A YAML file that is no declaration (no `dag_id`: a dbt project's, say) is none of ours; a declaration that is
    not valid, or two that declare one dag_id differently, leave that pipeline's rule unknown (`invalid`); one that
    does not even parse, every undeclared pipeline's (`unreadable`)."""
    import yaml

    from nightshift.pipelines import PipelineInvalid, load_pipeline

    policies: dict[str, RetentionPolicy] = {}
    invalid: dict[str, str] = {}
    unreadable: list[str] = []
    seen: set[Path] = set()
    for folder in dict.fromkeys(Path(f).resolve() for f in folders):
        for file in _yaml_below(folder) if folder.is_dir() else []:
            if file.resolve() in seen:
                continue
            seen.add(file.resolve())
            try:
                text = file.read_text()
                # A declaration names its dag_id; the rest of a DAG folder's YAML (dbt's) is not parsed at all.
                parsed = yaml.safe_load(text) if "dag_id" in text else None
            except (OSError, UnicodeDecodeError, yaml.YAMLError):
                unreadable.append(str(file))
                continue
            dag_id = parsed.get("dag_id") if isinstance(parsed, dict) else None
            if not isinstance(dag_id, str):
                continue
            try:
                retention = load_pipeline(file).retention
            except (PipelineInvalid, NightshiftError):
                invalid.setdefault(dag_id, str(file))
                continue
            if policies.setdefault(dag_id, retention) != retention:
                invalid.setdefault(dag_id, str(file))
    for dag_id in invalid:
        policies.pop(dag_id, None)
    return DeclaredRules(policies, invalid, tuple(unreadable))


def _log_removals(pipeline: Pipeline, removed: Sequence[Decision]) -> None:
    entries = [{**d.to_dict(), "mlflow_run_id": d.item.ident if d.item.kind == MLFLOW_RUN else d.item.mlflow_run_id}
               for d in removed]
    try:
        removals.append(pipeline.dag_id, entries)
    except OSError as err:
        raise GcFailed(f"writing the removal log {removals.log_path(pipeline.dag_id)} failed ({err}); what was "
                       f"removed is in this task's log; the lineage page shows it as missing, not as removed") from err


def collect(pipeline: Pipeline, *, dry_run: bool = False, now: float | None = None,
            rules: DeclaredRules | None = None) -> dict[str, Any]:
    """Plan with the pipeline's retention and (unless `dry_run`) remove what the plan lets go; each removal goes to
    the pipeline's removal log. `rules`: the other pipelines' declared retention (declared_rules), by which the
    dataset versions they used are judged; the pipeline's own rule is always its `retention`.

    Returns {"pipeline", "dry_run", "policy", "remove": [...], "keep": [...], "removed_bytes"}; each entry has
    kind, what, run_id, size, action and reason. GcFailed when something could not be read or removed."""
    now = time.time() if now is None else now
    if not pipeline.retention.enabled:  # nothing to read either: a registry that is down does not matter
        return {"pipeline": pipeline.dag_id, "dry_run": dry_run, "policy": pipeline.retention.to_dict(),
                "remove": [], "keep": [], "removed_bytes": 0}
    known = facts(pipeline)
    decisions = plan(inventory(pipeline, known, now), known, pipeline.retention)
    removed = [d for d in decisions if d.remove]
    if not dry_run and removed:
        fresh = facts(pipeline)  # read again: a run may have been promoted or registered since
        for decision in plan([d.item for d in removed], fresh, pipeline.retention):
            kept = _remove(decision, pipeline) if decision.remove else None
            if kept is not None:
                decision = Decision(decision.item, False, kept)
            if not decision.remove:
                removed.remove(next(d for d in removed if d.item == decision.item))
                decisions = [decision if d.item == decision.item else d for d in decisions]
            else:  # logged as it goes: a task killed half-way (no finally runs) has logged what it removed
                _log_removals(pipeline, [decision])
    leaving = frozenset(d.item.ident for d in removed if d.item.kind == WORKSPACE) if dry_run else frozenset()
    rules = rules or DeclaredRules()
    mine = DeclaredRules({**rules.policies, pipeline.dag_id: pipeline.retention},
                         {k: v for k, v in rules.invalid.items() if k != pipeline.dag_id}, rules.unreadable)
    datasets = collect_data(pipeline.retention, dry_run=dry_run, now=now, leaving=leaving, rules=mine,
                            removed=lambda decision: _log_removals(pipeline, [decision]))
    removed += [d for d in datasets if d.remove]
    decisions += datasets
    return {"pipeline": pipeline.dag_id, "dry_run": dry_run, "policy": pipeline.retention.to_dict(),
            "remove": [d.to_dict() for d in removed],
            "keep": [d.to_dict() for d in decisions if not d.remove],
            "removed_bytes": 0 if dry_run else sum(d.item.size for d in removed)}


# ---- the subcommand ------------------------------------------------------------------------------------------

def add_parser(subparsers: Any) -> None:
    gc = subparsers.add_parser("gc", help="remove what a pipeline's retention policy lets go (--dry-run: say it)")
    gc.add_argument("--pipeline", metavar="DAG_ID_OR_FILE",
                    help="one pipeline: its dag_id (a declaration in --pipelines) or its declaration file; "
                         "default: every declaration in --pipelines")
    gc.add_argument("--pipelines", default=os.environ.get("NIGHTSHIFT_PIPELINES", "pipelines"), metavar="DIR",
                    help="the folder of declarations (default: NIGHTSHIFT_PIPELINES, else ./pipelines)")
    gc.add_argument("--dry-run", action="store_true", help="print the plan, remove nothing")
    gc.add_argument("--images", action="store_true",
                    help="collect the podman images of superseded Nightshift builds (`make images`) instead of the "
                         "pipelines' leftovers: those no name, container or child image holds any more")
    gc.set_defaults(func=_gc)


def selected(pipeline: str | None, folder: str) -> list[Pipeline]:
    """The pipelines `nightshift gc` works on; UsageError naming what is missing or not valid."""
    from nightshift.errors import UsageError
    from nightshift.pipelines import load_pipeline, load_pipelines

    if pipeline and (pipeline.endswith((".yaml", ".yml")) or os.sep in pipeline):
        return [load_pipeline(pipeline)]
    if not Path(folder).is_dir():
        raise UsageError(f"--pipelines {folder} is not a folder of pipeline declarations; pass the folder "
                         f"(your DAG folder) or set NIGHTSHIFT_PIPELINES")
    loaded, errors = load_pipelines(folder)
    if pipeline:
        found = [p for p in loaded if p.dag_id == pipeline]
        if not found:
            bad = "; ".join(str(e) for e in errors)
            raise UsageError(f"no valid declaration of pipeline {pipeline!r} in {folder} (valid: "
                             f"{', '.join(p.dag_id for p in loaded) or 'none'}){'; ' + bad if bad else ''}")
        return found
    if errors:  # collecting with an unreadable policy could remove what it means to keep
        raise errors[0]
    return loaded


def policy_folders(pipelines: Sequence[Pipeline], folder: str | Path | None = None,
                   dags_folder: str | Path | None = None) -> list[Path]:
    """Where the declarations whose rules judge the shared dataset versions lie: `folder` (--pipelines), each
    selected pipeline's own folder, and the folders Airflow loads declarations from (the DAG folder, `dags_folder`
    when given, and NIGHTSHIFT_PIPELINES)."""
    from nightshift.pipelines import declaration_folders

    found = [Path(folder)] if folder is not None else []
    found += [Path(p.source).parent for p in pipelines if p.source is not None]
    return [*found, *declaration_folders(dags_folder)]


def _gc(args: Any) -> dict[str, Any]:
    if args.images:
        if args.pipeline:
            from nightshift.errors import UsageError

            raise UsageError("--images collects podman images, which belong to no pipeline: leave out --pipeline "
                             "(run `nightshift gc` without --images for the pipelines)")
        from nightshift.image_retention import collect_images

        return {"images": collect_images(dry_run=args.dry_run)}
    chosen = selected(args.pipeline, args.pipelines)
    rules = declared_rules(policy_folders(chosen, args.pipelines))
    results = [collect(p, dry_run=args.dry_run, rules=rules) for p in chosen]
    return {"pipelines": results}
