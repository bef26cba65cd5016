"""free_ports: several ports for one server are distinct even where the kernel hands a just-closed port out again."""

from __future__ import annotations

import socket
from typing import Any

import pytest

from nightshift import netutil


class _ReusingKernel:
    """bind(("h", 0)) gets the lowest port not bound right now: what a kernel may do with a port just closed."""

    def __init__(self) -> None:
        self.bound: set[int] = set()

    def socket(self, *args: Any) -> _Socket:
        return _Socket(self)


class _Socket:
    def __init__(self, kernel: _ReusingKernel) -> None:
        self.kernel, self.port = kernel, 0

    def bind(self, address: tuple[str, int]) -> None:
        self.port = min(p for p in range(40000, 40100) if p not in self.kernel.bound)
        self.kernel.bound.add(self.port)

    def getsockname(self) -> tuple[str, int]:
        return ("127.0.0.1", self.port)

    def __enter__(self) -> _Socket:
        return self

    def __exit__(self, *exc: object) -> None:
        self.kernel.bound.discard(self.port)


def test_ports_picked_together_are_distinct_where_the_kernel_reuses_a_closed_port(
        monkeypatch: pytest.MonkeyPatch) -> None:
    kernel = _ReusingKernel()
    monkeypatch.setattr(netutil.socket, "socket", kernel.socket)
    assert [netutil.free_port(), netutil.free_port()] == [40000, 40000]  # what one at a time may give
    assert netutil.free_ports(3) == [40000, 40001, 40002]
    assert kernel.bound == set()  # all closed again


def test_free_ports_are_bindable_on_loopback() -> None:
    ports = netutil.free_ports(5)
    assert len(set(ports)) == 5
    for port in ports:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))
