"""`nightshift publish-data` against a private redis-server: the stream gets exactly one entry naming the data
source, kept when nobody reads yet; Redis down, a wrong password and a directory outside the data roots are each
one line on stderr and a non-zero exit, with no secret in it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.integration.redis_helpers import RedisServer, free_port, random_password, redis_server

pytestmark = pytest.mark.integration

NIGHTSHIFT = str(Path(sys.executable).parent / "nightshift")


@pytest.fixture
def server(tmp_path: Path) -> Iterator[RedisServer]:
    with redis_server(tmp_path / "redis") as running:
        yield running


@pytest.fixture
def source(nightshift_home: Path, demo_data: Path) -> Path:
    out = nightshift_home / "data" / "landed"
    out.mkdir(parents=True)
    for file in demo_data.glob("*.parquet"):
        (out / file.name).write_bytes(file.read_bytes())
    return out


def _publish(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("NIGHTSHIFT_EVENTS_")}
    environ.update(env or {})
    return subprocess.run([NIGHTSHIFT, "publish-data", *args], env=environ, capture_output=True, text=True,
                          timeout=120, check=False)


def _entries(url: str, stream: str) -> list[dict[str, Any]]:
    """The events in `stream`, oldest first."""
    import redis

    client = redis.Redis.from_url(url)
    try:
        return [json.loads(fields[b"data"]) for _, fields in client.xrange(stream)]
    finally:
        client.close()


def test_the_event_is_appended_to_the_stream_with_the_source(server: RedisServer, source: Path) -> None:
    proc = _publish(str(source), "--redis", server.url)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["stream"] == "nightshift.new-data" and result["id"]
    received = _entries(server.url, "nightshift.new-data")
    assert received == [result["event"]]
    assert received[0]["source"] == str(source.resolve())
    assert {f["name"] for f in received[0]["files"]} == {"train.parquet", "validation.parquet", "test.parquet"}


def test_the_url_and_stream_from_the_environment(server: RedisServer, source: Path) -> None:
    proc = _publish(str(source), env={"NIGHTSHIFT_EVENTS_REDIS_URL": server.url,
                                      "NIGHTSHIFT_EVENTS_STREAM": "team.data"})
    assert proc.returncode == 0, proc.stderr
    assert len(_entries(server.url, "team.data")) == 1


def test_with_nobody_reading_the_event_is_kept_not_dropped(server: RedisServer, source: Path) -> None:
    for _ in range(2):
        proc = _publish(str(source), "--redis", server.url, "--stream", "nobody.reads.yet")
        assert proc.returncode == 0, proc.stderr
        assert json.loads(proc.stdout)["waiting"] is None  # no consumer group yet: Airflow reads it when it starts
    assert len(_entries(server.url, "nobody.reads.yet")) == 2


def test_redis_down_names_the_server(source: Path) -> None:
    port = free_port()  # nothing listens there
    proc = _publish(str(source), "--redis", f"redis://127.0.0.1:{port}/0")
    assert proc.returncode == 1
    assert proc.stderr.startswith(f"nightshift publish-data: Redis at redis://127.0.0.1:{port}/0 does not answer")
    assert proc.stderr.count("\n") == 1


def test_a_wrong_password_is_named_but_never_shown(tmp_path: Path, source: Path) -> None:
    with redis_server(tmp_path / "redis-pw", password=random_password()) as guarded:
        wrong = f"redis://:not-{guarded.password}@127.0.0.1:{guarded.port}/0"
        proc = _publish(str(source), env={"NIGHTSHIFT_EVENTS_REDIS_URL": wrong})
        assert proc.returncode == 1
        assert "refused the credentials" in proc.stderr or "does not answer" in proc.stderr
        assert guarded.password not in proc.stderr and "***" in proc.stderr

        proc = _publish(str(source), env={"NIGHTSHIFT_EVENTS_REDIS_URL": guarded.url})
        assert proc.returncode == 0, proc.stderr
        assert guarded.password not in proc.stdout  # the result names the Redis without its password
        assert len(_entries(guarded.url, "nightshift.new-data")) == 1


def test_a_directory_outside_the_data_roots_is_refused_before_anything_is_sent(server: RedisServer,
                                                                               demo_data: Path) -> None:
    proc = _publish(str(demo_data), "--redis", server.url)
    assert proc.returncode == 2
    assert "outside the allowed data roots" in proc.stderr and "NIGHTSHIFT_DATA_ROOTS" in proc.stderr
    assert _entries(server.url, "nightshift.new-data") == []
