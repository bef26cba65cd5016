"""Hostile review of issue 20 items 2, 3 and 15 (a93ff58, c0d6ff8, 9a472bf, confined_data_source of 8541cdf).

Each test here failed on the commit it was written against; each names what goes wrong. Children run staging
or Airflow code where a test must hold the project lock, race a task, or import Airflow (never in-process).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest

from nightshift.data.demo import write_demo_dataset
from nightshift.data.stage import stage_dataset
from nightshift.errors import DataError, DatasetPushFailed

REPO = Path(__file__).resolve().parents[3]


def _md5(path: Path) -> str:
    return hashlib.md5(path.read_bytes()).hexdigest()


@contextmanager
def _tmpfs(where: Path, size: str) -> Iterator[Path]:
    where.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                             capture_output=True, text=True, check=False)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True, text=True, check=False)


def _env(home: Path, **extra: str) -> dict[str, str]:
    env = {**os.environ, "NIGHTSHIFT_HOME": str(home), "PYTHONPATH": f"{REPO}{os.pathsep}{REPO / 'dags'}"}
    env.pop("NIGHTSHIFT_DVC_REMOTE", None)
    env.update(extra)
    return env


STAGE_CHILD = textwrap.dedent("""
    import json, sys
    from nightshift.data.stage import stage_dataset
    try:
        version = stage_dataset(sys.argv[1], sys.argv[2])
    except Exception as err:
        print(json.dumps({"error": type(err).__name__, "message": str(err)}))
        sys.exit(1)
    print(json.dumps({"version": version}))
