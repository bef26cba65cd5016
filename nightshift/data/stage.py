"""Stage validated data as a DVC version, push it to the DVC remote and materialise it in a workspace.

Where things live:
- The staging DVC project is `NIGHTSHIFT_HOME/dvc/` (`dvc init --no-scm`), shared by every run on the
  machine: its cache holds each dataset version once, and its state database remembers file hashes
  by inode, size and mtime, so re-staging unchanged files neither re-hashes nor copies them.
- Its remote is `settings.dvc_remote()` (`NIGHTSHIFT_DVC_REMOTE`, default `NIGHTSHIFT_HOME/dvc-remote`),
  applied each time the project is opened.
- A version is DVC's content hash of the dataset directory (the `.dir` md5 of its file listing).
  `versions/<hash>.json` in the project records it.
- The workspace gets `DIR/data/` (links into the cache: reflink, else hardlink, else symlink; never a
  copy) plus `DIR/data.dvc` and `DIR/dataset.json` naming the exact version.

Staging validates first and holds an exclusive file lock on the project for the rest, so concurrent
stagings cannot interleave their cache, remote or workspace writes. Invalid data never gets a version.
"""

from __future__ import annotations

import fcntl
import logging
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager, redirect_stdout
from pathlib import Path
from typing import Any, TypedDict

import yaml

from nightshift import settings
from nightshift.data.validate import ValidationReport, fingerprint, parquet_files, validate_data
from nightshift.datasets import SPLITS, split_path
from nightshift.errors import DataError, UsageError
from nightshift.fsutil import atomic_write_json

log = logging.getLogger(__name__)

REMOTE_NAME = "nightshift"
CACHE_TYPES = "reflink,hardlink,symlink"


class DatasetVersion(TypedDict):
    """What `nightshift stage` prints; travels with the run into the trainer, MLflow and the registry."""

    hash: str
    rows: int
    splits: dict[str, int]
    path: str
    size: int
    nfiles: int
    git_rev: str | None
    remote: str
    source: str


def project_dir() -> Path:
    return settings.home() / "dvc"


