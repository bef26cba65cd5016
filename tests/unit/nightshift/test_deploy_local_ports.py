"""A local deploy's port: a server counts as up only on a port it listens on itself, and a port another process
took first (two models deployed at once) is given up for another, leaving nothing behind. Without MLflow: the
model servers are stand-ins (tests/integration/test_deploy_local.py deploys real ones)."""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from nightshift import settings
from nightshift.deploy import local
from nightshift.deploy.local import PORT_TRIES, PortTaken, wait_healthy
from nightshift.errors import DeploymentFailed
from nightshift.netutil import free_port

NO_GROUP = 4_000_000  # above Linux's largest PID (2**22): a process group without processes


class _Ping(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200)
        self.end_headers()

    def log_message(self, *_args: Any) -> None:
        pass


@contextmanager
def ping_server() -> Iterator[int]:
    """A server answering every GET with 200, in this test's own process group; yields its port."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Ping)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


class _Proc:
    """What wait_healthy reads of a server process: its PID (the process group) and whether it exited."""

    def __init__(self, pid: int = NO_GROUP, returncode: int | None = None) -> None:
        self.pid, self.returncode = pid, returncode

    def poll(self) -> int | None:
        return self.returncode


@pytest.fixture
def listener() -> Iterator[socket.socket]:
    """Another process's server, as far as a model server in another process group can tell: a socket
    listening on a free port of 127.0.0.1."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock


def test_another_process_listening_on_the_port_is_port_taken_not_a_healthy_server(
        listener: socket.socket, tmp_path: Path) -> None:
    """Before: /ping answered by whoever listened there counted as this server's answer."""
    port = listener.getsockname()[1]
    with pytest.raises(PortTaken, match=f"another process listens on port {port}"):
        wait_healthy(f"http://127.0.0.1:{port}", _Proc(), tmp_path / "server.log", timeout=30,  # type: ignore[arg-type]
                     port=port)


def test_a_server_that_listens_on_its_port_itself_is_healthy(tmp_path: Path) -> None:
    with ping_server() as port:  # in this test's own process group
        wait_healthy(f"http://127.0.0.1:{port}", _Proc(os.getpgrp()), tmp_path / "server.log",  # type: ignore[arg-type]
                     timeout=30, port=port)


