"""Stream scoring (issue 12): `nightshift score-stream` consumers vs the same model scoring in process.

`python -m bench stream`. One private redis-server (AOF on, everysec), one tiny trained demo model as
@champion, consumers started as the real CLI (`--batch-rows 256 --batch-ms 50`).

- throughput: with 1 and then 2 consumers already waiting on the group, BENCH_STREAM_ROWS inputs (default
  20,000; demo test rows, cycled) are XADDed in pipelined chunks as fast as one producer can; rows/s =
  inputs / (last prediction's entry time - first input's entry time). Latency under that burst is
  queueing, reported as such.
- drain: the same inputs XADDed before 1 or 2 consumers start; rows/s from their first prediction to
  their last (no producer competing for the cores, start-up not counted).
- latency: a producer paced at about half the 1-consumer throughput for BENCH_STREAM_PACED_S seconds
  (default 10); p50/p99 of the predictions' latency_ms (XADD → prediction written).
- baseline (the skeptic's): a loop calling the same pyfunc's predict on batches of 256 of the same rows,
  already in memory as a DataFrame; rows/s, measured before and after the stream runs (the load moves).
  Goal: stream ≥ 0.5× that.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

MODEL = "bench-stream"
BATCH = 256
BIN = Path(sys.executable).parent


def _percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def _payloads(frame: Any, n: int, first_id: int) -> list[bytes]:
    columns = list(frame.columns)
    rows = frame.to_numpy().tolist()
    return [json.dumps({"id": first_id + i, **dict(zip(columns, rows[i % len(rows)], strict=True))}).encode()
            for i in range(n)]


def _start_consumers(url: str, group: str, k: int, logs: Path) -> list[subprocess.Popen[bytes]]:
    procs = []
    for i in range(k):
        name = f"{group}-c{i}"
        procs.append(subprocess.Popen(
            [str(BIN / "nightshift"), "score-stream", "--redis", url, "--input", f"{group}:in", "--output",
             f"{group}:out", "--dead-letter", f"{group}:dlq", "--group", group, "--consumer", name,
             "--model-name", MODEL, "--batch-rows", str(BATCH), "--batch-ms", "50"],
            stdout=(logs / f"{name}.out").open("wb"), stderr=(logs / f"{name}.err").open("wb"),
            start_new_session=True))
    return procs


def _wait_ready(client: Any, group: str, k: int, procs: list[subprocess.Popen[bytes]], timeout: float = 300) -> None:
    """Until all k consumers have read from the group once (they load the model before their first read)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for proc in procs:
            if proc.poll() is not None:
                raise RuntimeError(f"a consumer exited {proc.returncode} before it was ready")
        try:
            if len(client.xinfo_consumers(f"{group}:in", group)) >= k:
                return
        except Exception:  # the group does not exist yet
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{k} consumers not ready in {timeout:.0f} s")


def _stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for proc in procs:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)


def _outputs(client: Any, stream: str) -> list[tuple[int, dict[str, Any]]]:
    out: list[tuple[int, dict[str, Any]]] = []
    start = "-"
    while True:
        batch = client.xrange(stream, min=start, count=10_000)
        if not batch:
            return out
        out += [(int(eid.decode().split("-")[0]), json.loads(f[b"data"])) for eid, f in batch]
        ms, seq = batch[-1][0].decode().split("-")
        start = f"{ms}-{int(seq) + 1}"


def _wait_outputs(client: Any, stream: str, n: int, procs: list[subprocess.Popen[bytes]],
                  timeout: float = 900) -> None:
    deadline = time.monotonic() + timeout
    while client.xlen(stream) < n:
        if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
            raise RuntimeError(f"{stream}: {client.xlen(stream)} of {n} predictions")
        time.sleep(0.05)


def burst(client: Any, url: str, frame: Any, k: int, n: int, logs: Path) -> dict[str, Any]:
    group = f"burst{k}"
    procs = _start_consumers(url, group, k, logs)
    try:
        _wait_ready(client, group, k, procs)
        payloads = _payloads(frame, n, 0)
        first_ms = None
        produce_started = time.perf_counter()
        for start in range(0, n, 1000):
            pipe = client.pipeline(transaction=False)
            for p in payloads[start:start + 1000]:
                pipe.xadd(f"{group}:in", {"data": p})
            ids = pipe.execute()
            first_ms = first_ms or int(ids[0].decode().split("-")[0])
        produce_s = time.perf_counter() - produce_started
        _wait_outputs(client, f"{group}:out", n, procs)
    finally:
        _stop(procs)
    outs = _outputs(client, f"{group}:out")
    assert len({o["id"] for _, o in outs}) == n == len(outs), "not exactly one prediction per input"
    assert first_ms is not None
    seconds = (max(ms for ms, _ in outs) - first_ms) / 1000
    lat = [o["latency_ms"] for _, o in outs]
    return {"rows_per_s": n / seconds, "seconds": seconds, "p50_ms": _percentile(lat, 50),
            "p99_ms": _percentile(lat, 99), "produce_s": produce_s}


def drain(client: Any, url: str, frame: Any, k: int, n: int, logs: Path) -> float:
    """rows/s of k consumers emptying a backlog of n inputs XADDed before they started: n over the time
    from their first prediction to their last (no producer running meanwhile, start-up not counted)."""
    group = f"drain{k}"
    payloads = _payloads(frame, n, 0)
    for start in range(0, n, 1000):
        pipe = client.pipeline(transaction=False)
        for p in payloads[start:start + 1000]:
            pipe.xadd(f"{group}:in", {"data": p})
        pipe.execute()
    procs = _start_consumers(url, group, k, logs)
    try:
        _wait_outputs(client, f"{group}:out", n, procs)
    finally:
        _stop(procs)
    times = [ms for ms, _ in _outputs(client, f"{group}:out")]
    return n / max((max(times) - min(times)) / 1000, 1e-3)


