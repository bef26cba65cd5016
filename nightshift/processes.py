"""Which process a record names: host, pid and the process's start time, so that a later process that reused
the pid (or a process of another machine sharing the files) is never taken for it. Standard library only."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any


def start_ticks(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (field 22 of /proc/PID/stat); None when it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rpartition(")")[2].split()[19])


def identity(pid: int) -> dict[str, Any]:
    """What names process `pid` of this machine: {"host", "pid", "start"}."""
    return {"host": socket.gethostname(), "pid": pid, "start": start_ticks(pid)}


def on_this_host(record: dict[str, Any]) -> bool:
    return record.get("host") == socket.gethostname()


def still_running(record: dict[str, Any]) -> bool:
    """The process `record` (an `identity`) names is this machine's and has not ended (its pid not reused)."""
    start = record.get("start")
    return on_this_host(record) and start is not None and start_ticks(int(record["pid"])) == start
