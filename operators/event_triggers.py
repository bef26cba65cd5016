"""`RedisStreamTrigger`: an AssetWatcher's trigger that reads a Redis stream with a consumer group and
acknowledges each entry only after Airflow has recorded the asset event it became.

The Redis provider (4.7.1) has only a pub/sub trigger, which keeps nothing: it stops after each message, so a
second message within about a second is lost, and so is every message sent while the triggerer is down. A
stream keeps its entries, and a consumer group remembers what was delivered (the pending entries list) and
what was acknowledged (XACK).

How the triggerer drives it (Airflow 3.3, airflow/triggers/shared_stream.py, "ack mode"): the trigger has a
`shared_stream_key` and a `create_shared_stream_producer`, so the triggerer runs one `RedisStreamProducer`
per stream; `filter_shared_stream` turns each entry into one TriggerEvent, the triggerer stores it (one asset
event per watcher's asset, in the same transaction as `Trigger.submit_event`) and confirms the store back to
the runner on its next state sync; only then does it call `advance`, which XACKs the entry. An entry whose
store was never confirmed (the triggerer crashed, the store failed, the ack timeout ran out) stays pending
and is delivered again: by this producer (it re-reads its own pending entries), or by another one.

Each producer reads under a consumer name of its own (`<consumer>-<host>-<pid>-<random>`), so two triggerers
running the same watcher at once (Airflow reassigns a trigger whose triggerer missed its heartbeat while that
one may still run) never read each other's pending entries. A producer keeps the entries it holds fresh (XCLAIM
JUSTID to itself every `claim_idle_s / 3`), and every `claim_idle_s / 2` takes over (XAUTOCLAIM) entries another
consumer name has left idle longer than `claim_idle_s` (a triggerer that died, or an older name), and removes
such names once they hold nothing. So after a restart, what the dead triggerer delivered but never stored is
delivered again after `claim_idle_s` (60 s by default). Entries the stream no longer has when they are claimed
(trimmed by the retention, deleted) are named in a warning: their events are lost.

Delivery is therefore at least once: an entry whose asset event was stored but not yet acknowledged when the
triggerer died (a state-sync round, about a second), or held by a triggerer cut from Redis for longer than
`claim_idle_s`, is delivered, and recorded, again. The payload carries the entry's id, so such a duplicate is
recognisable (same `id`). Redis errors never end the trigger: it logs them (the URL never: only the connection
id and stream name) and retries with a capped backoff. A consumer group deleted while the stream stays is made
again after the last entry this producer delivered (at the stream's start when it delivered none), so what was
recorded is not delivered again.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import socket
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Hashable, Sequence
from typing import TYPE_CHECKING, Any

from airflow.triggers.base import BaseEventTrigger, TriggerEvent
from airflow.triggers.shared_stream import AdvanceItem, AdvanceOutcome, SharedStreamProducer

if TYPE_CHECKING:
    import redis

log = logging.getLogger(__name__)

# Entries handed to the triggerer and not yet acknowledged, at most: a backlog (a long triggerer outage) is
# read in steps, never all at once into the triggerer's per-subscriber queue (1024 by default).
MAX_IN_FLIGHT = 100
READ_COUNT = 50
BACKOFF_START_S = 1.0
BACKOFF_MAX_S = 30.0
# An entry another consumer (another triggerer, or a dead one) holds this long unacknowledged is taken over.
CLAIM_IDLE_S = 60.0
# Acknowledged ids remembered, so a pending-list read answered before an XACK never delivers them again.
ACKED_MEMORY = 10_000


def _text(value: Any) -> str:
    return value.decode("utf-8", errors="replace") if isinstance(value, bytes) else str(value)


def _id_key(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


def _said(err: BaseException) -> str:
    """An error for the log, with any URL's password hidden (imported here: a DAG file imports this module)."""
    from nightshift.redaction import redact

    return f"{type(err).__name__}: {redact(str(err))}"


