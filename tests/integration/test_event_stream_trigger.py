"""RedisStreamTrigger (operators/event_triggers.py) against a private redis-server, driven the way Airflow's
triggerer drives it (airflow.triggers.shared_stream.SharedStreamManager in ack mode): every entry of a burst is
delivered; an entry is acknowledged only once its trigger event is confirmed stored; what was delivered but not
confirmed, or published while nobody read, is delivered after a restart; Redis going away is waited out, not
raised. The whole path under `airflow standalone`: tests/integration/test_new_data_event.py."""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.integration.redis_helpers import RedisServer, redis_server

pytestmark = pytest.mark.integration

CONN_ID = "nightshift_stream_test"
GROUP = "airflow-new-data"
WAIT_S = 60.0  # a deadline for conditions, never a measured duration


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    with redis_server(tmp_path_factory.mktemp("redis")) as running:
        yield running


@pytest.fixture
def stream(server: RedisServer, monkeypatch: pytest.MonkeyPatch) -> str:
    """A stream key of the test's own on the shared server, reached through the Airflow connection CONN_ID."""
    monkeypatch.setenv(f"AIRFLOW_CONN_{CONN_ID.upper()}", server.url)
    return f"test.new-data.{secrets.token_hex(4)}"


def _client(server: RedisServer) -> Any:
    import redis

    return redis.Redis.from_url(server.url)


def _publish(server: RedisServer, stream: str, count: int, tag: str) -> list[str]:
    client = _client(server)
    try:
        return [client.xadd(stream, {"data": json.dumps({"n": i, "tag": tag})}).decode() for i in range(count)]
    finally:
        client.close()


def _pending(server: RedisServer, stream: str) -> int:
    client = _client(server)
    try:
        return int(client.xpending(stream, GROUP)["pending"])
    finally:
        client.close()


def _trigger(stream: str) -> Any:
    from operators.event_triggers import RedisStreamTrigger

    return RedisStreamTrigger(stream=stream, group=GROUP, redis_conn_id=CONN_ID, poll_interval=0.2)


class Triggerer:
    """The triggerer's side of one watcher in ack mode (TriggerRunner.run_trigger): subscribe, filter, bind each
    event as it leaves the trigger; `store` confirms events as persisted, as the supervisor's state sync does."""

    def __init__(self, trigger: Any) -> None:
        from airflow.triggers.shared_stream import SharedStreamManager

        self.manager = SharedStreamManager(ack_timeout=300.0)
        self.trigger = trigger
        self.key = trigger.shared_stream_key()
        self.events: list[tuple[dict[str, Any], int | None]] = []
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> Triggerer:
        events = self.trigger.filter_shared_stream(self.manager.subscribe(trigger_id=1, trigger=self.trigger,
                                                                          key=self.key))
        self._task = asyncio.create_task(self._drive(events))
        return self

    async def _drive(self, events: AsyncIterator[Any]) -> None:
        async for event in events:
            seq = self.manager.bind_pending_event(trigger_id=1, key=self.key)
            self.events.append((event.payload, seq))

    async def wait_events(self, count: int) -> list[dict[str, Any]]:
        async def enough() -> None:
            while len(self.events) < count:
                assert self._task is not None and not self._task.done(), self._task
                await asyncio.sleep(0.05)

        await asyncio.wait_for(enough(), WAIT_S)
        return [payload for payload, _ in self.events]

    def store(self, *indexes: int) -> None:
        seqs = [self.events[i][1] for i in indexes]
        assert None not in seqs, "the event is not bound to the stream's ack state: the trigger is not in ack mode"
        self.manager.confirm_persisted([s for s in seqs if s is not None])

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        await self.manager.unsubscribe(1, self.key)


async def _until(condition: Any) -> None:
    async def loop() -> None:
        while not condition():
            await asyncio.sleep(0.05)

    await asyncio.wait_for(loop(), WAIT_S)


def test_the_trigger_serializes_everything_it_needs_and_runs_in_ack_mode(stream: str) -> None:
    from airflow._shared.module_loading import import_string  # what the triggerer uses

    trigger = _trigger(stream)
    classpath, kwargs = trigger.serialize()
    again = import_string(classpath)(**kwargs)
    assert again.serialize() == (classpath, kwargs)
    assert kwargs == {"stream": stream, "group": GROUP, "consumer": "airflow-triggerer", "redis_conn_id": CONN_ID,
                      "poll_interval": 0.2}
    assert again.shared_stream_key() == trigger.shared_stream_key() is not None
    assert "create_shared_stream_producer" in type(trigger).__dict__  # what switches the triggerer to ack mode


