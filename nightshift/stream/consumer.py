"""The consumer loop of `nightshift score-stream`.

Each turn: maybe swap the model (between batches only), take a batch (this consumer's own pending
entries after a (re)connect, else entries other consumers left idle past `claim_idle_ms`, else new
ones: at most `batch_rows`, waiting at most `batch_ms` after the first), score it, then write the
predictions and dead letters and acknowledge the inputs in one script (redis_io.WRITE_AND_ACK).
Once a batch is scored, the next one is read (without blocking, before the write: Redis serves one
command at a time) and the write runs in a writer thread while that next batch is parsed and scored (one
write in flight at most; writes stay in batch order): Redis runs the script on its own core meanwhile.
Everything else (reading own pending entries, claiming, a model failure, a stop) first waits for the write
in flight. With `wait_replicas` the writes are not overlapped.

Redis going away is waited out with capped exponential backoff: a batch in hand is written when Redis is
back (the script is idempotent, so a write whose reply was lost is simply written again); entries read
but not yet written stay pending and are read again from this consumer's pending list after the
reconnect. The same holds for a server that says "not now": READONLY (it became a replica in a failover),
OOM (maxmemory reached with noeviction), MASTERDOWN. With `wait_replicas` N, a batch counts as written
only once WAIT says N replicas have it. A stop (SIGTERM, SIGINT, `stop()`, `stop_after`) finishes the
batch in hand first. While the consumer waits with a batch in hand (a model failure, a write retried), it
keeps the batch's entries from going idle for claimers (XCLAIM ... JUSTID, which counts no delivery).

Faults are told apart: an input's own fault (not JSON, a value the model refuses) dead-letters that input
with its reason. When predict raises on valid inputs, the batch is bisected (halves scored and written
apart) to find the rows it fails on; a row that fails alone while the model scores others (the batch's
other rows, or a row it scored before) `ROW_FAULT_STRIKES` times is dead-lettered as its own fault. When
every row fails, also alone, the model or the machine is at fault: the batch stays in hand and is retried
with backoff for `model_retry_s`, then left pending and read again (a delivery). Every read of a pending
entry counts as a delivery (XPENDING's count); an entry delivered more than `max_deliveries` times is
dead-lettered with reason `max-deliveries` whatever the cause, so no input (not even one that kills the
process) can stall the group. Entries read before (after a crash, a claim) are scored and written one at a
time, so an input that kills its consumer takes no neighbour to the cap with it.
"""

from __future__ import annotations

import logging
import signal
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from nightshift.stream import announce, records, redis_io
from nightshift.stream.config import Stats, StreamConfig
from nightshift.stream.errors import (
    GroupGone,
    ModelFailure,
    RedisClusterUnsupported,
    StreamTargetError,
    StreamUnavailable,
)
from nightshift.stream.scorer import VersionScorer, champion_version

log = logging.getLogger(__name__)

BACKOFF_START_S = 0.1
BACKOFF_CAP_S = 2.0
MODEL_BACKOFF_START_S = 0.2
MODEL_BACKOFF_CAP_S = 10.0
MAX_DELIVERIES_REASON = "max-deliveries"
ROW_FAULT_STRIKES = 3  # a row the model fails on alone this often, while it scores others, is the row's fault
DELETED_REASON = ("deleted from the stream (XDEL, XTRIM, XADD MAXLEN) while it was pending, before it was "
                  "scored: its input is unknown")

Entry = tuple[Any, Any]


class ReplicasBehind(Exception):
    """WAIT returned before `wait_replicas` replicas confirmed a batch's writes (retried, never dropped)."""


ScorerFactory = Callable[[str, str], VersionScorer]


