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
                          champion_poll_s=args.champion_poll_s)
    return run_consumer(config, url, password=password)


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "score-stream", help="score a Redis stream with MODEL@champion through a consumer group, exactly once",
        description="Reads entries (one field `data`: a JSON object with `id` and the model's columns) through "
                    "a consumer group, scores them in micro-batches with the registered @champion, and writes "
                    "{id, prediction, model_version, latency_ms} to --output; bad inputs go to --dead-letter "
                    "with the reason. An input is acknowledged only together with its prediction, and an id "
                    "never gets two predictions. Runs until SIGTERM/SIGINT (then finishes its batch) or "
                    "--stop-after; prints a summary as JSON.")
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
    p.add_argument("--model-name", default="nightshift-digits", help="registered model (nightshift-digits)")
    p.add_argument("--batch-rows", type=int, default=256, help="most inputs per micro-batch (256)")
    p.add_argument("--batch-ms", type=int, default=50, help="most milliseconds a batch waits for rows (50)")
    p.add_argument("--stop-after", type=int, default=None, help="stop after this many inputs")
    p.add_argument("--claim-idle-ms", type=int, default=30_000,
                   help="claim other consumers' inputs pending this long (XAUTOCLAIM): a crashed consumer's (30000)")
    p.add_argument("--champion-poll-s", type=float, default=30.0,
                   help="also ask the registry for @champion this often, for deploys that announced nothing (30)")
    p.add_argument("--verbose", action="store_true", help="debug logging")
    p.set_defaults(func=_score_stream)
