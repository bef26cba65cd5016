"""Stream scoring (issues 12, 21): `nightshift score-stream` consumers vs the same model scoring in process.

`python -m bench stream`. One private redis-server (AOF on, everysec), one tiny trained demo model as
@champion, consumers started as the real CLI (`--batch-rows 256 --batch-ms 50`). Payloads: JSON objects
(`data`), and binary entries (`id`, `shape`, `data` as little-endian float32).

- throughput (drain): BENCH_STREAM_ROWS inputs (default 100,000; demo test rows, cycled) XADDed before 1 or
  2 consumers start, hidden from their group until all have loaded the model; rows/s from their first
  prediction to their last (no producer competing for the cores, start-up not counted), for each payload.
  BENCH_STREAM_ROUNDS rounds (default 3), each measuring the in-process baseline and then every drain, so
  that each ratio compares numbers taken minutes apart at most; the goals are judged on the median of the
  rounds' ratios. (A drain of 20,000 inputs lasted under a second: one scheduling hiccup moved its ratio by
  a tenth.)
- latency: a producer paced at half the best 1-consumer rate of the payload for BENCH_STREAM_PACED_S
  seconds (default 10); p50/p99 of the predictions' latency_ms (XADD -> prediction written).
- soak (issue 21 item 7): BENCH_STREAM_SOAK_S seconds (default 60) of JSON inputs paced at 80% of the
  measured 1-consumer maximum, two consumers, one of them killed (SIGKILL) and restarted every 15 s:
  every input exactly one prediction or one dead letter, p99 latency, the RSS of the consumer never
  killed at 10 s and at the end.
- baselines (the skeptic's), measured before and after the stream runs (the load moves): a loop calling
  the same pyfunc's predict on batches of 256 of the same rows, already in memory as a DataFrame (the
  issue's in-process loop); and the served model's own scoring of float32 matrices of 256 rows already
  in memory (`TorchTableClassifier.invalid_rows` + `proba`, the work a consumer keeps per batch): no stream can
  beat it. Goals (issue 21): one consumer >= 0.8x the in-process loop, two consumers >= one.
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
from collections.abc import Callable
from pathlib import Path
from typing import Any

MODEL = "bench-stream"
BATCH = 256
BIN = Path(sys.executable).parent
BASELINE_ROWS = 20_000  # the in-process loops: the median of 3 passes over 20,000 rows, each pass ~0.7 s
_ERR_LOGS: dict[int, Path] = {}  # consumer pid -> its stderr log


def _percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def _payloads(frame: Any, n: int, first_id: int, kind: str = "json") -> list[dict[str, bytes]]:
    """n entries' fields, ids first_id.., rows of `frame` cycled: JSON objects or binary entries."""
    if kind == "binary":
        rows32 = frame.to_numpy(dtype="<f4")
        shape = str(rows32.shape[1]).encode()
        return [{"id": str(first_id + i).encode(), "shape": shape, "data": rows32[i % len(rows32)].tobytes()}
                for i in range(n)]
    columns = list(frame.columns)
    rows = frame.to_numpy().tolist()
    return [{"data": json.dumps({"id": first_id + i, **dict(zip(columns, rows[i % len(rows)], strict=True))}).encode()}
            for i in range(n)]


def _xadd(client: Any, stream: str, payloads: list[dict[str, bytes]]) -> list[bytes]:
    pipe = client.pipeline(transaction=False)
    for fields in payloads:
        pipe.xadd(stream, fields)
    return pipe.execute()


def _start_consumers(url: str, group: str, k: int, logs: Path, names: list[str] | None = None,
                     extra: tuple[str, ...] = ()) -> list[subprocess.Popen[bytes]]:
    procs = []
    for i in range(k):
        name = names[i] if names else f"{group}-c{i}"
        procs.append(subprocess.Popen(
            [str(BIN / "nightshift"), "score-stream", "--redis", url, "--input", f"{group}:in", "--output",
             f"{group}:out", "--dead-letter", f"{group}:dlq", "--group", group, "--consumer", name,
             "--model-name", MODEL, "--batch-rows", str(BATCH), "--batch-ms", "50", *extra],
            stdout=(logs / f"{name}.out").open("ab"), stderr=(logs / f"{name}.err").open("ab"),
            start_new_session=True))
        _ERR_LOGS[procs[-1].pid] = logs / f"{name}.err"
    return procs