def test_a_server_that_exits_because_its_address_is_in_use_is_port_taken(tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    log.write_text("an earlier start's line: [Errno 98] address already in use\n")
    offset = log.stat().st_size
    port = free_port()
    # what this start logged is another failure: not a port taken, whatever an earlier start logged
    with log.open("a") as handle:
        handle.write("ModuleNotFoundError: No module named 'torch'\n")
    with pytest.raises(DeploymentFailed, match="exited with code 1") as other:
        wait_healthy(f"http://127.0.0.1:{port}", _Proc(returncode=1), log, timeout=30,  # type: ignore[arg-type]
                     port=port, log_offset=offset)
    assert not isinstance(other.value, PortTaken)
    offset = log.stat().st_size
    with log.open("a") as handle:
        handle.write(f"ERROR: [Errno 98] error while attempting to bind on address ('127.0.0.1', {port}): "
                     f"address already in use\n")
    with pytest.raises(PortTaken, match=f"could not bind port {port}"):
        wait_healthy(f"http://127.0.0.1:{port}", _Proc(returncode=1), log, timeout=30,  # type: ignore[arg-type]
                     port=port, log_offset=offset)


def _staged(model_name: str) -> Path:
    staging = settings.serving_dir() / "models" / f".{model_name}-v1.tmp"
    staging.mkdir(parents=True)
    (staging / "MLmodel").write_text("flavors: {}\n")
    return staging


def _servers(monkeypatch: pytest.MonkeyPatch, ports: list[int], taken: set[int]) -> list[tuple[str, Any]]:
    """Stand-in servers on `ports` in turn; those on `taken` ports meet PortTaken. Returns the calls made."""
    calls: list[tuple[str, Any]] = []
    chosen = iter(ports)
    monkeypatch.setattr(local, "free_port", lambda: next(chosen))

    def start(model_path: Path, port: int, log_path: Path, server: str, range_policy: str = "accept") -> _Proc:
        assert (model_path / "MLmodel").is_file(), "the server starts on the model's files"
        calls.append(("start", port))
        return _Proc(pid=port)

    def healthy(url: str, proc: _Proc, log_path: Path, timeout: float, *, port: int, log_offset: int) -> None:
        if port in taken:
            raise PortTaken(f"another process listens on port {port}, chosen for this model server")

    def stop(pid: int) -> bool:
        calls.append(("stop", pid))
        return True

    monkeypatch.setattr(local, "start_server", start)
    monkeypatch.setattr(local, "wait_healthy", healthy)
    monkeypatch.setattr(local, "stop_server", stop)
    return calls


def test_a_port_taken_first_is_given_up_and_the_server_started_on_another(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _servers(monkeypatch, [7001, 7002], taken={7001})
    proc, port, model_path, _log = local._start_on_a_free_port("m", "1", _staged("m"), "mlflow", 30)
    assert (port, proc.pid) == (7002, 7002)
    assert calls == [("start", 7001), ("stop", 7001), ("start", 7002)]
    models = settings.serving_dir() / "models"
    assert model_path == models / "m-v1-7002" and (model_path / "MLmodel").is_file()
    assert sorted(p.name for p in models.iterdir()) == ["m-v1-7002"]  # nothing of the first try is left


def test_when_every_try_finds_its_port_taken_the_error_says_so_and_nothing_is_left(
        monkeypatch: pytest.MonkeyPatch) -> None:
    ports = list(range(7101, 7101 + PORT_TRIES + 1))
    calls = _servers(monkeypatch, ports, taken=set(ports))
    with pytest.raises(DeploymentFailed) as failed:
        local._start_on_a_free_port("m", "1", _staged("m"), "mlflow", 30)
    message = str(failed.value)
    assert f"each of {PORT_TRIES} free ports was taken by another process" in message and "deploy again" in message
    assert all(f"port {port}" in message for port in ports[:PORT_TRIES])
    assert [c for c in calls if c[0] == "start"] == [("start", p) for p in ports[:PORT_TRIES]]  # bounded
    assert [c for c in calls if c[0] == "stop"] == [("stop", p) for p in ports[:PORT_TRIES]]  # each one stopped
    assert list((settings.serving_dir() / "models").iterdir()) == []


def test_a_startup_failure_other_than_the_port_stops_the_server_and_removes_the_model(
        monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _servers(monkeypatch, [7201, 7202], taken=set())

    def broken(url: str, proc: _Proc, log_path: Path, timeout: float, *, port: int, log_offset: int) -> None:
        raise DeploymentFailed("model server exited with code 1 before answering")

    monkeypatch.setattr(local, "wait_healthy", broken)
    with pytest.raises(DeploymentFailed, match="exited with code 1"):
        local._start_on_a_free_port("m", "1", _staged("m"), "mlflow", 30)
    assert calls == [("start", 7201), ("stop", 7201)]  # not retried on another port
    assert list((settings.serving_dir() / "models").iterdir()) == []


# --- a redeploy of the version the record names ------------------------------------------------------------


def test_a_recorded_server_whose_port_another_process_now_serves_is_not_already_serving(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The recorded server died and another model's server (deployed at the same time, on the port chosen
    freely) answers /ping on its port: the redeploy of the recorded version starts it again. Before: that
    answer counted as the recorded server's, the deploy said `already_serving` and moved @champion to a URL
    that serves another model."""
    with ping_server() as port:  # another model's server, not the recorded process
        local._write_record("m", {"model_name": "m", "version": "1", "url": f"http://127.0.0.1:{port}",
                                  "port": port, "pid": NO_GROUP, "model_path": str(tmp_path / "m-v1")})
        aliases: list[tuple[str, str]] = []
        monkeypatch.setattr(local.registry, "get_version", lambda name, version: object())
        monkeypatch.setattr(local.registry, "set_alias", lambda name, alias, version: aliases.append((alias, version)))
        monkeypatch.setattr(local.registry, "evaluated_accuracy", lambda selected: 0.9)

        class Redeployed(Exception):
            pass

        def download(model_name: str, version: str) -> Path:
            raise Redeployed(f"{model_name} v{version}")

        monkeypatch.setattr(local, "_download", download)
        with pytest.raises(Redeployed, match="m v1"):
            local.deploy_local("m", data_dir=tmp_path, version="1")
        assert aliases == []
        # the recorded server's own listener (this test's process group) is still serving it
        local._write_record("m", {**local.read_record("m"), "pid": os.getpgrp()})  # type: ignore[dict-item]
        again = local.deploy_local("m", data_dir=tmp_path, version="1")
        assert again["status"] == "already_serving" and again["port"] == port
        assert aliases == [(local.registry.CHAMPION, "1")]


@pytest.mark.parametrize("policy", ["accept", "refuse"])
def test_the_server_process_gets_the_declared_range_policy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           policy: str) -> None:
    """deploy.options.range_policy reaches the served model: its server's environment (issue 34)."""
    from nightshift.served_model import RANGE_POLICY_ENV

    seen: list[dict[str, str]] = []

    class Started:
        pid = 0

    def popen(command: list[str], **kwargs: Any) -> Started:
        seen.append(kwargs["env"])
        return Started()

    monkeypatch.setenv(RANGE_POLICY_ENV, "refuse" if policy == "accept" else "accept")  # the caller's is not used
    monkeypatch.setattr(local.subprocess, "Popen", popen)
    local.start_server(tmp_path / "model", 1234, tmp_path / "logs" / "server.log", range_policy=policy)
    assert seen[0][RANGE_POLICY_ENV] == policy


def test_an_unknown_range_policy_is_refused_before_anything_is_served(tmp_path: Path) -> None:
    from nightshift.errors import UsageError

    with pytest.raises(UsageError, match=r"range_policy 'clip': use one of accept, refuse"):
        local.start_server(tmp_path / "model", 1234, tmp_path / "server.log", range_policy="clip")
