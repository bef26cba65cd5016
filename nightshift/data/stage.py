"""Stage validated data as a DVC version, push it to the DVC remote and materialise it in a workspace.

Where things live:
- The staging DVC project is `NIGHTSHIFT_HOME/dvc/` (`dvc init --no-scm`), shared by every run on the
  machine: its cache holds each dataset version once.
- Its remote is `settings.dvc_remote()` (`NIGHTSHIFT_DVC_REMOTE`, default `NIGHTSHIFT_HOME/dvc-remote`),
  applied each time the project is opened. Versions name it redacted (no credentials).
- A version is DVC's content hash of the dataset directory (the `.dir` md5 of its file listing).
  `versions/<hash>.json` in the project records it.
- The workspace gets `DIR/data/` (links into the cache: reflink, else hardlink, else symlink; never a
  copy) plus `DIR/data.dvc` and `DIR/dataset.json` naming the exact version.

Staging holds an exclusive file lock on the project from the first look at the data to the end, so
concurrent stagings cannot interleave their cache, remote or workspace writes. Under the lock it checks the
layout again (and, given `roots`, confines the data source to them again: the DAG's gate ran earlier), then
opens each split once: the name is stat-ed, resolved, opened with O_NOFOLLOW|O_NONBLOCK and the descriptor
must be a regular file with the inode and device just checked (a FIFO, a device or a file swapped in is
refused without being read). Everything after reads through those descriptors:

- Each file is hashed (SHA-256 for the gate's fingerprint, md5 for DVC) through its descriptor.
- When every md5 is already an object in the DVC cache and no file changed while it was hashed, nothing is
  copied: the version is built from those md5s and the cache objects (exactly the bytes hashed) are what is
  validated (unless a gate passed on the same fingerprint), pushed and materialised. Staging unchanged data
  into a new workspace (every DAG run) thus needs no free space and reads the data once.
- Otherwise the files are copied from the same descriptors into a private directory
  (`NIGHTSHIFT_HOME/dvc-snapshots/`, same filesystem as the cache), hashed again while copying; a copy
  whose digests differ from the first pass, or a source whose stats changed, is refused (a mix of old and
  new files). Validation reads the copy, DVC hashes it and each md5 must equal the one taken while copying;
  the copy becomes the cache object (hardlink where possible) and its directory is removed.

So what is versioned is exactly the bytes that were validated (by the suite here, or by a gate whose
fingerprint, taken over the bytes it parsed, equals the one hashed here). Invalid data never gets a version.

A version is recorded (`versions/<hash>.json`, the workspace's `dataset.json` and staging record) only
after the remote holds every object of it: a push DVC reports any failure of (a full, read-only or
unreachable remote) fails the staging with DatasetPushFailed naming the remote and the reason. DVC takes a
`.dir` object on the remote as proof of every file it lists, so after the push each object is looked up on
the remote; any that is missing is pushed again, and DatasetPushFailed is raised if one still is.

Re-staging unchanged data into the same workspace: each staging leaves `DIR/.staged.json`, a record of
what it staged (each source file's size, mtime_ns, ctime_ns, inode and device; each workspace link and
the cache object behind it; the suite's fingerprint, a hash of the remote URL, the project and the version).
When all of that still holds (source stats taken under the lock), staging answers with the recorded version
before DVC is imported or the suite run (a few stat calls). DVC stays the source of truth: any difference
(a file touched or replaced, a cache object or workspace link gone, another remote, project or suite) takes
the full path, which validates, versions, pushes, checks out and writes a new record. The record trusts that
the remote still holds what was pushed to it.
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import logging
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, redirect_stdout
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypedDict

import yaml

from nightshift import settings
from nightshift.data.files import chunks, not_regular, open_regular
from nightshift.data.validate import (
    SUITE,
    ValidationReport,
    fingerprint_of,
    suite_fingerprint,
    validate_data,
)
from nightshift.datasets import SPLITS, split_path
from nightshift.errors import DataError, DatasetPushFailed, DataValidationFailed, UsageError
from nightshift.fsutil import atomic_write_json
from nightshift.redaction import redact

log = logging.getLogger(__name__)

REMOTE_NAME = "nightshift"
CACHE_TYPES = "reflink,hardlink,symlink"
RECORD = ".staged.json"
RECORD_FORMAT = 2
SNAPSHOTS = "dvc-snapshots"
COPY_CHUNK = 1 << 20
# The logger DVC reports each object it failed to push to (with the exception) and carries on.
DVC_TRANSFER_LOGGER = "dvc_data.hashfile.transfer"


class DatasetVersion(TypedDict):
    """What `nightshift stage` prints; travels with the run into the trainer, MLflow and the registry."""

    hash: str
    rows: int
    splits: dict[str, int]
    path: str
    size: int
    nfiles: int
    git_rev: str | None
    remote: str  # redacted: the URL without user, password or secret query parameters
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


def _remote_id() -> str:
    """Tells remotes apart in the staging record without keeping the URL's credentials."""
    return f"sha256:{hashlib.sha256(settings.dvc_remote().encode()).hexdigest()}"


