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
