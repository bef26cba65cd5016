"""Retention on the season's clock, where a night is a day.

Retention counts days (a pipeline's `retention` block; NIGHTSHIFT_AIRFLOW_DB_RETENTION_DAYS and _LOG_), and a
season's nights last minutes: within a season nothing time-based would ever go, and its disk would say nothing of
months. So after each night the season runs, in a process with the season's environment, the very functions the
pipeline's `collect_garbage` task and the `nightshift_maintenance` DAG run (nightshift.gc.collect,
nightshift.maintenance.clean_metadata and prune_logs), with their clock moved: every window is the same T nights
(the pipeline's resumable_days, challenger_days and data_versions_days, the metadata and log retention), and
`now` is the start of the night T nights back plus T days, so that "older than T days" means "from before the
night T nights back". The pipeline's own collect_garbage task still runs every night on the real clock (it then
removes only what its count, keep_runs, lets go).

    python -m bench.season.clock --pipeline pipelines/digits.yaml --nights 7 --since EPOCH --metadata-url URL
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path

DAY = 86400.0


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.season.clock", description=__doc__.splitlines()[0])
    parser.add_argument("--pipeline", required=True, help="the declaration (its retention's windows are replaced)")
    parser.add_argument("--nights", type=float, required=True, help="T: every retention window, in nights")
    parser.add_argument("--since", type=float, required=True, help="when the night T nights back started (epoch)")
    parser.add_argument("--metadata-url", required=True, help="Airflow's metadata database (SQLAlchemy URL)")
    args = parser.parse_args(argv)

    from nightshift.gc import collect
    from nightshift.maintenance import clean_metadata, prune_logs
    from nightshift.pipelines import load_pipeline
    from nightshift.tracking import configure

    configure()
    now = args.since + args.nights * DAY
    pipeline = load_pipeline(args.pipeline)
    policy = replace(pipeline.retention, resumable_days=args.nights, challenger_days=args.nights,
                     data_versions_days=args.nights)
    pipeline = replace(pipeline, retention=policy)
    result = collect(pipeline, now=now)
    cleaned = clean_metadata(args.nights, floor_days=args.nights, now=datetime.fromtimestamp(now, UTC),
                             url=args.metadata_url)
    pruned = prune_logs(Path(os.environ["AIRFLOW_HOME"]) / "logs", args.nights, now=now)
    kinds: dict[str, int] = {}
    for entry in result["remove"]:
        kinds[entry["kind"]] = kinds.get(entry["kind"], 0) + 1
    print(json.dumps({"removed": kinds, "removed_bytes": result["removed_bytes"], "db_clean_before": cleaned["before"],
                      "db_held_by": cleaned["held_by"], "logs_removed": len(pruned["removed"]),
                      "logs_removed_bytes": pruned["removed_bytes"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