def check_layout(data: Path) -> None:
    """DataError unless `data` is a directory holding exactly the splits, each a regular file (the gate checks
    it too, so a folder staging would refuse never passes the gate)."""
    if not data.is_dir():
        raise DataError(f"{data} is not a directory; `nightshift stage` takes a dataset directory holding "
                        f"{', '.join(s + '.parquet' for s in SPLITS)}")
    missing = []
    for split in SPLITS:
        path = split_path(data, split)
        try:
            mode = os.stat(path).st_mode
        except FileNotFoundError:
            missing.append(path.name)
            continue
        except OSError as err:  # a link loop, a name too long, a directory without search permission
            raise DataError(f"{path} cannot be read ({err.strerror or err}); nothing was staged: make it the "
                            f"Parquet file itself and stage again") from err
        if not stat.S_ISREG(mode):
            raise not_regular(path, mode)
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


def _version(repo: Any, data: Path, *, expected: Mapping[str, str] | None = None) -> tuple[Any, Any, Any]:
    """Hash `data` with DVC (reusing the state DB) and add any new objects to the cache.

    `expected`: each file's md5 as read when it was validated; a file DVC hashes to anything else is refused
    before anything enters the cache.
    """
    from dvc_data.hashfile.build import build
    from dvc_data.hashfile.transfer import transfer
    from dvc_objects.fs.local import LocalFileSystem

    cache = repo.cache.local
    staging, meta, built = build(cache, str(data), LocalFileSystem(), "md5", ignore=None)
    tree: Any = built  # a directory builds a Tree
    if expected is not None:
        hashed = {"/".join(key): oid.value for key, _, oid in tree}
        for name in sorted(set(hashed) | set(expected)):
            if hashed.get(name) != expected.get(name):
                raise DataError(f"{name} changed between validation and hashing (DVC read md5 {hashed.get(name)}, "
                                f"validation read {expected.get(name)}); nothing was versioned: something writes "
                                f"into {data.parent}, stop it and stage again")
    # Objects already in the cache are skipped: unchanged data copies nothing. New ones are the private
    # copy itself (hardlinked where the filesystem allows), not a second copy of it.
    transfer(staging, cache, {tree.hash_info}, hardlink=True, shallow=False)
    return meta, tree, cache


def _cached_version(cache: Any, hashed: Mapping[str, Hashed]) -> tuple[Any, Any]:
    """The version of files whose objects are all in `cache` already, from their md5s (nothing read again);
    the `.dir` object is added to the cache when missing. The same hash `_version` would give."""
    from dvc_data.hashfile.db import add_update_tree
    from dvc_data.hashfile.hash_info import HashInfo
    from dvc_data.hashfile.meta import Meta
    from dvc_data.hashfile.tree import Tree

    tree = Tree()
    for name, digests in sorted(hashed.items()):
        tree.add((name,), Meta(size=digests.size), HashInfo("md5", digests.md5))
    tree.digest()
    tree = add_update_tree(cache, tree)
    meta = Meta(size=sum(d.size for d in hashed.values()), nfiles=len(hashed), isdir=True)
    return meta, tree


