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
and is delivered again: by this producer (it re-reads its pending entries) or, after a restart, by the next
one, which first reads the group's pending entries (XAUTOCLAIM, then XREADGROUP from 0) and only then new ones.

Delivery is therefore at least once: an entry whose asset event was stored but not yet acknowledged when the
triggerer died (a state-sync round, about a second) is delivered, and recorded, again. The payload carries the
entry's id, so such a duplicate is recognisable (same `id`). Redis errors never end the trigger: it logs them
(the URL never: only the connection id and stream name) and retries with a capped backoff.
"""

from __future__ import annotations

import asyncio
import logging
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
# An entry another consumer (a triggerer of another name) holds this long unacknowledged is taken over.
CLAIM_IDLE_MS = 60_000


def _text(value: Any) -> str:
    return value.decode("utf-8", errors="replace") if isinstance(value, bytes) else str(value)


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
    :param consumer: this watcher's consumer name in the group (one triggerer runs a watcher at a time).
    :param redis_conn_id: the Airflow connection (type redis).
    :param poll_interval: how long one read waits for new entries (seconds).
    """

    def __init__(self, *, stream: str, group: str, consumer: str = "airflow-triggerer",
                 redis_conn_id: str = "redis_default", poll_interval: float = 1.0) -> None:
        super().__init__()
        self.stream = stream
        self.group = group
        self.consumer = consumer
        self.redis_conn_id = redis_conn_id
        self.poll_interval = poll_interval

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (f"{type(self).__module__}.{type(self).__qualname__}", self._kwargs())

    def _kwargs(self) -> dict[str, Any]:
        return {"stream": self.stream, "group": self.group, "consumer": self.consumer,
                "redis_conn_id": self.redis_conn_id, "poll_interval": self.poll_interval}

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
                 redis_conn_id: str = "redis_default", poll_interval: float = 1.0) -> None:
        self.stream = stream
        self.group = group
        self.consumer = consumer
        self.redis_conn_id = redis_conn_id
        self.block_ms = max(1, int(poll_interval * 1000))
        self._client: redis.Redis | None = None
        self._in_flight: set[str] = set()   # yielded, not acknowledged: never yielded twice by this producer
        self._to_ack: list[str] = []         # clean, but XACK failed: retried before the next read
        self._reread_pending = True         # read the pending entries list from its start before new entries
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

        try:
            await self._call("xgroup_create", self.stream, self.group, id="0", mkstream=True)
            log.info("Created consumer group %s on %s", self.group, self._where())
        except redis.ResponseError as err:
            if "BUSYGROUP" not in str(err):
                raise

    async def _claim_stale(self) -> None:
        """Take over entries another consumer name left pending (a triggerer renamed, or gone)."""
        start = "0-0"
        while True:
            # Not justid: redis-py then drops the cursor. The entries are read again from the pending list.
            answer = await self._call("xautoclaim", self.stream, self.group, self.consumer, CLAIM_IDLE_MS,
                                      start_id=start, count=READ_COUNT)
            start = _text(answer[0])
            if start == "0-0":
                return

    async def _flush_acks(self) -> None:
        while self._to_ack:
            ids = list(self._to_ack)
            await self._call("xack", self.stream, self.group, *ids)
            del self._to_ack[:len(ids)]
            self._in_flight.difference_update(ids)
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
        return [(_text(entry_id), fields) for entry_id, fields in answer[0][1]]

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
                await self._room.wait()
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
                if entry_id in self._in_flight:
                    continue  # already with the triggerer, not yet acknowledged
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
