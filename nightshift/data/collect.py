"""Collect dataset versions: the DVC cache and remote objects of versions nothing needs any more.

The staging project (`nightshift.data.stage`, `NIGHTSHIFT_HOME/dvc/`, no git) knows each version it staged by its
record `versions/<hash>.json`. `dvc gc` decides what to keep from the DVC files of a workspace or of git revisions;
this project has neither (a version's `.dvc` file lives in a run's workspace, and its keepers are MLflow tags), and
`dvc gc --cloud` removes from the remote every object the project does not name, including what other projects or
machines pushed to a shared remote. So the collection names what goes, object by object, through DVC's own object
databases (the project's cache and `repo.cloud.get_remote_odb`), and removes only:

- the `.dir` object of a version the retention plan lets go (`nightshift.retention`: no registered model version
  names it, no workspace stages it, and the rule of every pipeline whose ledger names it, its own
  `data_versions_days` since its own last use, lets it go) and the file objects it lists,
- less every object that any `.dir` left in the cache or on the remote lists (a split shared with a version that
  stays, or with another project's data on the same remote),

from the cache, and from the remote only when it is declared this machine's alone (NIGHTSHIFT_DVC_REMOTE_EXCLUSIVE=1:
a `.dir` another project pushed to a shared remote, the repository's own `dvc push` of the demo data included, has
the same hash as the version staged from the same files, and no registry or ledger here knows that project's git
history), then the version's record. All of it under the staging lock, so that no staging runs meanwhile; a staging
afterwards that needs a removed object copies and pushes it again. Any failure of DVC or of the remote is GcFailed
naming the object and the remote: nothing is logged and passed over.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from contextlib import contextmanager, redirect_stdout
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from nightshift import ledger, settings
from nightshift.errors import NightshiftError
from nightshift.redaction import redact
from nightshift.retention import DATA_VERSION, Item

DAY = 86400.0
DATASET_TAG = "nightshift.dataset_version"
DIR_SUFFIX = ".dir"


class DataCollectionFailed(NightshiftError):
    """Dataset versions could not be read or removed (the DVC cache, the DVC remote, the registry or a ledger)."""


def versions_dir() -> Path:
    from nightshift.data.stage import project_dir

    return project_dir() / "versions"


def recorded_versions() -> dict[str, float]:
    """Every version the staging project recorded: hash -> the record's mtime (its first staging)."""
    folder = versions_dir()
    if not folder.is_dir():
        return {}
    return {path.stem: path.stat().st_mtime for path in folder.glob("*.json") if path.is_file()}


def _timestamp(value: object) -> float | None:
    try:
        return datetime.fromisoformat(str(value)).timestamp()
    except ValueError:
        return None


def last_uses() -> dict[str, dict[str, float]]:
    """Dataset version -> {dag_id: when a run of that pipeline last recorded it (its ledger's `recorded_at`)}."""
    uses: dict[str, dict[str, float]] = {}
    for dag_id in ledger.dag_ids():
        try:
            records = ledger.read_records(dag_id, strict=True)
        except ledger.LedgerUnreadable as err:
            raise DataCollectionFailed(f"{err}; no dataset version was removed: which runs used which cannot "
                                       f"be told") from err
        for record in records:
            version, when = record.get("dataset_version"), _timestamp(record.get("recorded_at"))
            if isinstance(version, str) and when is not None:
                by_dag = uses.setdefault(version, {})
                by_dag[dag_id] = max(when, by_dag.get(dag_id, when))
    return uses


def recorded_rules() -> dict[str, dict[str, Any]]:
    """dag_id -> the `retention` block its newest run record carries (what the run's declaration said: gc judges
    the versions of a pipeline whose declaration it cannot find by it)."""
    rules: dict[str, dict[str, Any]] = {}
    for dag_id in ledger.dag_ids():
        try:
            records = ledger.read_records(dag_id, strict=True)
        except ledger.LedgerUnreadable as err:
            raise DataCollectionFailed(f"{err}; no dataset version was removed: which rule keeps which cannot "
                                       f"be told") from err
        for record in records:
            if isinstance(record.get("retention"), dict):
                rules[dag_id] = record["retention"]
    return rules


