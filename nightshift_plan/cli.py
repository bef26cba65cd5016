"""`nightshift plan --conf JSON`: the Kubernetes objects a `nightly_retrain` run with that conf would create.

Rendering needs the DAG and its operator, which are Airflow's: the work is done by `nightshift_plan.plan`,
imported only when this command runs. The `nightshift` CLI finds `add_parser` through the `nightshift.commands`
entry point declared in pyproject.toml, so neither it nor anything below the DAGs imports this module.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from nightshift.cli import json_object
from nightshift.errors import UsageError


def add_parser(subparsers: Any) -> None:
    plan = subparsers.add_parser(
        "plan", help="print, as YAML, every Kubernetes object a nightly_retrain run with this conf would create")
    plan.add_argument("--conf", type=json_object, default={},
                      help="the trigger conf: a JSON object of the DAG's params")
    plan.add_argument("--run-id", default="manual__plan", help="the run id to render names and paths for")
    plan.add_argument("--against", metavar="REF",
                      help="print a diff of every object against the plan the code at git REF renders")
    plan.set_defaults(func=_plan)


def _plan(args: argparse.Namespace) -> int:
    import contextlib

    from nightshift_plan.plan import (
        PlanError,
        diff,
        placeholders,
        plan_at_ref,
        plan_explained,
        render_yaml,
        validate_all,
    )
    from operators.validation import ManifestInvalid

    try:
        # Airflow's loggers write to stdout outside a task: keep stdout for the YAML alone.
        with contextlib.redirect_stdout(sys.stderr):
            planned = plan_explained(args.conf, run_id=args.run_id)
            objects = planned.objects
            unchecked = validate_all(objects)
            before = plan_at_ref(args.against, args.conf, args.run_id) if args.against else None
    except (PlanError, ManifestInvalid) as err:
        raise UsageError(str(err)) from err
    if unchecked:
        print(f"nightshift plan: not validated (no CRD schema found; set NIGHTSHIFT_SCHEMAS): "
              f"{', '.join(unchecked)}", file=sys.stderr)
    if planned.namespace is not None:
        print(f"nightshift plan: namespace {planned.namespace} ({planned.namespace_source})", file=sys.stderr)
    stand_ins = placeholders(objects)
    if stand_ins:
        print(f"nightshift plan: placeholders, filled in at run time: {'; '.join(stand_ins)}", file=sys.stderr)
    if before is None:
        sys.stdout.write(render_yaml(objects, planned.namespace_source))
    else:
        sys.stdout.write(diff(before, objects, args.against, "working tree") or f"# no change against {args.against}\n")
    return 0