def _wait_ready(procs: list[subprocess.Popen[bytes]], timeout: float = 300) -> None:
    """Until every consumer has loaded the model (its log says "scoring with"; it reads right after). Not
    XINFO CONSUMERS: a consumer blocked on an empty stream is not listed yet."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for proc in procs:
            if proc.poll() is not None:
                raise RuntimeError(f"a consumer exited {proc.returncode} before it was ready")
        if all(b"scoring with" in _ERR_LOGS[proc.pid].read_bytes() for proc in procs):
            return
        time.sleep(0.2)
    raise RuntimeError(f"{len(procs)} consumers not ready in {timeout:.0f} s")


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


def drain(client: Any, url: str, frame: Any, k: int, n: int, logs: Path, kind: str, round_: int = 0) -> float:
    """rows/s of k consumers emptying a backlog of n inputs XADDed before they started: n over the time
    from their first prediction to their last (no producer running meanwhile, start-up not counted)."""
    group = f"drain{k}{kind}r{round_}"
    payloads = _payloads(frame, n, 0, kind)
    for start in range(0, n, 1000):
        _xadd(client, f"{group}:in", payloads[start:start + 1000])
    # The backlog stays hidden from the group ($) until every consumer has loaded its model: a consumer still
    # starting up while another drains would count its start-up in the window.
    client.xgroup_create(f"{group}:in", group, id="$")
    procs = _start_consumers(url, group, k, logs)
    try:
        _wait_ready(procs)
        client.xgroup_setid(f"{group}:in", group, id="0")
        _wait_outputs(client, f"{group}:out", n, procs)
    finally:
        _stop(procs)
    outs = _outputs(client, f"{group}:out")
    assert len({o["id"] for _, o in outs}) == n == len(outs), "not exactly one prediction per input"
    times = [ms for ms, _ in outs]
    client.delete(*client.keys(f"{group}*"))  # a round's backlog and markers: the next round starts empty
    return n / max((max(times) - min(times)) / 1000, 1e-3)


def _pace(client: Any, stream: str, payloads: list[dict[str, bytes]], rate: float,
          every: Callable[[float], None] | None = None) -> None:
    """XADD the payloads at `rate` per second, in 100 rounds a second; `every(elapsed)` between rounds."""
    chunk = max(1, int(rate / 100))
    started = time.perf_counter()
    for i, start in enumerate(range(0, len(payloads), chunk)):
        delay = started + i / 100 - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        if every is not None:
            every(time.perf_counter() - started)
        _xadd(client, stream, payloads[start:start + chunk])


def paced(client: Any, url: str, frame: Any, k: int, rate: float, seconds: float, logs: Path,
          kind: str) -> dict[str, Any]:
    group = f"paced{k}{kind}"
    procs = _start_consumers(url, group, k, logs)
    try:
        _wait_ready(procs)
        n = int(rate * seconds)
        _pace(client, f"{group}:in", _payloads(frame, n, 0, kind), rate)
        _wait_outputs(client, f"{group}:out", n, procs)
    finally:
        _stop(procs)
    lat = [o["latency_ms"] for _, o in _outputs(client, f"{group}:out")]
    return {"rate": rate, "rows": n, "p50_ms": _percentile(lat, 50), "p99_ms": _percentile(lat, 99)}


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for {pid}")


def soak(client: Any, url: str, frame: Any, rate: float, seconds: float, logs: Path) -> dict[str, Any]:
    """Two consumers (--claim-idle-ms 2000) under a paced producer; the second is killed (SIGKILL) and
    restarted under the same name every 15 s. Exactly one outcome per input, p99, the survivor's RSS."""
    group = "soak"
    names = ["soak-keep", "soak-killed"]
    extra = ("--claim-idle-ms", "2000")
    procs = _start_consumers(url, group, 2, logs, names, extra)
    kills: list[float] = []
    rss: dict[str, int] = {}
    try:
        _wait_ready(procs)
        rss["start"] = _rss_kib(procs[0].pid)

        def every(elapsed: float) -> None:
            if "10s" not in rss and elapsed >= 10:
                rss["10s"] = _rss_kib(procs[0].pid)
            if elapsed >= 15 * (len(kills) + 1) and elapsed < seconds - 1:
                os.kill(procs[1].pid, signal.SIGKILL)
                procs[1].wait(timeout=30)
                kills.append(elapsed)
                procs[1] = _start_consumers(url, group, 1, logs, names[1:], extra)[0]
            if procs[0].poll() is not None:
                raise RuntimeError(f"the consumer never killed exited {procs[0].returncode}")

        n = int(rate * seconds)
        _pace(client, f"{group}:in", _payloads(frame, n, 0, "json"), rate, every)
        rss["end_of_load"] = _rss_kib(procs[0].pid)
        deadline = time.monotonic() + 300
        while client.xlen(f"{group}:out") + client.xlen(f"{group}:dlq") < n and time.monotonic() < deadline:
            time.sleep(0.1)
        rss["end"] = _rss_kib(procs[0].pid)
    finally:
        _stop(procs)
    outs = _outputs(client, f"{group}:out")
    dead = _outputs(client, f"{group}:dlq")
    ids = [o["id"] for _, o in outs] + [d.get("id") for _, d in dead]
    exactly_once = len(ids) == n and set(ids) == set(range(n))
    lat = [o["latency_ms"] for _, o in outs]
    return {"rate": rate, "rows": n, "kills": len(kills), "predictions": len(outs), "dead_letters": len(dead),
            "exactly_once": exactly_once, "p50_ms": _percentile(lat, 50), "p99_ms": _percentile(lat, 99),
            "max_ms": max(lat), "rss": rss}


