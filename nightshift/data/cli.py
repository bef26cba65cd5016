"""Data subcommands: `demo-data`, `validate`, `stage`."""

from __future__ import annotations

import argparse
from typing import Any

from nightshift.data.demo import DIGITS_ROWS, write_demo_dataset


def add_parser(subparsers: Any) -> None:
    demo = subparsers.add_parser("demo-data", help="write the demo digits dataset as Parquet splits")
    demo.add_argument("out", help="directory to write train/validation/test.parquet into")
    demo.add_argument("--seed", type=int, default=0, help="seed of the sample and the split (default 0)")
    demo.add_argument("--rows", type=int, default=DIGITS_ROWS, help=f"rows in all (default {DIGITS_ROWS})")
    demo.set_defaults(func=_demo_data)

    validate = subparsers.add_parser("validate", help="check data against the GX suite (exit 1 on failure)")
    validate.add_argument("data", help="a Parquet file or a directory of them")
    validate.add_argument("--no-data-docs", action="store_true", help="skip building the Data Docs pages")
    validate.add_argument("--suite", metavar="FILE", help="a suite JSON file (e.g. from `nightshift suite init`) "
                                                          "instead of the project's gx/ suite")
    validate.set_defaults(func=_validate)

    stage = subparsers.add_parser("stage", help="validate, version with DVC, materialise in a workspace")
    stage.add_argument("data", help="a dataset directory holding train/validation/test.parquet")
    stage.add_argument("--workspace", required=True, help="the data lands in WORKSPACE/data")
    stage.set_defaults(func=_stage)


def _demo_data(args: argparse.Namespace) -> dict[str, Any]:
    return {"out": args.out, "rows": write_demo_dataset(args.out, rows=args.rows, seed=args.seed)}


def _validate(args: argparse.Namespace) -> dict[str, Any]:
    from nightshift.cli import emit
    from nightshift.data.validate import check_data, describe_failures
    from nightshift.errors import DataValidationFailed

    report = check_data(args.data, data_docs=not args.no_data_docs, suite_file=args.suite)
    if not report["success"]:
        emit(report)  # the full report on stdout; the one-line summary goes to stderr
        raise DataValidationFailed(describe_failures(report))
    return dict(report)


def _stage(args: argparse.Namespace) -> dict[str, Any]:
    from nightshift.data.stage import stage_dataset

    return dict(stage_dataset(args.data, args.workspace))
