"""A season unattended (issue 36): `python -m bench season --nights N` (default 30).

The real scheduler (scripts/airflow.sh's api-server, scheduler and dag-processor; the LocalExecutor on a
PostgreSQL of the season's own, or a database of its own on the shared server) runs nightly_retrain on a compressed
schedule: NIGHTSHIFT_RETRAIN_CRON="* * * * *", a night a minute (a night that runs longer delays the next one:
max_active_runs=1, catchup off). A season script (bench.season.script) lands each night's data: steady nights,
gradual drift, a sudden shift, bad data (a schema break and NaNs), a lost class, a heavy-tailed column, unchanged
nights and label noise; faults strike on some nights: a Horovod rank killed mid-training, the scheduler's machine
lost and the scheduler restarted, PostgreSQL restarted, the model server killed, the DVC remote read-only. An
oracle independent of the gate (bench.season.oracle) says what each night should have ended in and checks the
season. At the end: one row per night (data event, fault, decision, the oracle's, wall time, disk of
NIGHTSHIFT_HOME and of the metadata database), the goals' numbers, and `airflow dags test` of night 1's data for
comparison.

Options: --nights N, --rows R (rows a night lands, default 2400), --out FILE (the rows and summary as JSON), --keep
(keep the season's folder), --no-dags-test, --maintenance CRON (the nightshift_maintenance DAG's schedule during the
season; default every 10 minutes), --shared-postgres (the shared server instead of a private instance),
--clock-nights T (retention on the season's clock, bench.season.clock: every retention window T nights, default 7;
0 leaves retention on the real clock, where nothing time-based goes within a season).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from bench.season.runner import Season, SeasonConfig, table
from bench.season.script import EVENTS, FAULTS, season


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench season", description=__doc__.splitlines()[0])
    parser.add_argument("--nights", type=int, default=30)
    parser.add_argument("--rows", type=int, default=2400)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--keep", action="store_true")
    parser.add_argument("--no-dags-test", action="store_true")
    parser.add_argument("--maintenance", default="*/10 * * * *")
    parser.add_argument("--shared-postgres", action="store_true")
    parser.add_argument("--clock-nights", type=float, default=7.0,
                        help="retention on the season's clock: every window this many nights (0: the real clock)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(sys.argv[2:] if argv is None and sys.argv[1:2] == ["season"] else argv or [])
    nights = season(args.nights)
    config = SeasonConfig(nights, rows=args.rows, maintenance=args.maintenance,
                          private_postgres=not args.shared_postgres, dags_test=not args.no_dags_test,
                          keep=args.keep, clock_nights=args.clock_nights or None,
                          log=lambda line: print(line, flush=True))
    result = Season(config).run()
    from bench.season.runner import NightRow

    rows = [NightRow(**{k: v for k, v in r.items() if k != "ok"}) for r in result["rows"]]
    print("\n" + table(rows))
    print("\nevents: " + "; ".join(f"{k}: {v}" for k, v in EVENTS.items()))
    print("faults: " + "; ".join(f"{k}: {v}" for k, v in FAULTS.items()))
    print(json.dumps(result["summary"], indent=2, default=str))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2, default=str))
    return 0 if all(r["ok"] for r in result["rows"]) else 1
