"""The faults a season's night may suffer (bench.season.script.FAULTS), each on this season's processes and
folders only: trainer ranks and model servers are told apart from anyone else's by the season's NIGHTSHIFT_HOME in
their command line or environment."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
from pathlib import Path
from typing import Any


def _ours(proc: Any, home: Path) -> bool:
    import psutil

    try:
        if any(str(home) in part for part in proc.cmdline()):
            return True
        return proc.environ().get("NIGHTSHIFT_HOME") == str(home)
    except (psutil.Error, OSError):
        return False


def trainer_ranks(home: Path) -> list[int]:
    """PIDs of this season's trainer ranks (`python -m nightshift.train` under its NIGHTSHIFT_HOME)."""
    import psutil

    ranks = []
    for proc in psutil.process_iter():
        try:
            if proc.cmdline()[1:3] == ["-m", "nightshift.train"] and _ours(proc, home):
                ranks.append(proc.pid)
        except (psutil.Error, OSError, IndexError):
            continue
    return ranks


def checkpoints(home: Path, dag_id: str, run_id: str) -> list[Path]:
    from nightshift.fsutil import safe_name

    return sorted((home / "checkpoints" / safe_name(dag_id) / safe_name(run_id)).glob("*/ckpt-*.pt"))


def kill_rank(home: Path) -> int | None:
    """SIGKILL the last rank of this season's training; its PID, or None when none runs."""
    ranks = sorted(trainer_ranks(home))
    if not ranks:
        return None
    with contextlib.suppress(ProcessLookupError):
        os.kill(ranks[-1], signal.SIGKILL)
    return ranks[-1]


def _machine_of(leader: int) -> set[int]:
    import psutil

    pids = {leader}
    with contextlib.suppress(psutil.NoSuchProcess):
        pids |= {p.pid for p in psutil.Process(leader).children(recursive=True)}
    for proc in psutil.process_iter():
        with contextlib.suppress(psutil.Error, OSError):
            if os.getpgid(proc.pid) == leader:
                pids.add(proc.pid)
    return pids


def lose_machine(leader: int) -> set[int]:
    """Freeze everything of the process group `leader` leads and its descendants (until nothing new appears), then
    SIGKILL it all (as tests/integration/test_celery_executor.py loses a worker's machine)."""
    stopped: set[int] = set()
    for _ in range(5):
        new = _machine_of(leader) - stopped
        if not new:
            break
        for pid in new:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)
        stopped |= new
    with contextlib.suppress(ProcessLookupError):
        os.killpg(leader, signal.SIGKILL)
    for pid in stopped:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return stopped


def serving_record(home: Path, model_name: str) -> dict[str, Any] | None:
    try:
        return dict(json.loads((home / "serving" / f"{model_name}.json").read_text()))
    except (FileNotFoundError, ValueError):
        return None


def kill_model_server(home: Path, model_name: str) -> int | None:
    """SIGKILL the model server the serving record names (its process group); its PID, or None."""
    record = serving_record(home, model_name)
    if not record or not record.get("pid"):
        return None
    pid = int(record["pid"])
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)
    return pid


def make_read_only(folder: Path) -> None:
    """A read-only bind mount of `folder` over itself: writes fail with EROFS, root's included."""
    folder.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "--bind", str(folder), str(folder)], check=True, capture_output=True, timeout=30)
    done = subprocess.run(["mount", "-o", "remount,bind,ro", str(folder)], capture_output=True, text=True,
                          timeout=30, check=False)
    if done.returncode != 0:
        subprocess.run(["umount", str(folder)], check=False, capture_output=True, timeout=30)
        raise RuntimeError(f"mount -o remount,bind,ro {folder}: {done.stderr.strip()}")


def make_writable(folder: Path) -> None:
    subprocess.run(["umount", str(folder)], check=True, capture_output=True, timeout=60)


def mounts_under(root: Path) -> list[str]:
    """Mount points at or under `root` (what a read-only remote left behind)."""
    found = []
    with open("/proc/self/mountinfo") as info:
        for line in info:
            point = line.split()[4].replace("\\040", " ")
            if point == str(root) or point.startswith(f"{root}/"):
                found.append(point)
    return found
