"""The elastic trainer under a real elastic horovodrun on this machine: two "hosts" (`localhost` and
`127.0.0.1`, both run here without ssh), one rank each. The rank of one is killed mid-run: the other rolls
back to its last commit and goes on alone; after the blacklist cool-down Horovod adds the host back, a new
process joins with the state broadcast to it, and the job finishes, as accurate as an undisturbed run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.integration.horovod_helpers import HOROVODRUN

pytestmark = pytest.mark.integration

ARGS = ["--epochs", "60", "--batch-size", "16", "--threads", "1", "--seed", "11", "--log-every", "20",
        "--checkpoint-every", "200", "--commit-every", "10", "--elastic"]


def elastic_command(discovery: Path, data: Path, out: Path, ckpt: Path) -> list[str]:
    return [HOROVODRUN, "--gloo", "-np", "2", "--min-np", "1", "--max-np", "2", "--network-interfaces", "lo",
            "--blacklist-cooldown-range", "2", "120", "--host-discovery-script", str(discovery),
            sys.executable, "-m", "nightshift.train", "--data", str(data), "--out", str(out),
            "--checkpoint-dir", str(ckpt), *ARGS]


def descendants(root: int) -> list[int]:
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            parents.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [root]
    while todo:
        kids = parents.get(todo.pop(), [])
        found += kids
        todo += kids
    return found


def rank_on(host: str, root: int) -> int | None:
    """The training process horovodrun (`root`) started for `host`."""
    for pid in descendants(root):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if f"HOROVOD_HOSTNAME={host}".encode() in env and b"nightshift.train" in cmdline:
            return pid
    return None


def last_step(metrics: Path) -> int:
    if not metrics.exists():
        return 0
    steps = [json.loads(line).get("step", 0) for line in metrics.read_text().splitlines() if line.endswith("}")]
    return max(steps, default=0)


@pytest.fixture()
def discovery(tmp_path: Path) -> Path:
    script = tmp_path / "discover_hosts.sh"
    script.write_text("#!/bin/sh\necho localhost:1\necho 127.0.0.1:1\n")
    script.chmod(0o755)
    return script


def test_a_killed_rank_rolls_back_goes_on_alone_and_its_host_rejoins(
        tmp_path: Path, demo_data: Path, discovery: Path) -> None:
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    with open(tmp_path / "log", "w") as log:
        job = subprocess.Popen(elastic_command(discovery, demo_data, out, ckpt), stdout=log, stderr=subprocess.STDOUT,
                               start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while last_step(out / "metrics.jsonl") < 100 and job.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        victim = rank_on("127.0.0.1", job.pid)
        assert victim is not None, (tmp_path / "log").read_text()[-3000:]
        os.kill(victim, signal.SIGKILL)
        assert job.wait(timeout=300) == 0, (tmp_path / "log").read_text()[-5000:]
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
    text = (tmp_path / "log").read_text()
    summary = json.loads((out / "metrics.json").read_text())
    # The survivor saw both resets, the process started for the returning host says it joined.
    assert "elastic reset 1: now rank 0 of 1 (was rank" in text, text[-4000:]
    assert "elastic reset 2: now rank 0 of 2 (was rank 0 of 1)" in text, text[-4000:]
    assert "joined the running elastic job as rank 1 of 2" in text, text[-4000:]
    assert summary["elastic"]["world_sizes"] == [2, 1, 2]
    assert summary["steps_run"] > summary["steps"], "the steps since the last commit were trained again"

    # The same job undisturbed: the same accuracy within half a point.
    calm_out = tmp_path / "calm"
    calm = subprocess.run(elastic_command(discovery, demo_data, calm_out, tmp_path / "calm-ckpt"),
                          capture_output=True, text=True, timeout=300)
    assert calm.returncode == 0, calm.stderr[-3000:]
    undisturbed = json.loads((calm_out / "metrics.json").read_text())
    assert undisturbed["elastic"]["world_sizes"] == [2]
    assert abs(summary["val_accuracy"] - undisturbed["val_accuracy"]) <= 0.005, (summary, undisturbed)
