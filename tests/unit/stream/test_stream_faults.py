"""Hostile review of issue 21 (score-stream: dead letters, --max-deliveries, per-input markers, stream-trim).

Each test here reproduces a fault found in review; they are expected to FAIL on the reviewed code. They run a
real redis-server (own port, stopped by PID) and the real StreamConsumer and VersionScorer.score logic; only the
model is a tiny stand-in (no MLflow), so they take seconds.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

from nightshift.stream import consumer as consumer_mod
from nightshift.stream.consumer import StreamConfig, StreamConsumer
from nightshift.stream.records import marker_key
from nightshift.stream.redis_io import connect
from nightshift.stream.scorer import VersionScorer
from tests.integration.redis_helpers import RedisServer, redis_server

COLUMNS = ("a", "b")
STREAMS = {"input": "in", "output": "out", "dead_letter": "dlq"}


class _Classifier:
    """The served model's validation, reduced: finite numbers in [0, 16]."""

    def validate(self, frame: pd.DataFrame) -> Any:
        missing = [c for c in COLUMNS if c not in frame.columns]
        if missing:
            raise ValueError(f"missing columns {missing}")
        values = frame[list(COLUMNS)].to_numpy(dtype="float32")
        if self.invalid_rows(values):
            raise ValueError("feature values must lie in [0, 16]")
        return values

    def invalid_rows(self, values: Any) -> dict[int, str]:
        bad = ~((values >= 0) & (values <= 16)).all(axis=1)
        return {int(i): "feature values must lie in [0, 16]" for i in bad.nonzero()[0]}


class ProcessCrash(BaseException):
    """The process dying in predict (segfault, OOM killer): nothing in the consumer catches it."""


class TinyScorer(VersionScorer):
    """VersionScorer's own score()/row-by-row logic over a stand-in model: label = int(a).
    A row with b == 13 makes predict raise (a model bug on one valid row); b == 14 kills the process."""

    def __init__(self, model_name: str, version: str) -> None:  # no MLflow
        self.model_name = model_name
        self.version = str(version)
        self.classifier = _Classifier()
        self.columns = COLUMNS
        self.column_set = frozenset(COLUMNS)

    def predict_labels(self, values: Any) -> list[int]:
        assert not self.classifier.invalid_rows(values), "scored a row its validation refuses"
        if (values[:, 1] == 14).any():
            raise ProcessCrash("segfault in predict")
        if (values[:, 1] == 13).any():
            raise RuntimeError("index out of range in the model's embedding")
        return [int(v) for v in values[:, 0]]


@pytest.fixture(autouse=True)
def _no_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(consumer_mod, "champion_version", lambda name: "1")
    monkeypatch.setattr(consumer_mod, "MODEL_BACKOFF_START_S", 0.01)
    monkeypatch.setattr(consumer_mod, "MODEL_BACKOFF_CAP_S", 0.02)


@pytest.fixture
def server(tmp_path: Path) -> Iterator[RedisServer]:
    with redis_server(tmp_path / "redis") as srv:
        yield srv


def config(**kw: Any) -> StreamConfig:
    base: dict[str, Any] = {**STREAMS, "group": "g", "consumer": "c1", "model_name": "m"}
    return StreamConfig(**{**base, **kw})


def make(server: RedisServer, **kw: Any) -> StreamConsumer:
    return StreamConsumer(config(**kw), server.url, scorer_factory=TinyScorer)


def add(client: Any, input_id: Any, a: float = 1, b: float = 2, stream: str = "in") -> str:
    return client.xadd(stream, {"data": json.dumps({"id": input_id, "a": a, "b": b})}).decode()


def read(client: Any, stream: str) -> list[dict[str, Any]]:
    return [json.loads(f[b"data"]) for _, f in client.xrange(stream)]


def pending(client: Any) -> int:
    return int(client.xpending("in", "g")["pending"])


def run_restarting(server: RedisServer, runs: int, total: int | None = None,
                   **kw: Any) -> tuple[int, dict[str, Any], BaseException | None]:
    """Run a consumer (same name each time: a crash loop under a supervisor) until one returns a summary.
    With `total`, each run stops after the inputs that have no outcome yet (a run before it wrote some)."""
    last: BaseException | None = None
    client = connect(server.url)
    try:
        for n in range(1, runs + 1):
            if total is not None:
                kw["stop_after"] = total - client.xlen("out") - client.xlen("dlq")
            c = make(server, **kw)
            try:
                return n, c.run(), None
            except (Exception, ProcessCrash) as err:  # the process died (not pytest's own timeout)
                last = err
            finally:
                c.close()
    finally:
        client.close()
    return runs, {}, last