""")


def _waiting_on_a_lock(pid: int) -> bool:
    """Whether `pid` is blocked on a file lock (a `->` line of /proc/locks)."""
    return any("->" in line and f" {pid} " in line for line in Path("/proc/locks").read_text().splitlines())


@contextmanager
def _held_project_lock(home: Path) -> Iterator[None]:
    """Hold the staging project's lock the way another staging would (the same flock on NIGHTSHIFT_HOME/dvc.lock)."""
    import fcntl

    home.mkdir(parents=True, exist_ok=True)
    with open(home / "dvc.lock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _finish(proc: subprocess.Popen[str], timeout: float) -> tuple[int | None, str, str]:
    """The child's exit code and output, or None (and the child killed, by its PID) when it ran past `timeout`."""
    try:
        out, err = proc.communicate(timeout=timeout)
        return proc.returncode, out, err
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate(timeout=30)
        return None, out, err


# ---- a split swapped for something that is not a regular file while staging waits for the lock -------------

def _fifo(path: Path) -> None:
    path.unlink()
    os.mkfifo(path)


def _dev_zero(path: Path) -> None:
    path.unlink()
    path.symlink_to("/dev/zero")


SWAPS = {"a FIFO": _fifo, "a link to /dev/zero": _dev_zero}


@pytest.mark.parametrize("swap", list(SWAPS))
def test_a_split_swapped_for_a_non_regular_file_while_staging_waits_is_refused_at_once(
        swap: str, demo_data: Path, tmp_path: Path) -> None:
    """`check_layout` (is_file) runs before the lock; the copy opens whatever the name is once the lock is
    held. A FIFO makes staging block in open() for ever while holding the project lock (every staging on the
    machine then waits); /dev/zero is copied until the disk holding NIGHTSHIFT_HOME is full (here an 8 MiB
    tmpfs; in production the shared volume holding workspaces and checkpoints). Either must be refused as
    'not a regular file' without reading it."""
    data = tmp_path / "data"
    shutil.copytree(demo_data, data)
    with _tmpfs(tmp_path / "home", "8m") as home:
        env = _env(home, NIGHTSHIFT_DVC_REMOTE=str(tmp_path / "remote"))
        with _held_project_lock(home):
            proc = subprocess.Popen([sys.executable, "-c", STAGE_CHILD, str(data), str(tmp_path / "ws")],
                                    env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            deadline = time.monotonic() + 120
            while not _waiting_on_a_lock(proc.pid):
                assert proc.poll() is None, proc.communicate()
                assert time.monotonic() < deadline, "the staging never reached the project lock"
                time.sleep(0.05)
            SWAPS[swap](data / "train.parquet")  # after the layout check, before the copy
        code, out, err = _finish(proc, timeout=30)
        assert code is not None, f"staging hung on {swap} holding the project lock (killed after 30 s)"
        assert code == 1, out + err[-2000:]
        message = json.loads(out)["message"]
        assert "No space left" not in message, f"staging copied {swap} until the disk was full: {message}"
        assert "train.parquet" in message and "regular file" in message, message
        assert not any((home / "dvc-snapshots").glob("*/*")), "the partial copy is left behind"


# ---- item 15: a split relinked outside the data roots between the gate and the stage task ------------------

STEPS_STAGE_CHILD = textwrap.dedent("""
    import json, sys
    from nightly_tasks.steps import stage
    from nightshift.pipelines import load_pipeline
    digits = load_pipeline(sys.argv[3])
    try:
        staged = stage(digits, {"path": sys.argv[1], "fingerprint": sys.argv[2]}, "nightly_retrain",
                       "manual__faults")
    except Exception as err:
        print(json.dumps({"error": type(err).__name__, "message": str(err)}))
        sys.exit(1)
    print(json.dumps({"staged": staged}))
""")


@pytest.mark.integration
def test_a_split_relinked_outside_the_roots_after_the_gate_is_never_versioned(demo_data: Path,
                                                                              tmp_path: Path) -> None:
    """confined_data_source runs in the gate task only. `steps.stage` (a later task, possibly a retry hours
    later) passes the path on to stage_dataset, which follows whatever symlinks the directory then holds: a
    train.parquet relinked to another (valid) dataset outside the roots is read, validated, versioned and
    pushed, which is exactly what item 15 forbids."""
    from nightshift.data.validate import fingerprint
    from nightshift.settings import confined_data_source

    roots = tmp_path / "roots"
    data = roots / "incoming"
    shutil.copytree(demo_data, data)
    secret = tmp_path / "elsewhere"
    write_demo_dataset(secret, seed=7)  # valid data nobody allowed the DAG to serve
    home = tmp_path / "home"
    env = _env(home, NIGHTSHIFT_DATA_ROOTS=str(roots), NIGHTSHIFT_DVC_REMOTE=str(tmp_path / "remote"))
    os.environ["NIGHTSHIFT_DATA_ROOTS"] = str(roots)
    try:
        path = confined_data_source(str(data))  # the gate: passes
    finally:
        del os.environ["NIGHTSHIFT_DATA_ROOTS"]
    passed = fingerprint(path)
    (data / "train.parquet").unlink()
    (data / "train.parquet").symlink_to(secret / "train.parquet")  # after the gate, before the stage task
    done = subprocess.run([sys.executable, "-c", STEPS_STAGE_CHILD, str(path), passed,
                           str(REPO / "pipelines" / "digits.yaml")], env=env,
                          capture_output=True, text=True, timeout=600, check=False)
    result = json.loads(done.stdout.strip().splitlines()[-1]) if done.stdout.strip() else {"stderr": done.stderr}
    assert "staged" not in result, (f"train.parquet linked to {secret} (outside the roots) was versioned as "
                                    f"{result['staged']['hash']} and pushed")
    assert result.get("error") in {"UsageError", "DataError"} and "train.parquet" in result["message"], result
    remote = tmp_path / "remote"
    pushed = {p.name for p in remote.rglob("*") if p.is_file()} if remote.exists() else set()
    assert _md5(secret / "train.parquet")[2:] not in pushed, "the outside file reached the DVC remote"


# ---- item 3: the gate's fingerprint is not of the bytes the gate validated --------------------------------

GATE_CHILD = textwrap.dedent("""
    import json, shutil, sys
    from pathlib import Path
    from nightly_tasks.adapters import GXDataGateOperator
    import nightshift.data.validate as validate
    from nightshift.pipelines import load_pipeline

    data, good, bad = (Path(p) for p in sys.argv[1:4])
    real = validate.pd.read_parquet
    swapped = []

    def read_parquet(*args, **kwargs):
        # A writer replaces the split between the gate's fingerprint and its parse (a valid file this time).
        if not swapped:
            shutil.copyfile(good, data / "train.parquet")
            swapped.append(1)
        return real(*args, **kwargs)

    validate.pd.read_parquet = read_parquet

    class TI:
        def xcom_push(self, key, value):
            pass

    digits = load_pipeline(Path(sys.argv[5]))
    gate = GXDataGateOperator(task_id="validate_data", pipeline=digits, data_source=str(data))
    try:
        result = gate.execute({"ti": TI(), "params": {}})
    except Exception as err:  # the gate refused what it read: nothing passed
        print(json.dumps({"gate_error": type(err).__name__, "message": str(err)[:500]}))
        sys.exit(0)
    # ... and the writer puts the earlier file back (a rollback, a sync restoring its copy).
    shutil.copyfile(bad, data / "train.parquet")
    from nightshift.data.stage import stage_dataset
    try:
        version = stage_dataset(result["path"], sys.argv[4], validated=result.get("fingerprint"))
    except Exception as err:
        print(json.dumps({"gate": result, "error": type(err).__name__, "message": str(err)[:500]}))
        sys.exit(0)
    print(json.dumps({"gate": result, "version": version}))
""")


@pytest.mark.integration
def test_the_gate_fingerprint_is_of_the_bytes_the_gate_validated(demo_data: Path, tmp_path: Path) -> None:
    """GXDataGateOperator takes `fingerprint(path)` and then reads the files again to validate them. A split
    that is invalid when fingerprinted and valid when read passes the gate with the invalid bytes' fingerprint;
    if the invalid bytes are back when the stage task copies them, staging trusts the gate (same fingerprint),
    skips the suite and versions data no suite ever passed. The writer strikes when the gate first parses a
    split (pandas.read_parquet, on both the old and the read-once path); a gate that refuses the bytes it
    fingerprinted, or a staging that validates again and refuses them, are both right."""
    data = tmp_path / "roots" / "incoming"
    shutil.copytree(demo_data, data)
    good = tmp_path / "good.parquet"
    shutil.copyfile(data / "train.parquet", good)
    frame = pd.read_parquet(good)
    frame.loc[0, "pixel_0"] = np.float32(99.0)  # out of the suite's 0..16
    bad = tmp_path / "bad.parquet"
    frame.to_parquet(bad, index=False)
    shutil.copyfile(bad, data / "train.parquet")  # what the gate fingerprints
    home = tmp_path / "home"
    env = _env(home, NIGHTSHIFT_DATA_ROOTS=str(tmp_path / "roots"), NIGHTSHIFT_DVC_REMOTE=str(tmp_path / "remote"),
               AIRFLOW_HOME=str(tmp_path / "airflow-home"), AIRFLOW__CORE__LOAD_EXAMPLES="False",
               AIRFLOW__DATABASE__SQL_ALCHEMY_CONN=f"sqlite:///{tmp_path / 'airflow.db'}")
    done = subprocess.run([sys.executable, "-c", GATE_CHILD, str(data), str(good), str(bad), str(tmp_path / "ws"),
                           str(REPO / "pipelines" / "digits.yaml")],
                          env=env, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0 and done.stdout.strip(), done.stderr[-5000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    if "gate_error" in result:  # the gate validated the bytes it fingerprinted (pixel_0 = 99) and refused them
        assert result["gate_error"] == "AirflowFailException" and "train.parquet" in result["message"], result
    elif "version" in result:
        staged = Path(result["version"]["path"]) / "train.parquet"
        assert _md5(staged) != _md5(bad), (f"train.parquet with pixel_0 = 99 (never validated) was versioned as "
                                           f"{result['version']['hash']}: the gate passed other bytes")
    else:
        assert result["error"] == "DataValidationFailed", result


# ---- item 2: DVC errors that are not 'failed' sets --------------------------------------------------------

@pytest.mark.parametrize("error", [TimeoutError(), ConnectionError(), OSError()], ids=repr)
def test_a_push_raising_an_exception_without_a_message_fails_the_stage_cleanly(
        error: Exception, demo_data: Path, tmp_path: Path, nightshift_home: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """s3fs/aiohttp raise `TimeoutError()` (asyncio timeouts carry no message); `_push` takes
    `str(err).splitlines()[0]` of it, an IndexError inside the except clause: the task crashes with a
    traceback that names neither the remote nor the reason instead of DatasetPushFailed (exit 1)."""
    from dvc.data_cloud import DataCloud

    def push(self: object, *args: object, **kwargs: object) -> object:
        raise error

    monkeypatch.setattr(DataCloud, "push", push)
    workspace = tmp_path / "ws"
    with pytest.raises(DatasetPushFailed, match=r"the DVC remote|pushing dataset"):
        stage_dataset(demo_data, workspace)
    assert not (workspace / "dataset.json").exists()
    assert not list((nightshift_home / "dvc" / "versions").glob("*.json"))


# ---- item 2: a version recorded while the remote lacks one of its objects --------------------------------

def test_a_remote_missing_a_file_object_gets_it_again_before_a_version_is_recorded(
        demo_data: Path, tmp_path: Path, nightshift_home: Path) -> None:
    """DVC's status assumes a directory's files are on the remote whenever its `.dir` object is there, so
    `_push` pushes nothing and raises nothing for a remote that lost a file object (a lifecycle rule, a
    partial restore, someone's cleanup) but kept the `.dir`: the full path records a version, in a new
    workspace, that the remote cannot give back. The issue asks that a version be recorded only when the
    remote holds every object of it."""
    first = stage_dataset(demo_data, tmp_path / "ws1")
    remote = nightshift_home / "dvc-remote" / "files" / "md5"
    digest = _md5(demo_data / "train.parquet")
    lost = remote / digest[:2] / digest[2:]
    assert lost.is_file()
    lost.unlink()
    second = stage_dataset(demo_data, tmp_path / "ws2")  # a new DAG run: a new workspace, the full path
    assert second["hash"] == first["hash"]
    assert lost.is_file(), (f"version {second['hash']} was recorded in a new workspace while the remote lacks "
                            f"train.parquet ({digest})")


# ---- item 3's private copy: the disk it needs --------------------------------------------------------------

def test_restaging_unchanged_data_into_a_new_workspace_needs_no_room_for_a_second_copy(
        tmp_path: Path) -> None:
    """Every DAG run stages into a new workspace, so the staging record (same workspace) never applies there:
    each run takes the full path, which now copies the whole dataset into NIGHTSHIFT_HOME/dvc-snapshots
    before DVC finds every object already in the cache. Re-staging unchanged data thus needs as much free
    space as the dataset again (and reads it three times, under the global lock); before the change it needed
    none. Here the home holds the cache of a 17 MB dataset with 9 MB to spare: the second staging of the very
    same files fails with 'No space left on device'."""
    from nightshift.data.validate import fingerprint

    data = tmp_path / "data"
    write_demo_dataset(data, rows=60000, seed=0)
    size = sum(f.stat().st_size for f in data.iterdir())
    passed = fingerprint(data)  # as the gate does: staging trusts it, GX writes no Data Docs here
    with _tmpfs(tmp_path / "home", f"{(size + 9 * 2**20) // 1024}k") as home:
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("NIGHTSHIFT_HOME", str(home))
            patch.setenv("NIGHTSHIFT_DVC_REMOTE", str(tmp_path / "remote"))
            first = stage_dataset(data, home / "workspaces" / "run-1", validated=passed)
            second = stage_dataset(data, home / "workspaces" / "run-2", validated=passed)
    assert second["hash"] == first["hash"]


# ---- the confined_data_source walk ------------------------------------------------------------------------

def test_a_symlink_loop_under_the_data_source_is_a_usage_error(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """`entry.resolve()` raises RuntimeError('Symlink loop ...') on Python 3.11 for a link loop under the
    data source; the gate catches only UsageError, so the task fails with a traceback (and is retried)
    instead of refusing the data source in one line."""
    from nightshift.errors import UsageError
    from nightshift.settings import confined_data_source

    data = tmp_path / "roots" / "incoming"
    data.mkdir(parents=True)
    (data / "loop").symlink_to(data / "loop")
    monkeypatch.setenv("NIGHTSHIFT_DATA_ROOTS", str(tmp_path / "roots"))
    with pytest.raises(UsageError, match="loop"):
        confined_data_source(str(data))


# ---- credentials in the remote URL ------------------------------------------------------------------------

def test_the_staged_version_does_not_carry_the_remote_credentials(demo_data: Path, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Error messages redact the remote, but the DatasetVersion that stage returns (the stage_dataset task's
    XCom, shown in the Airflow UI, and written to dataset.json and versions/<hash>.json) holds
    `settings.dvc_remote()` verbatim: an http remote with basic auth puts its password there. (Pre-existing,
    not introduced by this change; a push failure message for the same remote is redacted.)"""
    from nightshift.data import stage

    monkeypatch.setenv("NIGHTSHIFT_DVC_REMOTE", "https://user:s3cr3t@dvc.example.invalid/store")
    monkeypatch.setattr(stage, "_push", lambda repo, tree: None)  # a remote that took everything
    version = stage_dataset(demo_data, tmp_path / "ws")
    assert "s3cr3t" not in json.dumps(version), version["remote"]
    assert "s3cr3t" not in (tmp_path / "ws" / "dataset.json").read_text()


# ---- attacks that found nothing (kept as regression checks; these pass) ------------------------------------

def test_push_failure_messages_hide_the_remote_credentials(demo_data: Path, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NIGHTSHIFT_DVC_REMOTE", "http://user:s3cr3t@127.0.0.1:9/store")
    with pytest.raises(DatasetPushFailed) as failed:
        stage_dataset(demo_data, tmp_path / "ws")
    assert "s3cr3t" not in str(failed.value) and "127.0.0.1:9" in str(failed.value)


def test_a_full_home_fails_the_copy_in_one_line_and_leaves_nothing(demo_data: Path, tmp_path: Path) -> None:
    data = tmp_path / "data"
    write_demo_dataset(data, rows=60000, seed=0)
    with _tmpfs(tmp_path / "home", "4m") as home:
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("NIGHTSHIFT_HOME", str(home))
            patch.setenv("NIGHTSHIFT_DVC_REMOTE", str(tmp_path / "remote"))
            with pytest.raises(DataError, match="No space left on device"):
                stage_dataset(data, tmp_path / "ws")
            assert not any((home / "dvc-snapshots").iterdir())


KILL_CHILD = textwrap.dedent("""
    import os, signal, sys
    from nightshift.data import stage
    where = sys.argv[3]
    if where == "after push":
        real = stage._push
        def push(repo, tree):
            real(repo, tree)
            os.kill(os.getpid(), signal.SIGKILL)
        stage._push = push
    else:
        real = stage._copy_hashing
        def copy(source, target):
            result = real(source, target)
            os.kill(os.getpid(), signal.SIGKILL)
        stage._copy_hashing = copy
    stage.stage_dataset(sys.argv[1], sys.argv[2])
""")


@pytest.mark.parametrize("where", ["after push", "while copying"])
def test_a_staging_killed_midway_is_recovered_by_the_next(where: str, demo_data: Path, tmp_path: Path,
                                                           nightshift_home: Path) -> None:
    workspace = tmp_path / "ws"
    done = subprocess.run([sys.executable, "-c", KILL_CHILD, str(demo_data), str(workspace), where],
                          env=_env(nightshift_home), capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == -9, done.stderr[-3000:]
    assert not (workspace / ".staged.json").exists() and not (workspace / "dataset.json").exists()
    version = stage_dataset(demo_data, workspace)
    assert not any((nightshift_home / "dvc-snapshots").iterdir())
    remote = nightshift_home / "dvc-remote" / "files" / "md5"
    for split in demo_data.iterdir():
        digest = _md5(split)
        assert (remote / digest[:2] / digest[2:]).is_file()
        assert _md5(Path(version["path"]) / split.name) == digest


# ---- checks of the fixes (each failed before them) ----------------------------------------------------------

def test_a_split_replaced_whole_while_staging_waits_for_the_lock_is_staged_as_replaced(
        demo_data: Path, tmp_path: Path) -> None:
    """A writer that swaps in a complete new file (rename over it) while staging waits for the lock is done
    before staging reads anything: the new file is staged. The stats compared at the end are taken under the
    lock; taken before it, this clean replacement was refused as 'changed while it was being staged'."""
    data = tmp_path / "data"
    shutil.copytree(demo_data, data)
    write_demo_dataset(tmp_path / "newer", seed=7)
    home = tmp_path / "home"
    with _held_project_lock(home):
        proc = subprocess.Popen([sys.executable, "-c", STAGE_CHILD, str(data), str(tmp_path / "ws")],
                                env=_env(home), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        while not _waiting_on_a_lock(proc.pid):
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.05)
        shutil.copyfile(tmp_path / "newer" / "train.parquet", data / ".train.parquet.tmp")
        os.replace(data / ".train.parquet.tmp", data / "train.parquet")
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, out + err[-3000:]
    staged = Path(json.loads(out)["version"]["path"]) / "train.parquet"
    assert _md5(staged) == _md5(tmp_path / "newer" / "train.parquet")


def test_a_split_swapped_between_its_check_and_its_open_is_refused(demo_data: Path, tmp_path: Path,
                                                                    nightshift_home: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The name is stat-ed (and confined) first and opened after: the file opened must be the one checked."""
    from nightshift.data import stage

    data = tmp_path / "data"
    shutil.copytree(demo_data, data)
    real = stage._resolve

    def resolve_then_swap(path: str | Path) -> Path:
        resolved = real(path)
        if Path(path).name == "train.parquet":  # checked, not opened yet
            shutil.copyfile(data / "test.parquet", data / ".swap")
            os.replace(data / ".swap", data / "train.parquet")
        return resolved

    monkeypatch.setattr(stage, "_resolve", resolve_then_swap)
    with pytest.raises(DataError, match=r"train\.parquet was replaced by another file"):
        stage_dataset(data, tmp_path / "ws")
    assert not (nightshift_home / "dvc" / "versions").exists()


def test_unchanged_data_staged_into_a_new_workspace_is_validated_from_the_cache_without_a_copy(
        demo_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No gate fingerprint: the suite runs, on the cache objects whose md5s were just read from the source."""
    from nightshift.data import stage

    first = stage_dataset(demo_data, tmp_path / "ws1")
    validated: list[set[str]] = []
    real = stage.validate_data

    def validate(path: Path, **kw: Any) -> object:
        validated.append({_md5(f) for f in Path(path).iterdir()})
        return real(path, **kw)

    monkeypatch.setattr(stage, "validate_data", validate)
    monkeypatch.setattr(stage, "_copy_hashing", lambda source, target: pytest.fail("copied cached data"))
    second = stage_dataset(demo_data, tmp_path / "ws2")
    assert second["hash"] == first["hash"] and second["splits"] == first["splits"]
    assert validated == [{_md5(f) for f in demo_data.iterdir()}]
    assert {_md5(f) for f in Path(second["path"]).iterdir()} == validated[0]


def test_a_remote_that_still_lacks_an_object_after_the_second_push_fails_the_stage(
        demo_data: Path, tmp_path: Path, nightshift_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from dvc.data_cloud import DataCloud
    from dvc_data.hashfile.transfer import TransferResult

    stage_dataset(demo_data, tmp_path / "ws1")
    digest = _md5(demo_data / "train.parquet")
    (nightshift_home / "dvc-remote" / "files" / "md5" / digest[:2] / digest[2:]).unlink()
    # A remote that answers every write and keeps nothing (an eventually consistent store, a broken gateway).
    monkeypatch.setattr(DataCloud, "transfer", lambda self, *args, **kwargs: TransferResult(set(), set()))
    with pytest.raises(DatasetPushFailed, match=r"still lacks 1 of 4 objects .*train\.parquet"):
        stage_dataset(demo_data, tmp_path / "ws2")
    assert not (tmp_path / "ws2" / "dataset.json").exists()
