from __future__ import annotations

from pathlib import Path

import pytest

from nightshift import settings
from nightshift.errors import UsageError


def test_data_sources_must_lie_under_the_data_roots(nightshift_home: Path, tmp_path: Path) -> None:
    inside = nightshift_home / "data" / "nightly"
    inside.mkdir(parents=True)
    assert settings.confined_data_source(str(inside)) == inside.resolve()
    assert settings.confined_data_source(nightshift_home / "demo-data" / "digits").is_relative_to(nightshift_home)
    for outside in ("/etc", str(nightshift_home / "data" / ".." / "mlflow.db"), str(tmp_path)):
        with pytest.raises(UsageError, match=r"outside the allowed data roots \(.*/demo-data, .*/data\)"):
            settings.confined_data_source(outside)


def test_a_symlink_inside_a_root_cannot_lead_out_of_it(nightshift_home: Path) -> None:
    link = nightshift_home / "data" / "escape"
    link.parent.mkdir(parents=True)
    link.symlink_to("/etc")
    with pytest.raises(UsageError, match="outside the allowed data roots"):
        settings.confined_data_source(link)


def test_the_roots_are_configurable(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("NIGHTSHIFT_DATA_ROOTS", f"{tmp_path / 'a'}:{tmp_path / 'b'}")
    assert settings.confined_data_source(tmp_path / "b" / "x") == (tmp_path / "b" / "x").resolve()
    with pytest.raises(UsageError, match="NIGHTSHIFT_DATA_ROOTS"):
        settings.confined_data_source(tmp_path / "c")