def _materialise(repo: Any, tree: Any, cache: Any, target: Path) -> None:
    from dvc_data.hashfile.checkout import checkout
    from dvc_objects.fs.local import LocalFileSystem

    checkout(str(target), LocalFileSystem(), tree, cache, force=True, relink=False, state=repo.state)


# ---- the sources, opened once under the lock ----------------------------------------------------------------

@dataclass(frozen=True)
class Source:
    """One split of the dataset directory, open: `path` is its name there, `fd` the file it named when checked."""

    name: str
    path: Path
    fd: int
    checked: os.stat_result


@dataclass(frozen=True)
class Hashed:
    """What one pass over a file read: its SHA-256 digest, md5 hex and size."""

    sha256: bytes
    md5: str
    size: int


@dataclass(frozen=True)
class Sources:
    """The splits of `data`, open; `before`: their stats when opened (what the staging record compares)."""

    data: Path
    files: dict[str, Source]
    before: dict[str, dict[str, int]]

    def changed(self) -> list[str]:
        """The names whose file (by descriptor or by name) no longer has its `before` stats, or that appeared."""
        now = _source_stats(self.data)
        names = set(self.before) | set(now or {})
        changed = {name for name in names if now is None or now.get(name) != self.before.get(name)}
        for name, source in self.files.items():
            if _stat_dict(os.fstat(source.fd)) != self.before[name]:
                changed.add(name)
        return sorted(changed)


def _resolve(path: str | Path) -> Path:
    try:
        return Path(path).resolve()
    except (RuntimeError, OSError) as err:  # Python 3.11 raises RuntimeError for a symlink loop
        raise DataError(f"{path} cannot be resolved ({err}); nothing was staged: remove the link loop and "
                        f"stage again") from err


@contextmanager
def _open_sources(data: Path, roots: Sequence[str | Path] | None) -> Iterator[Sources]:
    """Each split of `data` opened for reading, judged by what was opened. Call under `project_lock`.

    `roots`: the data roots the source must lie in (every file, links resolved), checked again here. Each
    split is stat-ed, resolved (and confined), then its target opened with O_NOFOLLOW|O_NONBLOCK; the
    descriptor must be a regular file with the inode and device stat-ed, so a name swapped between the
    checks and the open is refused, and a FIFO or device is never read.
    """
    from nightshift.settings import confined_data_source

    if roots is not None:
        confined = confined_data_source(data, roots)
        if confined != data:
            raise UsageError(f"{data} now resolves to {confined}: a directory on its path was relinked since "
                             f"it was checked; nothing was staged: stage the data source again")
    check_layout(data)
    files: dict[str, Source] = {}
    try:
        for split in SPLITS:
            entry = split_path(data, split)
            try:
                checked = os.stat(entry)
            except OSError as err:
                raise DataError(f"{entry} cannot be read ({err.strerror or err}); nothing was staged: make it "
                                f"the Parquet file itself and stage again") from err
            if not stat.S_ISREG(checked.st_mode):
                raise not_regular(entry, checked.st_mode)
            target = _resolve(entry)
            if roots is not None:
                try:
                    confined_data_source(target, roots)
                except UsageError as err:
                    raise UsageError(f"{entry} now links to {target}: {err}") from err
            fd = open_regular(target, follow=False, expect=checked)
            files[entry.name] = Source(entry.name, entry, fd, checked)
        yield Sources(data, files, {name: _stat_dict(source.checked) for name, source in files.items()})
    finally:
        for source in files.values():
            os.close(source.fd)


def _hash(source: Source) -> Hashed:
    sha256, md5, size = hashlib.sha256(), hashlib.md5(usedforsecurity=False), 0
    try:
        for chunk in chunks(source.fd, COPY_CHUNK):
            sha256.update(chunk)
            md5.update(chunk)
            size += len(chunk)
    except OSError as err:
        raise DataError(f"could not read {source.path} to stage it: {err.strerror or err}; make it readable "
                        f"and stage again") from err
    return Hashed(sha256.digest(), md5.hexdigest(), size)


# ---- the private copy: when something is new, validate and hash the same bytes -----------------------------

@dataclass(frozen=True)
class Snapshot:
    """A private copy of a dataset directory, with each file's md5 taken while copying it."""

    path: Path
    md5: dict[str, str]


