"""The trainer on CUDA: one GPU, and two ranks on two GPUs where there are two. `pytest -m gpu` runs them.

They skip, with the reason, where torch sees no GPU or Horovod was built without CUDA (the CPU wheel
that `make setup` builds cannot reduce CUDA tensors; the CUDA trainer image's can).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from nightshift.train.checkpoint import CheckpointStore


def _horovod_cuda() -> bool:
    try:
        import horovod.torch as hvd
    except ImportError:
        return False
    return bool(hvd.cuda_built())


GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.integration,
    pytest.mark.skipif(GPUS == 0, reason="no GPU: torch.cuda.is_available() is False on this machine"),
    pytest.mark.skipif(GPUS > 0 and not _horovod_cuda(),
                       reason="Horovod here was built without CUDA (hvd.cuda_built() is False)"),
]
two_gpus = pytest.mark.skipif(GPUS < 2, reason=f"2 ranks need 2 GPUs; torch.cuda.device_count() is {GPUS}")

HOROVODRUN = str(Path(sys.executable).with_name("horovodrun"))
# 6 epochs of 40 steps on one GPU (20 on two): a few seconds, long enough to be killed mid-run.
TRAIN_ARGS = ["--epochs", "6", "--batch-size", "32", "--checkpoint-every", "10", "--log-every", "10",
              "--seed", "5", "--device", "cuda"]


def command(np_: int, data: Path, out: Path, ckpt: Path, *extra: str) -> list[str]:
    trainer = [sys.executable, "-m", "nightshift.train", "--data", str(data), "--out", str(out),
               "--checkpoint-dir", str(ckpt), *TRAIN_ARGS, *extra]
    if np_ == 1:
        return trainer
    return [HOROVODRUN, "-np", str(np_), "-H", f"localhost:{np_}", "--gloo", *trainer]


def run(np_: int, data: Path, out: Path, ckpt: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(command(np_, data, out, ckpt, *extra), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def weights(out: Path) -> dict[str, torch.Tensor]:
    return torch.load(out / "model.pt", weights_only=True)


def kill_after_checkpoint(cmd: list[str], ckpt: Path, step: int) -> int:
    """Start `cmd`, SIGKILL its process group soon after a checkpoint at `step` or later; the newest step left."""
    store = CheckpointStore(ckpt)
    job = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while not any(c.step >= step for c in store.files()):
            assert job.poll() is None, "training ended before it could be killed"
            assert time.monotonic() < deadline, f"no checkpoint past step {step} in time"
            time.sleep(0.005)
    finally:
        os.killpg(job.pid, signal.SIGKILL)
        job.wait()
    return store.files()[-1].step


def assert_killed_run_resumes_bit_for_bit(np_: int, data: Path, tmp: Path, *extra: str) -> None:
    run(np_, data, tmp / "ref-out", tmp / "ref-ckpt", *extra)
    total = json.loads((tmp / "ref-out" / "metrics.json").read_text())["steps"]
    survivor = kill_after_checkpoint(command(np_, data, tmp / "out", tmp / "ckpt", *extra), tmp / "ckpt", total // 3)
    assert survivor < total, "the kill came too late to test anything"
    run(np_, data, tmp / "out", tmp / "ckpt", *extra)
    summary = json.loads((tmp / "out" / "metrics.json").read_text())
    assert summary["device"] == "cuda" and summary["resumed_from_step"] == survivor
    ref, resumed = weights(tmp / "ref-out"), weights(tmp / "out")
    assert ref.keys() == resumed.keys()
    for name in ref:
        assert torch.equal(ref[name], resumed[name]), f"parameter {name} differs after the resume on CUDA"


def test_single_gpu_run_trains_on_cuda_with_cuda_rng_states_in_its_checkpoints(demo_data: Path,
                                                                               tmp_path: Path) -> None:
    result = run(1, demo_data, tmp_path / "out", tmp_path / "ckpt")
    assert "training on cuda:0" in result.stderr
    summary = json.loads((tmp_path / "out" / "metrics.json").read_text())
    assert summary["device"] == "cuda" and summary["val_accuracy"] > 0.85
    _, state = CheckpointStore(tmp_path / "ckpt").latest_valid()  # type: ignore[misc]
    assert state["resume_key"]["device"] == "cuda"
    assert state["rng"][0]["cuda"].dtype == torch.uint8 and state["rng"][0]["cuda"].device.type == "cpu"


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_killed_single_gpu_run_resumes_bit_for_bit(demo_data: Path, tmp_path: Path, precision: str) -> None:
    assert_killed_run_resumes_bit_for_bit(1, demo_data, tmp_path, "--precision", precision)


@two_gpus
def test_killed_two_gpu_run_resumes_bit_for_bit(demo_data: Path, tmp_path: Path) -> None:
    assert_killed_run_resumes_bit_for_bit(2, demo_data, tmp_path, "--precision", "bf16", "--compression", "fp16")


def test_a_cpu_checkpoint_is_refused_on_the_gpu(demo_data: Path, tmp_path: Path) -> None:
    cpu = subprocess.run(command(1, demo_data, tmp_path / "out", tmp_path / "ckpt", "--epochs", "1", "--device", "cpu"),
                         capture_output=True, text=True, timeout=600)
    assert cpu.returncode == 0, cpu.stderr[-3000:]
    gpu = subprocess.run(command(1, demo_data, tmp_path / "out", tmp_path / "ckpt", "--epochs", "1"),
                         capture_output=True, text=True, timeout=600)
    assert gpu.returncode == 2 and "Traceback" not in gpu.stderr
    assert "device: 'cpu' there, 'cuda' here" in gpu.stderr
