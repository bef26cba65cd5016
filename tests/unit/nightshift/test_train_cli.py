"""Bad input to `python -m nightshift.train`: one line on stderr, exit 2, never a traceback."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch

from nightshift.train.checkpoint import CheckpointStore
from nightshift.train.config import TrainConfig


def train(*args: str | Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "nightshift.train", *map(str, args)],
                          capture_output=True, text=True, timeout=300, env=env)


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


def test_a_checkpoint_from_a_different_model_is_set_aside_and_training_starts_afresh(
        demo_data: Path, run_dirs: list[str | Path]) -> None:
    first = train("--data", demo_data, "--model", "mlp", "--epochs", "1", *run_dirs)
    assert first.returncode == 0, first.stderr
    result = train("--data", demo_data, "--model", "digits_cnn", "--epochs", "1", *run_dirs)
    assert result.returncode == 0, result.stderr
    assert "not resuming" in result.stderr and "model: 'mlp' there, 'digits_cnn' here" in result.stderr
    summary = json.loads((Path(run_dirs[1]) / "metrics.json").read_text())
    assert summary["steps_run"] == summary["steps"] and summary["resumed_from_step"] is None


def test_config_names_the_bad_field() -> None:
    with pytest.raises(Exception, match="--lr must be positive"):
        TrainConfig(data=Path("."), out=Path("."), checkpoint_dir=Path("."), lr=0.0)
    with pytest.raises(Exception, match=r"--momentum must be in \[0, 1\)"):
        TrainConfig(data=Path("."), out=Path("."), checkpoint_dir=Path("."), momentum=1.0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: --device cuda would train")
def test_device_cuda_without_a_gpu_fails_before_training_naming_the_host(demo_data: Path,
                                                                         run_dirs: list[str | Path]) -> None:
    result = train("--data", demo_data, "--device", "cuda", *run_dirs,
                   env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert_clean_error(result, "nightshift.train:", f"on host {socket.gethostname()}",
                       "rank 0 (local rank 0)", "--device cuda", "torch.cuda.is_available() is False",
                       "torch.cuda.device_count() is 0", "CUDA_VISIBLE_DEVICES is ''")
    assert "training on" not in result.stderr and not Path(run_dirs[3]).exists()  # no step, no checkpoint


@pytest.mark.parametrize(("flag", "value"), [("--device", "tpu"), ("--precision", "fp8"), ("--compression", "int8")])
def test_unknown_device_precision_or_compression(demo_data: Path, run_dirs: list[str | Path], flag: str,
                                                 value: str) -> None:
    assert_clean_error(train("--data", demo_data, flag, value, *run_dirs), flag, "invalid choice", repr(value))


# A finished single-process run of the small dense model with a checkpoint every 10 of its 40 steps,
# written with 1 torch thread: what the resume tests below start from.
MLP_RUN = ["--model", "mlp", "--epochs", "1", "--checkpoint-every", "10", "--keep-checkpoints", "10", "--seed", "3"]


@pytest.fixture(scope="module")
def mlp_run(demo_data: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("mlp-run")
    result = train("--data", demo_data, "--out", base / "out", "--checkpoint-dir", base / "ckpt", *MLP_RUN,
                   "--threads", "1")
    assert result.returncode == 0, result.stderr
    assert [c.step for c in CheckpointStore(base / "ckpt").files()] == [10, 20, 30, 40]
    return base


def copy_checkpoint(run: Path, step: int, ckpt: Path) -> None:
    ckpt.mkdir()
    (checkpoint,) = [c for c in CheckpointStore(run / "ckpt").files() if c.step == step]
    shutil.copy(checkpoint.path, ckpt / checkpoint.path.name)


def assert_trained_afresh(result: subprocess.CompletedProcess[str], out: Path, ckpt: Path, *fragments: str) -> None:
    """The run did not resume: it said why, set the old checkpoints aside and ran every step."""
    assert result.returncode == 0, result.stderr
    assert "not resuming" in result.stderr and "training from step 0" in result.stderr, result.stderr
    for fragment in fragments:
        assert fragment in result.stderr
    summary = json.loads((out / "metrics.json").read_text())
    assert summary["resumed_from_step"] is None and summary["steps_run"] == summary["steps"] > 0
    (aside,) = (ckpt / "superseded").iterdir()
    assert [c.step for c in CheckpointStore(aside).files()] == [20]  # moved, not lost


def test_an_explicit_thread_count_that_differs_from_the_checkpoint_trains_afresh(
        demo_data: Path, mlp_run: Path, tmp_path: Path) -> None:
    copy_checkpoint(mlp_run, 20, tmp_path / "ckpt")
    result = train("--data", demo_data, "--out", tmp_path / "out", "--checkpoint-dir", tmp_path / "ckpt", *MLP_RUN,
                   "--threads", "2")
    assert_trained_afresh(result, tmp_path / "out", tmp_path / "ckpt", "threads: 1 there, 2 here")


def test_a_rerun_on_changed_data_never_resumes_the_old_runs_checkpoint(demo_data: Path, mlp_run: Path,
                                                                       tmp_path: Path) -> None:
    """Issue 20.1: a DAG run cleared after its data was fixed reads new bytes from the same place with the
    same checkpoint directory; it must train on them, not hand back the first run's model (steps_run 0)."""
    data = tmp_path / "data"
    data.mkdir()
    for split in ("train", "validation", "test"):
        frame = pd.read_parquet(demo_data / f"{split}.parquet")
        (frame.iloc[: len(frame) * 4 // 5] if split == "train" else frame).to_parquet(data / f"{split}.parquet")
    copy_checkpoint(mlp_run, 20, tmp_path / "ckpt")
    result = train("--data", data, "--out", tmp_path / "out", "--checkpoint-dir", tmp_path / "ckpt", *MLP_RUN,
                   "--threads", "1")
    assert_trained_afresh(result, tmp_path / "out", tmp_path / "ckpt", "data_version: 'sha256:")
    retrained = torch.load(tmp_path / "out" / "model.pt", weights_only=True)
    first = torch.load(mlp_run / "out" / "model.pt", weights_only=True)
    assert not all(torch.equal(retrained[name], first[name]) for name in first)
    info = json.loads((tmp_path / "out" / "model.json").read_text())
    assert info["train_key"] != json.loads((mlp_run / "out" / "model.json").read_text())["train_key"]
    assert info["params"]["data_version"].startswith("sha256:")


def test_the_automatic_thread_count_is_restored_from_the_checkpoint(demo_data: Path, mlp_run: Path,
                                                                     tmp_path: Path) -> None:
    copy_checkpoint(mlp_run, 20, tmp_path / "ckpt")
    result = train("--data", demo_data, "--out", tmp_path / "out", "--checkpoint-dir", tmp_path / "ckpt", *MLP_RUN,
                   "--threads", "0")
    assert result.returncode == 0, result.stderr
    if (os.cpu_count() or 1) > 1:  # automatic would have picked more than the checkpoint's 1
        assert "using 1 torch threads per process as the checkpoint was written with" in result.stderr
    assert "resumed from checkpoint" in result.stderr
    resumed = torch.load(tmp_path / "out" / "model.pt", weights_only=True)
    reference = torch.load(mlp_run / "out" / "model.pt", weights_only=True)
    assert all(torch.equal(resumed[name], reference[name]) for name in reference)


def test_a_checkpoint_written_on_another_device_is_set_aside(demo_data: Path, mlp_run: Path, tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path / "ckpt")
    state = CheckpointStore(mlp_run / "ckpt").latest_valid()[1]  # type: ignore[index]
    state["resume_key"]["device"] = "cuda"  # as a GPU run would have written it
    state["step"] = 20
    store.write(state)
    result = train("--data", demo_data, "--out", tmp_path / "out", "--checkpoint-dir", tmp_path / "ckpt", *MLP_RUN,
                   "--threads", "1", "--device", "cpu")
    assert_trained_afresh(result, tmp_path / "out", tmp_path / "ckpt", "device: 'cuda' there, 'cpu' here")
