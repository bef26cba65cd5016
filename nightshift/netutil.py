"""Small network helpers shared by the model server, the private redis-server and the tests."""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterable
from pathlib import Path

LOOPBACK = "127.0.0.1"
_LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp's `st` column
_TCP_TABLES = ("/proc/net/tcp", "/proc/net/tcp6")


def free_port(host: str = LOOPBACK) -> int:
    """A TCP port free on `host` now (the kernel's choice); whoever binds it next may still lose a race."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def free_ports(count: int, host: str = LOOPBACK) -> list[int]:
    """`count` distinct TCP ports free on `host` now. Picked while all are held open: calling free_port() several
    times may hand back a port twice (the kernel may reuse one just closed), which one server then fails to bind
    (seen: an MLServer whose REST and metrics ports were both 43047)."""
    with contextlib.ExitStack() as held:
        ports = []
        for _ in range(count):
            sock = held.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            sock.bind((host, 0))
            ports.append(int(sock.getsockname()[1]))
        return ports


def listening_sockets(port: int) -> set[int] | None:
    """The inodes of the TCP sockets listening on `port` on any address (IPv4 and IPv6), from /proc/net/tcp*;
    None where the kernel does not publish those tables (not Linux), so that a caller can skip the check."""
    found: set[int] = set()
    readable = False
    for table in _TCP_TABLES:
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        readable = True
        for line in lines:
            # sl local_address rem_address st tx_queue:rx_queue tr:tm->when retrnsmt uid timeout inode ...
            fields = line.split()
            if len(fields) > 9 and fields[3] == _LISTEN and int(fields[1].rsplit(":", 1)[1], 16) == port:
                found.add(int(fields[9]))
    return found if readable else None


def socket_inodes(pids: Iterable[int]) -> set[int]:
    """The inodes of the sockets the processes `pids` hold open (those of this user: others' are unreadable)."""
    inodes: set[int] = set()
    for pid in pids:
        with contextlib.suppress(OSError):
            for fd in os.scandir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    target = os.readlink(fd.path)
                    if target.startswith("socket:["):
                        inodes.add(int(target[8:-1]))
    return inodes
