"""A private redis-server: Debian's binary on 127.0.0.1, a free port, a data directory of its own with the
append-only file on, stopped by its PID. Used by `make demo`'s stream part, the stream and new-data tests
and `bench stream`.

    server = RedisServer(data_dir, password=None)
    server.start()          # waits for PONG (not while the AOF is loading)
    server.restart()        # same port, same data dir: the append-only file is replayed
    server.stop()           # SIGTERM (or hard=True: SIGKILL) by PID, then wait
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Sequence
from contextlib import suppress
from pathlib import Path

from nightshift.netutil import free_port

HOST = "127.0.0.1"
REDIS_SERVER = shutil.which("redis-server") or ("/usr/bin/redis-server" if Path("/usr/bin/redis-server").exists()
                                                 else None)
MISSING = "redis-server is not installed (Debian: apt-get install redis-server)"


class RedisServer:
    """One redis-server process we own. `url` holds the password when there is one: never print it."""

    def __init__(self, data_dir: Path, *, password: str | None = None, appendfsync: str = "everysec",
                 extra_config: Sequence[str] = ()) -> None:
        if REDIS_SERVER is None:
            raise FileNotFoundError(MISSING)
        self.data_dir = data_dir
        self.port = free_port()
        self.password = password
        self.appendfsync = appendfsync
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = data_dir / "redis.log"
        data_dir.mkdir(parents=True, exist_ok=True)
        # Everything (the password too) goes in a config file, never on redis-server's command line.
        self.config_path = data_dir / "redis.conf"
        lines = [
            f"bind {HOST}",
            f"port {self.port}",
            f"dir {data_dir}",
            "appendonly yes",
            f"appendfsync {appendfsync}",
            "save ''",
            "daemonize no",
            f"logfile {self.log_path}",
            "protected-mode yes",
        ]
        if password:
            lines.append(f"requirepass {password}")
        lines.extend(extra_config)  # e.g. "maxmemory 1mb", "replicaof 127.0.0.1 PORT"
        self.config_path.write_text("\n".join(lines) + "\n")
        self.config_path.chmod(0o600)

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}{HOST}:{self.port}/0"

    @property
    def url_without_password(self) -> str:
        return f"redis://{HOST}:{self.port}/0"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None and self.proc.poll() is None else None

    def start(self, timeout: float = 30.0) -> None:
        assert REDIS_SERVER is not None
        self.proc = subprocess.Popen([REDIS_SERVER, str(self.config_path)], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode} at start; log:\n{self.log_tail()}")
            if self.answers():
                return
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"redis-server on port {self.port} did not answer PING in {timeout:.0f} s; "
                           f"log:\n{self.log_tail()}")

    def answers(self) -> bool:
        """PING over a raw socket (no client library): True once it answers PONG (not while -LOADING the AOF)."""
        try:
            with socket.create_connection((HOST, self.port), timeout=1) as sock:
                request = b""
                if self.password:
                    pw = self.password.encode()
                    request += b"*2\r\n$4\r\nAUTH\r\n$%d\r\n%s\r\n" % (len(pw), pw)
                request += b"*1\r\n$4\r\nPING\r\n"
                sock.sendall(request)
                expected_lines = 2 if self.password else 1
                reply = b""
                while reply.count(b"\r\n") < expected_lines:
                    chunk = sock.recv(256)
                    if not chunk:
                        break
                    reply += chunk
                return b"+PONG" in reply
        except OSError:
            return False

    def stop(self, *, hard: bool = False, timeout: float = 30.0) -> None:
        """SIGTERM (redis-server flushes the AOF and exits) or, with hard=True, SIGKILL; by PID, then wait."""
        proc = self.proc
        if proc is None:
            return
        if proc.poll() is None:
            with suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGKILL if hard else signal.SIGTERM)
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                with suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)
        self.proc = None

    def restart(self, *, hard: bool = False, down_for: float = 0.0) -> None:
        """Stop and start again on the same port and data directory: the append-only file is replayed.
        `down_for` keeps it down that many seconds (clients see connection errors meanwhile)."""
        self.stop(hard=hard)
        if down_for:
            time.sleep(down_for)
        self.start()

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"