# --- 1. an input id that cannot be encoded as a Redis key crash-loops the group, past --max-deliveries -----


def test_an_id_with_a_lone_surrogate_is_dead_lettered_not_a_crash_loop(server: RedisServer) -> None:
    """`{"id": "\\ud800"}` is valid JSON and passes parse_entry, but its marker key
    `out:scored:s:\\ud800` cannot be UTF-8 encoded: redis-py raises UnicodeEncodeError in the write, which
    nothing catches. The consumer dies with its whole batch pending; its restart (or a claimer) dies again.
    --max-deliveries does not help: the max-deliveries dead letter is keyed on the same marker. Expected:
    the input is dead-lettered with its reason, its neighbour gets its prediction, nothing stays pending."""
    client = connect(server.url)
    add(client, "fine-before")
    client.xadd("in", {"data": b'{"id": "\\ud800", "a": 1, "b": 2}'})
    add(client, "fine-after")

    runs, _summary, error = run_restarting(server, 8, stop_after=3)

    assert error is None and runs == 1, f"the consumer died {runs} times in a row, last: {error!r}"
    assert sorted(o["id"] for o in read(client, "out")) == ["fine-after", "fine-before"]
    assert len(read(client, "dlq")) == 1
    assert pending(client) == 0
    client.close()


def test_an_id_naming_a_foreign_key_of_another_type_does_not_crash_loop_the_group(server: RedisServer) -> None:
    """Ids may hold ':' and are chosen by producers; the marker `out:scored:s:<id>` of id `cache` is the
    key `out:scored:s:cache`. When any other key of that name exists (another application's hash), the
    script's GET replies WRONGTYPE, which the consumer raises as StreamTargetError (fatal, 'name other
    streams') for the whole batch, on every restart; the max-deliveries dead letter hits the same GET, so
    the cap never frees the group. Fixed by naming markers after a digest of the id: `cache` is an id like any
    other and gets its prediction; the other application's key is left as it was.
    (Reviewed test corrected: it expected `cache` dead-lettered, which only the reviewed key scheme needs.)"""
    client = connect(server.url)
    client.hset("out:scored:s:cache", "k", "v")  # not ours
    add(client, "fine")
    add(client, "cache")

    runs, _summary, error = run_restarting(server, 8, stop_after=2)

    assert error is None, f"the consumer died {runs} times in a row, last: {error!r}"
    assert [o["id"] for o in read(client, "out")] == ["fine", "cache"]
    assert client.hgetall("out:scored:s:cache") == {b"k": b"v"}
    assert pending(client) == 0
    client.close()


def test_a_marker_key_taken_by_another_type_dead_letters_that_input_only(server: RedisServer) -> None:
    """Should a key of another type still sit where an input's marker goes (the digest's name, written by
    someone else), that input is dead-lettered with the key named, the others of its batch are scored, and
    the foreign key is neither read nor overwritten nor given a TTL."""
    from nightshift.stream.redis_io import scored_key

    client = connect(server.url)
    taken = f"{scored_key('out')}:{marker_key('taken')}"
    client.hset(taken, "k", "v")
    add(client, "fine")
    add(client, "taken")
    client.xadd("in", {"data": b"{oops"})

    runs, summary, error = run_restarting(server, 3, stop_after=3)

    assert error is None and runs == 1, f"the consumer died {runs} times in a row, last: {error!r}"
    assert [o["id"] for o in read(client, "out")] == ["fine"]
    dead = read(client, "dlq")
    assert [d.get("id") for d in dead] == ["taken", None]
    assert taken in dead[0]["reason"] and "hash" in dead[0]["reason"]
    assert summary["predictions"] == 1 and summary["dead_letters"] == 2
    assert client.hgetall(taken) == {b"k": b"v"} and client.ttl(taken) == -1
    assert pending(client) == 0
    client.close()


# --- 2. one poison input takes its whole batch to the dead letters (max-deliveries) ------------------------


