"""`nightshift score-stream`: score a Redis stream with the registered `@champion`, exactly once."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any

from nightshift.stream.redis_io import PASSWORD_FILE_ENV, REDIS_URL_ENV


def _score_stream(args: argparse.Namespace) -> dict[str, Any]:
    from nightshift.stream.consumer import StreamConfig, run_consumer
    from nightshift.stream.redis_io import read_password_file, resolve_url
    from nightshift.stream.trim import parse_duration

    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s score-stream %(message)s")
    for noisy in ("mlflow", "urllib3", "alembic"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    url = resolve_url(args.redis)
    password_file = args.redis_password_file or os.environ.get(PASSWORD_FILE_ENV)
    password = read_password_file(password_file) if password_file else None
    consumer = args.consumer or f"{os.uname().nodename}-{os.getpid()}"
    config = StreamConfig(input=args.input, output=args.output, dead_letter=args.dead_letter, group=args.group,
                          consumer=consumer, model_name=args.model_name, batch_rows=args.batch_rows,
                          batch_ms=args.batch_ms, stop_after=args.stop_after, claim_idle_ms=args.claim_idle_ms,
                          champion_poll_s=args.champion_poll_s, max_deliveries=args.max_deliveries,
                          dedup_retention_s=parse_duration(args.dedup_retention, "--dedup-retention"),
                          wait_replicas=args.wait_replicas, wait_timeout_ms=args.wait_timeout_ms,
                          model_retry_s=args.model_retry_s, threads=_threads(args.threads))
    return run_consumer(config, url, password=password)


def _threads(flag: int | None) -> int:
    """--threads, else OMP_NUM_THREADS (what an operator already sets for torch), else 1."""
    if flag is not None:
        return flag
    value = os.environ.get("OMP_NUM_THREADS", "").strip()
    if not value:
        return 1
    if not value.isdigit():
        from nightshift.stream.errors import StreamConfigError

        raise StreamConfigError(f"OMP_NUM_THREADS={value!r} is not a number of threads; set it to one, or pass "
                                f"--threads")
    return int(value)


def _stream_trim(args: argparse.Namespace) -> dict[str, Any] | int:
    from nightshift.stream.redis_io import connect, read_password_file, resolve_url, retryable_errors
    from nightshift.stream.trim import parse_duration, trim_streams

    url = resolve_url(args.redis)
    password_file = args.redis_password_file or os.environ.get(PASSWORD_FILE_ENV)
    password = read_password_file(password_file) if password_file else None
    client = connect(url, password=password)
    try:
        result = trim_streams(client, input=args.input, output=args.output, dead_letter=args.dead_letter,
                              max_age_s=parse_duration(args.max_age, "--max-age"),
                              dedup_retention_s=parse_duration(args.dedup_retention, "--dedup-retention"))
    except retryable_errors() as err:
        from nightshift.redaction import redact
        from nightshift.stream.errors import StreamUnavailable

        raise StreamUnavailable(f"Redis at {redact(url)} did not take the trim ({type(err).__name__}: {err}); "
                                f"nothing is lost by running it again") from err
    finally:
        client.close()
    if not result.get("warnings"):
        return result
    from nightshift.cli import emit

    emit(result)
    for warning in result["warnings"]:
        print(f"nightshift stream-trim: warning: {warning}", file=sys.stderr)
    return 1


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "score-stream", help="score a Redis stream with MODEL@champion through a consumer group, exactly once",
        description="Reads entries (one field `data`: a JSON object with `id` and the model's columns) through "
                    "a consumer group, scores them in micro-batches with the registered @champion, and writes "
                    "{id, prediction, model_version, latency_ms} to --output (prediction: the class, or a "
                    "regression's value); bad inputs go to --dead-letter with the reason. An input is "
                    "acknowledged only together with its prediction, and an id never gets two predictions. "
                    "Runs until SIGTERM/SIGINT (then finishes its batch) or --stop-after; prints a summary as "
                    "JSON.")
    p.add_argument("--redis", default=None,
                   help=f"redis://HOST:PORT/DB (default ${REDIS_URL_ENV}); keep the password out of it, see "
                        f"--redis-password-file")
    p.add_argument("--redis-password-file", default=None,
                   help=f"file holding the Redis password (default ${PASSWORD_FILE_ENV}), so that it is on no "
                        f"command line")
    p.add_argument("--input", required=True, help="stream of inputs")
    p.add_argument("--output", required=True, help="stream the predictions go to")
    p.add_argument("--dead-letter", required=True, help="stream bad inputs go to, with the reason")
    p.add_argument("--group", required=True, help="consumer group (created on --input if missing)")
    p.add_argument("--consumer", default=None, help="this consumer's name in the group (default HOST-PID); "
                   "reuse a name after a crash and it first scores what it had read")
    p.add_argument("--model-name", default="nightshift-digits",
                   help="registered model to score with, any a pipeline registered: its @champion's own columns "
                        "and task decide what an input holds and what `prediction` is (nightshift-digits)")
    p.add_argument("--batch-rows", type=int, default=256, help="most inputs per micro-batch (256)")
    p.add_argument("--batch-ms", type=int, default=50, help="most milliseconds a batch waits for rows (50)")
    p.add_argument("--stop-after", type=int, default=None, help="stop after this many inputs")
    p.add_argument("--claim-idle-ms", type=int, default=30_000,
                   help="claim other consumers' inputs pending this long (XAUTOCLAIM): a crashed consumer's (30000)")
    p.add_argument("--champion-poll-s", type=float, default=30.0,
                   help="also ask the registry for @champion this often, for deploys that announced nothing (30)")
    p.add_argument("--max-deliveries", type=int, default=5,
                   help="dead-letter (reason max-deliveries) an entry delivered more often than this, whatever made "
                        "its consumers fail or die on it (5)")
    p.add_argument("--model-retry-s", type=float, default=60.0,
                   help="when predict fails on valid inputs and not because of one of them, retry the batch in "
                        "hand with backoff this long, then leave it pending to be read again (a delivery) (60)")
    p.add_argument("--dedup-retention", default="7d",
                   help="how long an input id's marker lives (an id sent again within it gets no second prediction); "
                        "seconds or 30m/24h/7d (7d). Keep stream-trim's --max-age at most this")
    p.add_argument("--wait-replicas", type=int, default=0,
                   help="after each batch, WAIT until this many replicas have its predictions and acknowledgements "
                        "before going on (0: don't wait)")
    p.add_argument("--wait-timeout-ms", type=int, default=1000,
                   help="one WAIT's timeout; short of replicas, the batch's write is retried with backoff (1000)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads for this consumer (default $OMP_NUM_THREADS, else 1: scale out by "
                        "starting more consumers)")
    p.add_argument("--verbose", action="store_true", help="debug logging")
    p.set_defaults(func=_score_stream)

    t = subparsers.add_parser(
        "stream-trim", help="trim a scoring stream's input, output and dead letters by age, keeping what is owed",
        description="Trims --input below every consumer group's oldest pending and first undelivered entry "
                    "(never an input still owed a prediction), and --output and --dead-letter, to entries younger "
                    "than --max-age (Redis's clock). Markers expire by themselves after --dedup-retention; an age "
                    "longer than the retention is refused (inputs would outlive their markers). Prints JSON; "
                    "exits 1 with a warning when a pending entry older than the retention holds the input's "
                    "trim back (the inputs after it have outlived their markers).")
    t.add_argument("--redis", default=None, help=f"redis://HOST:PORT/DB (default ${REDIS_URL_ENV})")
    t.add_argument("--redis-password-file", default=None,
                   help=f"file holding the Redis password (default ${PASSWORD_FILE_ENV})")
    t.add_argument("--input", required=True)
    t.add_argument("--output", required=True)
    t.add_argument("--dead-letter", required=True)
    t.add_argument("--max-age", required=True, help="keep entries younger than this: seconds or 30m/24h/7d")
    t.add_argument("--dedup-retention", default="7d", help="the consumers' --dedup-retention (7d)")
    t.set_defaults(func=_stream_trim)
