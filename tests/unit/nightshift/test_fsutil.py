from __future__ import annotations

import json
from pathlib import Path

import pytest

from nightshift.fsutil import atomic_write_bytes, atomic_write_json


def test_replaces_the_file_and_leaves_no_temporary(tmp_path: Path) -> None:
    target = tmp_path / "record.json"
    target.write_text("old")
    atomic_write_json(target, {"b": 1, "a": [2]})
    assert json.loads(target.read_text()) == {"a": [2], "b": 1}
    assert target.read_text().endswith("\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["record.json"]


def test_a_failed_write_keeps_the_old_file_and_cleans_up(tmp_path: Path) -> None:
    target = tmp_path / "model.pt"
    target.write_bytes(b"old weights")
    with pytest.raises(TypeError):
        atomic_write_bytes(target, "not bytes")  # type: ignore[arg-type]
    assert target.read_bytes() == b"old weights"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.pt"]


def test_without_overwrite_an_existing_file_is_kept(tmp_path: Path) -> None:
    target = tmp_path / "suite.json"
    atomic_write_json(target, {"a": 1}, overwrite=False)
    assert json.loads(target.read_text()) == {"a": 1}
    with pytest.raises(FileExistsError):
        atomic_write_json(target, {"a": 2}, overwrite=False)
    assert json.loads(target.read_text()) == {"a": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["suite.json"]


def test_safe_name_is_injective_and_never_climbs(tmp_path: Path) -> None:
    """Issue 20.16: run ids `a:b`, `a+b`, `a_b` mapped to one workspace, and run id `.` to the DAG's own."""
    from nightshift.fsutil import safe_name

    ids = ["a:b", "a_b", "a/b", "a b", ".", "..", "_", "", "manual__2026-01-01T00:00:00+00:00",
           "manual__2026-01-01T00_00_00+00_00", "x" * 300, "x" * 301, "é", "e"]
    names = [safe_name(i) for i in ids]
    assert len(set(names)) == len(ids)
    for name in names:
        assert name not in ("", ".", "..") and "/" not in name and len(name) <= 120
        assert (tmp_path / name).resolve().parent == tmp_path.resolve()
    assert safe_name("scheduled__2026-01-01") == "scheduled__2026-01-01"  # a safe id stays readable
