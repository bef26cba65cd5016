from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"


@pytest.fixture(autouse=True)
def nightshift_home(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Every test gets its own NIGHTSHIFT_HOME, so no test touches ~/.nightshift or another's state."""
    home = tmp_path_factory.mktemp("nightshift-home")
    monkeypatch.setenv("NIGHTSHIFT_HOME", str(home))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    return home


@pytest.fixture(scope="session")
def demo_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo digits dataset, written once per session; tests must not modify it."""
    from nightshift.data.demo import write_demo_dataset

    out = tmp_path_factory.mktemp("demo-data")
    write_demo_dataset(out, seed=0)
    return out