def test_a_valid_row_the_model_fails_on_does_not_take_its_batch_to_the_dead_letters(server: RedisServer) -> None:
    """Issue 21 item 2 says only an input's own fault dead-letters it. One row that passes validation but
    makes predict raise (a model bug on that row) fails the whole batch as ModelFailure, every retry re-reads
    and re-fails the same batch (no bisection), and at the 6th delivery all 10 inputs are dead-lettered
    `max-deliveries`: 9 good inputs the model scores fine get a dead letter instead of a prediction."""
    client = connect(server.url)
    for i in range(10):
        add(client, f"r{i}", a=i % 10, b=13 if i == 4 else 2)

    summary = make(server, stop_after=10).run()

    dead = read(client, "dlq")
    assert [d["id"] for d in dead] == ["r4"], [(d["id"], d["reason"][:40]) for d in dead]
    assert sorted(o["id"] for o in read(client, "out")) == [f"r{i}" for i in range(10) if i != 4]
    assert summary["predictions"] == 9
    client.close()


def test_an_input_that_kills_the_process_does_not_take_its_batch_to_the_dead_letters(server: RedisServer) -> None:
    """Issue 21 item 1: the crash loop stops after --max-deliveries, but the cap counts the batch: the nine
    inputs read together with the killer are re-read with it on every restart and are dead-lettered
    `max-deliveries` with it, although nothing is wrong with them."""
    client = connect(server.url)
    for i in range(10):
        add(client, f"r{i}", a=1, b=14 if i == 7 else 2)

    # Each run stops after what is left: the runs before the last one wrote the killer's neighbours.
    runs, summary, error = run_restarting(server, 10, total=10)

    assert summary, f"still crashing after {runs} runs: {error!r}"
    dead = read(client, "dlq")
    assert [d["id"] for d in dead] == ["r7"], f"{len(dead)} dead letters: {[d['id'] for d in dead]}"
    assert len(read(client, "out")) == 9
    client.close()