def paced(client: Any, url: str, frame: Any, k: int, rate: float, seconds: float, logs: Path) -> dict[str, Any]:
    group = f"paced{k}"
    procs = _start_consumers(url, group, k, logs)
    try:
        _wait_ready(client, group, k, procs)
        chunk = max(1, int(rate / 100))  # 100 XADD rounds a second
        n = int(rate * seconds)
        payloads = _payloads(frame, n, 0)
        started = time.perf_counter()
        for i, start in enumerate(range(0, n, chunk)):
            delay = started + i / 100 - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            pipe = client.pipeline(transaction=False)
            for p in payloads[start:start + chunk]:
                pipe.xadd(f"{group}:in", {"data": p})
            pipe.execute()
        _wait_outputs(client, f"{group}:out", n, procs)
    finally:
        _stop(procs)
    lat = [o["latency_ms"] for _, o in _outputs(client, f"{group}:out")]
    return {"rate": rate, "rows": n, "p50_ms": _percentile(lat, 50), "p99_ms": _percentile(lat, 99)}


def in_process(frame: Any, version: str, n: int) -> float:
    """rows/s of the pyfunc's predict over batches of 256 of the same rows, already in memory."""
    import mlflow.pyfunc
    import pandas as pd

    model = mlflow.pyfunc.load_model(f"models:/{MODEL}/{version}")
    rows = pd.concat([frame] * (n // len(frame) + 1), ignore_index=True).head(n).astype("float32")
    batches = [rows.iloc[s:s + BATCH].reset_index(drop=True) for s in range(0, n, BATCH)]
    model.predict(batches[0])
    times = []
    for _ in range(3):
        started = time.perf_counter()
        for b in batches:
            model.predict(b)
        times.append(time.perf_counter() - started)
    return n / statistics.median(times)


def main() -> None:
    import pandas as pd

    from nightshift.data.demo import write_demo_dataset
    from nightshift.registry import register
    from nightshift.stream.redis_io import connect
    from nightshift.stream.redis_server import RedisServer
    from nightshift.tracking import log_training_run
    from tests.trained_model import write_trained_output

    n = int(os.environ.get("BENCH_STREAM_ROWS", "20000"))
    paced_s = float(os.environ.get("BENCH_STREAM_PACED_S", "10"))
    saved_home = os.environ.get("NIGHTSHIFT_HOME")
    with tempfile.TemporaryDirectory(prefix="bench-stream-") as tmp:
        os.environ["NIGHTSHIFT_HOME"] = str(Path(tmp) / "home")
        os.environ.pop("MLFLOW_TRACKING_URI", None)
        data = Path(tmp) / "data"
        write_demo_dataset(data)
        out = write_trained_output(Path(tmp) / "out", data, epochs=2, hidden=32)
        version = register(log_training_run(out, experiment="bench"), model_name=MODEL, alias="champion")["version"]
        frame = pd.read_parquet(data / "test.parquet").drop(columns=["label"])
        logs = Path(tmp) / "logs"
        logs.mkdir()
        server = RedisServer(Path(tmp) / "redis")
        server.start()
        try:
            client = connect(server.url)
            load = os.getloadavg()
            before = in_process(frame, version, n)
            results = {k: burst(client, server.url, frame, k, n, logs) for k in (1, 2)}
            drained = {k: drain(client, server.url, frame, k, n, logs) for k in (1, 2)}
            rate = 0.5 * results[1]["rows_per_s"]
            latency = {k: paced(client, server.url, frame, k, rate, paced_s, logs) for k in (1, 2)}
            after = in_process(frame, version, n)
            baseline = (before + after) / 2
            load_after = os.getloadavg()
            client.close()
        finally:
            server.stop()
    if saved_home is None:
        os.environ.pop("NIGHTSHIFT_HOME", None)
    else:
        os.environ["NIGHTSHIFT_HOME"] = saved_home
    print(f"load average before {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}, after {load_after[0]:.1f} "
          f"{load_after[1]:.1f} {load_after[2]:.1f}; {os.cpu_count()} cores; {n} inputs, batches of {BATCH}")
    print(f"in-process pyfunc predict, batches of {BATCH}, rows in memory: {baseline:,.0f} rows/s (mean of "
          f"{before:,.0f} before and {after:,.0f} after the stream runs)")
    for k, r in results.items():
        print(f"stream, {k} consumer(s), burst of {n}: {r['rows_per_s']:,.0f} rows/s ({r['seconds']:.1f} s) = "
              f"{r['rows_per_s'] / baseline:.2f}x in-process; latency under the burst (queueing) p50 "
              f"{r['p50_ms']:.0f} ms, p99 {r['p99_ms']:.0f} ms; the producer's XADDs took {r['produce_s']:.1f} s")
    for k, rate in drained.items():
        print(f"stream, {k} consumer(s), draining a backlog of {n} (first to last prediction): {rate:,.0f} rows/s "
              f"= {rate / baseline:.2f}x in-process")
    for k, r in latency.items():
        print(f"stream, {k} consumer(s), paced at {r['rate']:,.0f} rows/s for {r['rows']} rows: latency XADD -> "
              f"prediction p50 {r['p50_ms']:.1f} ms, p99 {r['p99_ms']:.1f} ms")
    best = max(max(r["rows_per_s"] for r in results.values()), *drained.values())
    verdict = "met" if best >= 0.5 * baseline else "MISSED"
    print(f"goal stream >= 0.5x in-process: best {best / baseline:.2f}x -> {verdict}")


if __name__ == "__main__":
    main()
