"""The consumer loop of `nightshift score-stream`.

Each turn: maybe swap the model (between batches only), take a batch (this consumer's own pending
entries after a (re)connect, else entries other consumers left idle past `claim_idle_ms`, else new
ones: at most `batch_rows`, waiting at most `batch_ms` after the first), score it, then write the
predictions and dead letters and acknowledge the inputs in one script (redis_io.WRITE_AND_ACK).

Redis going away is waited out with capped exponential backoff: a batch in hand is written when Redis is
back (the script is idempotent, so a write whose reply was lost is simply written again); entries read
but not yet written stay pending and are read again from this consumer's pending list after the
reconnect. A stop (SIGTERM, SIGINT, `stop()`, `stop_after`) finishes the batch in hand first.
"""

from __future__ import annotations

import logging
import signal
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from nightshift.served_model import MAX_ROWS
from nightshift.stream import announce, records, redis_io
from nightshift.stream.errors import StreamConfigError, StreamUnavailable
from nightshift.stream.scorer import VersionScorer, champion_version

log = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "nightshift-digits"
BACKOFF_START_S = 0.1
BACKOFF_CAP_S = 2.0


@dataclass(frozen=True)
class StreamConfig:
    """What one consumer reads, writes and scores with; checked when built."""

    input: str
    output: str
    dead_letter: str
    group: str
    consumer: str
    model_name: str = DEFAULT_MODEL_NAME
    batch_rows: int = 256
    batch_ms: int = 50
    stop_after: int | None = None
    claim_idle_ms: int = 30_000
    champion_poll_s: float = 30.0
    drain_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        for name in ("input", "output", "dead_letter", "group", "consumer", "model_name"):
            if not getattr(self, name):
                raise StreamConfigError(f"--{name.replace('_', '-')} must not be empty")
        streams = {self.input, self.output, self.dead_letter}
        if len(streams) != 3:
            raise StreamConfigError(f"--input, --output and --dead-letter must be three different streams "
                                    f"(got {self.input!r}, {self.output!r}, {self.dead_letter!r})")
        if not 1 <= self.batch_rows <= MAX_ROWS:
            raise StreamConfigError(f"--batch-rows {self.batch_rows}: must be 1..{MAX_ROWS} (the served model's "
                                    f"limit per call, NIGHTSHIFT_SERVING_MAX_ROWS)")
        if not 1 <= self.batch_ms <= 10_000:
            raise StreamConfigError(f"--batch-ms {self.batch_ms}: must be 1..10000 (a batch waits at most that "
                                    f"long for rows)")
        if self.stop_after is not None and self.stop_after < 1:
            raise StreamConfigError(f"--stop-after {self.stop_after}: must be at least 1 (leave it out to run "
                                    f"until SIGTERM)")
        if self.claim_idle_ms < 1:
            raise StreamConfigError(f"--claim-idle-ms {self.claim_idle_ms}: must be at least 1")
        if self.champion_poll_s <= 0:
            raise StreamConfigError(f"--champion-poll-s {self.champion_poll_s}: must be positive")

    @property
    def claim_interval_s(self) -> float:
        return min(max(self.claim_idle_ms / 2000, 0.1), 5.0)


@dataclass
class Stats:
    inputs: int = 0
    predictions: int = 0
    duplicates: int = 0
    dead_letters: int = 0
    claimed: int = 0
    reconnects: int = 0
    batches: int = 0
    by_version: Counter[str] = field(default_factory=Counter)
    swaps: list[dict[str, str]] = field(default_factory=list)


ScorerFactory = Callable[[str, str], VersionScorer]


