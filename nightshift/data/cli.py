"""Data subcommands: `demo-data`."""

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


def _demo_data(args: argparse.Namespace) -> dict[str, Any]:
    return {"out": args.out, "rows": write_demo_dataset(args.out, rows=args.rows, seed=args.seed)}
