"""The run ledgers: one per pipeline's DAG, one JSON line per finished run, in NIGHTSHIFT_HOME; and the code version.

It answers "what did the last successful run train on?" (the skip-training check) and feeds the
plugin's lineage page (dataset version -> model version -> deployment). The DAG's tasks, the plugin and
the registry all read and write it here. Standard library only (the plugin imports it into the API
server); `code_version` is the one answer to "which code is this?" for runs, tags and model versions.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import subprocess
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from nightshift import settings
from nightshift.errors import CodeVersionUnknown, NightshiftError

LEDGER_NAME = "runs.jsonl"
# Code that shapes a trained model; a change here means a retrain even on the same data.
CODE_PATHS = ("nightshift", "operators", "dags", "gx", "pipelines")


def ledgers_dir() -> Path:
    return settings.home() / "airflow"


def ledger_path(dag_id: str) -> Path:
    """NIGHTSHIFT_HOME/airflow/<dag_id>/runs.jsonl; DagIdInvalid for a dag_id that would name another folder
    (the lineage page takes it from a query parameter)."""
    return ledgers_dir() / settings.checked_dag_id(dag_id) / LEDGER_NAME


def dag_ids() -> list[str]:
    """The DAG ids that have a ledger, sorted (the lineage page's list of pipelines)."""
    found = (path.parent.name for path in ledgers_dir().glob(f"*/{LEDGER_NAME}") if path.is_file())
    return sorted(name for name in found if settings.DAG_ID_PATTERN.fullmatch(name))


def append_record(dag_id: str, record: dict[str, Any]) -> Path:
    """Append one run record (locked, one line, flushed) and return the ledger path."""
    path = ledger_path(dag_id)
    path.parent.mkdir(parents=True, exist_ok=True)
    line = json.dumps({"recorded_at": datetime.now(UTC).isoformat(timespec="seconds"), **record},
                      sort_keys=True, default=str)
    with path.open("a+b") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            # A record torn by a crash or a full disk must not take the next one with it: start on a line of its own.
            end = handle.seek(0, os.SEEK_END)
            torn = end > 0 and handle.seek(end - 1) >= 0 and handle.read(1) != b"\n"
            handle.write((("\n" if torn else "") + line + "\n").encode())
            handle.flush()
            os.fsync(handle.fileno())
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
    return path


class LedgerUnreadable(NightshiftError):
    """A line of the run ledger is not a record (torn by a crash or a full disk, or edited by hand)."""


def read_records(dag_id: str, newest: int | None = None, *, strict: bool = False) -> list[dict[str, Any]]:
    """Every record of the ledger (or the `newest` ones), oldest first; a torn line is ignored, or with `strict`
    raises LedgerUnreadable naming it (for what removes files on the ledger's word: nightshift.gc)."""
    path = ledger_path(dag_id)
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        return []
    records = []
    for number, line in enumerate(lines, 1):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as err:
            if strict:
                raise LedgerUnreadable(f"{path} line {number} is not a run record ({err.msg}): a record torn by a "
                                       f"crash or a full disk? Repair or delete that line; what it said about its "
                                       f"run cannot be told") from err
            continue
    return records[-newest:] if newest else records


def last_successful(dag_id: str, exclude_run_id: str | None = None) -> dict[str, Any] | None:
    for record in reversed(read_records(dag_id)):
        if record.get("status") == "success" and record.get("run_id") != exclude_run_id:
            return record
    return None


def _repo_root() -> Path | None:
    import importlib.util

    spec = importlib.util.find_spec("nightshift")
    if spec is None or spec.origin is None:
        return None
    return Path(spec.origin).resolve().parents[1]


def source_digest(root: Path | None = None, paths: tuple[str, ...] = CODE_PATHS) -> str:
    """A hash of the Python sources under `paths` of `root` (default: where `nightshift` is imported from):
    a code version that needs no git, for installed packages and images built without NIGHTSHIFT_GIT_COMMIT."""
    root = root if root is not None else _repo_root()
    digest = hashlib.sha256()
    found = 0
    for top in paths:
        base = (root / top) if root is not None else Path(top)
        for path in sorted(base.rglob("*.py")) if base.is_dir() else ():
            if "__pycache__" in path.parts:
                continue
            digest.update(str(path.relative_to(base.parent)).encode() + b"\0")
            digest.update(path.read_bytes() + b"\0")
            found += 1
    if not found:
        raise CodeVersionUnknown(f"no Python sources under {', '.join(paths)} in {root}: cannot tell which code "
                                 f"runs; set NIGHTSHIFT_GIT_COMMIT to the commit this code was built from")
    return f"src.{digest.hexdigest()[:16]}"


def code_version(bundle_version: str | None = None) -> str:
    """The code that trains, in this order of preference:

    - `bundle_version`: the commit of the git DAG bundle a task runs from (Airflow's `bundle_version` of
      the DAG run, which pins every task of the run to that commit); the task passes it in;
    - `NIGHTSHIFT_GIT_COMMIT`: the commit an image was built from;
    - git HEAD of the checkout `nightshift` is imported from, plus a hash of uncommitted changes
      (uncommitted edits of tracked files under CODE_PATHS count as a different code version);
    - where `nightshift` is not imported from a git checkout (an installed package): a hash of its sources.

    Never "unknown": two different codes must never compare equal, so a checkout whose git fails raises
    CodeVersionUnknown instead of guessing.
    """
    if bundle_version and bundle_version.strip():
        return bundle_version.strip()
    if os.environ.get("NIGHTSHIFT_GIT_COMMIT", "").strip():
        return os.environ["NIGHTSHIFT_GIT_COMMIT"].strip()
    root = _repo_root()
    if root is None or not (root / ".git").exists():
        return source_digest(root)
    return git_version(root, CODE_PATHS)


def git_version(root: Path, paths: tuple[str, ...] = ()) -> str:
    """git HEAD of the checkout at `root`, plus a hash of what differs from it under `paths` (all of the tree when
    empty): uncommitted changes of tracked files and untracked files git does not ignore (a new module changes
    what runs as much as an edit does). Two different trees never share a value; a git that fails raises
    CodeVersionUnknown, never a guess."""
    def git(*args: str) -> bytes:
        return subprocess.run(["git", "-C", str(root), *args], capture_output=True, timeout=30,
                              check=True).stdout

    where = ("--", *paths) if paths else ()
    try:
        head = git("rev-parse", "HEAD").decode().strip()
        diff = git("diff", "--no-ext-diff", "--no-textconv", "--binary", "HEAD", *where)
        untracked = sorted(n for n in git("ls-files", "--others", "--exclude-standard", "-z", *where).split(b"\0")
                           if n)
    except subprocess.CalledProcessError as err:
        stderr = (err.stderr if isinstance(err.stderr, str) else (err.stderr or b"").decode(errors="replace"))
        raise CodeVersionUnknown(f"git in {root} failed ({stderr.strip() or err}): cannot tell which code runs; "
                                 f"fix the checkout or set NIGHTSHIFT_GIT_COMMIT") from err
    except (OSError, subprocess.SubprocessError) as err:
        raise CodeVersionUnknown(f"git in {root} could not run ({err}): cannot tell which code runs; install git "
                                 f"or set NIGHTSHIFT_GIT_COMMIT") from err
    if not head:
        raise CodeVersionUnknown(f"git in {root} printed no HEAD commit; set NIGHTSHIFT_GIT_COMMIT")
    if not diff and not untracked:
        return head
    digest = hashlib.sha256(diff)
    for name in untracked:
        path = root / name.decode(errors="surrogateescape")
        digest.update(b"\0" + name + b"\0")
        if path.is_file() and not path.is_symlink():
            digest.update(path.read_bytes())
    return f"{head}+dirty.{digest.hexdigest()[:12]}"


# The fields of a fingerprint that must all match the last success for training to be skipped.
FINGERPRINT_KEYS = ("dataset_version", "code_version", "training", "declaration")


def declaration_digest(declaration: dict[str, Any]) -> str:
    """A stable hash of the training-relevant part of a pipeline declaration (plain JSON values)."""
    text = json.dumps(declaration, sort_keys=True, separators=(",", ":"), default=str)
    return f"decl.{hashlib.sha256(text.encode()).hexdigest()[:16]}"


def fingerprint(dataset_hash: str, params: dict[str, Any], bundle_version: str | None = None,
                declaration: dict[str, Any] | None = None) -> dict[str, Any]:
    """What a training run depends on: the dataset version, the code (`code_version(bundle_version)`: a run
    pinned to a DAG bundle's commit needs no git here), the training parameters and the declaration's task,
    dataset loader and options (label, features) and model (`declaration_digest`; None when not given)."""
    training = {k: params.get(k) for k in ("epochs", "learning_rate", "batch_size", "workers")}
    # Elastic training (min/max workers) trains another way (nightshift.train.elastic): counted when set only, so
    # a fixed-size run's fingerprint stays what it was. An elastic run ignores `workers` (it starts max_workers):
    # then `workers` is not counted, so changing it alone retrains nothing.
    elastic = {k: params[k] for k in ("min_workers", "max_workers") if params.get(k) is not None}
    if elastic:
        training.pop("workers")
    training.update(elastic)
    return {"dataset_version": dataset_hash, "code_version": code_version(bundle_version), "training": training,
            "declaration": declaration_digest(declaration) if declaration is not None else None}


def unchanged_since(previous: dict[str, Any] | None, current: dict[str, Any]) -> bool:
    if not previous:
        return False
    return all(previous.get(key) == current.get(key) for key in FINGERPRINT_KEYS)
