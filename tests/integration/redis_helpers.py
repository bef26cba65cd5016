"""A private redis-server for a test: Debian's binary on 127.0.0.1, a free port, a data directory of its own
with the append-only file on, stopped by PID afterwards. Shared by the stream-scoring and the new-data
(AssetWatcher) tests.

    with redis_server(tmp_path) as server:      # or the `redis_server` fixture (see `redis_server_fixture`)
        client = redis.Redis.from_url(server.url)
        server.restart()                        # same port, same data dir: the AOF is replayed

Skips the test (with the reason) where `redis-server` is not installed.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import pytest

from nightshift.stream.redis_server import MISSING, REDIS_SERVER, RedisServer, free_port

__all__ = ["RedisServer", "free_port", "random_password", "redis_server", "redis_server_fixture"]

SKIP_REASON = f"{MISSING}; the stream tests need a real one"


@contextmanager
def redis_server(data_dir: Path, *, password: str | None = None, appendfsync: str = "everysec",
                 extra_config: Sequence[str] = ()) -> Iterator[RedisServer]:
    """A started RedisServer in `data_dir` (created; the caller removes it, e.g. a tmp_path), stopped after.
    Skips the calling test where redis-server is missing."""
    if REDIS_SERVER is None:
        pytest.skip(SKIP_REASON)
    server = RedisServer(data_dir, password=password, appendfsync=appendfsync, extra_config=extra_config)
    try:
        server.start()
        yield server
    finally:
        server.stop()


def random_password() -> str:
    return secrets.token_urlsafe(16)


@pytest.fixture
def redis_server_fixture(tmp_path: Path) -> Iterator[RedisServer]:
    """Import as `from tests.integration.redis_helpers import redis_server_fixture as redis_server`."""
    with redis_server(tmp_path / "redis") as server:
        yield server