class RedisStreamTrigger(BaseEventTrigger):
    """Yield one TriggerEvent per entry of a Redis stream, read with a consumer group; never returns.

    The payload is `{"type": "stream", "stream", "id" (the entry's id), "data" (its `data` field, text)}`.

    :param stream: the stream's key.
    :param group: the consumer group; created at the stream's start (id 0) with the stream when missing, so
        entries published before any triggerer ran are delivered too.
    :param consumer: the start of this watcher's consumer names in the group (each producer adds its host,
        pid and a random part).
    :param redis_conn_id: the Airflow connection (type redis).
    :param poll_interval: how long one read waits for new entries (seconds).
    :param claim_idle_s: how long another consumer's entry must wait unacknowledged before it is taken over.
    """

    def __init__(self, *, stream: str, group: str, consumer: str = "airflow-triggerer",
                 redis_conn_id: str = "redis_default", poll_interval: float = 1.0,
                 claim_idle_s: float = CLAIM_IDLE_S) -> None:
        super().__init__()
        self.stream = stream
        self.group = group
        self.consumer = consumer
        self.redis_conn_id = redis_conn_id
        self.poll_interval = poll_interval
        self.claim_idle_s = claim_idle_s

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (f"{type(self).__module__}.{type(self).__qualname__}", self._kwargs())

    def _kwargs(self) -> dict[str, Any]:
        return {"stream": self.stream, "group": self.group, "consumer": self.consumer,
                "redis_conn_id": self.redis_conn_id, "poll_interval": self.poll_interval,
                "claim_idle_s": self.claim_idle_s}

    # --- ack mode: the triggerer acknowledges after the asset event is stored ------------------------------

    def shared_stream_key(self) -> Hashable | None:
        return ("redis-stream", self.redis_conn_id, self.stream, self.group, self.consumer)

    @classmethod
    def create_shared_stream_producer(cls, kwargs: dict[str, Any]) -> SharedStreamProducer:
        return RedisStreamProducer(**kwargs)

    async def filter_shared_stream(self, shared_stream: AsyncIterator[Any]) -> AsyncIterator[TriggerEvent]:
        async for raw in shared_stream:
            yield TriggerEvent(raw)

    # --- without ack mode (the triggerer fell back to run()): acknowledge when resumed ---------------------

    async def run(self) -> AsyncIterator[TriggerEvent]:
        """Only when the triggerer does not use the shared stream: the entry is acknowledged when the triggerer
        resumes this generator, i.e. after it queued the event but possibly before it stored it."""
        producer = RedisStreamProducer(**self._kwargs())
        try:
            async for raw, entry_id in producer.open_stream():
                yield TriggerEvent(raw)
                await producer.advance([AdvanceItem(entry_id, AdvanceOutcome(acked=1, failed=0))])
        finally:
            await producer.aclose()