def snapshots_dir() -> Path:
    """Where private copies live: next to the project, so they can become cache objects by hardlink."""
    return project_dir().parent / SNAPSHOTS


def _copy_hashing(source: Source, target: Path) -> tuple[bytes, str]:
    """Copy the open `source` to the new file `target`; the SHA-256 digest and md5 hex of the bytes copied."""
    sha256, md5 = hashlib.sha256(), hashlib.md5(usedforsecurity=False)
    with target.open("xb") as writer:
        for chunk in chunks(source.fd, COPY_CHUNK):
            sha256.update(chunk)
            md5.update(chunk)
            writer.write(chunk)
    return sha256.digest(), md5.hexdigest()


@contextmanager
def _private_dir() -> Iterator[Path]:
    """A new directory under `snapshots_dir()` (mode 0700), removed on leaving. Call under `project_lock`."""
    root = snapshots_dir()
    if root.is_dir():
        for leftover in root.iterdir():  # from a staging that was killed; the lock says no one uses them
            shutil.rmtree(leftover) if leftover.is_dir() and not leftover.is_symlink() else leftover.unlink()
    root.mkdir(parents=True, exist_ok=True)
    path = Path(tempfile.mkdtemp(prefix="snapshot-", dir=root))
    try:
        yield path
    finally:
        # Best effort: a copy left behind (only if removing fails) is removed by the next staging.
        shutil.rmtree(path, ignore_errors=True)


@contextmanager
def _snapshot(sources: Sources, hashed: Mapping[str, Hashed]) -> Iterator[Snapshot]:
    """A private copy of `sources`, read through their descriptors; removed on leaving. Call under `project_lock`.

    Raises DataError when a file's copy differs from `hashed` (what the first pass read) or a file changed
    while it was copied (the copy could mix old and new files).
    """
    with _private_dir() as path:
        md5: dict[str, str] = {}
        differ: list[str] = []
        for name, source in sorted(sources.files.items()):
            try:
                sha256, md5[name] = _copy_hashing(source, path / name)
            except OSError as err:
                raise DataError(f"could not copy {source.path} into {path.parent} to stage it: "
                                f"{err.strerror or err}; make it readable / free space under "
                                f"{path.parent.parent} and stage again") from err
            if (sha256, md5[name]) != (hashed[name].sha256, hashed[name].md5):
                differ.append(name)
        changed = sorted({*differ, *sources.changed()})
        if changed:
            raise DataError(f"{sources.data} changed while it was being staged ({', '.join(changed)}); nothing "
                            f"was versioned: stage it again once whatever writes it has finished")
        yield Snapshot(path, md5)


def _validate_copy(copy: Path, data: Path, suite_file: str | Path | None = None) -> dict[str, int]:
    """Rows per split of the private copy `copy` of `data`, validated (with `suite_file`, else gx/'s suite);
    errors name `data`, not the copy."""
    try:
        report: ValidationReport = validate_data(copy, suite_file=suite_file)
    except (DataError, DataValidationFailed) as err:
        raise type(err)(str(err).replace(str(copy), str(data))) from err
    return {Path(f["path"]).stem: f["rows"] for f in report["files"]}


def _validate_objects(objects: Mapping[str, Path], data: Path, suite_file: str | Path | None = None) -> dict[str, int]:
    """Rows per split of the cache objects `objects` (split file name: object), validated under the split
    names (a directory of links to them); errors name `data`."""
    with _private_dir() as view:
        for name, path in objects.items():
            (view / name).symlink_to(path)
        return _validate_copy(view, data, suite_file)


def _parquet_rows(file: Path) -> int:
    import pyarrow.parquet as pq

    return int(pq.ParquetFile(file).metadata.num_rows)


def _check_workspace(data: Path, workspace: str | Path) -> Path:
    resolved = Path(workspace).resolve()
    if resolved == data or data in resolved.parents or resolved in data.parents:
        raise UsageError(f"--workspace {resolved} must not overlap the data directory {data}")
    return resolved