class StreamConsumer:
    """One member of a consumer group scoring `config.input` into `config.output`."""

    def __init__(self, config: StreamConfig, url: str, *, password: str | None = None,
                 scorer_factory: ScorerFactory = VersionScorer) -> None:
        self.config = config
        self.url = url
        self.safe_url = redis_io.redact(url)
        self.client = redis_io.connect(url, password=password, single_connection=config.wait_replicas > 0)
        self.scorer_factory = scorer_factory
        self.scorer: VersionScorer | None = None
        self.stats = Stats()
        self.stopping = False
        self.stop_reason = ""
        self._recover = True  # read this consumer's own pending entries first
        self._claim_cursor = "0-0"
        self._last_claim = 0.0
        self._last_poll = 0.0
        self._announced: bytes | None = None
        self._scripts: dict[str, Any] = {}
        self._backoff = BACKOFF_START_S
        self._outage_since: float | None = None
        self._model_backoff = MODEL_BACKOFF_START_S
        self._failing_since: float | None = None  # when the model began failing on the batch in hand
        self._probe: records.InputRow | None = None  # a row the model scored: is it the rows' fault or the model's?
        self._failures: dict[str, str] = {}  # entry id -> the last model failure it met in this process
        self._last_entry: str | None = None  # the last input entry this consumer wrote an outcome for
        self._heartbeat_s = min(config.claim_idle_ms / 3000, 10.0)
        self._last_heartbeat = 0.0
        self._ttl_ms = str(int(config.dedup_retention_s * 1000))
        self._scored_prefix = redis_io.scored_key(config.output) + ":"
        self._seen_prefix = redis_io.dead_key(config.dead_letter) + ":"
        # The write in flight (a scored batch) and how many inputs it holds; None: none, or not overlapped
        self._writer: ThreadPoolExecutor | None = None
        self._in_flight: Future[None] | None = None
        self._in_flight_inputs = 0
        self._ahead: list[Entry] = []  # new entries read before the write in flight was sent

    # --- control -----------------------------------------------------------------------------------

    def stop(self, reason: str = "stop requested") -> None:
        """Finish the batch in hand, then return from run()."""
        if not self.stopping:
            self.stop_reason = reason
        self.stopping = True

    def install_signal_handlers(self) -> None:
        def handler(signum: int, _frame: Any) -> None:
            self.stop(signal.Signals(signum).name)

        signal.signal(signal.SIGTERM, handler)
        signal.signal(signal.SIGINT, handler)

    def _room(self) -> int:
        if self.config.stop_after is None:
            return self.config.batch_rows
        # The write in flight counts: its inputs are not in stats.inputs until it returns
        return max(0, min(self.config.batch_rows,
                          self.config.stop_after - self.stats.inputs - self._in_flight_inputs))

    # --- Redis with backoff ------------------------------------------------------------------------

    def _sleep(self, seconds: float, *, interruptible: bool, holding: list[str] | None = None) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and not (interruptible and self.stopping):
            if holding:
                self._heartbeat(holding)
            time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))

    def _redis_down(self, err: BaseException, doing: str, *, interruptible: bool) -> None:
        import redis

        if self._outage_since is None:
            self._outage_since = time.monotonic()
            self.stats.reconnects += 1
        self.stats.redis_retries[type(err).__name__] += 1
        if isinstance(err, redis.exceptions.ReadOnlyError):
            # A failover made this server a replica: connect afresh, so that a name that follows the master
            # (DNS, a virtual IP, a proxy) is resolved again.
            self.client.connection_pool.disconnect()
            if getattr(self.client, "connection", None) is not None:
                self.client.connection.disconnect()
        log.warning("Redis at %s did not take the command while %s (%s: %s); retrying in %.1f s", self.safe_url,
                    doing, type(err).__name__, err, self._backoff)
        self._recover = True
        self._sleep(self._backoff, interruptible=interruptible)
        self._backoff = min(self._backoff * 2, BACKOFF_CAP_S)

    def _redis_up(self) -> None:
        if self._outage_since is not None:
            log.info("Redis at %s answers again after %.1f s", self.safe_url, time.monotonic() - self._outage_since)
        self._outage_since = None
        self._backoff = BACKOFF_START_S

    def _script(self, source: str) -> Any:
        if source not in self._scripts:
            self._scripts[source] = self.client.register_script(source)
        return self._scripts[source]

    def _heartbeat(self, entry_ids: list[str]) -> None:
        """Keep `entry_ids` (those still pending for this consumer) from going idle for claimers; best effort."""
        import redis

        now = time.monotonic()
        if not entry_ids or now - self._last_heartbeat < self._heartbeat_s:
            return
        self._last_heartbeat = now
        try:
            self._script(redis_io.HEARTBEAT)(keys=[self.config.input],
                                             args=[self.config.group, self.config.consumer, *entry_ids],
                                             client=self.client)
        except (redis.RedisError, OSError) as err:
            log.debug("heartbeat for %d pending inputs failed (%s)", len(entry_ids), err)

    def _until_answered(self, doing: str, call: Callable[[], Any], holding: list[str] | None = None) -> Any:
        """Run `call` until Redis answers. Used for what must not be dropped (a batch's write); while
        stopping, gives up after drain_timeout_s and leaves the inputs pending for another consumer.
        `holding`: the entries of the batch in hand, kept from claimers while Redis says "not now"."""
        errors: tuple[type[BaseException], ...] = (*redis_io.retryable_errors(), ReplicasBehind)
        while True:
            try:
                result = call()
            except errors as err:
                if self.stopping and self._outage_since is not None and \
                        time.monotonic() - self._outage_since > self.config.drain_timeout_s:
                    raise StreamUnavailable(
                        f"Redis at {self.safe_url} has not answered for {self.config.drain_timeout_s:.0f} s while "
                        f"{doing} during shutdown; the batch's inputs stay pending and another consumer claims "
                        f"them after --claim-idle-ms") from err
                if holding and not isinstance(err, redis_io.connection_errors()):
                    self._heartbeat(holding)  # OOM, MASTERDOWN, replicas behind: Redis still takes XCLAIM
                self._redis_down(err, doing, interruptible=False)
                continue
            self._redis_up()
            return result

    def _wrong_type(self, err: BaseException) -> StreamTargetError:
        return StreamTargetError(
            f"a key of --input {self.config.input!r}, --output {self.config.output!r} or --dead-letter "
            f"{self.config.dead_letter!r} holds another Redis type ({err}); nothing of the batch was written and "
            f"its inputs stay pending. Name other streams or delete the key")

    def _group_gone(self) -> GroupGone:
        import redis

        try:
            length: int | str = int(self.client.xlen(self.config.input))
        except (redis.RedisError, OSError):
            length = "some"
        where = self._last_entry or "$"
        return GroupGone(
            f"the consumer group {self.config.group!r} on {self.config.input!r} is gone (XGROUP DESTROY, or the "
            f"stream deleted and added to again) while the stream holds {length} entries; not creating it again "
            f"at 0, which would score every entry again whose marker has expired. Create it again where it was "
            f"and restart the consumers: redis-cli XGROUP CREATE {self.config.input} {self.config.group} {where} "
            f"({where}: the last entry this consumer wrote; $ skips every entry now in the stream)")

    def _check_targets(self) -> None:
        """Before the first write: not a Cluster, the three streams are streams (or absent), enough replicas;
        say which memory policy is safe."""
        import redis

        def info(section: str) -> dict[str, Any]:
            try:
                return dict(self._until_answered(f"reading INFO {section}", lambda: self.client.info(section)))
            except redis.ResponseError as err:  # INFO may be renamed or refused (managed Redis): go on
                log.info("cannot read INFO %s (%s)", section, err)
                return {}

        if str(info("cluster").get("cluster_enabled", "0")) == "1":
            raise RedisClusterUnsupported(
                f"Redis at {self.safe_url} is a Cluster (cluster_enabled:1): score-stream writes a batch's "
                f"predictions, dead letters, markers and acknowledgements in one script, whose keys lie in many "
                f"slots (CROSSSLOT); use a standalone Redis (with replicas) instead")

        def types() -> list[str]:
            pipe = self.client.pipeline(transaction=False)
            for key in (self.config.input, self.config.output, self.config.dead_letter):
                pipe.type(key)
            return [t.decode() if isinstance(t, bytes) else str(t) for t in pipe.execute()]

        found = self._until_answered("checking the streams' types", types)
        streams = (self.config.input, self.config.output, self.config.dead_letter)
        for flag, key, kind in zip(("--input", "--output", "--dead-letter"), streams, found, strict=True):
            if kind not in {"stream", "none"}:
                raise StreamTargetError(f"{flag} {key!r} holds a Redis {kind}, not a stream; name another key or "
                                        f"delete it")
        if self.config.wait_replicas:
            connected = int(info("replication").get("connected_slaves", 0))
            if connected < self.config.wait_replicas:
                log.warning("--wait-replicas %d but %d replicas are connected to %s: every batch is held (its write "
                            "retried) until %d replicas confirm it; at a stop, a batch written but not confirmed "
                            "is reported as such", self.config.wait_replicas, connected, self.safe_url,
                            self.config.wait_replicas)
        try:
            policy = self.client.config_get("maxmemory-policy").get(b"maxmemory-policy", b"").decode()
        except redis.RedisError as err:  # CONFIG may be renamed or refused (managed Redis): say so, go on
            log.info("cannot read maxmemory-policy (%s); only noeviction is safe for scoring streams", err)
            return
        if policy and policy != "noeviction":
            log.warning("Redis at %s evicts keys (maxmemory-policy %s): an evicted marker lets an input be scored "
                        "twice and an evicted stream loses inputs or predictions; use maxmemory-policy noeviction "
                        "(the consumer waits out OOM replies)", self.safe_url, policy)

    def _ensure_group(self) -> None:
        created = self._until_answered("creating the consumer group",
                                       lambda: redis_io.ensure_group(self.client, self.config.input, self.config.group))
        if created:
            log.info("created consumer group %s on %s", self.config.group, self.config.input)

    # --- the model ---------------------------------------------------------------------------------

    def _load(self, version: str, why: str) -> None:
        started = time.monotonic()
        scorer = self.scorer_factory(self.config.model_name, version)
        old = self.scorer.version if self.scorer else None
        self.scorer = scorer
        if old is not None:
            self.stats.swaps.append({"from": old, "to": scorer.version, "why": why,
                                     "after_inputs": str(self.stats.inputs + self._in_flight_inputs)})
            log.info("swapped %s v%s -> v%s between batches (%s, loaded in %.1f s)", self.config.model_name, old,
                     scorer.version, why, time.monotonic() - started)
        else:
            log.info("scoring with %s v%s (%s)", self.config.model_name, scorer.version, why)

    def _read_announcement(self) -> bytes | None:
        try:
            value = self.client.get(announce.champion_key(self.config.model_name))
        except redis_io.connection_errors():
            return self._announced  # not now; the next batch asks again
        return value if isinstance(value, bytes) or value is None else str(value).encode()

    def _maybe_swap(self) -> None:
        """Between batches: load the announced champion when the announcement changes, or the registry's
        @champion every champion_poll_s when it differs from the version in use."""
        assert self.scorer is not None
        target, why = None, ""
        announced = self._read_announcement()
        if announced is not None and announced != self._announced:
            self._announced = announced
            if announced.decode() != self.scorer.version:
                target, why = announced.decode(), "announced by the deploy step"
        elif time.monotonic() - self._last_poll >= self.config.champion_poll_s:
            self._last_poll = time.monotonic()
            try:
                current = champion_version(self.config.model_name)
            except Exception as err:  # a registry hiccup must not stop scoring with the model in hand
                log.warning("reading %s@champion failed (%s); scoring on with v%s", self.config.model_name, err,
                            self.scorer.version)
                return
            if current != self.scorer.version:
                target, why = current, "@champion moved in the registry"
        if target is None:
            return
        try:
            self._load(target, why)
        except Exception as err:
            log.error("could not load %s v%s (%s); scoring on with v%s", self.config.model_name, target, err,
                      self.scorer.version)

    # --- reading -----------------------------------------------------------------------------------

    def _read(self, start: str, count: int, block: int | None = None) -> list[Entry]:
        reply = self.client.xreadgroup(self.config.group, self.config.consumer, {self.config.input: start},
                                       count=count, block=block)
        if not reply:
            return []
        return list(reply[0][1])

    def _deliveries(self, entries: list[Entry]) -> dict[str, int]:
        """How often each of `entries` (pending for this consumer) has been delivered: one XPENDING."""
        ids = [_entry_id(raw) for raw, _ in entries]
        reply = self.client.xpending_range(self.config.input, self.config.group, min=ids[0], max=ids[-1],
                                           count=len(ids) + 1000, consumername=self.config.consumer)
        counts = {_entry_id(item["message_id"]): int(item["times_delivered"]) for item in reply}
        return {entry: counts.get(entry, 1) for entry in ids}

    def _read_own_pending(self, limit: int) -> tuple[list[Entry], dict[str, int]]:
        """Entries pending for this consumer (after a restart, a reconnect, a claim), read so that a read
        counts a delivery only for what is scored next: the leading entries delivered once so far together,
        else the first one alone. An entry that killed the consumer is read again alone after its first
        redelivery, and its neighbours' counts stand still meanwhile."""
        reply = self.client.xpending_range(self.config.input, self.config.group, min="-", max="+", count=limit,
                                           consumername=self.config.consumer)
        if not reply:
            return [], {}
        first_time = 0
        while first_time < len(reply) and int(reply[first_time]["times_delivered"]) == 1:
            first_time += 1
        entries = self._read("0", first_time or 1)
        if not entries:
            return [], {}
        return entries, self._deliveries(entries)

    def _claim_idle(self, limit: int) -> bool:
        """Claim (without counting a delivery) entries other consumers left idle past claim_idle_ms; dead-letter
        those deleted from the stream meanwhile. True when some were claimed: read them as own pending."""
        cursor, claimed, deleted = self._script(redis_io.CLAIM_IDLE)(
            keys=[self.config.input],
            args=[self.config.group, self.config.consumer, self.config.claim_idle_ms, self._claim_cursor, limit],
            client=self.client)
        self._claim_cursor = _entry_id(cursor)
        if deleted:
            self._dead_letter_deleted([_entry_id(raw) for raw in deleted])
        if not claimed:
            return False
        self.stats.claimed += len(claimed)
        log.info("claimed %d pending inputs idle for %d ms or more", len(claimed), self.config.claim_idle_ms)
        self._recover = True
        return True

    def _next_batch(self) -> tuple[list[Entry], dict[str, int]]:
        """A batch and, for entries read before (this consumer's own pending, or claimed), their delivery
        counts; a new entry is on its first delivery."""
        limit = self._room()
        if limit == 0:
            return [], {}
        if self._ahead:  # new entries in hand (a first delivery each): before own pending, which they join
            entries, self._ahead = self._ahead, []
            return entries, {}
        if self._recover:
            self._join_write()  # its entries are still pending: not read again while written
            entries, deliveries = self._read_own_pending(limit)
            if entries:
                return entries, deliveries
            self._recover = False
        now = time.monotonic()
        if now - self._last_claim >= self.config.claim_interval_s:
            self._last_claim = now
            self._join_write()
            if self._claim_idle(limit):
                entries, deliveries = self._read_own_pending(limit)
                if entries:
                    return entries, deliveries
        entries = self._read(">", limit, block=self.config.batch_ms)
        if not entries:
            return [], {}
        deadline = time.monotonic() + self.config.batch_ms / 1000
        while len(entries) < limit and not self.stopping:
            left_ms = int((deadline - time.monotonic()) * 1000)
            if left_ms < 1:
                break
            more = self._read(">", limit - len(entries), block=left_ms)
            if not more:
                break
            entries.extend(more)
        return entries, {}

    # --- writing -----------------------------------------------------------------------------------

    def _write_args(self, good: list[records.InputRow], labels: list[records.Prediction],
                    rejected: list[records.Rejected], kinds: dict[str, str], version: str
                    ) -> tuple[list[str], list[Any]]:
        scored, seen = self._scored_prefix, self._seen_prefix
        now_ms = time.time() * 1000
        keys = [self.config.input, self.config.output, self.config.dead_letter]
        args: list[Any] = [self.config.group, self._ttl_ms]
        for row, label in zip(good, labels, strict=True):
            latency = now_ms - records.entry_ms(row.entry_id)
            keys += [scored + records.marker_key(row.input_id), seen + row.entry_id]
            args += ["p", row.entry_id, records.prediction_payload(row.input_id, label, version, latency)]
        for item in rejected:
            dead_marker = seen + item.entry_id
            keys += [dead_marker if item.input_id is None else scored + records.marker_key(item.input_id), dead_marker]
            args += [kinds.get(item.entry_id, "d"), item.entry_id, records.dead_letter_payload(item)]
        return keys, args

    def _write(self, keys: list[str], args: list[Any], holding: list[str]) -> tuple[int, int, list[int]]:
        """Run the write script (and WAIT for replicas) until Redis takes it: (written, dead letters, the
        positions of inputs whose marker keys hold another type, when the script refused to write)."""
        import redis

        script = self._script(redis_io.WRITE_AND_ACK)
        totals = [0, 0]
        foreign: list[int] = []
        reply_lost = [False]
        ran = [False]  # a reply came: the inputs are written and acknowledged

        def attempt() -> None:
            try:
                reply = script(keys=keys, args=args, client=self.client)
            except redis_io.connection_errors():
                reply_lost[0] = True  # the script may have run: its retry finds its outcomes as its own duplicates
                raise
            if reply and isinstance(reply[0], bytes | str):
                foreign[:] = [int(position) for position in reply[1:]]
                return
            written, _duplicates, dead, own_p, own_d = (int(value) for value in reply)
            totals[0] += written + (own_p if reply_lost[0] else 0)
            totals[1] += dead + (own_d if reply_lost[0] else 0)
            reply_lost[0] = False
            ran[0] = True
            if self.config.wait_replicas:
                # Runs again after a shortfall: the script, then all duplicates, refreshes its markers, so this
                # connection's WAIT covers the batch even after a reconnect.
                acked = int(self.client.execute_command("WAIT", self.config.wait_replicas,
                                                        self.config.wait_timeout_ms))
                if acked < self.config.wait_replicas:
                    raise ReplicasBehind(f"{acked} of {self.config.wait_replicas} replicas confirmed the batch "
                                         f"within {self.config.wait_timeout_ms} ms")

        try:
            self._until_answered("writing predictions", attempt, holding)
        except StreamUnavailable as err:
            if not ran[0]:
                raise
            inputs = (len(args) - 2) // 3
            self.stats.unconfirmed += inputs
            log.warning("stopping: the last batch's %d inputs were written and acknowledged on %s, but not "
                        "confirmed on %d replicas (--wait-replicas) within %.0f s (%s); a failover to a replica "
                        "that lacks them would lose them", inputs, self.safe_url, self.config.wait_replicas,
                        self.config.drain_timeout_s, err.__cause__)
        except redis.ResponseError as err:
            if redis_io.is_wrong_type(err):
                raise self._wrong_type(err) from err
            if "NOGROUP" in str(err):
                raise self._group_gone() from err
            raise
        return totals[0], totals[1], foreign

    def _commit(self, good: list[records.InputRow], labels: list[records.Prediction],
                rejected: list[records.Rejected]) -> None:
        """Write predictions and dead letters and acknowledge their inputs (one script run), after the write in
        flight; count them."""
        assert self.scorer is not None
        self._join_write()
        self._commit_now(good, labels, rejected, self.scorer.version)

    def _commit_behind(self, good: list[records.InputRow], labels: list[records.Prediction]) -> None:
        """`_commit` in the writer thread, after the write in flight: returns at once (the next batch, read
        here first, is scored meanwhile). Its errors are raised by the next `_join_write`."""
        assert self.scorer is not None
        if self._writer is None:
            self._commit(good, labels, [])
            return
        self._join_write()
        self._in_flight_inputs = len(good)  # counted by _room before the write is sent, as after
        self._read_ahead()
        self._in_flight = self._writer.submit(self._commit_now, good, labels, [], self.scorer.version)

    def _read_ahead(self) -> None:
        """New entries for the next batch, without blocking, while Redis has nothing else to do; not when the
        next turn would read its own pending entries or claim, or is stopping."""
        if self.stopping or self._recover or self._ahead or \
                time.monotonic() - self._last_claim >= self.config.claim_interval_s:
            return
        room = self._room()
        if room <= 0:
            return
        import redis

        try:
            self._ahead = self._read(">", room)
        except (redis.RedisError, OSError) as err:  # the next turn's read meets it again (and waits it out)
            log.debug("reading ahead failed (%s: %s)", type(err).__name__, err)
            self._recover = True  # the reply may be lost with entries in it: they are pending for this consumer

    def _join_write(self) -> None:
        """Wait for the write in flight; raise what it raised."""
        future, self._in_flight = self._in_flight, None
        if future is not None:
            try:
                future.result()
            finally:
                self._in_flight_inputs = 0

    def _commit_now(self, good: list[records.InputRow], labels: list[records.Prediction],
                    rejected: list[records.Rejected], version: str) -> None:
        kinds: dict[str, str] = {}
        holding = [row.entry_id for row in good] + [item.entry_id for item in rejected]
        while True:
            keys, args = self._write_args(good, labels, rejected, kinds, version)
            written, dead, foreign = self._write(keys, args, holding)
            if not foreign:
                break
            good, labels, rejected = self._foreign_markers(foreign, keys, good, labels, rejected, kinds)
        done = len(good) + len(rejected)
        self.stats.batches += 1
        self.stats.inputs += done
        self.stats.predictions += written
        self.stats.duplicates += done - written - dead
        self.stats.dead_letters += dead
        self.stats.by_version[version] += written
        for entry_id in holding:
            self._failures.pop(entry_id, None)
        last = max((batch[-1].entry_id for batch in (good, rejected) if batch), key=records.id_key)
        if self._last_entry is None or records.id_key(last) > records.id_key(self._last_entry):
            self._last_entry = last
        if dead:
            log.info("%d inputs of a batch of %d went to %s", dead, done, self.config.dead_letter)

    def _foreign_markers(self, positions: list[int], keys: list[str], good: list[records.InputRow],
                         labels: list[records.Prediction], rejected: list[records.Rejected],
                         kinds: dict[str, str]
                         ) -> tuple[list[records.InputRow], list[records.Prediction], list[records.Rejected]]:
        """The inputs at `positions` (1-based) have a marker key of another type (an application's key named
        like a marker): dead-letter them, without touching that key; the others are written as they were."""
        def reason(position: int) -> str:
            names = dict.fromkeys(keys[1 + 2 * position: 3 + 2 * position])
            try:
                found = [(name, _entry_id(self.client.type(name))) for name in names]
            except Exception:  # only for the message
                found = [(name, "value of another type") for name in names]
            taken = "; ".join(f"{name} holds a Redis {kind}" for name, kind in found if kind not in {"string", "none"})
            return (f"its marker key is not a marker ({taken or 'another type'}: another application's key?); "
                    f"dead-lettered without deduplication")

        bad = {position - 1 for position in positions}
        keep_rows: list[records.InputRow] = []
        keep_labels: list[records.Prediction] = []
        dead = list(rejected)
        for i, (row, label) in enumerate(zip(good, labels, strict=True)):
            if i in bad:
                dead.append(records.Rejected(row.entry_id, row.input_id, reason(i + 1), row.raw_text))
                kinds[row.entry_id] = "f"
            else:
                keep_rows.append(row)
                keep_labels.append(label)
        for j, item in enumerate(rejected):
            if len(good) + j in bad:
                dead[j] = records.Rejected(item.entry_id, item.input_id, f"{item.reason}; {reason(len(good) + j + 1)}",
                                           item.raw)
                kinds[item.entry_id] = "f"
        dead.sort(key=lambda item: records.id_key(item.entry_id))
        log.warning("%d inputs have a marker key of another Redis type; dead-lettered", len(bad))
        return keep_rows, keep_labels, dead

    def _dead_letter_deleted(self, entry_ids: list[str]) -> None:
        """Entries XAUTOCLAIM found deleted from the stream (and dropped from the pending list): a dead letter
        each, so that they leave a trace."""
        items = [records.Rejected(entry_id, None, DELETED_REASON, "") for entry_id in entry_ids]
        assert self.scorer is not None
        keys, args = self._write_args([], [], items, dict.fromkeys(entry_ids, "g"), self.scorer.version)
        _written, dead, _foreign = self._write(keys, args, [])
        self.stats.deleted += dead
        log.warning("%d pending inputs were deleted from %s before they were scored (first %s); dead-lettered to %s",
                    len(entry_ids), self.config.input, entry_ids[0], self.config.dead_letter)

    # --- scoring -----------------------------------------------------------------------------------

    def _over_cap(self, entry_id: str, fields: Any, deliveries: int) -> records.Rejected:
        assert self.scorer is not None
        (parsed,) = records.parse_entries([(entry_id, fields)], self.scorer.columns, self.scorer.column_set)
        raw = parsed.raw_text if isinstance(parsed, records.InputRow) else parsed.raw
        last = self._failures.get(entry_id)
        reason = (f"{MAX_DELIVERIES_REASON}: delivered {deliveries} times, more than --max-deliveries "
                  f"{self.config.max_deliveries}, without a prediction"
                  + (f"; last failure: {last}" if last else " (its consumers died or failed on it)"))
        return records.Rejected(entry_id, parsed.input_id, reason, raw)

    def _parse(self, entries: list[Entry], deliveries: dict[str, int]
               ) -> tuple[list[records.InputRow], list[records.Rejected]]:
        assert self.scorer is not None
        scorer = self.scorer
        rows: list[records.InputRow] = []
        rejected: list[records.Rejected] = []
        todo: list[tuple[str, Any]] = []
        for raw_id, fields in entries:
            entry_id = _entry_id(raw_id)
            count = deliveries.get(entry_id, 1)
            if count > self.config.max_deliveries:
                rejected.append(self._over_cap(entry_id, fields, count))
                self.stats.max_deliveries += 1
                continue
            todo.append((entry_id, fields))
        for parsed in records.parse_entries(todo, scorer.columns, scorer.column_set):
            (rows if isinstance(parsed, records.InputRow) else rejected).append(parsed)  # type: ignore[arg-type]
        return rows, rejected

    def _process(self, entries: list[Entry], deliveries: dict[str, int] | None = None) -> None:
        deliveries = deliveries or {}
        if deliveries and len(entries) > 1 and any(count > 1 for count in deliveries.values()):
            # Read before: one of them may have killed the consumer that had them. Each is scored and written
            # alone, so that only that one reaches --max-deliveries.
            for entry in entries:
                if not self._process_batch([entry], deliveries):
                    return  # the model keeps failing: the rest stay pending too
            return
        self._process_batch(entries, deliveries)

    def _process_batch(self, entries: list[Entry], deliveries: dict[str, int]) -> bool:
        """Score `entries` and write their outcomes; False when some were left pending (the model failed)."""
        assert self.scorer is not None
        rows, rejected = self._parse(entries, deliveries)
        try:
            scored = self.scorer.score(rows)
        except ModelFailure as failure:
            self._join_write()  # its errors surface now, not after the model's retries
            rejected.extend(failure.rejected)
            rejected.sort(key=lambda item: records.id_key(item.entry_id))
            if rejected:
                self._commit([], [], rejected)
            settled = {row.entry_id for row in failure.valid} | {item.entry_id for item in rejected}
            unsettled = [row for row in rows if row.entry_id not in settled]
            if unsettled:  # the scorer stopped before validating them: read again
                self._note_failure(unsettled, failure)
                self._recover = True
            return self._isolate(failure.valid, failure) and not unsettled
        rejected.extend(scored.rejected)
        if len(rejected) > 1:  # dead letters in input order
            rejected.sort(key=lambda item: records.id_key(item.entry_id))
        if rejected:
            self._commit(scored.rows, scored.labels, rejected)
        elif scored.rows:
            self._commit_behind(scored.rows, scored.labels)
        if scored.rows:
            self._model_ok(scored.rows[0])
        return True

    def _model_ok(self, row: records.InputRow) -> None:
        self._probe = row
        self._failing_since = None
        self._model_backoff = MODEL_BACKOFF_START_S

    def _note_failure(self, rows: list[records.InputRow], failure: ModelFailure) -> None:
        if len(self._failures) > 100_000:
            self._failures.clear()
        why = _why(failure)
        for row in rows:
            self._failures[row.entry_id] = why

    def _isolate(self, rows: list[records.InputRow], failure: ModelFailure) -> bool:
        """The model failed on `rows` (valid) together. Bisect them, writing what it scores; dead-letter a row
        it fails on alone ROW_FAULT_STRIKES times while it scores others; retry the rest in hand with backoff
        (the model or the machine is at fault) for model_retry_s, then leave them pending. True when every row
        got its outcome."""
        assert self.scorer is not None
        strikes: Counter[str] = Counter()
        err = failure
        while rows:
            self.stats.model_failures += 1
            self._note_failure(rows, err)
            failed, contrast, err = self._bisect(rows, err)
            if self._failing_since is None:  # (again, when the model scored some of them)
                self._failing_since = time.monotonic()
            if contrast:
                for row in failed:
                    strikes[row.entry_id] += 1
                faulty = [row for row in failed if strikes[row.entry_id] >= ROW_FAULT_STRIKES]
                if faulty:
                    self._dead_letter_row_faults(faulty, err)
                    failed = [row for row in failed if strikes[row.entry_id] < ROW_FAULT_STRIKES]
            rows = failed
            if not rows:
                return True
            self._note_failure(rows, err)
            started = self._failing_since
            if self.stopping or time.monotonic() - started > self.config.model_retry_s:
                return self._leave_pending(rows, err)
            self._model_failed(err, rows)
            if self.stopping:
                return self._leave_pending(rows, err)
            try:
                labels = self.scorer.predict_valid(rows)
            except ModelFailure as again:
                err = again
                continue
            self._commit(rows, labels, [])
            self._model_ok(rows[0])
        return True

    def _bisect(self, rows: list[records.InputRow], failure: ModelFailure
                ) -> tuple[list[records.InputRow], bool, ModelFailure]:
        """`rows` just failed together. Does the model work at all? Ask it about a row it scored before; if it
        fails there too, bisect nothing. Else score halves, recursively, writing each half that scores.
        Returns the rows that failed alone, whether the model scored anything (the probe or a half), and the
        last failure."""
        assert self.scorer is not None
        scorer = self.scorer
        contrast = False
        if self._probe is not None:
            try:
                scorer.predict_valid([self._probe])
            except ModelFailure as probe_failure:
                return rows, False, probe_failure
            contrast = True
        failed: list[records.InputRow] = []
        last = failure

        def split(chunk: list[records.InputRow]) -> None:
            nonlocal contrast, last
            if len(chunk) == 1:
                failed.append(chunk[0])
                return
            middle = len(chunk) // 2
            for half in (chunk[:middle], chunk[middle:]):
                try:
                    labels = scorer.predict_valid(half)
                except ModelFailure as half_failure:
                    last = half_failure
                    split(half)
                    continue
                self._commit(half, labels, [])
                self._model_ok(half[0])
                contrast = True

        split(rows)
        return failed, contrast, last

    def _dead_letter_row_faults(self, rows: list[records.InputRow], failure: ModelFailure) -> None:
        why = _why(failure)
        items = [records.Rejected(row.entry_id, row.input_id,
                                  f"the model fails on this input alone ({why}) while it scores other inputs "
                                  f"({ROW_FAULT_STRIKES} tries)", row.raw_text) for row in rows]
        self.stats.row_faults += len(items)
        log.error("%s fails on %d valid inputs alone while it scores others; dead-lettered as their own fault "
                  "(first: entry %s)", self.config.model_name, len(items), items[0].entry_id)
        self._commit([], [], items)

    def _model_failed(self, failure: ModelFailure, rows: list[records.InputRow]) -> None:
        log.error("%s; %d inputs kept in hand, tried again in %.1f s (for up to --model-retry-s %g s, then left "
                  "pending)", failure, len(rows), self._model_backoff, self.config.model_retry_s)
        self._sleep(self._model_backoff, interruptible=True, holding=[row.entry_id for row in rows])
        self._model_backoff = min(self._model_backoff * 2, MODEL_BACKOFF_CAP_S)

    def _leave_pending(self, rows: list[records.InputRow], failure: ModelFailure) -> bool:
        started = self._failing_since or time.monotonic()
        log.error("%s; leaving %d inputs pending after %.1f s of retries (%s): they are read again (a delivery "
                  "each; an input delivered more than --max-deliveries %d times is dead-lettered)", failure,
                  len(rows), time.monotonic() - started,
                  "stopping" if self.stopping else f"--model-retry-s {self.config.model_retry_s:g}",
                  self.config.max_deliveries)
        self._recover = True
        self._failing_since = None  # the next delivery gets its own --model-retry-s
        return False

    # --- the loop ----------------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        """Score until stopped (or `stop_after` inputs); return what was done."""
        self._check_targets()
        self._ensure_group()
        self._announced = self._until_answered(
            "reading the champion announcement",
            lambda: self.client.get(announce.champion_key(self.config.model_name)))
        self._load(champion_version(self.config.model_name), "@champion in the registry")
        self._last_poll = time.monotonic()
        if not self.config.wait_replicas:  # WAIT covers one connection's writes: not overlapped
            self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="stream-writer")
        try:
            self._loop()
            self._join_write()
        finally:
            if self._in_flight is not None:  # run() is raising: the write in flight still completes
                try:
                    self._join_write()
                except Exception as err:
                    log.error("the write in flight failed too (%s: %s)", type(err).__name__, err)
            if self._writer is not None:
                self._writer.shutdown(wait=True)
                self._writer = None
        return self.summary()

    def _loop(self) -> None:
        errors = redis_io.retryable_errors()
        import redis

        while not self.stopping:
            if self.config.stop_after is not None and \
                    self.stats.inputs + self._in_flight_inputs >= self.config.stop_after:
                self._join_write()
                if self.stats.inputs >= self.config.stop_after:
                    self.stop(f"--stop-after {self.config.stop_after}")
                    break
            self._maybe_swap()
            ahead = bool(self._ahead)  # served without asking Redis: says nothing of an outage the writer met
            try:
                entries, deliveries = self._next_batch()
            except errors as err:
                if self.stopping:
                    break
                self._join_write()
                self._redis_down(err, "reading", interruptible=True)
                continue
            except redis.ResponseError as err:
                if redis_io.is_wrong_type(err):
                    raise self._wrong_type(err) from err
                if "NOGROUP" not in str(err):
                    raise
                self._join_write()
                if self._until_answered("reading the stream's length", lambda: self.client.xlen(self.config.input)):
                    raise self._group_gone() from err
                log.warning("the consumer group %s on %s is gone and the stream is empty; creating it again",
                            self.config.group, self.config.input)
                self._ensure_group()
                continue
            if not ahead:
                self._redis_up()
            if entries:
                self._process(entries, deliveries)
        if self._ahead:  # read ahead before the stop: the batch in hand, finished
            entries, self._ahead = self._ahead, []
            self._process(entries, {})

    def summary(self) -> dict[str, Any]:
        s = self.stats
        return {"consumer": self.config.consumer, "group": self.config.group, "input": self.config.input,
                "output": self.config.output, "dead_letter": self.config.dead_letter, "redis": self.safe_url,
                "model_name": self.config.model_name,
                "model_version": self.scorer.version if self.scorer else None,
                "inputs": s.inputs, "predictions": s.predictions, "duplicates": s.duplicates,
                "dead_letters": s.dead_letters, "claimed": s.claimed, "batches": s.batches,
                "reconnects": s.reconnects, "redis_retries": dict(s.redis_retries),
                "model_failures": s.model_failures, "max_deliveries": s.max_deliveries, "row_faults": s.row_faults,
                "deleted_before_scoring": s.deleted, "unconfirmed_by_replicas": s.unconfirmed,
                "predictions_by_version": dict(s.by_version), "swaps": s.swaps,
                "stopped_by": self.stop_reason or None}

    def close(self) -> None:
        self.client.close()


def _entry_id(raw: Any) -> str:
    return raw.decode() if isinstance(raw, bytes) else str(raw)


def _why(failure: ModelFailure) -> str:
    cause = failure.__cause__
    return f"{type(cause).__name__}: {cause}"[:300] if cause is not None else str(failure)


def run_consumer(config: StreamConfig, url: str, *, password: str | None = None,
                 install_signals: bool = True) -> dict[str, Any]:
    """The consumer of `nightshift score-stream`, in this process, which it owns: torch gets `config.threads`
    threads (one by default: consumers scale out as processes, and several consumers' spinning OpenMP
    threads on the same cores made two consumers slower than one)."""
    import torch

    torch.set_num_threads(config.threads)
    consumer = StreamConsumer(config, url, password=password)
    if install_signals:
        consumer.install_signal_handlers()
    try:
        return consumer.run()
    finally:
        consumer.close()
