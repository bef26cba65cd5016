"""The stream part of `make demo`: a private redis-server, the demo's test rows streamed through
`nightshift score-stream`, and the accuracy of what came out.

The redis-server is the machine's own binary (Debian's `redis-server`), on 127.0.0.1, a free port and a
data directory under NIGHTSHIFT_HOME (append-only file on); it is stopped by its PID at the end. Where
the binary is missing, the demo says so and skips this part.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

from nightshift.errors import StreamDemoFailed
from nightshift.stream.redis_io import PASSWORD_FILE_ENV

BIN = Path(sys.executable).parent


@contextmanager
def private_redis(data_dir: Path) -> Iterator[str]:
    """A redis-server of our own in `data_dir` (AOF on); yields its URL; stopped by PID afterwards."""
    from nightshift.stream.redis_server import RedisServer

    server = RedisServer(data_dir)
    try:
        server.start()
        yield server.url
    finally:
        server.stop()


def _run_score_stream(command: list[str], env: dict[str, str] | None, timeout: float,
                      folder: Path) -> tuple[int | None, str]:
    """Run score-stream in a session of its own, its output to files (a child of its own that outlives it cannot hold
    a pipe open): (exit code, or None when it ran past `timeout`; the last lines it printed). Whatever is left of its
    session (children it started) is killed when it ends or is stopped."""
    out_path, err_path = folder / "score-stream.out", folder / "score-stream.err"
    with out_path.open("wb") as out, err_path.open("wb") as err:
        try:
            proc = subprocess.Popen(command, env=env, stdout=out, stderr=err, stdin=subprocess.DEVNULL,
                                    start_new_session=True)
        except OSError as exc:
            raise StreamDemoFailed(f"cannot run {command[0]} score-stream: {exc}") from exc
        try:
            code: int | None = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            code = None
        finally:
            with suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    said = [path.read_text(errors="replace").strip() for path in (err_path, out_path)]
    lines = next((text.splitlines() for text in said if text), [])
    return code, " | ".join(lines[-3:])


def stream_demo(nightshift_home: Path, data_dir: Path, model_name: str = "nightshift-digits",
                env: dict[str, str] | None = None, timeout: float = 600) -> dict[str, Any] | None:
    """Stream the test split (and one bad row) through score-stream; print and return what came out.
    None (with the reason printed) where it cannot run here (no redis-server). StreamDemoFailed when it could and
    failed: Redis would not start or answer, score-stream exited with an error or took over `timeout` seconds."""
    import pandas as pd
    import redis

    print("\n=== stream scoring: the test rows through Redis Streams and `nightshift score-stream`", flush=True)
    if shutil.which("redis-server") is None:
        print("  skipped: redis-server is not installed (Debian: apt-get install redis-server)")
        return None
    frame = pd.read_parquet(data_dir / "test.parquet")
    labels = frame.pop("label").astype(int).tolist()
    columns = list(frame.columns)
    root = nightshift_home / "redis-demo"
    shutil.rmtree(root, ignore_errors=True)
    try:
        with private_redis(root) as url:
            client: Any = redis.Redis.from_url(url)
            pipe = client.pipeline(transaction=False)
            for i, row in enumerate(frame.to_numpy().tolist()):
                pipe.xadd("demo:in", {"data": json.dumps({"id": i, **dict(zip(columns, row, strict=True))})})
            pipe.xadd("demo:in", {"data": json.dumps({"id": "bad-1", **dict.fromkeys(columns, 0.0),
                                                      "pixel_3": "three"})})
            pipe.execute()
            total = len(frame) + 1
            started = time.monotonic()
            command = [str(BIN / "nightshift"), "score-stream", "--redis", url, "--input", "demo:in", "--output",
                       "demo:out", "--dead-letter", "demo:dead", "--group", "demo", "--consumer", "demo-1",
                       "--model-name", model_name, "--stop-after", str(total)]
            # The private Redis has no password: one the user's environment names for their own Redis is not its.
            child_env = {k: v for k, v in (os.environ if env is None else env).items() if k != PASSWORD_FILE_ENV}
            code, said = _run_score_stream(command, child_env, timeout, root)
            seconds = time.monotonic() - started
            if code is None:
                try:
                    scored = f"{client.xlen('demo:out') + client.xlen('demo:dead')} of {total}"
                except redis.RedisError as err:
                    scored = f"? of {total} (Redis no longer answers: {err})"
                raise StreamDemoFailed(
                    f"score-stream did not finish within {timeout:.0f} s ({scored} rows answered; it was stopped with "
                    f"its children): run `{' '.join(command[:2])} ... --stop-after {total}` by hand against a Redis "
                    f"to see where it waits")
            if code != 0:
                raise StreamDemoFailed(f"score-stream exited {code}: {said or '(it printed nothing)'}")
            outs = [json.loads(f[b"data"]) for _, f in client.xrange("demo:out")]
            dead = [json.loads(f[b"data"]) for _, f in client.xrange("demo:dead")]
            client.close()
            if len(outs) + len(dead) != total:
                raise StreamDemoFailed(f"score-stream exited 0 but answered {len(outs) + len(dead)} of {total} rows "
                                       f"({len(outs)} predictions, {len(dead)} dead letters)")
    except (OSError, RuntimeError, redis.RedisError) as err:
        raise StreamDemoFailed(f"the stream demo's private redis-server failed: {err}") from err
    finally:
        shutil.rmtree(root, ignore_errors=True)
    correct = sum(1 for o in outs if o["prediction"] == labels[int(o["id"])])
    latencies = sorted(o["latency_ms"] for o in outs)
    versions = sorted({o["model_version"] for o in outs})
    result = {"inputs": total, "predictions": len(outs), "dead_letters": len(dead),
              "accuracy": correct / max(len(outs), 1), "model_versions": versions,
              "latency_p50_ms": latencies[len(latencies) // 2] if latencies else None, "seconds": seconds}
    print(f"  {len(outs)} predictions by {model_name} v{', v'.join(versions)} for {len(frame)} test rows: "
          f"accuracy {result['accuracy']:.3f}")
    if dead:
        print(f"  dead letter     : id {dead[0].get('id')}: {dead[0]['reason']}")
    print(f"  score-stream (with its start, loading the model): {seconds:.1f} s; latency from XADD, p50 "
          f"{result['latency_p50_ms']:.0f} ms (the rows were queued before it started)")
    return result
