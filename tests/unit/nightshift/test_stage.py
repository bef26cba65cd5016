"""DVC staging with a real DVC project, cache and remote in temporary directories."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest

from nightshift.data.demo import write_demo_dataset
from nightshift.data.stage import DatasetVersion, project_dir, stage_dataset
from nightshift.errors import DataError, DatasetPushFailed, DataValidationFailed

REPO = Path(__file__).resolve().parents[3]


def _store_files(home: Path) -> set[str]:
    """Every object file of the staging cache and of the remote, plus the version records."""
    roots = [home / "dvc" / ".dvc" / "cache", home / "dvc-remote", home / "dvc" / "versions"]
    return {str(p) for root in roots if root.exists() for p in root.rglob("*") if p.is_file()}


def _md5(path: Path) -> str:
    return hashlib.md5(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def staged_home(tmp_path_factory: pytest.TempPathFactory, demo_data: Path) -> tuple[Path, DatasetVersion]:
    """One NIGHTSHIFT_HOME with the demo data already staged: the baseline corruptions must not change."""
    home = tmp_path_factory.mktemp("staged-home")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("NIGHTSHIFT_HOME", str(home))
        version = stage_dataset(demo_data, home / "workspaces" / "baseline")
    return home, version


def test_stage_versions_pushes_and_links_into_the_workspace(staged_home: tuple[Path, DatasetVersion],
                                                            demo_data: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    home, first = staged_home
    monkeypatch.setenv("NIGHTSHIFT_HOME", str(home))
    assert first["rows"] == 1797 and first["splits"] == {"test": 270, "train": 1257, "validation": 270}
    assert first["nfiles"] == 3 and len(first["hash"]) == 32
    assert first["git_rev"] is None  # the demo data lives in a tmp dir, outside any git repository
    remote = home / "dvc-remote" / "files" / "md5"
    assert (remote / first["hash"][:2] / f"{first['hash'][2:]}.dir").is_file()
    for split in ("train", "validation", "test"):
        staged = Path(first["path"]) / f"{split}.parquet"
        assert _md5(staged) == _md5(demo_data / f"{split}.parquet")
        assert (remote / _md5(staged)[:2] / _md5(staged)[2:]).is_file()

    before = _store_files(home)
    workspace = home / "workspaces" / "run-2"
    second = stage_dataset(demo_data, workspace)
    assert second["hash"] == first["hash"]  # unchanged data, same version
    assert _store_files(home) == before  # nothing new in cache, remote or records
    cache = home / "dvc" / ".dvc" / "cache" / "files" / "md5"
    for split in ("train", "validation", "test"):
        staged = workspace / "data" / f"{split}.parquet"
        digest = _md5(staged)
        cached = cache / digest[:2] / digest[2:]
        # a link into the cache (hardlink here; symlink or reflink elsewhere), never a second copy
        assert staged.is_symlink() or os.path.samefile(staged, cached)
    assert json.loads((workspace / "dataset.json").read_text())["hash"] == first["hash"]
    assert f"md5: {first['hash']}.dir" in (workspace / "data.dvc").read_text()


def test_dvc_cli_sees_the_staging_project_and_remote(staged_home: tuple[Path, DatasetVersion]) -> None:
    """The project is an ordinary DVC project: `dvc` itself reads its cache config and remote objects."""
    home, _ = staged_home
    env = {**os.environ, "NIGHTSHIFT_HOME": str(home), "DVC_NO_ANALYTICS": "1"}
    dvc = str(Path(sys.executable).parent / "dvc")
    out = subprocess.run([dvc, "config", "cache.type"], cwd=home / "dvc", env=env,
                         capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "reflink,hardlink,symlink"


def _corrupt(transform: Callable[[pd.DataFrame], pd.DataFrame]) -> Callable[[Path], None]:
    def write(path: Path) -> None:
        transform(pd.read_parquet(path)).to_parquet(path, index=False)
    return write


def _set(column: str, value: object, rows: slice = slice(0, 3)) -> Callable[[pd.DataFrame], pd.DataFrame]:
    def change(frame: pd.DataFrame) -> pd.DataFrame:
        frame.loc[frame.index[rows], column] = value
        return frame
    return change


def _null_label(frame: pd.DataFrame) -> pd.DataFrame:
    frame["label"] = frame["label"].astype("Int64")
    frame.loc[frame.index[:2], "label"] = pd.NA
    return frame


def _duplicate_rows(frame: pd.DataFrame) -> pd.DataFrame:
    return pd.concat([frame, frame.iloc[:40]], ignore_index=True)


def _drop_class(frame: pd.DataFrame) -> pd.DataFrame:
    return frame[frame["label"] != 3].reset_index(drop=True)


def _rare_class(frame: pd.DataFrame) -> pd.DataFrame:
    threes = frame.index[frame["label"] == 3]
    return frame.drop(threes[10:]).reset_index(drop=True)


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


CORRUPTIONS: dict[str, tuple[Callable[[Path], None], type[Exception], str]] = {
    "missing column": (_corrupt(lambda f: f.drop(columns=["pixel_9"])), DataValidationFailed,
                       r"expect_table_columns_to_match_set .*'missing': \['pixel_9'\]"),
    "extra column": (_corrupt(lambda f: f.assign(extra=1)), DataValidationFailed,
                     r"expect_table_columns_to_match_set .*'unexpected': \['extra'\]"),
    "wrong dtype": (_corrupt(lambda f: f.astype({"pixel_3": "float64"})), DataValidationFailed,
                    r"expect_table_column_types_to_be\(pixel_3\) \[schema: .*float64"),
    "nulls": (_corrupt(_null_label), DataValidationFailed,
              r"expect_columns_values_to_not_be_null\(label\) \[no nulls or NaN\]"),
    "NaN": (_corrupt(_set("pixel_5", np.nan)), DataValidationFailed,
            r"expect_columns_values_to_not_be_null\(pixel_5\) \[no nulls or NaN\] e\.g\. \['NaN'"),
    "infinity": (_corrupt(_set("pixel_6", np.inf)), DataValidationFailed,
                 r"expect_columns_values_to_be_finite_between\(pixel_6\) \[pixels are finite.*'inf'"),
    "pixel out of range": (_corrupt(_set("pixel_7", -2.0)), DataValidationFailed,
                           r"expect_columns_values_to_be_finite_between\(pixel_7\) .*e\.g\. \[-2\.0"),
    "label out of range": (_corrupt(_set("label", 11)), DataValidationFailed,
                           r"expect_column_values_to_be_in_set\(label\) \[labels are in 0\.\.9\] "
                           r"e\.g\. \[11"),
    "empty file": (lambda p: p.write_bytes(b""), DataError, r"train\.parquet is empty \(0 bytes\)"),
    "truncated parquet": (_truncate, DataError, r"train\.parquet is not a readable Parquet file \(truncated"),
    "not parquet": (lambda p: p.write_text("label,pixel_0\n1,2\n"), DataError,
                    r"not a readable Parquet file"),
    "missing class": (_corrupt(_drop_class), DataValidationFailed,
                      r"expect_column_value_shares_to_be_at_least\(label\) \[class balance.*'3': 0\.0"),
    "class below share": (_corrupt(_rare_class), DataValidationFailed,
                          r"expect_column_value_shares_to_be_at_least\(label\) \[class balance.*'3': 0\.0"),
    "duplicated rows": (_corrupt(_duplicate_rows), DataValidationFailed,
                        r"expect_compound_columns_to_be_unique_by_hash \[duplicated rows are at most 1%"),
    "too few rows": (_corrupt(lambda f: f.iloc[:60]), DataValidationFailed,
                     r"expect_table_row_count_to_be_between \[row count within"),
}


@pytest.mark.integration
@pytest.mark.parametrize("kind", list(CORRUPTIONS))
def test_corrupt_data_is_refused_and_never_versioned(kind: str, staged_home: tuple[Path, DatasetVersion],
                                                     demo_data: Path, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    home, _ = staged_home
    monkeypatch.setenv("NIGHTSHIFT_HOME", str(home))
    corrupt, error, pattern = CORRUPTIONS[kind]
    data = tmp_path / "data"
    shutil.copytree(demo_data, data)
    corrupt(data / "train.parquet")
    before = _store_files(home)
    workspace = tmp_path / "workspace"
    with pytest.raises(error, match=pattern):
        stage_dataset(data, workspace)
    assert _store_files(home) == before, "a refused dataset must leave cache, remote and records untouched"
    assert not (workspace / "data").exists()


def test_stage_refuses_files_that_were_not_validated(demo_data: Path, tmp_path: Path) -> None:
    data = tmp_path / "data"
    shutil.copytree(demo_data, data)
    (data / "notes.txt").write_text("not validated")
    with pytest.raises(DataError, match="files other than the splits"):
        stage_dataset(data, tmp_path / "ws")
    assert not project_dir().exists()


@pytest.mark.integration
def test_concurrent_stagings_do_not_corrupt_each_other(tmp_path: Path, nightshift_home: Path) -> None:
    """Two `nightshift stage` processes at once, on two different datasets, sharing one cache and remote."""
    sources = {}
    for seed in (1, 2):
        sources[seed] = tmp_path / f"data-{seed}"
        write_demo_dataset(sources[seed], rows=800, seed=seed)
    env = {**os.environ, "NIGHTSHIFT_HOME": str(nightshift_home)}
    nightshift = str(Path(sys.executable).parent / "nightshift")
    procs = {
        seed: subprocess.Popen([nightshift, "stage", str(src), "--workspace", str(tmp_path / f"ws-{seed}")],
                               env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for seed, src in sources.items()
    }
    versions = {}
    for seed, proc in procs.items():
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err
        versions[seed] = json.loads(out)
    assert versions[1]["hash"] != versions[2]["hash"]
    for seed, version in versions.items():
        for split in ("train", "validation", "test"):
            staged = Path(version["path"]) / f"{split}.parquet"
            assert _md5(staged) == _md5(sources[seed] / f"{split}.parquet")
    records = sorted(p.stem for p in (nightshift_home / "dvc" / "versions").glob("*.json"))
    assert records == sorted(v["hash"] for v in versions.values())


def test_a_passed_gate_is_trusted_only_for_the_same_bytes(demo_data: Path, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    from nightshift.data import stage, validate

    data = tmp_path / "data"
    shutil.copytree(demo_data, data)
    passed = validate.fingerprint(data)
    calls: list[Path] = []
    real = stage.validate_data
    monkeypatch.setattr(stage, "validate_data", lambda path, **kw: calls.append(Path(path)) or real(path, **kw))
    version = stage_dataset(data, tmp_path / "ws1", validated=passed)
    assert calls == [] and version["splits"] == {"train": 1257, "validation": 270, "test": 270}
    # One value changed after the gate passed: another fingerprint, so the suite runs again and refuses it.
    frame = pd.read_parquet(data / "train.parquet")
    frame.loc[0, "pixel_0"] = np.float32(99.0)
    frame.to_parquet(data / "train.parquet")
    assert validate.fingerprint(data) != passed
    with pytest.raises(DataValidationFailed):
        stage_dataset(data, tmp_path / "ws2", validated=passed)
    assert len(calls) == 1  # the suite ran once more, on the bytes staging read


@pytest.fixture
def staged_once(demo_data: Path, tmp_path: Path) -> tuple[Path, Path, DatasetVersion]:
    """A private copy of the demo data, staged once into `tmp_path/ws` (so it has a staging record)."""
    data = tmp_path / "data"
    shutil.copytree(demo_data, data)
    workspace = tmp_path / "ws"
    return data, workspace, stage_dataset(data, workspace)


def _count_full_paths(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count DVC project openings: the full staging path opens the project, the fast path never does."""
    from nightshift.data import stage

    opened: list[int] = []
    real = stage._open_project

    def counting() -> object:
        opened.append(1)
        return real()

    monkeypatch.setattr(stage, "_open_project", counting)
    return opened


