"""RedisStreamTrigger (operators/event_triggers.py) against a private redis-server, driven the way Airflow's
triggerer drives it (airflow.triggers.shared_stream.SharedStreamManager in ack mode): every entry of a burst is
delivered; an entry is acknowledged only once its trigger event is confirmed stored; what was delivered but not
confirmed, or published while nobody read, is delivered after a restart; Redis going away is waited out, not
raised. The whole path under `airflow standalone`: tests/integration/test_new_data_event.py."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import secrets
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.integration.redis_helpers import RedisServer, redis_server

pytestmark = pytest.mark.integration

CONN_ID = "nightshift_stream_test"
GROUP = "airflow-new-data"
WAIT_S = 60.0  # a deadline for conditions, never a measured duration
REPO = Path(__file__).resolve().parents[2]


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


def _trigger(stream: str, claim_idle_s: float = 2.0) -> Any:
    from operators.event_triggers import RedisStreamTrigger

    return RedisStreamTrigger(stream=stream, group=GROUP, redis_conn_id=CONN_ID, poll_interval=0.2,
                              claim_idle_s=claim_idle_s)


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
                      "poll_interval": 0.2, "claim_idle_s": 2.0}
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
    # The new ones are read at once; the dead triggerer's two once they have waited claim_idle_s.
    delivered = asyncio.run(second())
    assert sorted(delivered) == sorted(ids[1:] + down) and len(delivered) == 7


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


# --- Faults from the hostile review of the stream trigger (each failed before its fix) -------------------------


# --- 1. two triggerers (HA) running the watcher at once: same consumer name, same pending list ------------------


def test_a_second_triggerer_taking_over_the_watcher_does_not_record_entries_the_first_still_holds(
        server: RedisServer, stream: str) -> None:
    """Airflow reassigns a trigger whose triggerer missed its heartbeat (triggerer_health_check_threshold) while
    that triggerer may still be running it: for a while two triggerer processes run the watcher. Both read as the
    fixed consumer "airflow-triggerer", so the newcomer's start-up read of "its" pending entries (XREADGROUP from 0)
    returns the entries the first one has delivered and is about to store: both store them. The module docstring
    says a duplicate only happens when a triggerer died between storing and acknowledging."""

    async def scenario() -> list[str]:
        async with Triggerer(_trigger(stream)) as first:
            ids = _publish(server, stream, 5, "ha")
            await first.wait_events(5)  # delivered by the first triggerer; its state sync has not confirmed yet
            async with Triggerer(_trigger(stream)) as second:  # the same watcher, reassigned, first still alive
                await asyncio.sleep(5.0)  # past claim_idle_s (2 s): the first's heartbeat keeps its entries
                first.store(*range(5))
                await _until(lambda: _pending(server, stream) == 0)
                if second.events:
                    second.store(*range(len(second.events)))
                await asyncio.sleep(1.0)
                delivered = [p["id"] for p, _ in first.events + second.events]
        assert len(set(delivered)) == len(ids)
        return delivered

    delivered = asyncio.run(scenario())
    assert len(delivered) == 5, f"5 entries became {len(delivered)} trigger events (asset events): {delivered}"


# --- 2. a pending-list re-read racing an acknowledgement -----------------------------------------------------


def test_a_pending_list_read_answered_before_an_ack_does_not_deliver_the_acknowledged_entries_again(
        server: RedisServer, stream: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """After any Redis error the producer re-reads its pending entries from 0 and skips those in `_in_flight`. That
    read and the advance pump's XACK run on two threads: when Redis answers the read before it executes the XACK
    but the poll task sees the answer after `advance` removed the entries from `_in_flight`, the entries (whose
    asset events are stored and acknowledged) are yielded again. Forced here by holding the read's answer back
    (a slow reply / busy GIL); Redis itself is a real one."""
    import redis

    from operators import event_triggers as et

    real_call = et.RedisStreamProducer._call
    state: dict[str, Any] = {"fail_next_read": False, "hold_next_pel_read": False}

    async def call(self: Any, method: str, *args: Any, **kwargs: Any) -> Any:
        if method == "xreadgroup" and state["fail_next_read"] and args[2][self.stream] == ">":
            state["fail_next_read"] = False
            raise redis.ConnectionError("connection dropped (injected)")  # a Redis blip past redis-py's retries
        result = await real_call(self, method, *args, **kwargs)
        if method == "xreadgroup" and state["hold_next_pel_read"] and args[2][self.stream] != ">":
            state["hold_next_pel_read"] = False
            state["answered"].set()  # Redis has answered the pending-list read
            await state["release"].wait()  # ... and the answer reaches the poll task late
        return result

    monkeypatch.setattr(et.RedisStreamProducer, "_call", call)

    async def scenario() -> list[str]:
        state["answered"], state["release"] = asyncio.Event(), asyncio.Event()
        async with Triggerer(_trigger(stream)) as triggerer:
            _publish(server, stream, 3, "race")
            await triggerer.wait_events(3)  # in flight, not yet confirmed stored
            state["hold_next_pel_read"] = True
            state["fail_next_read"] = True  # the blip: after it, the producer re-reads its pending list from 0
            await asyncio.wait_for(state["answered"].wait(), 60)
            triggerer.store(0, 1, 2)  # the state sync confirms the three stored; the pump XACKs them
            await _until(lambda: _pending(server, stream) == 0)
            state["release"].set()
            await asyncio.sleep(2.0)
            return [p["id"] for p, _ in triggerer.events]

    delivered = asyncio.run(scenario())
    assert len(delivered) == 3, f"3 stored and acknowledged entries were delivered {len(delivered)} times: {delivered}"


# --- 3. a pending entry trimmed by the retention: lost without a word ----------------------------------------


def test_a_pending_entry_trimmed_before_it_was_recorded_is_reported(
        server: RedisServer, stream: str, trigger_log: Records) -> None:
    """A triggerer delivered an entry and stopped before storing it; meanwhile the retention (XADD MAXLEN ~) trimmed
    it. The producer has a branch for this ("Entry ... was trimmed before it was recorded; acknowledging it", a
    warning), but every (re)start runs _claim_stale first, and Redis 7's XAUTOCLAIM removes ids whose entries no
    longer exist from the pending list whatever their idle time (the third element of its reply, ignored), so the
    read from 0 never sees the entry and the warning branch never runs: an event lost without any trace. The
    The docs (docs/how-to/new-data.md) only admit losing entries trimmed "before any triggerer read it"."""
    client = _client(server)
    try:
        client.xgroup_create(stream, GROUP, id="0", mkstream=True)
        (lost,) = _publish(server, stream, 1, "trimmed")
        client.xreadgroup(GROUP, "airflow-triggerer", {stream: ">"}, count=1)  # delivered, never stored
        client.xdel(stream, lost)  # what MAXLEN ~ does to the oldest entries of a long backlog
        assert int(client.xpending(stream, GROUP)["pending"]) == 1
    finally:
        client.close()

    async def scenario() -> None:
        async with Triggerer(_trigger(stream)):
            await _until(lambda: _pending(server, stream) == 0)
            await asyncio.sleep(0.5)

    asyncio.run(scenario())
    assert any(lost in m for m in trigger_log.messages), (
        f"entry {lost} left the pending list without a word: {trigger_log.messages}")


# --- 4. the consumer group gone, the stream kept: re-created at 0 --------------------------------------------


def test_a_recreated_group_does_not_replay_entries_already_recorded(server: RedisServer, stream: str) -> None:
    """NOGROUP makes the producer re-create the group at id 0: when only the group went (XGROUP DESTROY, a restore
    of the stream key without its group), every retained entry (up to NIGHTSHIFT_EVENTS_RETENTION, 10000) is
    delivered and recorded again, though this very producer knows what it already acknowledged."""

    async def scenario() -> list[str]:
        async with Triggerer(_trigger(stream)) as triggerer:
            _publish(server, stream, 3, "recorded")
            await triggerer.wait_events(3)
            triggerer.store(0, 1, 2)
            await _until(lambda: _pending(server, stream) == 0)
            client = _client(server)
            try:
                client.xgroup_destroy(stream, GROUP)
            finally:
                client.close()
            await asyncio.sleep(4.0)  # NOGROUP, backoff 1 s, the group made again
            return [p["id"] for p, _ in triggerer.events]

    delivered = asyncio.run(scenario())
    assert len(delivered) == 3, f"3 recorded entries were delivered {len(delivered)} times: {delivered}"


# --- 5. the Redis password in publish-data's errors ----------------------------------------------------------


@pytest.mark.parametrize("password", ["Zq9k2Lm/x+Pw8", "Zq9k2Lm#x8Pw8", "Zq9k2Lm?x8Pw8"],
                         ids=["slash", "hash", "question-mark"])
def test_publish_data_never_prints_any_part_of_the_password(server: RedisServer, nightshift_home: Path,
                                                            demo_data: Path, password: str) -> None:
    """A generated password (base64 has '/' and '+') put in NIGHTSHIFT_EVENTS_REDIS_URL unencoded: redis-py cannot
    parse the URL and raises a ValueError outside publish's try ("Port could not be cast to integer value as
    'Zq9k2Lm'"); the CLI catches NightshiftError only, so `nightshift publish-data` dies with a traceback that
    shows the start of the password on stderr (CI logs, cron mail)."""
    import os

    source = nightshift_home / "data" / "landed"
    source.mkdir(parents=True)
    for file in demo_data.glob("*.parquet"):
        (source / file.name).write_bytes(file.read_bytes())
    env = {k: v for k, v in os.environ.items() if not k.startswith("NIGHTSHIFT_EVENTS_")}
    env["NIGHTSHIFT_EVENTS_REDIS_URL"] = f"redis://:{password}@127.0.0.1:{server.port}/0"
    proc = subprocess.run([str(REPO / ".venv" / "bin" / "nightshift"), "publish-data", str(source)], env=env,
                          capture_output=True, text=True, timeout=120, check=False)
    shown = proc.stdout + proc.stderr
    assert password[:7] not in shown, f"publish-data exited {proc.returncode} printing: {shown[-600:]}"
    assert "Traceback" not in shown, shown[-600:]


@pytest.mark.parametrize("password", ["Zq9k2Lm/x+Pw8", "Zq9k2Lm#x8Pw8", "Zq9k2Lm?x8Pw8"],
                         ids=["slash", "hash", "question-mark"])
def test_redact_hides_a_password_with_url_delimiters(password: str) -> None:
    """redact() is what every message about the URL goes through (publish's EventsUnavailable/UsageError, the
    trigger's _said): its userinfo pattern [^/?#\\s]*@ stops at '/', '#' or '?', so such a URL comes back whole."""
    from nightshift.redaction import redact

    url = f"redis://:{password}@127.0.0.1:6379/0"
    assert password[:7] not in redact(url), f"redact({url!r}) = {redact(url)!r}"


# --- 6. scripts/airflow.sh: a percent-encoded password reaches the triggerer still encoded ----------------------


def test_the_triggerer_connection_gets_the_password_publish_uses() -> None:
    """A password with '@', '/' or '#' must be percent-encoded in the URL. publish (redis-py) decodes it; the
    snippet in scripts/airflow.sh that makes AIRFLOW_CONN_NIGHTSHIFT_EVENTS takes urlsplit().password, which is not
    decoded: the triggerer authenticates with 'p%40ss%2Fw0rd', is refused forever (warnings only), and every
    event waits in the stream while publish-data reports success."""
    from redis.connection import parse_url

    text = (REPO / "scripts" / "airflow.sh").read_text()
    match = re.search(r"events_conn=\"\$\(python -c '(?P<code>.*?)'\)\"", text, re.S)
    assert match, "the connection snippet in scripts/airflow.sh moved"
    url = "redis://:p%40ss%2Fw0rd@127.0.0.1:6379/0"
    made = subprocess.run([sys.executable, "-c", match["code"]], env={"NIGHTSHIFT_EVENTS_REDIS_URL": url},
                          capture_output=True, text=True, check=True, timeout=60)
    conn = json.loads(made.stdout)
    assert parse_url(url)["password"] == "p@ss/w0rd"  # what publish-data authenticates with
    assert conn["password"] == "p@ss/w0rd", f"the triggerer's connection has password {conn['password']!r}"