class StreamConsumer:
    """One member of a consumer group scoring `config.input` into `config.output`."""

    def __init__(self, config: StreamConfig, url: str, *, password: str | None = None,
                 scorer_factory: ScorerFactory = VersionScorer) -> None:
        self.config = config
        self.url = url
        self.safe_url = redis_io.redact(url)
        self.client = redis_io.connect(url, password=password)
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
        self._script: Any = None
        self._backoff = BACKOFF_START_S
        self._outage_since: float | None = None

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
        return max(0, min(self.config.batch_rows, self.config.stop_after - self.stats.inputs))

    # --- Redis with backoff ------------------------------------------------------------------------

    def _sleep(self, seconds: float, *, interruptible: bool) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and not (interruptible and self.stopping):
            time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))

    def _redis_down(self, err: BaseException, doing: str, *, interruptible: bool) -> None:
        if self._outage_since is None:
            self._outage_since = time.monotonic()
            self.stats.reconnects += 1
        log.warning("Redis at %s did not answer while %s (%s: %s); retrying in %.1f s", self.safe_url, doing,
                    type(err).__name__, err, self._backoff)
        self._recover = True
        self._sleep(self._backoff, interruptible=interruptible)
        self._backoff = min(self._backoff * 2, BACKOFF_CAP_S)

    def _redis_up(self) -> None:
        if self._outage_since is not None:
            log.info("Redis at %s answers again after %.1f s", self.safe_url, time.monotonic() - self._outage_since)
        self._outage_since = None
        self._backoff = BACKOFF_START_S

    def _until_answered(self, doing: str, call: Callable[[], Any]) -> Any:
        """Run `call` until Redis answers. Used for what must not be dropped (a batch's write); while
        stopping, gives up after drain_timeout_s and leaves the inputs pending for another consumer."""
        errors = redis_io.connection_errors()
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
                self._redis_down(err, doing, interruptible=False)
                continue
            self._redis_up()
            return result

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
                                     "after_inputs": str(self.stats.inputs)})
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

    def _read(self, start: str, count: int, block: int | None = None) -> list[tuple[Any, Any]]:
        reply = self.client.xreadgroup(self.config.group, self.config.consumer, {self.config.input: start},
                                       count=count, block=block)
        if not reply:
            return []
        return list(reply[0][1])

    def _next_batch(self) -> list[tuple[Any, Any]]:
        limit = self._room()
        if limit == 0:
            return []
        if self._recover:
            entries = self._read("0", limit)
            if entries:
                return entries
            self._recover = False
        now = time.monotonic()
        if now - self._last_claim >= self.config.claim_interval_s:
            self._last_claim = now
            reply = self.client.xautoclaim(self.config.input, self.config.group, self.config.consumer,
                                           min_idle_time=self.config.claim_idle_ms, start_id=self._claim_cursor,
                                           count=limit)
            cursor, claimed = reply[0], reply[1]
            self._claim_cursor = cursor.decode() if isinstance(cursor, bytes) else str(cursor)
            if claimed:
                self.stats.claimed += len(claimed)
                log.info("claimed %d pending inputs idle for %d ms or more", len(claimed), self.config.claim_idle_ms)
                return list(claimed)
        entries = self._read(">", limit, block=self.config.batch_ms)
        if not entries:
            return []
        deadline = time.monotonic() + self.config.batch_ms / 1000
        while len(entries) < limit and not self.stopping:
            left_ms = int((deadline - time.monotonic()) * 1000)
            if left_ms < 1:
                break
            more = self._read(">", limit - len(entries), block=left_ms)
            if not more:
                break
            entries.extend(more)
        return entries

    # --- scoring and writing -----------------------------------------------------------------------

    def _write_args(self, entries: list[tuple[Any, Any]]) -> list[Any]:
        assert self.scorer is not None
        scorer = self.scorer
        rows: list[records.InputRow] = []
        rejected: list[records.Rejected] = []
        for raw_id, fields in entries:
            entry_id = raw_id.decode() if isinstance(raw_id, bytes) else str(raw_id)
            parsed = records.parse_entry(entry_id, fields, scorer.columns, scorer.column_set)
            (rows if isinstance(parsed, records.InputRow) else rejected).append(parsed)  # type: ignore[arg-type]
        scored = scorer.score(rows)
        if scored.rejected:  # dead letters in input order
            rejected.extend(scored.rejected)
            rejected.sort(key=lambda item: tuple(int(part) for part in item.entry_id.split("-", 1)))
        now_ms = time.time() * 1000
        args: list[Any] = [self.config.group]
        for row, label in zip(scored.rows, scored.labels, strict=True):
            latency = now_ms - records.entry_ms(row.entry_id)
            args += ["p", row.entry_id, records.marker_key(row.input_id),
                     records.prediction_payload(row.input_id, label, scorer.version, latency)]
        for item in rejected:
            args += ["d", item.entry_id, item.entry_id, records.dead_letter_payload(item)]
        return args

    def _write(self, args: list[Any]) -> tuple[int, int, int]:
        if self._script is None:
            self._script = self.client.register_script(redis_io.WRITE_AND_ACK)
        keys = [self.config.input, self.config.output, self.config.dead_letter,
                redis_io.scored_key(self.config.output), redis_io.dead_key(self.config.dead_letter)]
        written, duplicates, dead = self._until_answered(
            "writing predictions", lambda: self._script(keys=keys, args=args, client=self.client))
        return int(written), int(duplicates), int(dead)

    def _process(self, entries: list[tuple[Any, Any]]) -> None:
        assert self.scorer is not None
        args = self._write_args(entries)
        written, duplicates, dead = self._write(args)
        self.stats.batches += 1
        self.stats.inputs += len(entries)
        self.stats.predictions += written
        self.stats.duplicates += duplicates
        self.stats.dead_letters += dead
        self.stats.by_version[self.scorer.version] += written
        if dead:
            log.info("%d inputs of a batch of %d went to %s", dead, len(entries), self.config.dead_letter)

    # --- the loop ----------------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        """Score until stopped (or `stop_after` inputs); return what was done."""
        self._ensure_group()
        self._announced = self._until_answered(
            "reading the champion announcement",
            lambda: self.client.get(announce.champion_key(self.config.model_name)))
        self._load(champion_version(self.config.model_name), "@champion in the registry")
        self._last_poll = time.monotonic()
        errors = redis_io.connection_errors()
        import redis

        while not self.stopping:
            if self.config.stop_after is not None and self.stats.inputs >= self.config.stop_after:
                self.stop(f"--stop-after {self.config.stop_after}")
                break
            self._maybe_swap()
            try:
                entries = self._next_batch()
            except errors as err:
                if self.stopping:
                    break
                self._redis_down(err, "reading", interruptible=True)
                continue
            except redis.ResponseError as err:
                if "NOGROUP" not in str(err):
                    raise
                log.warning("the consumer group %s on %s is gone (stream deleted?); creating it again",
                            self.config.group, self.config.input)
                self._ensure_group()
                continue
            self._redis_up()
            if entries:
                self._process(entries)
        return self.summary()

    def summary(self) -> dict[str, Any]:
        s = self.stats
        return {"consumer": self.config.consumer, "group": self.config.group, "input": self.config.input,
                "output": self.config.output, "dead_letter": self.config.dead_letter, "redis": self.safe_url,
                "model_name": self.config.model_name,
                "model_version": self.scorer.version if self.scorer else None,
                "inputs": s.inputs, "predictions": s.predictions, "duplicates": s.duplicates,
                "dead_letters": s.dead_letters, "claimed": s.claimed, "batches": s.batches,
                "reconnects": s.reconnects, "predictions_by_version": dict(s.by_version), "swaps": s.swaps,
                "stopped_by": self.stop_reason or None}

    def close(self) -> None:
        self.client.close()


def run_consumer(config: StreamConfig, url: str, *, password: str | None = None,
                 install_signals: bool = True) -> dict[str, Any]:
    consumer = StreamConsumer(config, url, password=password)
    if install_signals:
        consumer.install_signal_handlers()
    try:
        return consumer.run()
    finally:
        consumer.close()