def stage_dataset(path: str | Path, workspace: str | Path, *, validated: str | None = None,
                  roots: Sequence[str | Path] | None = None, suite_file: str | Path | None = None) -> DatasetVersion:
    """Validate `path`, version it with DVC, push it and materialise it in `workspace/data`.

    `validated`: the fingerprint (`validate.fingerprint`) of a gate that passed on this data. When the
    bytes staging reads and the suite still have that fingerprint the suite is not run again; when anything
    changed since, the data is validated as if no gate had run: with `suite_file` (the pipeline's suite, the
    one its gate ran), else gx/'s suite.

    `roots`: data roots the source must lie in, every file with its links resolved (as
    `settings.confined_data_source`), checked again under the lock: UsageError naming the file otherwise.

    Staging the same unchanged files into the same workspace again returns the recorded version without
    validating or opening DVC (see the module's docstring: the staging record).

    Returns the dataset version (hash, rows, path, git rev...). Raises DataValidationFailed or
    DataError before anything is versioned when the data is invalid, unreadable, not a regular file or
    changes while it is read, and DatasetPushFailed when the remote does not take all of it.
    """
    data = _resolve(path)
    check_layout(data)  # early, for a one-line answer before waiting for the lock; again under it
    workspace = _check_workspace(data, workspace)
    with project_lock(), _open_sources(data, roots) as sources:
        unchanged = restaged(data, workspace, sources.before, _suite(suite_file))
        if unchanged is not None:
            log.info("%s is unchanged since it was staged into %s as %s: DVC not opened", data, workspace,
                     unchanged["hash"])
            return unchanged
        return _stage(sources, workspace, validated=validated, suite_file=suite_file)


def version_validated(data: Path, workspace: str | Path, splits: dict[str, int], *,
                      before: dict[str, dict[str, int]] | None = None) -> DatasetVersion:
    """The DVC half of staging, for data the caller has just validated: version, push, materialise.

    `before`: the source files' stats taken before they were validated (`_source_stats`); staging refuses
    files that no longer have them. Unchanged data already staged into `workspace` returns its recorded
    version without opening DVC. The rows are the caller's: `stage_dataset` is what guarantees that what is
    versioned is the validated bytes.
    """
    workspace = _check_workspace(data, workspace)
    with project_lock(), _open_sources(data, None) as opened:
        sources = opened if before is None else dataclasses.replace(opened, before=before)
        unchanged = restaged(data, workspace, sources.before)
        if unchanged is not None:
            return unchanged
        return _stage(sources, workspace, splits=splits)


def _stage(sources: Sources, workspace: Path, *, validated: str | None = None,
           splits: dict[str, int] | None = None, suite_file: str | Path | None = None) -> DatasetVersion:
    """Validate (unless `splits` are given or the gate's fingerprint `validated` holds), version, push and
    materialise the open `sources`. Call under `project_lock`."""
    data = sources.data
    hashed = {name: _hash(source) for name, source in sorted(sources.files.items())}
    trusted = splits is not None
    if validated is not None:
        trusted = validated == fingerprint_of({name: h.sha256 for name, h in hashed.items()}, _suite(suite_file))
        if trusted:
            log.info("%s passed the gate with fingerprint %s: not validated again", data, validated)
        else:
            log.warning("%s changed since it passed the gate (fingerprint differs): validating again", data)

    def rows(files: Mapping[str, Path], validate: Callable[[], dict[str, int]]) -> dict[str, int]:
        if splits is not None:
            return splits
        return {Path(name).stem: _parquet_rows(path) for name, path in files.items()} if trusted else validate()

    # DVC writes progress and notices to stdout, which carries the command's JSON result.
    with redirect_stdout(sys.stderr), _open_project() as repo:
        cache = repo.cache.local
        objects = {name: Path(cache.oid_to_path(h.md5)) for name, h in hashed.items()}
        if all(path.is_file() for path in objects.values()) and not sources.changed():
            # The bytes hashed are cache objects already: validate and version those, copy nothing.
            log.info("%s: every file is in the DVC cache already; nothing copied", data)
            found = rows(objects, lambda: _validate_objects(objects, data, suite_file))
            meta, tree = _cached_version(cache, hashed)
        else:
            with _snapshot(sources, hashed) as copy:
                copies = {name: copy.path / name for name in copy.md5}
                found = rows(copies, lambda: _validate_copy(copy.path, data, suite_file))
                meta, tree, cache = _version(repo, copy.path, expected=copy.md5)
        return _record(repo, sources, workspace, found, meta, tree, cache, _suite(suite_file))