def _workspace_versions(workspace: Path) -> set[str]:
    """The versions a workspace stages: its `dataset.json` and its `data.dvc` (both, when they differ)."""
    found: set[str] = set()
    record, pointer = workspace / "dataset.json", workspace / "data.dvc"
    try:
        if record.is_file():
            found.add(str(json.loads(record.read_text())["hash"]))
        if pointer.is_file():
            import yaml

            for out in yaml.safe_load(pointer.read_text()).get("outs") or []:
                found.add(str(out["md5"]).removesuffix(DIR_SUFFIX))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        raise DataCollectionFailed(f"workspace {workspace}: its dataset record cannot be read ({err}); no dataset "
                                   f"version was removed: repair it or remove the workspace") from err
    return found


def in_use(skip: frozenset[str] = frozenset()) -> dict[str, str]:
    """Dataset version -> a workspace under workspaces_dir() that stages it (`<dag>/<run>/`, and `<dir>/` for one
    staged by hand there); `skip`: workspace paths about to be removed (a dry run's plan)."""
    root = settings.workspaces_dir()
    staged: dict[str, str] = {}
    if not root.is_dir():
        return staged
    for first in sorted(root.iterdir()):
        if not first.is_dir():
            continue
        for workspace in [first, *sorted(p for p in first.iterdir() if p.is_dir())]:
            if str(workspace) in skip:
                continue
            for version in _workspace_versions(workspace):
                staged.setdefault(version, str(workspace))
    return staged


def _run_dataset(client: Any, run_id: str | None) -> str | None:
    """The dataset version the training run `run_id` was tagged with (the DAG's train task tags it), if any."""
    from nightshift.registry import _is_missing

    if not run_id:
        return None
    try:
        return client.get_run(run_id).data.tags.get(DATASET_TAG)
    except Exception as err:
        if _is_missing(err):
            return None  # the run was purged: what it trained on cannot be told from it
        raise


def registered_data() -> dict[str, list[str]]:
    """Dataset version -> the registered model versions (of every model) whose lineage tag names it, or, for a
    version registered without one (`nightshift register` by hand), whose training run's tag does."""
    from nightshift import tracking

    named: dict[str, list[str]] = {}
    token: str | None = None
    client = tracking.client()
    try:
        while True:
            page = client.search_model_versions(max_results=1000, page_token=token)
            for version in page:
                data = (version.tags or {}).get(DATASET_TAG) or _run_dataset(client, version.run_id)
                if data:
                    named.setdefault(str(data), []).append(f"{version.name} v{version.version}")
            token = page.token
            if not token:
                break
    except Exception as err:
        raise DataCollectionFailed(f"reading the registered model versions failed ({type(err).__name__}: {err}); "
                                   f"no dataset version was removed: which data a rollback needs cannot be "
                                   f"told") from err
    return named


def inventory(now: float) -> list[Item]:
    """One item per recorded dataset version, aged from its first staging (each pipeline's last use of it is
    last_uses')."""
    return [Item(DATA_VERSION, version, None, (now - staged) / DAY)
            for version, staged in sorted(recorded_versions().items())]


# ---- DVC ---------------------------------------------------------------------------------------------------

