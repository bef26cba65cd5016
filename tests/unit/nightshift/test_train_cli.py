"""Bad input to `python -m nightshift.train`: one line on stderr, exit 2, never a traceback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from nightshift.train.config import TrainConfig


def train(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "nightshift.train", *map(str, args)],
                          capture_output=True, text=True, timeout=300)


def assert_clean_error(result: subprocess.CompletedProcess[str], *fragments: str) -> None:
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    error_lines = [line for line in result.stderr.splitlines() if line.startswith(("nightshift.train:", "usage:"))
                   or "error:" in line]
    assert error_lines, result.stderr
    for fragment in fragments:
        assert fragment in result.stderr


@pytest.fixture
def run_dirs(tmp_path: Path) -> list[str | Path]:
    return ["--out", tmp_path / "out", "--checkpoint-dir", tmp_path / "ckpt"]


def test_missing_data_directory(tmp_path: Path, run_dirs: list[str | Path]) -> None:
    result = train("--data", tmp_path / "nowhere", *run_dirs)
    assert_clean_error(result, "nowhere", "does not exist")


def test_empty_training_split(tmp_path: Path, demo_data: Path, run_dirs: list[str | Path]) -> None:
    data = tmp_path / "data"
    data.mkdir()
    for split in ("train", "validation", "test"):
        frame = pd.read_parquet(demo_data / f"{split}.parquet")
        (frame.iloc[:0] if split == "train" else frame).to_parquet(data / f"{split}.parquet")
    assert_clean_error(train("--data", data, *run_dirs), "train.parquet has no rows")


def test_unknown_model(demo_data: Path, run_dirs: list[str | Path]) -> None:
    assert_clean_error(train("--data", demo_data, "--model", "resnet9000", *run_dirs),
                       "unknown model 'resnet9000'", "digits_cnn")


@pytest.mark.parametrize(("flag", "value"), [("--epochs", "0"), ("--batch-size", "-4"),
                                             ("--checkpoint-every", "0")])
def test_non_positive_numbers(demo_data: Path, run_dirs: list[str | Path], flag: str, value: str) -> None:
    assert_clean_error(train("--data", demo_data, flag, value, *run_dirs), flag, "positive")


def test_checkpoint_from_a_different_model_is_refused(demo_data: Path, run_dirs: list[str | Path]) -> None:
    first = train("--data", demo_data, "--model", "mlp", "--epochs", "1", *run_dirs)
    assert first.returncode == 0, first.stderr
    result = train("--data", demo_data, "--model", "digits_cnn", "--epochs", "1", *run_dirs)
    assert_clean_error(result, "different configuration", "model: 'mlp' there, 'digits_cnn' here",
                       "--checkpoint-dir")


def test_config_names_the_bad_field() -> None:
    with pytest.raises(Exception, match="--lr must be positive"):
        TrainConfig(data=Path("."), out=Path("."), checkpoint_dir=Path("."), lr=0.0)
    with pytest.raises(Exception, match=r"--momentum must be in \[0, 1\)"):
        TrainConfig(data=Path("."), out=Path("."), checkpoint_dir=Path("."), momentum=1.0)