def _reason(err: BaseException) -> str:
    """The first line of what `err` says, else its type's name (asyncio timeouts carry no message)."""
    if isinstance(err, OSError) and err.strerror:
        return err.strerror
    lines = str(err).strip().splitlines()
    return lines[0] if lines else type(err).__name__


def _transfer(repo: Any, tree: Any, send: Callable[[], Any], total: int) -> None:
    """Run `send` (a DVC push of `total` objects of `tree`); DatasetPushFailed unless DVC reports none failed."""
    reasons: list[str] = []
    litter: list[Path] = []
    url = settings.dvc_remote()
    local = Path(url).resolve() if "://" not in url else None

    class Collect(logging.Handler):
        """What DVC logs of each object it failed to push: the reason, and the temporary file it left."""

        def emit(self, record: logging.LogRecord) -> None:
            err = record.exc_info[1] if record.exc_info else None
            if isinstance(err, OSError):
                reasons.append(_reason(err))
                left = Path(str(err.filename2)) if err.filename2 else None
                if local and left and left.name.startswith(".") and left.name.endswith(".tmp") \
                        and left.is_relative_to(local):
                    litter.append(left)
            elif err is not None:
                reasons.append(_reason(err))

    remote = redact(url)
    handler = Collect(logging.ERROR)
    transfer_log = logging.getLogger(DVC_TRANSFER_LOGGER)
    transfer_log.addHandler(handler)
    try:
        result = send()
    except Exception as err:  # DVC raises OSError, DvcException and its fs's own errors alike
        raise DatasetPushFailed(f"pushing dataset {tree.hash_info.value} to the DVC remote {remote} failed: "
                                f"{redact(_reason(err))}; nothing was versioned: fix the remote "
                                f"(NIGHTSHIFT_DVC_REMOTE) and stage again") from err
    finally:
        transfer_log.removeHandler(handler)
    if result.failed:
        # DVC copies into a temporary file and renames it; a copy that failed half way leaves the part it
        # wrote, which would keep a full remote full. These names are this push's own.
        for path in litter:
            try:
                path.unlink(missing_ok=True)
            except OSError as err:
                reasons.append(f"its partial file {path} could not be removed either ({err.strerror})")
        why = "; ".join(sorted(set(reasons))) or "DVC reported the objects as failed"
        raise DatasetPushFailed(f"the DVC remote {remote} did not take {len(result.failed)} of {total} "
                                f"objects of dataset {tree.hash_info.value}: {redact(why)}; nothing was versioned: "
                                f"give the remote room or write access (NIGHTSHIFT_DVC_REMOTE) and stage again")


def _push(repo: Any, tree: Any) -> None:
    """Push the tree object and every file it lists; DatasetPushFailed unless the remote holds them all."""
    from dvc_data.hashfile.db import get_index

    objects = {tree.hash_info, *(oid for _, _, oid in tree)}
    names = {oid.value: "/".join(key) for key, _, oid in tree}
    remote = redact(settings.dvc_remote())
    # The remote skips objects it already holds.
    _transfer(repo, tree, lambda: repo.cloud.push(objects, remote=REMOTE_NAME), len(objects))

    def missing() -> list[Any]:
        try:
            odb = repo.cloud.get_remote_odb(REMOTE_NAME, "push")
            present = set(odb.oids_exist([oid.value for oid in objects]))
        except Exception as err:  # the remote's own errors: a listing that fails is no proof
            raise DatasetPushFailed(f"could not check that the DVC remote {remote} holds dataset "
                                    f"{tree.hash_info.value}: {redact(_reason(err))}; nothing was versioned: fix "
                                    f"the remote (NIGHTSHIFT_DVC_REMOTE) and stage again") from err
        return sorted((oid for oid in objects if oid.value not in present), key=lambda oid: oid.value)

    # DVC's push takes a `.dir` object on the remote (or in its index of the remote) as proof of every file
    # it lists; a remote that lost a file object keeps it. Look each object up, send what is missing directly.
    lacking = missing()
    if lacking:
        log.warning("the DVC remote %s lacks %s of dataset %s although DVC's push found nothing to send: "
                    "pushing them again", remote, ", ".join(names.get(o.value, o.value) for o in lacking),
                    tree.hash_info.value)
        odb = repo.cloud.get_remote_odb(REMOTE_NAME, "push")
        get_index(odb).clear()  # it vouches for the lost objects
        _transfer(repo, tree, lambda: repo.cloud.transfer(repo.cache.local, odb, set(lacking)), len(lacking))
        lacking = missing()
    if lacking:
        raise DatasetPushFailed(f"the DVC remote {remote} still lacks {len(lacking)} of {len(objects)} objects "
                                f"of dataset {tree.hash_info.value} after pushing them again "
                                f"({', '.join(names.get(o.value, o.value) for o in lacking)}); nothing was "
                                f"versioned: check the remote (NIGHTSHIFT_DVC_REMOTE) and stage again")