class RedisStreamProducer(SharedStreamProducer):
    """The broker side: reads the group's pending entries, then new ones; XACKs what `advance` is given clean,
    and delivers again what it is given failed. Never raises out of `open_stream` or `advance`."""

    def __init__(self, *, stream: str, group: str, consumer: str = "airflow-triggerer",
                 redis_conn_id: str = "redis_default", poll_interval: float = 1.0,
                 claim_idle_s: float = CLAIM_IDLE_S) -> None:
        self.stream = stream
        self.group = group
        self.prefix = consumer
        self.consumer = f"{consumer}-{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"
        self.redis_conn_id = redis_conn_id
        self.block_ms = max(1, int(poll_interval * 1000))
        self.claim_idle_s = max(float(claim_idle_s), 3 * poll_interval)
        self._client: redis.Redis | None = None
        self._in_flight: set[str] = set()   # yielded, not acknowledged: never yielded twice by this producer
        self._to_ack: list[str] = []         # clean, but XACK failed: retried before the next read
        self._acked: OrderedDict[str, None] = OrderedDict()  # acknowledged lately: never yielded again
        self._last_delivered: str | None = None  # the highest id read as new (">"): where a lost group resumes
        self._reread_pending = True         # read the pending entries list from its start before new entries
        self._last_heartbeat = self._last_claim = 0.0
        self._room = asyncio.Event()
        self._room.set()

    # --- Redis, off the event loop ------------------------------------------------------------------------

    async def _redis(self) -> redis.Redis:
        if self._client is None:
            self._client = await asyncio.to_thread(self._connect)
        return self._client

    def _connect(self) -> redis.Redis:
        from airflow.providers.redis.hooks.redis import RedisHook

        client = RedisHook(redis_conn_id=self.redis_conn_id).get_conn()
        # A read blocks block_ms at most; a dead server must not hang a thread forever.
        client.connection_pool.connection_kwargs.update(socket_timeout=self.block_ms / 1000 + 10,
                                                        socket_connect_timeout=10)
        return client

    async def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        client = await self._redis()
        return await asyncio.to_thread(getattr(client, method), *args, **kwargs)

    def _where(self) -> str:
        return f"stream {self.stream} (group {self.group}, connection {self.redis_conn_id})"

    async def _ensure_group(self) -> None:
        import redis

        start = self._last_delivered or "0"
        try:
            await self._call("xgroup_create", self.stream, self.group, id=start, mkstream=True)
        except redis.ResponseError as err:
            if "BUSYGROUP" not in str(err):
                raise
            return
        if self._last_delivered is None:
            log.info("Created consumer group %s on %s", self.group, self._where())
        else:
            log.warning("Consumer group %s of %s was gone; made it again after entry %s, the last this triggerer "
                        "delivered (entries other triggerers held unacknowledged are not delivered again)",
                        self.group, self._where(), start)

    async def _claim_stale(self) -> bool:
        """Take over entries other consumer names left pending longer than claim_idle_s (a triggerer gone, or
        an older name); name those the stream no longer has; remove such names once they hold nothing. True
        when something was taken over (read it from the pending list)."""
        start, claimed = "0-0", False
        idle_ms = int(self.claim_idle_s * 1000)
        while True:
            # Not justid: redis-py then drops the cursor. The entries are read again from the pending list.
            answer = await self._call("xautoclaim", self.stream, self.group, self.consumer, idle_ms,
                                      start_id=start, count=READ_COUNT)
            start = _text(answer[0])
            claimed = claimed or bool(answer[1])
            for lost in answer[2] if len(answer) > 2 else ():
                log.warning("Entry %s of %s was delivered but never recorded, and the stream no longer has it "
                            "(trimmed by the retention, or deleted): its new-data event is lost; publish that "
                            "data again (nightshift publish-data DIR)", _text(lost), self._where())
            if start == "0-0":
                break
        for info in await self._call("xinfo_consumers", self.stream, self.group):
            name = _text(info.get("name", ""))
            mine = name == self.prefix or name.startswith(f"{self.prefix}-")
            if (mine and name != self.consumer and int(info.get("pending", 1)) == 0
                    and int(info.get("idle", 0)) > idle_ms):
                await self._call("xgroup_delconsumer", self.stream, self.group, name)
                log.info("Removed consumer %s of %s: idle %.0fs, holding nothing", name, self._where(),
                         int(info["idle"]) / 1000)
        self._last_claim = time.monotonic()
        return claimed

    async def _heartbeat(self) -> None:
        """Reset the idle time of the entries this producer holds, so no other consumer takes them over."""
        held = sorted(self._in_flight)
        for i in range(0, len(held), READ_COUNT):
            await self._call("xclaim", self.stream, self.group, self.consumer, 0, held[i:i + READ_COUNT],
                             justid=True)
        self._last_heartbeat = time.monotonic()

    async def _upkeep(self) -> None:
        now = time.monotonic()
        if self._in_flight and now - self._last_heartbeat >= self.claim_idle_s / 3:
            await self._heartbeat()
        if now - self._last_claim >= self.claim_idle_s / 2 and await self._claim_stale():
            self._reread_pending = True

    async def _wait_room(self) -> None:
        while not self._room.is_set():
            try:
                await asyncio.wait_for(self._room.wait(), self.claim_idle_s / 3)
            except TimeoutError:
                await self._heartbeat()

    async def _flush_acks(self) -> None:
        while self._to_ack:
            ids = list(self._to_ack)
            await self._call("xack", self.stream, self.group, *ids)
            del self._to_ack[:len(ids)]
            self._in_flight.difference_update(ids)
            for entry_id in ids:
                self._acked[entry_id] = None
            while len(self._acked) > ACKED_MEMORY:
                self._acked.popitem(last=False)
        self._make_room()

    def _make_room(self) -> None:
        if len(self._in_flight) < MAX_IN_FLIGHT:
            self._room.set()
        else:
            self._room.clear()

    async def _read(self, cursor: str | None) -> list[tuple[str, dict[Any, Any] | None]]:
        """Pending entries after `cursor` (no blocking), or new ones (cursor None; waits up to block_ms)."""
        if cursor is None:
            answer = await self._call("xreadgroup", self.group, self.consumer, {self.stream: ">"},
                                      count=READ_COUNT, block=self.block_ms)
        else:
            answer = await self._call("xreadgroup", self.group, self.consumer, {self.stream: cursor},
                                      count=READ_COUNT)
        if not answer:
            return []
        entries = [(_text(entry_id), fields) for entry_id, fields in answer[0][1]]
        if cursor is None and entries:
            last = entries[-1][0]
            if self._last_delivered is None or _id_key(last) > _id_key(self._last_delivered):
                self._last_delivered = last
        return entries

    # --- SharedStreamProducer -----------------------------------------------------------------------------

    async def open_stream(self) -> AsyncIterator[tuple[Any, Any]]:
        import redis

        backoff = BACKOFF_START_S
        cursor: str | None = "0"
        ready = False
        while True:
            try:
                if not ready:
                    await self._ensure_group()
                    await self._claim_stale()
                    ready = True
                    log.info("Reading %s as consumer %s", self._where(), self.consumer)
                await self._flush_acks()
                await self._wait_room()
                await self._upkeep()
                if self._reread_pending:
                    self._reread_pending = False
                    cursor = "0"
                entries = await self._read(cursor)
                if cursor is not None:
                    cursor = entries[-1][0] if entries else None  # the pending list read through: new ones next
                backoff = BACKOFF_START_S
            except asyncio.CancelledError:
                raise
            except redis.ResponseError as err:
                if "NOGROUP" in str(err):  # the stream or the group was deleted meanwhile: make them again
                    ready = False
                log.warning("Redis refused a read of %s: %s; again in %.0fs", self._where(), _said(err), backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, BACKOFF_MAX_S)
                self._reread_pending = True
                continue
            except Exception as err:  # Redis down, the connection missing: never end the watcher
                log.warning("Cannot read %s: %s; again in %.0fs", self._where(), _said(err), backoff)
                await self.aclose()
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, BACKOFF_MAX_S)
                ready = False
                self._reread_pending = True
                continue
            for entry_id, fields in entries:
                if entry_id in self._in_flight or entry_id in self._acked:
                    continue  # with the triggerer, or acknowledged after Redis answered this read
                if not fields:
                    # Pending, but trimmed from the stream (retention) or deleted: nothing left to deliver.
                    log.warning("Entry %s of %s was trimmed before it was recorded; acknowledging it", entry_id,
                                self._where())
                    self._to_ack.append(entry_id)
                    self._in_flight.add(entry_id)
                    continue
                data = {_text(k): _text(v) for k, v in fields.items()}.get("data", "")
                self._in_flight.add(entry_id)
                self._make_room()
                yield {"type": "stream", "stream": self.stream, "id": entry_id, "data": data}, entry_id

    async def advance(self, batch: Sequence[AdvanceItem]) -> None:
        redeliver = False
        for item in batch:
            entry_id = str(item.broker_payload)
            if item.outcome.failed == 0 and (item.outcome.acked > 0 or item.outcome.rejected > 0):
                self._to_ack.append(entry_id)
            else:  # not stored (ack timeout, no subscriber): leave it pending and deliver it again
                log.warning("Entry %s of %s was not recorded (%s); delivering it again", entry_id, self._where(),
                            item.outcome)
                self._in_flight.discard(entry_id)
                redeliver = True
        if redeliver:
            self._reread_pending = True
        try:
            await self._flush_acks()
        except Exception as err:  # kept in _to_ack: open_stream retries before its next read
            log.warning("Cannot acknowledge entries of %s yet: %s", self._where(), _said(err))
        self._make_room()

    async def aclose(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            try:
                await asyncio.to_thread(client.close)
            except Exception as err:  # best effort
                log.debug("Closing the Redis client of %s: %s", self._where(), _said(err))