def test_a_burst_is_delivered_whole_and_acknowledged_only_once_stored(server: RedisServer, stream: str) -> None:
    async def scenario() -> None:
        async with Triggerer(_trigger(stream)) as triggerer:
            ids = _publish(server, stream, 20, "burst")
            payloads = await triggerer.wait_events(20)
            assert [p["id"] for p in payloads] == ids
            assert [json.loads(p["data"])["n"] for p in payloads] == list(range(20))
            assert {p["stream"] for p in payloads} == {stream}
            assert _pending(server, stream) == 20  # delivered, none stored yet: none acknowledged

            triggerer.store(*range(10))
            await _until(lambda: _pending(server, stream) == 10)
            triggerer.store(*range(10, 20))
            await _until(lambda: _pending(server, stream) == 0)
            assert len(triggerer.events) == 20  # nothing delivered twice

    asyncio.run(scenario())


def test_what_was_not_stored_or_not_yet_read_is_delivered_after_a_restart(server: RedisServer, stream: str) -> None:
    async def first() -> list[str]:
        async with Triggerer(_trigger(stream)) as triggerer:
            ids = _publish(server, stream, 3, "before")
            await triggerer.wait_events(3)
            triggerer.store(0)  # the triggerer dies before the other two were stored
            await _until(lambda: _pending(server, stream) == 2)
        return ids

    async def second() -> list[str]:
        async with Triggerer(_trigger(stream)) as triggerer:
            payloads = await triggerer.wait_events(7)
            triggerer.store(*range(7))
            await _until(lambda: _pending(server, stream) == 0)
            return [p["id"] for p in payloads]

    ids = asyncio.run(first())
    down = _publish(server, stream, 5, "down")  # while no triggerer reads
    assert asyncio.run(second()) == ids[1:] + down


def test_events_published_before_any_triggerer_read_the_stream_are_delivered(server: RedisServer,
                                                                              stream: str) -> None:
    early = _publish(server, stream, 4, "early")  # the group does not exist yet

    async def scenario() -> list[str]:
        async with Triggerer(_trigger(stream)) as triggerer:
            payloads = await triggerer.wait_events(4)
            triggerer.store(*range(4))
            await _until(lambda: _pending(server, stream) == 0)
            return [p["id"] for p in payloads]

    assert asyncio.run(scenario()) == early


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture
def trigger_log() -> Iterator[Records]:
    """What operators.event_triggers logs (a handler of its own: Airflow's logging setup bypasses caplog)."""
    handler = Records()
    logger = logging.getLogger("operators.event_triggers")
    logger.addHandler(handler)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)


def test_redis_going_away_is_waited_out_not_raised(server: RedisServer, stream: str, trigger_log: Records) -> None:
    def failed_reads() -> int:
        return sum("Cannot read" in m for m in trigger_log.messages)

    async def scenario() -> None:
        async with Triggerer(_trigger(stream)) as triggerer:
            first = _publish(server, stream, 1, "up")
            await triggerer.wait_events(1)
            triggerer.store(0)
            await _until(lambda: _pending(server, stream) == 0)
            await asyncio.to_thread(server.stop)
            await _until(lambda: failed_reads() >= 2)  # past redis-py's own retries; the trigger's task lives on
            await asyncio.to_thread(server.start)
            later = _publish(server, stream, 2, "after")
            payloads = await triggerer.wait_events(3)  # raises if the trigger's task ended
            assert [p["id"] for p in payloads] == first + later
            triggerer.store(1, 2)
            await _until(lambda: _pending(server, stream) == 0)

    asyncio.run(scenario())


def test_publish_data_appends_to_the_stream_the_trigger_reads(server: RedisServer, stream: str,
                                                              nightshift_home: Path, demo_data: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    from nightshift import events

    source = nightshift_home / "data" / "landed"
    source.mkdir(parents=True)
    for file in demo_data.glob("*.parquet"):
        (source / file.name).write_bytes(file.read_bytes())
    monkeypatch.setenv(events.URL_ENV, server.url)
    monkeypatch.setenv(events.STREAM_ENV, stream)

    async def scenario() -> list[dict[str, Any]]:
        published = events.publish(source)
        assert published["waiting"] is None  # no triggerer has read the stream yet: kept, not dropped
        async with Triggerer(_trigger(stream)) as triggerer:
            payloads = await triggerer.wait_events(1)
            triggerer.store(0)
            await _until(lambda: _pending(server, stream) == 0)
        assert events.publish(source)["waiting"] == 1  # the group exists now; this one waits for it
        assert payloads[0]["id"] == published["id"]
        return payloads

    payloads = asyncio.run(scenario())
    assert events.parse_event(payloads[0]["data"])["source"] == str(source.resolve())