def _suite(suite_file: str | Path | None) -> str | Path:
    """What the suite part of a fingerprint or staging record is of: the suite file given (the one the
    pipeline's gate ran, as it is now), else gx/'s suite."""
    return SUITE if suite_file is None else Path(suite_file)


def _record(repo: Any, sources: Sources, workspace: Path, splits: dict[str, int], meta: Any, tree: Any,
            cache: Any, suite: str | Path = SUITE) -> DatasetVersion:
    """Push and materialise the version `tree` of `sources`, then record it. Call under `project_lock`."""
    data = sources.data
    workspace.mkdir(parents=True, exist_ok=True)
    (workspace / RECORD).unlink(missing_ok=True)  # from here on it would not describe the workspace
    _push(repo, tree)
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
        remote=redact(settings.dvc_remote()),
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
    if not sources.changed():
        _write_record(data, workspace, sources.before, version, tree, cache, suite)
    else:
        log.warning("%s changed after it was read for staging: version %s holds the bytes validated before the "
                    "change; no staging record, the next staging takes the full path", data, digest)
    return version


# ---- the staging record: "unchanged" without DVC --------------------------------------------------------

def _stat_dict(st: os.stat_result) -> dict[str, int]:
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns, "ino": st.st_ino,
            "dev": st.st_dev}


def _stat(path: Path) -> dict[str, int]:
    return _stat_dict(path.stat())


def _source_stats(data: Path) -> dict[str, dict[str, int]] | None:
    """Each file of the dataset directory by name: size, mtime_ns, ctime_ns, inode, device (links followed);
    None when one cannot be stat-ed (it vanished, or became a broken link or a loop)."""
    try:
        return {file.name: _stat(file) for file in sorted(data.iterdir())}
    except OSError:
        return None


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
                  tree: Any, cache: Any, suite: str | Path = SUITE) -> None:
    objects = {"/".join(key): cache.oid_to_path(oid.value) for key, _, oid in tree}
    target = workspace / "data"
    record = {
        "format": RECORD_FORMAT,
        "source": str(data),
        "workspace": str(workspace),
        "project": str(project_dir()),
        "remote": _remote_id(),
        "suite": suite_fingerprint(suite),
        "sources": sources,
        "links": {name: _link_stats(target / name) for name in objects},
        "objects": {name: _object_stats(Path(path)) for name, path in objects.items()},
        "tree": _object_stats(Path(cache.oid_to_path(tree.hash_info.value))),
        "version": version,
    }
    atomic_write_json(workspace / RECORD, record)


def restaged(data: Path, workspace: str | Path, sources: dict[str, dict[str, int]],
             suite: str | Path = SUITE) -> DatasetVersion | None:
    """The version recorded in `workspace` when `data` (whose files have `sources` stats) is exactly what was
    staged there, under the same `suite` (gx/'s suite name, or a suite file), and everything DVC made for it
    is still in place; None when anything differs.

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
                and record["remote"] == _remote_id() and version["remote"] == redact(settings.dvc_remote())
                and record["sources"] == sources and record["suite"] == suite_fingerprint(suite)
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
