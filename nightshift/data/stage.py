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

Re-staging unchanged data into the same workspace: each staging leaves `DIR/.staged.json`, a record of
what it staged (each source file's size, mtime_ns, ctime_ns, inode and device; each workspace link and
the cache object behind it; the suite's fingerprint, the remote, the project and the version). When all of
that still holds, staging answers with the recorded version before DVC is imported or the suite run (a
few stat calls). DVC stays the source of truth: any difference (a file touched or replaced, a cache
object or workspace link gone, another remote, project or suite) takes the full path, which validates,
versions, pushes, checks out and writes a new record. The record trusts that the remote still holds
what was pushed to it.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager, redirect_stdout
from pathlib import Path
from typing import Any, TypedDict

import yaml

from nightshift import settings
from nightshift.data.validate import (
    ValidationReport,
    fingerprint,
    parquet_files,
    suite_fingerprint,
    validate_data,
)
from nightshift.datasets import SPLITS, split_path
from nightshift.errors import DataError, UsageError
from nightshift.fsutil import atomic_write_json

log = logging.getLogger(__name__)

REMOTE_NAME = "nightshift"
CACHE_TYPES = "reflink,hardlink,symlink"
RECORD = ".staged.json"
RECORD_FORMAT = 1


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

    Staging the same unchanged files into the same workspace again returns the recorded version without
    validating or opening DVC (see the module's docstring: the staging record).

    Returns the dataset version (hash, rows, path, git rev...). Raises DataValidationFailed or
    DataError before anything is versioned when the data is invalid or unreadable.
    """
    data = Path(path).resolve()
    _check_layout(data)
    before = _source_stats(data)  # before anything reads the files: a change while staging voids the record
    with project_lock():
        unchanged = restaged(data, workspace, before)
    if unchanged is not None:
        log.info("%s is unchanged since it was staged into %s as %s: DVC not opened", data, workspace,
                 unchanged["hash"])
        return unchanged
    if validated is not None and validated == fingerprint(data):
        log.info("%s passed the gate with fingerprint %s: not validated again", data, validated)
        splits = {file.stem: _parquet_rows(file) for file in parquet_files(data)}
    else:
        if validated is not None:
            log.warning("%s changed since it passed the gate (fingerprint differs): validating again", data)
        report: ValidationReport = validate_data(data)
        splits = {Path(f["path"]).stem: f["rows"] for f in report["files"]}
    return version_validated(data, workspace, splits, before=before)


def _parquet_rows(file: Path) -> int:
    import pyarrow.parquet as pq

    return int(pq.ParquetFile(file).metadata.num_rows)


def version_validated(data: Path, workspace: str | Path, splits: dict[str, int], *,
                      before: dict[str, dict[str, int]] | None = None) -> DatasetVersion:
    """The DVC half of staging, for data `stage_dataset` has just validated: version, push, materialise.

    `before`: the source files' stats taken before they were validated (`_source_stats`); the staging
    record is written only when the files still have them at the end. Unchanged data already staged into
    `workspace` returns its recorded version without opening DVC.
    """
    workspace = Path(workspace).resolve()
    if workspace == data or data in workspace.parents or workspace in data.parents:
        raise UsageError(f"--workspace {workspace} must not overlap the data directory {data}")
    before = before if before is not None else _source_stats(data)
    with project_lock():
        unchanged = restaged(data, workspace, before)
        if unchanged is not None:
            return unchanged
        workspace.mkdir(parents=True, exist_ok=True)
        (workspace / RECORD).unlink(missing_ok=True)  # from here on it would not describe the workspace

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
        if _source_stats(data) == before:
            _write_record(data, workspace, before, version, tree, cache)
        else:
            log.warning("%s changed while it was being staged: no staging record, the next staging takes "
                        "the full path", data)
    return version


# ---- the staging record: "unchanged" without DVC --------------------------------------------------------

def _stat(path: Path) -> dict[str, int]:
    st = path.stat()
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns, "ino": st.st_ino,
            "dev": st.st_dev}


def _source_stats(data: Path) -> dict[str, dict[str, int]]:
    """Each file of the dataset directory by name: size, mtime_ns, ctime_ns, inode, device."""
    return {file.name: _stat(file) for file in sorted(data.iterdir())}


def _link_stats(link: Path) -> dict[str, Any]:
    """What a workspace file is: a symlink (its target) or a hardlink/reflink/copy (its inode and times)."""
    if link.is_symlink():
        return {"symlink": os.readlink(link)}
    st = _stat(link)
    return {"size": st["size"], "mtime_ns": st["mtime_ns"], "ino": st["ino"], "dev": st["dev"]}


def _object_stats(path: Path) -> dict[str, Any]:
    """A cache object: its path, and the size, mtime and inode it had (not ctime: linking it elsewhere
    changes that)."""
    st = _stat(path)
    return {"path": str(path), "size": st["size"], "mtime_ns": st["mtime_ns"], "ino": st["ino"]}


def _write_record(data: Path, workspace: Path, sources: dict[str, dict[str, int]], version: DatasetVersion,
                  tree: Any, cache: Any) -> None:
    objects = {"/".join(key): cache.oid_to_path(oid.value) for key, _, oid in tree}
    target = workspace / "data"
    record = {
        "format": RECORD_FORMAT,
        "source": str(data),
        "workspace": str(workspace),
        "project": str(project_dir()),
        "remote": settings.dvc_remote(),
        "suite": suite_fingerprint(),
        "sources": sources,
        "links": {name: _link_stats(target / name) for name in objects},
        "objects": {name: _object_stats(Path(path)) for name, path in objects.items()},
        "tree": _object_stats(Path(cache.oid_to_path(tree.hash_info.value))),
        "version": version,
    }
    atomic_write_json(workspace / RECORD, record)


def restaged(data: Path, workspace: str | Path, sources: dict[str, dict[str, int]]) -> DatasetVersion | None:
    """The version recorded in `workspace` when `data` (whose files have `sources` stats) is exactly what was
    staged there and everything DVC made for it is still in place; None when anything differs.

    Reads two small JSON files, stats a few files and asks git for HEAD; imports nothing of DVC or GX.
    Call under `project_lock`.
    """
    workspace = Path(workspace).resolve()
    try:
        record = json.loads((workspace / RECORD).read_text())
        version: DatasetVersion = record["version"]
        target = workspace / "data"
        if not (record.get("format") == RECORD_FORMAT and record["source"] == str(data)
                and record["workspace"] == str(workspace) and record["project"] == str(project_dir())
                and record["remote"] == settings.dvc_remote() == version["remote"]
                and record["sources"] == sources and record["suite"] == suite_fingerprint()
                and version["path"] == str(target)):
            return None
        if sorted(p.name for p in target.iterdir()) != sorted(record["links"]):
            return None
        for name, expected in record["links"].items():
            if _link_stats(target / name) != expected:
                return None
        for entry in [*record["objects"].values(), record["tree"]]:
            if _object_stats(Path(entry["path"])) != entry:
                return None
        if json.loads((workspace / "dataset.json").read_text()) != version:
            return None
        digest = version["hash"]
        if f"md5: {digest}.dir" not in (workspace / "data.dvc").read_text():
            return None
        if not (project_dir() / "versions" / f"{digest}.json").is_file():
            return None
        if git_rev(data) != version["git_rev"]:
            return None
    except (OSError, ValueError, KeyError, TypeError):
        return None  # no record, or one this code cannot read: the full path decides
    return version