def test_restaging_unchanged_data_imports_neither_dvc_nor_gx(staged_once: tuple[Path, Path, DatasetVersion],
                                                             nightshift_home: Path) -> None:
    data, workspace, first = staged_once
    assert (workspace / ".staged.json").is_file()
    script = ("import json, sys\n"
              "from nightshift.data.stage import stage_dataset\n"
              "version = stage_dataset(sys.argv[1], sys.argv[2])\n"
              "print(json.dumps({'version': version, 'dvc': any(m == 'dvc' or m.startswith(('dvc.', 'dvc_'))\n"
              "                  for m in sys.modules), 'gx': 'great_expectations' in sys.modules}))\n")
    out = subprocess.run([sys.executable, "-c", script, str(data), str(workspace)], check=True,
                         capture_output=True, text=True, env={**os.environ, "NIGHTSHIFT_HOME": str(nightshift_home)})
    result = json.loads(out.stdout)
    assert result == {"version": first, "dvc": False, "gx": False}


def test_restaging_unchanged_data_neither_validates_nor_opens_dvc(staged_once: tuple[Path, Path, DatasetVersion],
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    from nightshift.data import stage

    data, workspace, first = staged_once
    opened = _count_full_paths(monkeypatch)
    monkeypatch.setattr(stage, "validate_data", lambda path: pytest.fail("validated unchanged data again"))
    assert stage_dataset(data, workspace) == first
    assert stage_dataset(data, workspace, validated="sha256:not-this-data") == first
    assert stage.version_validated(data.resolve(), workspace, first["splits"]) == first
    assert opened == []


def _rewrite_one_pixel(data: Path, workspace: Path, tmp_path: Path) -> None:
    frame = pd.read_parquet(data / "train.parquet")
    frame.loc[0, "pixel_0"] = np.float32(7.0) if frame.loc[0, "pixel_0"] != 7.0 else np.float32(8.0)
    frame.to_parquet(data / "train.parquet", index=False)


def _replace_with_a_copy(data: Path, workspace: Path, tmp_path: Path) -> None:
    copy = tmp_path / "train.copy"
    shutil.copy2(data / "train.parquet", copy)  # same bytes, size and mtime; another inode
    os.replace(copy, data / "train.parquet")


def _rewrite_in_place_keeping_mtime(data: Path, workspace: Path, tmp_path: Path) -> None:
    path = data / "train.parquet"
    st = path.stat()
    path.write_bytes(path.read_bytes())  # same inode and size; only the ctime tells
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert path.stat().st_mtime_ns == st.st_mtime_ns and path.stat().st_ino == st.st_ino


def _delete_workspace_link(data: Path, workspace: Path, tmp_path: Path) -> None:
    (workspace / "data" / "train.parquet").unlink()


def _delete_cache_object(data: Path, workspace: Path, tmp_path: Path) -> None:
    record = json.loads((workspace / ".staged.json").read_text())
    Path(record["objects"]["train.parquet"]["path"]).unlink()


RESTAGE_CHANGES: dict[str, tuple[Callable[[Path, Path, Path], None], bool]] = {
    # name: (change, whether the dataset version changes)
    "content touched": (_rewrite_one_pixel, True),
    "file replaced by a same-size copy": (_replace_with_a_copy, False),
    "file rewritten in place, mtime restored": (_rewrite_in_place_keeping_mtime, False),
    "workspace link deleted": (_delete_workspace_link, False),
    "cache object deleted": (_delete_cache_object, False),
}


@pytest.mark.parametrize("change", list(RESTAGE_CHANGES))
def test_restaging_takes_the_full_dvc_path_after(change: str, staged_once: tuple[Path, Path, DatasetVersion],
                                                 tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data, workspace, first = staged_once
    modify, new_version = RESTAGE_CHANGES[change]
    modify(data, workspace, tmp_path)
    opened = _count_full_paths(monkeypatch)
    again = stage_dataset(data, workspace)
    assert opened == [1]
    assert (again["hash"] != first["hash"]) is new_version
    for split in ("train", "validation", "test"):  # the workspace holds the new version, links restored
        assert _md5(workspace / "data" / f"{split}.parquet") == _md5(data / f"{split}.parquet")
    assert stage_dataset(data, workspace) == again and opened == [1]  # recorded anew: fast again


def test_restaging_takes_the_full_dvc_path_for_another_remote(staged_once: tuple[Path, Path, DatasetVersion],
                                                              tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data, workspace, first = staged_once
    other = tmp_path / "other-remote"
    monkeypatch.setenv("NIGHTSHIFT_DVC_REMOTE", str(other))
    opened = _count_full_paths(monkeypatch)
    again = stage_dataset(data, workspace)
    assert opened == [1] and again["remote"] == str(other) and again["hash"] == first["hash"]
    assert (other / "files" / "md5" / first["hash"][:2] / f"{first['hash'][2:]}.dir").is_file()  # pushed there
    assert stage_dataset(data, workspace) == again and opened == [1]


# ---- a remote that cannot take the data (issue 20 item 2) ------------------------------------------------

@pytest.fixture
def small_remote(tmp_path: Path) -> Iterator[Path]:
    """A DVC remote on a 64 KiB tmpfs (too small for the demo dataset), unmounted whatever the test does."""
    remote = tmp_path / "small-remote"
    remote.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(remote)],
                             capture_output=True, text=True, check=False)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (a full remote needs one): {mounted.stderr.strip()}")
    try:
        yield remote
    finally:
        subprocess.run(["umount", str(remote)], capture_output=True, text=True, check=True)


def _resize(remote: Path, options: str) -> None:
    subprocess.run(["mount", "-o", f"remount,{options}", str(remote)], capture_output=True, text=True, check=True)


def _remote_objects(remote: Path) -> dict[str, str]:
    """Each file under the remote by its path relative to the remote, with the md5 of its bytes."""
    return {str(p.relative_to(remote)): _md5(p) for p in remote.rglob("*") if p.is_file()}


def test_a_push_to_a_full_remote_fails_the_stage_and_the_next_staging_pushes_everything(
        small_remote: Path, demo_data: Path, tmp_path: Path, nightshift_home: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NIGHTSHIFT_DVC_REMOTE", str(small_remote))
    data = tmp_path / "data"
    shutil.copytree(demo_data, data)
    workspace = tmp_path / "ws"
    for attempt in ("first", "second: the fast path must not hide the failed push"):
        with pytest.raises(DatasetPushFailed) as failed:
            stage_dataset(data, workspace)
        message = str(failed.value)
        assert failed.value.exit_code == 1 and "\n" not in message, attempt
        assert f"the DVC remote {small_remote} did not take" in message, attempt
        assert "No space left on device" in message and "nothing was versioned" in message, attempt
        assert not (workspace / ".staged.json").exists() and not (workspace / "dataset.json").exists()
        assert not list((nightshift_home / "dvc" / "versions").glob("*.json")), "a version that was never stored"
        assert not [p for p in small_remote.rglob("*.tmp")], "the failed push left its partial files on the remote"

    _resize(small_remote, "size=8m")  # the remote has room now
    version = stage_dataset(data, workspace)
    objects = _remote_objects(small_remote)
    expected = {f"files/md5/{version['hash'][:2]}/{version['hash'][2:]}.dir"}
    expected |= {f"files/md5/{_md5(f)[:2]}/{_md5(f)[2:]}" for f in data.iterdir()}
    assert expected <= set(objects), f"objects missing from the remote: {expected - set(objects)}"
    for name, digest in objects.items():  # every file the remote holds is a whole object: none torn, no leftovers
        assert name.replace("/", "").removeprefix("filesmd5").removesuffix(".dir") == digest, name
    assert (workspace / ".staged.json").is_file()


def test_a_read_only_remote_fails_the_stage_command_naming_the_remote(
        small_remote: Path, demo_data: Path, tmp_path: Path, nightshift_home: Path) -> None:
    _resize(small_remote, "ro")
    workspace = tmp_path / "ws"
    env = {**os.environ, "NIGHTSHIFT_HOME": str(nightshift_home), "NIGHTSHIFT_DVC_REMOTE": str(small_remote)}
    nightshift = str(Path(sys.executable).parent / "nightshift")
    done = subprocess.run([nightshift, "stage", str(demo_data), "--workspace", str(workspace)], env=env,
                          capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 1 and done.stdout == "", done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("nightshift stage: pushing dataset ") and f"DVC remote {small_remote}" in last, last
    assert "Read-only file system" in last and "nothing was versioned" in last, last
    assert not (workspace / ".staged.json").exists() and not (workspace / "dataset.json").exists()


# ---- validated bytes are the versioned bytes (issue 20 item 3) ---------------------------------------------

def _break_a_pixel(path: Path) -> None:
    frame = pd.read_parquet(path)
    frame.loc[0, "pixel_0"] = np.float32(99.0)  # out of the suite's 0..16
    frame.to_parquet(path, index=False)


def test_data_changed_after_validation_is_never_versioned(demo_data: Path, tmp_path: Path,
                                                          nightshift_home: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The source is rewritten with a bad value right after the suite passed on it: what is versioned and
    materialised is exactly the validated bytes, and the next staging sees (and refuses) the change."""
    from nightshift.data import stage

    data = tmp_path / "data"
    shutil.copytree(demo_data, data)
    validated = {f.name: _md5(f) for f in data.iterdir()}
    real = stage.validate_data

    def validate_then_change(path: Path, **kw: Any) -> object:
        report = real(path, **kw)
        _break_a_pixel(data / "train.parquet")
        return report

    monkeypatch.setattr(stage, "validate_data", validate_then_change)
    workspace = tmp_path / "ws"
    version = stage_dataset(data, workspace)
    assert {f.name: _md5(f) for f in Path(version["path"]).iterdir()} == validated
    remote = nightshift_home / "dvc-remote" / "files" / "md5"
    assert all((remote / d[:2] / d[2:]).is_file() for d in validated.values())
    assert not (workspace / ".staged.json").exists()  # the source differs now: no fast path next time
    monkeypatch.setattr(stage, "validate_data", real)
    with pytest.raises(DataValidationFailed, match=r"pixel_0"):
        stage_dataset(data, workspace)


def test_bytes_changed_between_validation_and_hashing_are_refused(demo_data: Path, tmp_path: Path,
                                                                  nightshift_home: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Whatever DVC is about to hash is changed after validation: staging refuses and versions nothing."""
    from nightshift.data import stage

    data = tmp_path / "data"
    shutil.copytree(demo_data, data)
    real = stage._version

    def change_then_hash(repo: object, path: Path, **kwargs: object) -> object:
        _break_a_pixel(Path(path) / "train.parquet")
        return real(repo, path, **kwargs)

    monkeypatch.setattr(stage, "_version", change_then_hash)
    workspace = tmp_path / "ws"
    with pytest.raises(DataError, match=r"train\.parquet changed between validation and hashing"):
        stage_dataset(data, workspace)
    assert not list((nightshift_home / "dvc" / "versions").glob("*.json"))
    assert not (nightshift_home / "dvc-remote").exists()
    assert not (workspace / "data").exists() and not (workspace / "dataset.json").exists()


def test_data_changed_while_it_is_copied_is_refused(demo_data: Path, tmp_path: Path, nightshift_home: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A writer rewrites a split while staging reads the dataset: a mix of old and new files is refused."""
    from nightshift.data import stage

    data = tmp_path / "data"
    shutil.copytree(demo_data, data)
    real = stage._copy_hashing

    def copy_then_change(source: Path, target: Path) -> object:
        result = real(source, target)
        if source.name == "test.parquet":  # the first file copied; train.parquet is still to come
            _break_a_pixel(data / "validation.parquet")
        return result

    monkeypatch.setattr(stage, "_copy_hashing", copy_then_change)
    with pytest.raises(DataError, match=r"changed while it was being staged .*validation\.parquet"):
        stage_dataset(data, tmp_path / "ws")
    assert not list((nightshift_home / "dvc" / "versions").glob("*.json"))
    assert not any((nightshift_home / "dvc-snapshots").iterdir()), "the private copy is removed"