@contextmanager
def project_lock() -> Iterator[None]:
    """Exclusive lock on the staging project, held across hash, cache, push and checkout."""
    project = project_dir()
    project.parent.mkdir(parents=True, exist_ok=True)
    with open(project.parent / "dvc.lock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _open_project() -> Any:
    """The staging DVC project (created on first use), with the remote from settings. Call under the lock."""
    settings.no_telemetry()  # DVC must not phone home
    from dvc.repo import Repo

    project = project_dir()
    if not (project / ".dvc").is_dir():
        project.mkdir(parents=True, exist_ok=True)
        Repo.init(str(project), no_scm=True).close()
        with Repo(str(project)) as repo, repo.config.edit() as config:
            config["core"]["analytics"] = False
            config["core"]["site_cache_dir"] = str(project / ".dvc" / "site")
            config["cache"]["type"] = CACHE_TYPES
    overrides = {
        "core": {"remote": REMOTE_NAME},
        "remote": {REMOTE_NAME: {"url": settings.dvc_remote()}},
    }
    return Repo(str(project), config=overrides)


def _check_layout(data: Path) -> None:
    if not data.is_dir():
        raise DataError(f"{data} is not a directory; `nightshift stage` takes a dataset directory holding "
                        f"{', '.join(s + '.parquet' for s in SPLITS)}")
    missing = [split_path(data, s).name for s in SPLITS if not split_path(data, s).is_file()]
    if missing:
        raise DataError(f"{data} lacks {', '.join(missing)}; a dataset directory holds one file per split")
    expected = {split_path(data, s).name for s in SPLITS}
    extra = sorted(p.name for p in data.iterdir() if p.name not in expected)
    if extra:
        raise DataError(f"{data} holds files other than the splits ({', '.join(extra[:5])}); "
                        f"only validated files may be versioned, move them away")


def git_rev(path: Path) -> str | None:
    """HEAD of the git repository holding `path`, if any."""
    try:
        out = subprocess.run(["git", "-C", str(path), "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=30, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def _version(repo: Any, data: Path) -> tuple[Any, Any, Any]:
    """Hash `data` with DVC (reusing the state DB) and add any new objects to the cache."""
    from dvc_data.hashfile.build import build
    from dvc_data.hashfile.transfer import transfer
    from dvc_objects.fs.local import LocalFileSystem

    cache = repo.cache.local
    staging, meta, tree = build(cache, str(data), LocalFileSystem(), "md5", ignore=None)
    # Objects already in the cache are skipped: unchanged data copies nothing.
    transfer(staging, cache, {tree.hash_info}, hardlink=False, shallow=False)
    return meta, tree, cache


def _materialise(repo: Any, tree: Any, cache: Any, target: Path) -> None:
    from dvc_data.hashfile.checkout import checkout
    from dvc_objects.fs.local import LocalFileSystem

    checkout(str(target), LocalFileSystem(), tree, cache, force=True, relink=False, state=repo.state)


def stage_dataset(path: str | Path, workspace: str | Path, *, validated: str | None = None) -> DatasetVersion:
    """Validate `path`, version it with DVC, push it and materialise it in `workspace/data`.

    `validated`: the fingerprint (`validate.fingerprint`) of a gate that passed on this data. When the
    files and the suite still have that fingerprint the suite is not run again; when anything changed
    since, the data is validated as if no gate had run.

    Returns the dataset version (hash, rows, path, git rev...). Raises DataValidationFailed or
    DataError before anything is versioned when the data is invalid or unreadable.
    """
    data = Path(path).resolve()
    _check_layout(data)
    if validated is not None and validated == fingerprint(data):
        log.info("%s passed the gate with fingerprint %s: not validated again", data, validated)
        splits = {file.stem: _parquet_rows(file) for file in parquet_files(data)}
    else:
        if validated is not None:
            log.warning("%s changed since it passed the gate (fingerprint differs): validating again", data)
        report: ValidationReport = validate_data(data)
        splits = {Path(f["path"]).stem: f["rows"] for f in report["files"]}
    return version_validated(data, workspace, splits)


def _parquet_rows(file: Path) -> int:
    import pyarrow.parquet as pq

    return int(pq.ParquetFile(file).metadata.num_rows)


def version_validated(data: Path, workspace: str | Path, splits: dict[str, int]) -> DatasetVersion:
    """The DVC half of staging, for data `stage_dataset` has just validated: version, push, materialise."""
    workspace = Path(workspace).resolve()
    if workspace == data or data in workspace.parents or workspace in data.parents:
        raise UsageError(f"--workspace {workspace} must not overlap the data directory {data}")
    workspace.mkdir(parents=True, exist_ok=True)

    # DVC writes progress and notices to stdout, which carries the command's JSON result.
    with redirect_stdout(sys.stderr), project_lock(), _open_project() as repo:
        meta, tree, cache = _version(repo, data)
        # The tree object and every file it lists; the remote skips objects it already holds.
        repo.cloud.push({tree.hash_info, *(oid for _, _, oid in tree)}, remote=REMOTE_NAME)
        target = workspace / "data"
        _materialise(repo, tree, cache, target)
        digest = tree.hash_info.value.removesuffix(".dir")
        version = DatasetVersion(
            hash=digest,
            rows=sum(splits.values()),
            splits=splits,
            path=str(target),
            size=int(meta.size or 0),
            nfiles=int(meta.nfiles or 0),
            git_rev=git_rev(data),
            remote=settings.dvc_remote(),
            source=str(data),
        )
        record = {"md5": tree.hash_info.value, "size": version["size"], "nfiles": version["nfiles"],
                  "hash": "md5", "path": "data"}
        (workspace / "data.dvc").write_text(yaml.safe_dump({"outs": [record]}, sort_keys=False))
        versions = project_dir() / "versions"
        versions.mkdir(exist_ok=True)
        if not (versions / f"{digest}.json").exists():
            atomic_write_json(versions / f"{digest}.json", {**version, "path": None})
        atomic_write_json(workspace / "dataset.json", version)
    return version