def test_a_model_outage_of_seven_seconds_does_not_dead_letter_good_inputs(server: RedisServer,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 21 item 2 ('a model failure dropped good inputs') in slow motion: each ModelFailure re-reads
    the batch from the pending list, which counts as a delivery, so with the shipped backoff (0.2 s doubling)
    five failures, about 6 s of a transient fault (CUDA OOM from a co-tenant, a driver reset), dead-letter
    every good input of the batch `max-deliveries` though the model works again on the next try."""
    monkeypatch.setattr(consumer_mod, "MODEL_BACKOFF_START_S", 0.2)  # the shipped values
    monkeypatch.setattr(consumer_mod, "MODEL_BACKOFF_CAP_S", 10.0)
    healthy_at = time.monotonic() + 7.0

    class Outage(TinyScorer):
        def predict_labels(self, frame: Any) -> list[int]:
            if time.monotonic() < healthy_at:
                raise MemoryError("CUDA out of memory")
            return super().predict_labels(frame)

    client = connect(server.url)
    for i in range(3):
        add(client, f"r{i}")
    c = StreamConsumer(config(stop_after=3), server.url, scorer_factory=Outage)
    try:
        summary = c.run()
    finally:
        c.close()

    assert summary["model_failures"] >= 1
    assert summary["predictions"] == 3, [d["reason"][:60] for d in read(client, "dlq")]
    client.close()


# --- 3. one input, two outcomes / none ------------------------------------------------------------------


def test_a_stalled_consumer_writing_after_the_retention_gives_no_second_prediction(server: RedisServer) -> None:
    """The only guard against a second outcome for an entry is its marker, which has a TTL; the script never
    asks whether the entry is still pending. A consumer that stalls with a batch in hand (GC pause, SIGSTOP,
    a network partition during which _until_answered retries the write forever) while another consumer
    claims and scores the batch, and that resumes after --dedup-retention, writes a second prediction."""
    client = connect(server.url)
    add(client, "x")
    slow = make(server, consumer="slow", dedup_retention_s=1)
    slow._ensure_group()
    slow._load("1", "test")
    in_hand = slow._read(">", 10)
    time.sleep(0.01)
    claimer = make(server, consumer="claimer", claim_idle_ms=1, dedup_retention_s=1, stop_after=1)
    assert claimer.run()["predictions"] == 1
    time.sleep(1.2)  # --dedup-retention 1 s (7 d by default: a partition healing after a shorter retention)

    slow._process(in_hand)

    outs = read(client, "out")
    assert [o["id"] for o in outs] == ["x"], f"{len(outs)} predictions for one input"
    for c in (slow, claimer):
        c.close()
    client.close()


def test_a_pending_entry_deleted_before_its_claim_is_accounted_for(server: RedisServer) -> None:
    """A pending entry deleted from the input (a producer's XADD MAXLEN, XDEL) gets a dead letter ('the
    entry has no fields (deleted ...)') when its own consumer re-reads it, but XAUTOCLAIM (Redis 7) returns
    such ids in a third element that _next_batch ignores, and drops them from the pending list: the input
    vanishes without an outcome or a trace when a *claimer* meets it."""
    client = connect(server.url)
    client.xgroup_create("in", "g", id="0", mkstream=True)
    gone = add(client, "gone")
    client.xreadgroup("g", "crashed", {"in": ">"}, count=1)
    client.xdel("in", gone)
    add(client, "fine")
    time.sleep(0.01)

    summary = make(server, claim_idle_ms=1, stop_after=1).run()

    assert summary["predictions"] == 1
    dead = read(client, "dlq")
    assert len(dead) == 1 and "deleted" in dead[0]["reason"], \
        f"entry {gone} left the pending list with no dead letter: {dead}"
    client.close()


# --- 4. stream-trim / retention: 'every input left in the stream has its marker' ------------------------


def test_a_trim_held_back_past_the_retention_says_so(server: RedisServer,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """docs/how-to/streams.md: stream-trim 'refuses a --max-age longer than --dedup-retention, so every input left
    in the stream has its marker and a group that reads it again (XGROUP SETID ... 0) gets duplicates only'. Not
    when one pending entry (a dead consumer's, another group's) holds the trim: the inputs after it stay in
    the stream while their markers expire, and reading again scores them a second time. The docs no longer
    claims it; the trim names the entry holding it back and the CLI exits 1.
    (Reviewed test corrected: it expected a group reading again to get no prediction at all, which no trim can
    give: entry 0 was never scored and is owed one, and the entries after it have outlived their markers.)"""
    from nightshift.cli import main
    from nightshift.stream.trim import trim_streams

    client = connect(server.url)
    client.xgroup_create("in", "g", id="0", mkstream=True)
    for i in range(4):
        add(client, i)
    stuck = client.xreadgroup("g", "stuck", {"in": ">"}, count=1)[0][1][0][0].decode()  # 30 s claim idle
    assert make(server, dedup_retention_s=1, stop_after=3).run()["predictions"] == 3
    deadline = time.monotonic() + 30
    while client.exists(*(f"out:scored:{marker_key(i)}" for i in range(1, 4))) and time.monotonic() < deadline:
        time.sleep(0.05)  # the markers of 1..3 expire (--dedup-retention 1 s); entry 0 is older than 1 s then
    result = trim_streams(client, input="in", output="out", dead_letter="dlq", max_age_s=1, dedup_retention_s=1)

    assert client.xlen("in") == 4  # held by the pending entry 0
    [warning] = result["warnings"]
    assert stuck in warning and "'stuck'" in warning and "group 'g'" in warning and "outlived" in warning
    args = ["stream-trim", "--redis", server.url, "--input", "in", "--output", "out", "--dead-letter", "dlq",
            "--max-age", "1", "--dedup-retention", "1"]
    assert main(args) == 1
    out, err = capsys.readouterr()
    assert json.loads(out)["input"]["held_by_groups"] == ["g"]
    assert f"warning: group 'g' has entry {stuck} pending" in err
    client.close()


def test_a_group_deleted_under_a_running_consumer_is_not_re_scored_from_the_start(server: RedisServer) -> None:
    """On NOGROUP the consumer created the group again at id 0 and read the whole input stream again; every
    input older than --dedup-retention (7 d by default; the input is never trimmed unless an operator runs
    stream-trim) got a second prediction. Now it stops (GroupGone, exit 2) naming the group and the command
    that creates it again where it was, and creates nothing.
    (Reviewed test corrected: it also expected the input added after the deletion to be scored by the same
    consumer, which only re-creating the group would do; the issue asks the consumer to stop loudly.)"""
    import threading

    from nightshift.stream.errors import GroupGone

    client = connect(server.url)
    for i in range(3):
        add(client, i)
    c = make(server, dedup_retention_s=1, batch_ms=5)
    result: dict[str, Any] = {}

    def target() -> None:
        try:
            result.update(c.run())
        except BaseException as err:  # reported to the test
            result["error"] = err

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while client.xlen("out") < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        while client.exists(*(f"out:scored:{marker_key(i)}" for i in range(3))) and time.monotonic() < deadline:
            time.sleep(0.05)  # markers expired (--dedup-retention 1 s): re-reading would score them again
        client.xgroup_destroy("in", "g")  # an operator's mistake, a reset script
        add(client, "new")
        thread.join(timeout=30)
    finally:
        c.stop()
        thread.join(timeout=30)
        c.close()
    error = result.get("error")
    assert isinstance(error, GroupGone), result
    assert "'g'" in str(error) and f"XGROUP CREATE in g {client.xrange('in')[2][0].decode()}" in str(error)
    assert sorted(o["id"] for o in read(client, "out")) == [0, 1, 2]
    assert client.xinfo_groups("in") == []
    client.close()


# --- 5. deployment shapes the docs do not rule out ---------------------------------------------------


def test_redis_cluster_is_refused_at_start_not_crash_looped(tmp_path: Path) -> None:
    """docs/how-to/streams.md: 'or any Redis 7'. On a Cluster (one node owning every slot here, so nothing is MOVED) the
    write script's keys (input, output, dead letters, one marker per input) lie in different slots: the
    consumer reads a batch, the script replies CROSSSLOT, and the consumer dies with a raw ResponseError,
    on every restart, with the batch pending. Expected: refused at start with a message (or hash tags
    {...} in the key names so that one slot holds them)."""
    from nightshift.stream.errors import StreamConfigError
    from nightshift.stream.redis_server import REDIS_SERVER

    if REDIS_SERVER is None:
        pytest.skip("redis-server is not installed")
    for _ in range(50):  # the cluster bus port is port + 10000
        srv = RedisServer(tmp_path / "cluster", extra_config=["cluster-enabled yes",
                                                              f"cluster-config-file {tmp_path}/nodes.conf"])
        if srv.port <= 55535:
            break
    try:
        srv.start()
        client = connect(srv.url)
        client.execute_command("CLUSTER", "ADDSLOTSRANGE", 0, 16383)
        deadline = time.monotonic() + 20
        while b"cluster_state:ok" not in client.execute_command("CLUSTER", "INFO") and time.monotonic() < deadline:
            time.sleep(0.1)
        add(client, "a")  # 'in' is served by this node
        c = make(srv, stop_after=1)
        try:
            c.run()
        except StreamConfigError:
            pass  # refused at start: acceptable
        finally:
            c.close()
        # (Reviewed test corrected: it read the group's pending count, which raises NOGROUP when the consumer
        # refused before creating the group.)
        groups = client.xinfo_groups("in")
        assert all(int(g["pending"]) == 0 for g in groups) or client.xlen("out") == 1
        client.close()
    finally:
        srv.stop()


def _run_in_thread(c: StreamConsumer) -> tuple[Any, dict[str, Any]]:
    import threading

    result: dict[str, Any] = {}

    def target() -> None:
        try:
            result.update(c.run())
        except BaseException as err:
            result["error"] = err

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread, result


def test_wait_replicas_short_at_shutdown_does_not_claim_written_inputs_are_pending(server: RedisServer) -> None:
    """--wait-replicas 1 with no replica: the batch is written and acknowledged, WAIT stays short, the write
    is retried for ever (a hang nothing at start warns about: no replica is connected at all). On SIGTERM the
    consumer gives up after drain_timeout_s with StreamUnavailable (exit 3, no summary) saying 'the batch's
    inputs stay pending' although they were written and acknowledged."""
    from nightshift.stream.errors import StreamUnavailable

    client = connect(server.url)
    add(client, "a")
    c = StreamConsumer(config(stop_after=1, wait_replicas=1, wait_timeout_ms=50, drain_timeout_s=1), server.url,
                       scorer_factory=TinyScorer)
    thread, result = _run_in_thread(c)
    deadline = time.monotonic() + 20
    while c.stats.redis_retries["ReplicasBehind"] < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    c.stop("SIGTERM")
    thread.join(timeout=30)
    c.close()
    assert client.xlen("out") == 1 and pending(client) == 0  # written and acknowledged
    error = result.get("error")
    assert not (isinstance(error, StreamUnavailable) and "stay pending" in str(error)), str(error)
    client.close()


# --- the write in flight (a batch written in the writer thread while the next one, read ahead, is scored) ----


def _in_writer() -> bool:
    import threading

    return threading.current_thread().name.startswith("stream-writer")


def _slow_writes(monkeypatch: pytest.MonkeyPatch, seconds: float) -> None:
    """Writes in the writer thread take `seconds` longer (a loaded Redis, a slow link)."""
    real = StreamConsumer._commit_now

    def slow(self: StreamConsumer, *args: Any) -> None:
        if _in_writer():
            time.sleep(seconds)
        real(self, *args)

    monkeypatch.setattr(StreamConsumer, "_commit_now", slow)


def test_stop_after_counts_the_inputs_of_the_write_in_flight(server: RedisServer,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """stop_after 10, batches of 8: while batch 1's write is in flight, 8 more inputs arrive; the next batch
    may take only 2 (before: stats.inputs was still 0 and it took 8: 16 inputs)."""
    _slow_writes(monkeypatch, 1.0)
    client = connect(server.url)
    for i in range(8):
        add(client, f"a{i}")
    c = StreamConsumer(config(batch_rows=8, stop_after=10), server.url, scorer_factory=TinyScorer)
    thread, result = _run_in_thread(c)
    deadline = time.monotonic() + 20
    while c._in_flight is None and time.monotonic() < deadline and thread.is_alive():
        time.sleep(0.01)
    for i in range(8):
        add(client, f"b{i}")
    thread.join(30)
    c.close()
    assert "error" not in result, result
    assert result["inputs"] == 10 and client.xlen("out") == 10, result
    client.close()


def test_a_write_retried_for_a_moment_costs_the_batch_read_ahead_no_delivery(server: RedisServer,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Redis answers OOM for 0.6 s right after the next batch was read ahead: the writer retries (and marks a
    recovery). The batch read ahead is in hand, on its first delivery: scored, not dropped and read again from
    the pending list (before: a second delivery each, and with --max-deliveries 1 eight good inputs were
    dead-lettered as max-deliveries)."""
    import threading

    client = connect(server.url)
    for i in range(16):
        add(client, f"x{i}")
    real_read_ahead = StreamConsumer._read_ahead
    fired: list[bool] = []

    def read_ahead(self: StreamConsumer) -> None:
        real_read_ahead(self)
        if self._ahead and not fired:
            fired.append(True)
            client.config_set("maxmemory", 1)  # noeviction (the default): writes refused with OOM
            threading.Timer(0.6, lambda: client.config_set("maxmemory", 0)).start()

    real_swap = StreamConsumer._maybe_swap

    def maybe_swap(self: StreamConsumer) -> None:  # the turn's announcement read takes a moment: the writer
        if len(fired) == 1:                         # meets the OOM before the next batch is taken
            fired.append(True)
            time.sleep(0.05)
        real_swap(self)

    monkeypatch.setattr(StreamConsumer, "_read_ahead", read_ahead)
    monkeypatch.setattr(StreamConsumer, "_maybe_swap", maybe_swap)
    c = StreamConsumer(config(batch_rows=8, stop_after=16, max_deliveries=1), server.url, scorer_factory=TinyScorer)
    thread, result = _run_in_thread(c)
    thread.join(30)
    c.close()
    assert "error" not in result, result
    assert fired and result["redis_retries"], result  # the write was refused, then retried
    assert read(client, "dlq") == [] and client.xlen("out") == 16 and pending(client) == 0
    client.close()


def test_a_swap_counts_the_batch_still_being_written_before_it(server: RedisServer,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The deploy step announces v2 while v1's batch is still being written: the swap says it came after
    those 8 inputs (before: after 0), and they are v1's predictions."""
    from nightshift.stream import announce

    _slow_writes(monkeypatch, 0.5)
    client = connect(server.url)
    real_read_ahead = StreamConsumer._read_ahead

    def read_ahead(self: StreamConsumer) -> None:
        real_read_ahead(self)
        if not client.exists(announce.champion_key("m")):
            client.set(announce.champion_key("m"), "2")
            for i in range(8):
                add(client, f"b{i}")

    monkeypatch.setattr(StreamConsumer, "_read_ahead", read_ahead)
    for i in range(8):
        add(client, f"a{i}")
    c = StreamConsumer(config(batch_rows=8, stop_after=16), server.url, scorer_factory=TinyScorer)
    thread, result = _run_in_thread(c)
    thread.join(30)
    c.close()
    assert "error" not in result, result
    assert result["predictions_by_version"] == {"1": 8, "2": 8}
    assert [s["after_inputs"] for s in result["swaps"]] == ["8"], result["swaps"]
    client.close()