def in_process(frame: Any, version: str, n: int) -> dict[tuple[str, int], float]:
    """rows/s over batches of 256 of the same rows, already in memory, with 1 and with 2 torch threads:
    ("pyfunc", threads) the pyfunc's predict on DataFrames; ("matrix", threads) the served model's own
    checks and prediction on float32 matrices."""
    import mlflow.pyfunc
    import pandas as pd
    import torch

    model = mlflow.pyfunc.load_model(f"models:/{MODEL}/{version}")
    classifier = model.unwrap_python_model().classifier
    rows = pd.concat([frame] * (n // len(frame) + 1), ignore_index=True).head(n).astype("float32")
    batches = [rows.iloc[s:s + BATCH].reset_index(drop=True) for s in range(0, n, BATCH)]
    matrices = [b.to_numpy(dtype="float32") for b in batches]

    def pyfunc() -> None:
        for b in batches:
            model.predict(b)

    def matrix() -> None:
        for m in matrices:
            assert not classifier.invalid_rows(m)
            classifier.proba(m).argmax(axis=1)

    rates = {}
    saved = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for name, loop in (("pyfunc", pyfunc), ("matrix", matrix)):
                loop()
                times = []
                for _ in range(3):
                    started = time.perf_counter()
                    loop()
                    times.append(time.perf_counter() - started)
                rates[name, threads] = n / statistics.median(times)
    finally:
        torch.set_num_threads(saved)
    return rates


def main() -> None:
    import pandas as pd

    from nightshift.data.demo import write_demo_dataset
    from nightshift.registry import register
    from nightshift.stream.redis_io import connect
    from nightshift.stream.redis_server import RedisServer
    from nightshift.tracking import log_training_run
    from tests.trained_model import write_trained_output

    n = int(os.environ.get("BENCH_STREAM_ROWS", "100000"))
    n_rounds = int(os.environ.get("BENCH_STREAM_ROUNDS", "3"))
    paced_s = float(os.environ.get("BENCH_STREAM_PACED_S", "10"))
    soak_s = float(os.environ.get("BENCH_STREAM_SOAK_S", "60"))
    saved_home = os.environ.get("NIGHTSHIFT_HOME")
    kinds = ("json", "binary")
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
            rounds = []  # (the in-process rates, the drains' rates) of each round
            for round_no in range(n_rounds):
                base = in_process(frame, version, BASELINE_ROWS)
                rounds.append((base, {(kind, k): drain(client, server.url, frame, k, n, logs, kind, round_no)
                                      for kind in kinds for k in (1, 2)}))
            before = rounds[0][0]
            drained = {key: statistics.median(d[key] for _, d in rounds) for key in rounds[0][1]}
            latency = {(kind, k): paced(client, server.url, frame, k, 0.5 * drained[kind, 1], paced_s, logs, kind)
                       for kind in kinds for k in (1, 2)}
            soaked = soak(client, server.url, frame, 0.8 * drained["json", 1], soak_s, logs) if soak_s > 0 else None
            after = in_process(frame, version, BASELINE_ROWS)
            load_after = os.getloadavg()
            client.close()
        finally:
            server.stop()
    if saved_home is None:
        os.environ.pop("NIGHTSHIFT_HOME", None)
    else:
        os.environ["NIGHTSHIFT_HOME"] = saved_home
    mean = {key: (before[key] + after[key]) / 2 for key in before}
    pyfunc_threads = max((1, 2), key=lambda t: mean["pyfunc", t])
    pyfunc, direct = mean["pyfunc", pyfunc_threads], max(mean["matrix", 1], mean["matrix", 2])
    print(f"load average before {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}, after {load_after[0]:.1f} "
          f"{load_after[1]:.1f} {load_after[2]:.1f}; {os.cpu_count()} cores; {n} inputs, batches of {BATCH}; "
          f"consumers with --threads 1")
    for (name, threads), rate in mean.items():
        what = ("pyfunc predict, DataFrames" if name == "pyfunc" else
                "served model's checks + prediction, float32 matrices")
        print(f"in-process {what} in memory, {threads} torch thread(s): {rate:,.0f} rows/s (before "
              f"{before[name, threads]:,.0f}, after {after[name, threads]:,.0f})")
    print(f"baseline (the in-process loop at its best): pyfunc with {pyfunc_threads} thread(s), {pyfunc:,.0f} rows/s")

    def best_pyfunc(base: dict[tuple[str, int], float]) -> float:
        return max(base["pyfunc", 1], base["pyfunc", 2])

    ratios = {key: [d[key] / best_pyfunc(base) for base, d in rounds] for key in drained}
    two_over_one = {kind: [d[kind, 2] / d[kind, 1] for _, d in rounds] for kind in kinds}
    for i, (base, d) in enumerate(rounds):
        print(f"round {i + 1}: pyfunc loop at its best {best_pyfunc(base):,.0f} rows/s; " + ", ".join(
            f"{kind} x{k} {rate:,.0f} = {rate / best_pyfunc(base):.2f}x" for (kind, k), rate in d.items()))
    for (kind, k), rate in drained.items():
        print(f"stream {kind}, {k} consumer(s), draining {n}, median of {n_rounds} rounds: {rate:,.0f} rows/s = "
              f"{statistics.median(ratios[kind, k]):.2f}x the pyfunc loop of its round (rounds "
              f"{', '.join(f'{x:.2f}' for x in ratios[kind, k])}), {rate / direct:.2f}x the best matrix loop")
    for (kind, k), r in latency.items():
        print(f"stream {kind}, {k} consumer(s), paced at {r['rate']:,.0f} rows/s for {r['rows']} rows: latency "
              f"XADD -> prediction p50 {r['p50_ms']:.1f} ms, p99 {r['p99_ms']:.1f} ms")
    if soaked is not None:
        rss = soaked["rss"]
        growth = rss["end"] / rss["10s"] - 1
        print(f"soak: {soaked['rows']} JSON inputs at {soaked['rate']:,.0f}/s for {soak_s:.0f} s, one of 2 consumers "
              f"killed -9 and restarted {soaked['kills']} times: {soaked['predictions']} predictions, "
              f"{soaked['dead_letters']} dead letters, exactly one outcome each: {soaked['exactly_once']}; latency "
              f"p50 {soaked['p50_ms']:.0f} ms, p99 {soaked['p99_ms']:.0f} ms, max {soaked['max_ms']:.0f} ms; RSS of "
              f"the consumer never killed {rss['start'] / 1024:.0f} MiB at start, {rss['10s'] / 1024:.0f} at 10 s, "
              f"{rss['end'] / 1024:.0f} at the end ({growth:+.1%}; goal within 10%: "
              f"{'met' if abs(growth) <= 0.10 else 'MISSED'})")
    for kind in kinds:
        one, two = statistics.median(ratios[kind, 1]), statistics.median(two_over_one[kind])
        print(f"goals {kind} (medians of the rounds): 1 consumer >= 0.8x the pyfunc loop: {one:.2f}x -> "
              f"{'met' if one >= 0.8 else 'MISSED'}; 2 consumers >= 1: {two:.2f}x -> {'met' if two >= 1 else 'MISSED'}")


if __name__ == "__main__":
    main()
