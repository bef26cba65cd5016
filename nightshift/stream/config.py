"""`nightshift score-stream`'s options as one checked object, and what a consumer counts."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from nightshift.served_model import MAX_ROWS
from nightshift.stream import redis_io
from nightshift.stream.errors import StreamConfigError

DEFAULT_MODEL_NAME = "nightshift-digits"
DEFAULT_DEDUP_RETENTION_S = 7 * 24 * 3600.0
DEFAULT_MODEL_RETRY_S = 60.0


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
    max_deliveries: int = 5
    dedup_retention_s: float = DEFAULT_DEDUP_RETENTION_S
    wait_replicas: int = 0
    wait_timeout_ms: int = 1000
    model_retry_s: float = DEFAULT_MODEL_RETRY_S
    threads: int = 1

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
        if self.max_deliveries < 1:
            raise StreamConfigError(f"--max-deliveries {self.max_deliveries}: must be at least 1")
        if self.dedup_retention_s < 1:
            raise StreamConfigError(f"--dedup-retention {self.dedup_retention_s:g} s: must be at least 1 s (the "
                                    f"window in which an id sent again gets no second prediction)")
        if self.model_retry_s < 0:
            raise StreamConfigError(f"--model-retry-s {self.model_retry_s:g}: must be at least 0 (how long a batch "
                                    f"the model fails on is retried in hand before it is left pending)")
        if not 1 <= self.threads <= 256:
            raise StreamConfigError(f"--threads {self.threads}: must be 1..256 (torch threads of this consumer; "
                                    f"scale out with more consumers)")
        if self.wait_replicas < 0 or self.wait_timeout_ms < 1:
            raise StreamConfigError(f"--wait-replicas {self.wait_replicas} / --wait-timeout-ms {self.wait_timeout_ms}: "
                                    f"must be at least 0 / 1")
        markers = {redis_io.scored_key(self.output): "--output", redis_io.dead_key(self.dead_letter): "--dead-letter"}
        for name in ("input", "output", "dead_letter"):
            stream = getattr(self, name)
            for prefix, owner in markers.items():
                if stream.startswith(prefix + ":"):
                    raise StreamConfigError(f"--{name.replace('_', '-')} {stream!r} lies among the markers of "
                                            f"{owner} ({prefix}:*); name another stream")

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
    model_failures: int = 0
    max_deliveries: int = 0
    row_faults: int = 0
    deleted: int = 0
    unconfirmed: int = 0
    redis_retries: Counter[str] = field(default_factory=Counter)
    by_version: Counter[str] = field(default_factory=Counter)
    swaps: list[dict[str, str]] = field(default_factory=list)