@dataclass
class Store:
    """The staging project's cache and remote object databases, opened under the staging lock."""

    cache: Any
    remote: Any
    remote_name: str
    exclusive: bool = False  # the remote is this machine's staging's alone: versions are removed from it too

    def _fail(self, what: str, err: BaseException) -> DataCollectionFailed:
        return DataCollectionFailed(f"{what} ({type(err).__name__}: {redact(str(err))}); fix the DVC remote "
                                    f"{self.remote_name} or the cache, then run `nightshift gc` again")

    def listing(self, version: str) -> set[str] | None:
        """The object ids of a version (its `.dir` and the files it lists), from the cache or else the remote;
        None when neither holds its `.dir` any more."""
        from dvc_data.hashfile.hash_info import HashInfo
        from dvc_data.hashfile.tree import Tree

        oid = version + DIR_SUFFIX
        for odb in (self.cache, self.remote):
            try:
                if not odb.exists(oid):
                    continue
                tree = Tree.load(odb, HashInfo("md5", oid))
            except Exception as err:
                raise self._fail(f"reading the file list {oid} of dataset version {version} failed", err) from err
            return {oid, *(entry.value for _, _, entry in tree)}
        return None

    def dir_objects(self) -> set[str]:
        """Every `.dir` object in the cache, and on the remote when it is collected too (`exclusive`): a remote that
        is kept needs no protection, and listing a shared one would read all of it under the staging lock."""
        found: set[str] = set()
        for odb in (self.cache, self.remote) if self.exclusive else (self.cache,):
            try:
                found.update(oid for oid in odb.all() if oid.endswith(DIR_SUFFIX))
            except Exception as err:
                raise self._fail(f"listing the objects of {redact(str(odb.path))} failed", err) from err
        return found

    def size(self, oids: set[str]) -> int:
        total = 0
        for oid in oids:
            path = Path(self.cache.oid_to_path(oid))
            total += path.stat().st_size if path.is_file() else 0
        return total

    def remove(self, oids: set[str]) -> None:
        """Remove the objects from the remote (when it is `exclusive`), then from the cache, a version's `.dir` after
        its files: a removal that fails half-way leaves the listing, by which the next gc finishes it (the `.dir`
        first left the files it listed in no listing, never collected); DataCollectionFailed naming the first
        that fails."""
        from dvc_data.hashfile.db import get_index

        ordered = sorted(oids, key=lambda oid: (oid.endswith(DIR_SUFFIX), oid))
        remote = [(self.remote, f"the DVC remote {self.remote_name}")] if self.exclusive else []
        for odb, where in (*remote, (self.cache, "the DVC cache")):
            try:
                present = set(odb.oids_exist(ordered))
            except Exception as err:
                raise self._fail(f"looking up objects in {where} failed", err) from err
            for oid in (o for o in ordered if o in present):
                try:
                    odb.delete(oid)
                except Exception as err:
                    raise self._fail(f"removing object {oid} from {where} failed", err) from err
        if not self.exclusive:
            return
        try:
            get_index(self.remote).clear()  # it would vouch for the removed objects to the next push
        except Exception as err:
            raise self._fail("clearing DVC's index of the remote failed", err) from err


@contextmanager
def store() -> Iterator[Store]:
    """The staging project's cache and remote, under the staging lock (no staging runs while it is held)."""
    from nightshift.data.stage import REMOTE_NAME, _open_project, project_dir, project_lock

    remote = redact(settings.dvc_remote())
    with project_lock(), redirect_stdout(sys.stderr):
        if not (project_dir() / ".dvc").is_dir():
            raise DataCollectionFailed(f"{project_dir()} is not a DVC project although dataset versions are "
                                       f"recorded in it; no dataset version was removed")
        try:
            repo = _open_project()
            odb = repo.cloud.get_remote_odb(REMOTE_NAME, "gc")
        except Exception as err:
            raise DataCollectionFailed(f"opening the DVC project {project_dir()} or its remote {remote} failed "
                                       f"({type(err).__name__}: {redact(str(err))}); no dataset version was "
                                       f"removed") from err
        try:
            yield Store(repo.cache.local, odb, remote, settings.dvc_remote_exclusive())
        finally:
            repo.close()


def objects_to_remove(opened: Store, versions: list[str]) -> dict[str, set[str]]:
    """Version -> the objects removing it frees: its `.dir` and listed files, less what any `.dir` that stays
    (in the cache, a recorded version's wherever it is, and on a remote that is collected, this project's or not)
    lists."""
    going = {version + DIR_SUFFIX for version in versions}
    protected: set[str] = set()
    for oid in sorted((opened.dir_objects() | {v + DIR_SUFFIX for v in recorded_versions()}) - going):
        protected |= opened.listing(oid.removesuffix(DIR_SUFFIX)) or {oid}
    freed = {}
    for version in versions:
        listing = opened.listing(version)
        freed[version] = (listing or set()) - protected
    return freed
