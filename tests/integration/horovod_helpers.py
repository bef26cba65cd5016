"""Real `horovodrun --gloo` training jobs on this machine, shared by test_train_horovod and
test_kueue_preemption: the command, a run that must succeed, and bit-for-bit weight comparison; and the
processes left behind by a run, for the emulated-host tests (test_run_mpijob, test_hosts_backend)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

HOROVODRUN = str(Path(sys.executable).with_name("horovodrun"))
# 6 epochs × 40 steps: long enough to be killed mid-run, short enough for CI.
TRAIN_ARGS = ["--epochs", "6", "--batch-size", "16", "--checkpoint-every", "10", "--log-every", "10",
              "--threads", "1", "--seed", "7"]


def command(data: Path, out: Path, ckpt: Path, *extra: str) -> list[str]:
    return [HOROVODRUN, "-np", "2", "-H", "localhost:2", "--gloo", sys.executable, "-m", "nightshift.train",
            "--data", str(data), "--out", str(out), "--checkpoint-dir", str(ckpt), *TRAIN_ARGS, *extra]


def run(data: Path, out: Path, ckpt: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(command(data, out, ckpt, *extra), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def weights(out: Path) -> dict[str, torch.Tensor]:
    return torch.load(out / "model.pt", weights_only=True)


def assert_bitwise_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), f"parameter {name} differs"


def processes_mentioning(*needles: str, pids: list[str] | None = None) -> list[str]:
    """"PID: command line" of each process (of `pids`, default all) whose command line holds one of `needles`."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or (pids is not None and entry.name not in pids):
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if any(needle in cmdline for needle in needles):
            found.append(f"{entry.name}: {cmdline[:200]}")
    return found
