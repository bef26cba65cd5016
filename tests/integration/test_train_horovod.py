"""Real `horovodrun --gloo` jobs: a normal run, a SIGKILLed and resumed run, a corrupt checkpoint, and
mixed precision with fp16 gradient compression resumed bit-for-bit on 1 and 2 processes."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nightshift.train.checkpoint import CheckpointStore
from tests.integration.horovod_helpers import HOROVODRUN, assert_bitwise_equal, command, run, weights

pytestmark = pytest.mark.integration

@pytest.fixture(scope="module")
def reference(demo_data: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """One uninterrupted run, the yardstick for the others."""
    base = tmp_path_factory.mktemp("reference")
    result = run(demo_data, base / "out", base / "ckpt")
    return base, result.stdout + result.stderr


def test_uninterrupted_run_trains_and_writes_outputs(reference: tuple[Path, str]) -> None:
    base, log = reference
    summary = json.loads((base / "out" / "metrics.json").read_text())
    assert summary["world_size"] == 2
    assert summary["steps"] == summary["steps_run"] == 6 * 40
    assert summary["val_accuracy"] > 0.85
    lines = [json.loads(line) for line in (base / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [line["epoch"] for line in lines if line["event"] == "epoch"] == [1, 2, 3, 4, 5, 6]
    assert {"loss", "samples_per_sec", "lr"} <= set(next(line for line in lines if line["event"] == "step"))
    info = json.loads((base / "out" / "model.json").read_text())
    assert info["model"] == "digits_cnn" and info["num_classes"] == 10
    assert [c.step for c in CheckpointStore(base / "ckpt").files()] == [220, 230, 240]  # last 3 kept
    # Only rank 0 logs progress; horovodrun prefixes each line with the rank.
    assert "[0]<stderr>:" in log and "eta" in log
    assert not [line for line in log.splitlines() if line.startswith("[1]") and "step " in line]


def test_killed_run_resumes_bit_for_bit(demo_data: Path, tmp_path: Path, reference: tuple[Path, str]) -> None:
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    store = CheckpointStore(ckpt)
    job = subprocess.Popen(command(demo_data, out, ckpt), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                           start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while not any(c.step >= 100 for c in store.files()):
            assert job.poll() is None, "training ended before it could be killed"
            assert time.monotonic() < deadline, "no checkpoint past step 100 in time"
            time.sleep(0.01)
        time.sleep(random.uniform(0.0, 0.2))  # land on an arbitrary step between checkpoints
    finally:
        os.killpg(job.pid, signal.SIGKILL)
        job.wait()
    survivors = store.files()
    assert survivors and survivors[-1].step < 240, "the kill came too late to test anything"

    result = run(demo_data, out, ckpt)
    summary = json.loads((out / "metrics.json").read_text())
    assert summary["resumed_from_step"] == survivors[-1].step  # the newest surviving checkpoint
    assert summary["steps_run"] == 240 - survivors[-1].step  # no step it covered was redone
    assert f"resumed from checkpoint {survivors[-1].path}" in result.stderr + result.stdout
    assert_bitwise_equal(weights(out), weights(reference[0] / "out"))
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    epochs = [line["epoch"] for line in lines if line["event"] == "epoch"]
    assert epochs == [1, 2, 3, 4, 5, 6]  # lines after the checkpoint were dropped, then redone once


def test_corrupt_newest_checkpoint_is_skipped(demo_data: Path, tmp_path: Path,
                                              reference: tuple[Path, str]) -> None:
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    # The reference's checkpoints at 220 and 230 and 240: corrupt the newest, drop the middle one.
    ref_store = CheckpointStore(reference[0] / "ckpt")
    files = ref_store.files()
    ckpt.mkdir()
    for checkpoint in files[:1] + files[2:]:
        (ckpt / checkpoint.path.name).write_bytes(checkpoint.path.read_bytes())
    newest = ckpt / files[-1].path.name
    newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])

    result = run(demo_data, out, ckpt)
    log = result.stdout + result.stderr
    assert "skipping checkpoint" in log and newest.name in log
    summary = json.loads((out / "metrics.json").read_text())
    assert summary["resumed_from_step"] == 220 and summary["steps_run"] == 20
    assert_bitwise_equal(weights(out), weights(reference[0] / "out"))


# --- mixed precision and gradient compression, on the CPU -------------------------------------------

# 2 short epochs, a checkpoint every 7 steps so that some land mid-epoch.
MIXED_ARGS = ["--epochs", "2", "--batch-size", "32", "--checkpoint-every", "7", "--keep-checkpoints", "20",
              "--log-every", "10", "--threads", "1", "--seed", "11", "--device", "cpu"]


def run_np(np_: int, data: Path, out: Path, ckpt: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    cmd = [HOROVODRUN, "-np", str(np_), "-H", f"localhost:{np_}", "--gloo", sys.executable, "-m", "nightshift.train",
           "--data", str(data), "--out", str(out), "--checkpoint-dir", str(ckpt), *MIXED_ARGS, *extra]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


@pytest.mark.parametrize(("np_", "extra"), [
    (1, ["--precision", "bf16", "--compression", "fp16"]),
    (2, ["--precision", "bf16", "--compression", "fp16"]),
    # fp16 autocast with a GradScaler (allowed on the CPU); the dense model, as CPU fp16 convolutions are slow.
    (2, ["--precision", "fp16", "--compression", "fp16", "--model", "mlp"]),
], ids=["np1-bf16", "np2-bf16", "np2-fp16-mlp"])
def test_mixed_precision_with_compression_resumes_bit_for_bit(demo_data: Path, tmp_path: Path, np_: int,
                                                              extra: list[str]) -> None:
    precision = extra[extra.index("--precision") + 1]
    reference = run_np(np_, demo_data, tmp_path / "ref-out", tmp_path / "ref-ckpt", *extra)
    summary = json.loads((tmp_path / "ref-out" / "metrics.json").read_text())
    assert summary["world_size"] == np_ and summary["device"] == "cpu" and summary["precision"] == precision
    assert summary["compression"] == "fp16" and summary["val_accuracy"] > 0.5
    assert f"precision {precision}, gradient compression fp16" in reference.stderr

    files = CheckpointStore(tmp_path / "ref-ckpt").files()
    middle = files[len(files) // 2]
    state = CheckpointStore(tmp_path / "ref-ckpt").load(middle)
    assert state["resume_key"]["precision"] == precision and state["resume_key"]["compression"] == "fp16"
    assert state["resume_key"]["device"] == "cpu" and state["threads"] == [1] * np_ and len(state["rng"]) == np_
    assert bool(state["scaler"]) == (precision == "fp16")  # the loss scale and its growth tracker
    (tmp_path / "ckpt").mkdir()
    shutil.copy(middle.path, tmp_path / "ckpt" / middle.path.name)

    run_np(np_, demo_data, tmp_path / "out", tmp_path / "ckpt", *extra)
    resumed = json.loads((tmp_path / "out" / "metrics.json").read_text())
    assert resumed["resumed_from_step"] == middle.step and resumed["steps_run"] == summary["steps"] - middle.step
    assert_bitwise_equal(weights(tmp_path / "out"), weights(tmp_path / "ref-out"))
