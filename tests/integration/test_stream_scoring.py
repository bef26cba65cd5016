"""`nightshift score-stream` against a real redis-server (AOF on) and a champion in a real MLflow registry:
labels as in-process scoring, dead letters, exactly once under redelivery, a crashed consumer, a Redis
restart and a champion swap.

The 100,000-input kill -9 test is marked `slow` as well as `integration` (see its docstring for timing).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest

from nightshift.stream.announce import announce_champion
from nightshift.stream.consumer import StreamConfig, StreamConsumer
from nightshift.stream.redis_io import WRITE_AND_ACK, connect, scored_key
from tests.integration.redis_helpers import RedisServer, random_password, redis_server
from tests.trained_model import write_trained_output

pytestmark = pytest.mark.integration

MODEL = "digits-stream"
BIN = Path(sys.executable).parent
STREAMS = {"input": "in", "output": "out", "dead_letter": "dlq"}


# --- fixtures ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory, demo_data: Path) -> dict[str, Any]:
    """One NIGHTSHIFT_HOME whose registry holds MODEL v1 (@champion) and v2 (@challenger, another seed)."""
    from nightshift import registry, tracking

    home = tmp_path_factory.mktemp("stream-home")
    saved = os.environ.get("NIGHTSHIFT_HOME")
    os.environ["NIGHTSHIFT_HOME"] = str(home)
    if hasattr(tracking, "_configured"):
        tracking._configured = None
    try:
        root = tmp_path_factory.mktemp("stream-trained")
        versions = {}
        for key, seed, alias in (("A", 0, registry.CHAMPION), ("B", 5, registry.CHALLENGER)):
            out = write_trained_output(root / key, demo_data, epochs=2, seed=seed, hidden=32)
            run_id = tracking.log_training_run(out, experiment="stream-it", tags={"nightshift.run_key": key})
            versions[key] = registry.register(run_id, model_name=MODEL, alias=alias)["version"]
    finally:
        if saved is None:
            os.environ.pop("NIGHTSHIFT_HOME", None)
        else:
            os.environ["NIGHTSHIFT_HOME"] = saved
        if hasattr(tracking, "_configured"):
            tracking._configured = None
    frame = pd.read_parquet(demo_data / "test.parquet")
    return {"home": home, "v1": versions["A"], "v2": versions["B"], "test": frame}


@pytest.fixture(autouse=True)
def shared_home(world: dict[str, Any], nightshift_home: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    from nightshift import registry, tracking

    monkeypatch.setenv("NIGHTSHIFT_HOME", str(world["home"]))
    if hasattr(tracking, "_configured"):
        monkeypatch.setattr(tracking, "_configured", None)
    yield
    registry.set_alias(MODEL, registry.CHAMPION, world["v1"])  # a swap test moved it


@pytest.fixture
def server(tmp_path: Path) -> Iterator[RedisServer]:
    with redis_server(tmp_path / "redis") as srv:
        yield srv


# --- helpers -----------------------------------------------------------------------------------------


def features(world: dict[str, Any]) -> pd.DataFrame:
    return world["test"].drop(columns=["label"])


def add_inputs(client: Any, frame: pd.DataFrame, ids: list[Any], stream: str = "in", chunk: int = 2000,
               first_row: int = 0) -> None:
    """XADD one input per id; the i-th id gets row (first_row + i) of `frame`, cycling."""
    columns = list(frame.columns)
    values = frame.to_numpy().tolist()
    for start in range(0, len(ids), chunk):
        pipe = client.pipeline(transaction=False)
        for i in range(start, min(start + chunk, len(ids))):
            row = values[(first_row + i) % len(values)]
            pipe.xadd(stream, {"data": json.dumps({"id": ids[i], **dict(zip(columns, row, strict=True))})})
        pipe.execute()


def read_stream(client: Any, stream: str) -> list[dict[str, Any]]:
    out, start = [], "-"
    while True:
        batch = client.xrange(stream, min=start, count=10_000)
        if not batch:
            return out
        out.extend(json.loads(fields[b"data"]) for _, fields in batch)
        last = batch[-1][0].decode()
        ms, seq = last.split("-")
        start = f"{ms}-{int(seq) + 1}"


def pending(client: Any, group: str = "g") -> int:
    return int(client.xpending("in", group)["pending"])


def in_process_labels(version: str, frame: pd.DataFrame) -> np.ndarray:
    import mlflow.pyfunc

    from nightshift import tracking

    tracking.client()
    model = mlflow.pyfunc.load_model(f"models:/{MODEL}/{version}")
    return model.predict(frame)["predicted_label"].to_numpy()


def config(**kw: Any) -> StreamConfig:
    base: dict[str, Any] = {**STREAMS, "group": "g", "consumer": "c1", "model_name": MODEL}
    return StreamConfig(**{**base, **kw})


def child_env(world: dict[str, Any]) -> dict[str, str]:
    env = dict(os.environ)
    env["NIGHTSHIFT_HOME"] = str(world["home"])
    env.pop("NIGHTSHIFT_REDIS_URL", None)
    return env


def start_consumer(world: dict[str, Any], url: str, name: str, log_dir: Path, *args: str,
                   password_file: Path | None = None) -> subprocess.Popen[bytes]:
    cmd = [str(BIN / "nightshift"), "score-stream", "--redis", url, "--input", "in", "--output", "out",
           "--dead-letter", "dlq", "--group", "g", "--consumer", name, "--model-name", MODEL, *args]
    if password_file is not None:
        cmd += ["--redis-password-file", str(password_file)]
    log_dir.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen(cmd, env=child_env(world), stdout=(log_dir / f"{name}.out").open("wb"),
                            stderr=(log_dir / f"{name}.err").open("wb"), start_new_session=True)


def stop(proc: subprocess.Popen[bytes], sig: int = signal.SIGTERM, timeout: float = 60) -> int:
    if proc.poll() is None:
        os.kill(proc.pid, sig)
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        raise


def wait_for(predicate: Any, timeout: float, what: str, procs: list[subprocess.Popen[bytes]] | None = None,
             log_dir: Path | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        for proc in procs or []:
            if proc.poll() is not None and proc.returncode != 0 and proc.returncode != -signal.SIGKILL:
                logs = "".join(p.read_text()[-3000:] for p in sorted((log_dir or Path()).glob("*.err")))
                raise AssertionError(f"a consumer exited {proc.returncode} while waiting for {what}:\n{logs}")
        time.sleep(0.2)
    logs = "".join(p.read_text()[-3000:] for p in sorted((log_dir or Path()).glob("*.err"))) if log_dir else ""
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}\n{logs}")


def assert_exactly_once(client: Any, ids: list[Any]) -> list[dict[str, Any]]:
    outs = read_stream(client, "out")
    counts = Counter(o["id"] for o in outs)
    twice = [k for k, n in counts.items() if n > 1]
    missing = set(ids) - set(counts)
    assert not twice, f"{len(twice)} ids have more than one prediction, e.g. {twice[:5]}"
    assert not missing, f"{len(missing)} ids have no prediction, e.g. {sorted(missing)[:5]}"
    assert len(outs) == len(ids)
    assert pending(client) == 0
    return outs


# --- tests -------------------------------------------------------------------------------------------


def test_streamed_labels_equal_in_process_scoring(world: dict[str, Any], tmp_path: Path) -> None:
    """The CLI against a password-protected Redis (password from a file): same labels as the pyfunc in
    process, one prediction per id naming v1 with its latency, a JSON summary, the password nowhere."""
    password = random_password()
    pw_file = tmp_path / "redis.pw"
    pw_file.write_text(password)
    pw_file.chmod(0o600)
    frame = features(world)  # the demo's test split: 270 rows
    with redis_server(tmp_path / "redis", password=password) as srv:
        client = connect(srv.url)
        ids = [f"row-{i}" for i in range(len(frame))]
        add_inputs(client, frame, ids)
        proc = start_consumer(world, srv.url_without_password, "c1", tmp_path / "logs", "--stop-after", str(len(frame)),
                              "--batch-rows", "64", password_file=pw_file)
        try:
            ps = subprocess.run(["ps", "-o", "args=", "-p", str(proc.pid)], capture_output=True, text=True).stdout
            assert proc.wait(timeout=300) == 0, (tmp_path / "logs" / "c1.err").read_text()[-3000:]
        finally:
            if proc.poll() is None:
                stop(proc, signal.SIGKILL)
        outs = assert_exactly_once(client, ids)
        client.close()
    summary = json.loads((tmp_path / "logs" / "c1.out").read_text())
    assert summary["inputs"] == summary["predictions"] == len(frame)
    assert summary["stopped_by"] == f"--stop-after {len(frame)}"
    assert summary["redis"] == srv.url_without_password
    expected = in_process_labels(world["v1"], frame)
    by_id = {o["id"]: o for o in outs}
    got = np.array([by_id[i]["prediction"] for i in ids])
    np.testing.assert_array_equal(got, expected)
    assert {o["model_version"] for o in outs} == {world["v1"]}
    assert all(o["latency_ms"] >= 0 for o in outs)
    logs = (tmp_path / "logs" / "c1.err").read_text() + (tmp_path / "logs" / "c1.out").read_text()
    assert password not in logs and password not in ps


def test_bad_inputs_go_to_the_dead_letter_stream_with_reasons(world: dict[str, Any], server: RedisServer) -> None:
    client = connect(server.url)
    frame = features(world).head(20)
    good = frame.iloc[0].to_dict()
    row = {"id": "ok-1", **good}
    bad: dict[str, bytes] = {
        "not json": b"{oops",
        "missing id": json.dumps(good).encode(),
        "missing column": json.dumps({k: v for k, v in row.items() if k != "pixel_5"}).encode(),
        "extra column": json.dumps({**row, "id": "x1", "colour": 3}).encode(),
        "wrong type": json.dumps({**row, "id": "x2", "pixel_3": "three"}).encode(),
        "nan": json.dumps({**row, "id": "x3", "pixel_7": float("nan")}).encode(),
        "inf": json.dumps({**row, "id": "x4", "pixel_7": float("inf")}).encode(),
        "out of range": json.dumps({**row, "id": "x5", "pixel_7": 99.0}).encode(),
    }
    ids = [f"g{i}" for i in range(len(frame))]
    add_inputs(client, frame.head(10), ids[:10])
    for payload in bad.values():
        client.xadd("in", {"data": payload})
    add_inputs(client, frame.tail(10), ids[10:])
    client.xadd("in", {"not_data": b"1"})
    total = 20 + len(bad) + 1

    summary = StreamConsumer(config(stop_after=total, batch_rows=512), server.url).run()

    assert summary["predictions"] == 20 and summary["dead_letters"] == len(bad) + 1
    assert pending(client) == 0
    dead = read_stream(client, "dlq")
    reasons = [d["reason"] for d in dead]
    expected = ["is not JSON", "no 'id'", "missing columns ['pixel_5']", "extra columns ['colour']",
                "wrong type: pixel_3 is a JSON string", "finite", "finite", "must lie in [0, 16]",
                "no 'data' field"]
    for reason, want in zip(reasons, expected, strict=True):
        assert want in reason
    assert dead[0]["data"] == "{oops" and "id" not in dead[0]
    assert dead[3]["id"] == "x1" and json.loads(dead[3]["data"])["colour"] == 3
    assert sorted(o["id"] for o in read_stream(client, "out")) == sorted(ids)
    client.close()


def test_a_redelivered_or_repeated_input_gets_one_prediction(world: dict[str, Any], server: RedisServer) -> None:
    """A consumer that read inputs and died: its pending inputs are claimed after the idle time and scored
    once; an id sent twice is scored once; the write script run twice (a lost reply) writes once."""
    client = connect(server.url)
    frame = features(world).head(50)
    client.xgroup_create("in", "g", id="0", mkstream=True)
    add_inputs(client, frame, list(range(40)))
    client.xreadgroup("g", "crashed", {"in": ">"}, count=25)  # read, never acknowledged
    add_inputs(client, frame.head(10), list(range(30, 40)))  # ids 30..39 sent a second time
    time.sleep(0.3)

    summary = StreamConsumer(config(stop_after=50, claim_idle_ms=200), server.url).run()

    assert summary["claimed"] == 25 and summary["inputs"] == 50
    assert summary["predictions"] == 40 and summary["duplicates"] == 10
    assert_exactly_once(client, list(range(40)))
    assert int(client.xpending("in", "g")["pending"]) == 0

    # The same write again, as after a reply lost to a connection drop: acknowledged, nothing written.
    entry = client.xadd("in", {"data": b"{}"}).decode()
    script = client.register_script(WRITE_AND_ACK)
    keys = ["in", "out", "dlq", scored_key("out"), "dlq:seen"]
    args = ["g", "p", entry, "i:999", json.dumps({"id": 999})]
    assert script(keys=keys, args=args) == [1, 0, 0]
    assert script(keys=keys, args=args) == [0, 1, 0]
    assert sum(1 for o in read_stream(client, "out") if o["id"] == 999) == 1
    client.close()


def test_sigterm_finishes_the_batch_and_exits_zero(world: dict[str, Any], server: RedisServer,
                                                    tmp_path: Path) -> None:
    client = connect(server.url)
    frame = features(world)
    ids = list(range(3000))
    proc = start_consumer(world, server.url, "c1", tmp_path / "logs", "--batch-rows", "128")
    try:
        add_inputs(client, frame, ids, chunk=500)
        wait_for(lambda: client.xlen("out") > 200, 180, "first predictions", [proc], tmp_path / "logs")
    finally:
        code = stop(proc, signal.SIGTERM)
    assert code == 0
    summary = json.loads((tmp_path / "logs" / "c1.out").read_text())
    assert summary["stopped_by"] == "SIGTERM"
    # Everything it read was written and acknowledged: nothing of c1's pending, outputs = its inputs.
    assert int(client.xpending("in", "g")["pending"]) == 0
    assert client.xlen("out") == summary["predictions"] == summary["inputs"]
    client.close()


def test_champion_swap_mid_stream_loses_and_repeats_nothing(world: dict[str, Any], server: RedisServer,
                                                            tmp_path: Path) -> None:
    """Two consumers; @champion moves to v2 and the deploy step announces it mid-stream. Every input is
    scored once; each consumer's predictions go v1… then v2…; v2's labels are v2's in-process labels."""
    from nightshift import registry

    client = connect(server.url)
    frame = features(world)
    n = 6000
    ids = list(range(n))
    procs = [start_consumer(world, server.url, name, tmp_path / "logs", "--batch-rows", "64",
                            "--champion-poll-s", "3600") for name in ("c1", "c2")]
    try:
        add_inputs(client, frame, ids[: n // 2], chunk=500)
        wait_for(lambda: client.xlen("out") >= n // 4, 240, "v1 predictions", procs, tmp_path / "logs")
        registry.set_alias(MODEL, registry.CHAMPION, world["v2"])
        assert announce_champion(MODEL, world["v2"], url=server.url)
        add_inputs(client, frame, ids[n // 2:], chunk=500, first_row=n // 2)
        wait_for(lambda: client.xlen("out") >= n, 240, "all predictions", procs, tmp_path / "logs")
    finally:
        codes = [stop(p) for p in procs]
    assert codes == [0, 0]
    outs = assert_exactly_once(client, ids)
    versions = [o["model_version"] for o in outs]
    assert set(versions) == {world["v1"], world["v2"]}
    summaries = [json.loads((tmp_path / "logs" / f"{c}.out").read_text()) for c in ("c1", "c2")]
    for s in summaries:
        assert [w["to"] for w in s["swaps"]] == [world["v2"]], s["swaps"]
    # Within one consumer's batches the version never goes back: the swap happened between batches.
    first_v2 = versions.index(world["v2"])
    late_v1 = [i for i, v in enumerate(versions) if v == world["v1"] and i > first_v2]
    assert len(late_v1) < 2 * 64, "v1 predictions after the swap beyond the other consumer's batch in flight"
    v2_rows = [(o["id"], o["prediction"]) for o in outs if o["model_version"] == world["v2"]]
    labels = in_process_labels(world["v2"], frame)
    assert all(pred == labels[i % len(frame)] for i, pred in v2_rows)
    client.close()


@pytest.mark.parametrize("hard", [False, True], ids=["sigterm", "kill9-appendfsync-always"])
def test_redis_restart_mid_stream_loses_nothing(world: dict[str, Any], tmp_path: Path, hard: bool) -> None:
    """Redis goes down mid-stream for ~2 s and comes back from its append-only file; the consumers
    reconnect and every input has exactly one prediction."""
    frame = features(world)
    n = 8000
    ids = list(range(n))
    with redis_server(tmp_path / "redis", appendfsync="always" if hard else "everysec") as srv:
        procs = [start_consumer(world, srv.url, name, tmp_path / "logs", "--batch-rows", "64",
                                "--claim-idle-ms", "5000") for name in ("c1", "c2")]
        try:
            client = connect(srv.url)
            add_inputs(client, frame, ids[: n // 2], chunk=500)
            wait_for(lambda: client.xlen("out") >= n // 8, 240, "first predictions", procs, tmp_path / "logs")
            restarted = threading.Event()

            def restart() -> None:
                srv.restart(hard=hard, down_for=2.0)
                restarted.set()

            thread = threading.Thread(target=restart)
            thread.start()
            thread.join(timeout=120)
            assert restarted.is_set()
            client = connect(srv.url)
            add_inputs(client, frame, ids[n // 2:], chunk=500, first_row=n // 2)
            wait_for(lambda: client.xlen("out") >= n, 240, "all predictions", procs, tmp_path / "logs")
        finally:
            codes = [stop(p) for p in procs]
        assert codes == [0, 0]
        assert_exactly_once(client, ids)
        client.close()
    summaries = [json.loads((tmp_path / "logs" / f"{c}.out").read_text()) for c in ("c1", "c2")]
    assert all(s["reconnects"] >= 1 for s in summaries)
    assert sum(s["predictions"] for s in summaries) == n


def consumer_pending(client: Any, name: str) -> int:
    return len(client.xpending_range("in", "g", min="-", max="+", count=100_000, consumername=name))


# The issue's size: 100,000 inputs (about 1-2 min on 2 cores, more under load); it runs in CI like the rest.
@pytest.mark.parametrize("n", [100_000])
def test_kill9_of_one_of_two_consumers_mid_batch_scores_every_input_once(
        world: dict[str, Any], server: RedisServer, tmp_path: Path, n: int) -> None:
    """Two consumers over n inputs; one is SIGKILLed while it holds a batch it has read but not written.
    The other claims that batch after --claim-idle-ms and at the end every input has one prediction."""
    client = connect(server.url)
    frame = features(world)
    ids = list(range(n))
    logs = tmp_path / "logs"
    procs = {name: start_consumer(world, server.url, name, logs, "--batch-rows", "256", "--claim-idle-ms", "2000")
             for name in ("c1", "c2")}
    try:
        add_inputs(client, frame, ids, chunk=5000)
        wait_for(lambda: client.xlen("out") >= n // 5, 600, "a fifth of the predictions", list(procs.values()), logs)
        wait_for(lambda: consumer_pending(client, "c1") > 0, 60, "c1 holding a batch", list(procs.values()), logs)
        os.kill(procs["c1"].pid, signal.SIGKILL)
        assert procs["c1"].wait(timeout=30) == -signal.SIGKILL
        held = consumer_pending(client, "c1")
        scored_before = client.xlen("out")
        assert held > 0, "c1 was not killed mid-batch"
        wait_for(lambda: client.xlen("out") >= n, 900, "all predictions", [procs["c2"]], logs)
    finally:
        code = stop(procs["c2"])
        if procs["c1"].poll() is None:
            stop(procs["c1"], signal.SIGKILL)
    assert code == 0
    assert scored_before < n, "the kill came after the stream was done"
    assert_exactly_once(client, ids)
    summary = json.loads((logs / "c2.out").read_text())
    assert summary["claimed"] >= held
    client.close()


def test_a_champion_moved_without_an_announcement_is_found_by_the_registry_poll(
        world: dict[str, Any], server: RedisServer) -> None:
    """No Redis at deploy time: the consumer still swaps, at its next registry poll, between batches."""
    from nightshift import registry

    client = connect(server.url)
    frame = features(world)
    n = 2000
    consumer = StreamConsumer(config(stop_after=n, batch_rows=64, champion_poll_s=0.5), server.url)
    result: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: result.update(consumer.run()))
    add_inputs(client, frame, list(range(n // 2)))
    thread.start()
    try:
        deadline = time.monotonic() + 240
        while client.xlen("out") < n // 4 and time.monotonic() < deadline and thread.is_alive():
            time.sleep(0.1)
        registry.set_alias(MODEL, registry.CHAMPION, world["v2"])
        add_inputs(client, frame, list(range(n // 2, n)), first_row=n // 2)
    finally:
        thread.join(timeout=300)
        if thread.is_alive():
            consumer.stop()
            thread.join(timeout=60)
    assert result["swaps"] and result["swaps"][0]["to"] == world["v2"]
    assert "registry" in result["swaps"][0]["why"]
    outs = assert_exactly_once(client, list(range(n)))
    versions = [o["model_version"] for o in outs]
    first_v2 = versions.index(world["v2"])
    assert set(versions[:first_v2]) == {world["v1"]} and set(versions[first_v2:]) == {world["v2"]}
    client.close()
