"""`nightshift suite init` on real tables (issue 34 item 6): false refusals of fresh samples, corruptions caught.

Method, per table (scikit-learn's bundled wine, breast cancer, diabetes, iris; no download) and per night
(seeded, so a rerun gives the same numbers):

1. shuffle the table and cut it in two halves; split each half 60/20/20 into train/validation/test;
2. draw a suite from the first half's three splits (`build_suite`, the table's task given), and, as the
   baseline, with the drawing of main before this change (`git show BASELINE:nightshift/data/suite_init.py`);
3. a fresh night: validate each split of the second half with the project's validator (GX, result format
   SUMMARY); the night is falsely refused when any split fails;
4. corruptions, each applied to one split of the second half chosen by the night's seed, each validated once:
   a numeric feature set to its median (`constant`), every label equal to the most common class
   (`single_class`, classification only), every row repeated five times (`duplicated`), a feature times 1,000
   (`units`), 10% of a feature's values null (`nulls`), and, which should pass, a feature shifted by a quarter
   of its standard deviation (`drift`). A corruption is caught when the split is refused by a failure naming
   the expected rule and column (`refused` counts any refusal).

Run: `python -m bench suite` (NIGHTSHIFT_BENCH_SUITE_NIGHTS, default 100 nights; ..._BASELINE_NIGHTS for the
baseline, default the same).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

BASELINE = "6a1c157"  # main before issue 34 item 6
SPLITS = (("train", 0.6), ("validation", 0.2), ("test", 0.2))
TABLES = {  # name: (loader, task)
    "wine": ("load_wine", "multiclass"),
    "breast_cancer": ("load_breast_cancer", "binary"),
    "diabetes": ("load_diabetes", "regression"),
    "iris": ("load_iris", "multiclass"),
}
LABEL = "target"
# The rules (expectation types) that should name each corruption, and whether they name the label or a feature.
EXPECTED: dict[str, tuple[set[str], bool]] = {
    "constant": ({"expect_columns_quantiles_to_be_between", "expect_columns_stdev_to_be_between"}, False),
    "single_class": ({"expect_column_unique_value_count_to_be_between", "expect_column_value_shares_to_be_at_least"},
                     True),
    "duplicated": ({"expect_compound_columns_to_be_unique_by_hash"}, False),
    "units": ({"expect_columns_quantiles_to_be_between", "expect_columns_stdev_to_be_between",
               "expect_columns_values_to_be_finite_between"}, False),
    "nulls": ({"expect_columns_values_to_not_be_null", "expect_column_values_to_not_be_null"}, False),
    "drift": (set(), False),
}


def table(name: str) -> pd.DataFrame:
    from sklearn import datasets

    loader, _ = TABLES[name]
    return getattr(datasets, loader)(as_frame=True).frame


def splits(frame: pd.DataFrame) -> list[tuple[str, pd.DataFrame]]:
    cuts = np.cumsum([0] + [round(share * len(frame)) for _, share in SPLITS[:-1]] + [len(frame)])
    cuts[-1] = len(frame)
    return [(f"{split}.parquet", frame.iloc[cuts[i]:cuts[i + 1]].reset_index(drop=True))
            for i, (split, _) in enumerate(SPLITS)]


def baseline_module() -> types.ModuleType:
    """The drawing of suites before this change, from git (the repository this runs in)."""
    source = subprocess.run(["git", "show", f"{BASELINE}:nightshift/data/suite_init.py"], check=True,
                            capture_output=True, text=True, cwd=Path(__file__).parent).stdout
    module = types.ModuleType("suite_init_baseline")
    exec(compile(source, "suite_init_baseline.py", "exec"), module.__dict__)  # this repository's own file
    return module


def corrupt(kind: str, frame: pd.DataFrame, column: str, rng: np.random.Generator) -> pd.DataFrame:
    bad = frame.copy()
    if kind == "constant":
        bad[column] = bad[column].median()
    elif kind == "single_class":
        bad[LABEL] = frame[LABEL].mode().iloc[0]
    elif kind == "duplicated":
        bad = pd.concat([frame] * 5, ignore_index=True)
    elif kind == "units":
        bad[column] = bad[column] * 1000
    elif kind == "nulls":
        rows = rng.choice(len(bad), size=max(1, math.ceil(0.1 * len(bad))), replace=False)
        bad.loc[rows, column] = np.nan
    elif kind == "drift":
        bad[column] = bad[column] + 0.25 * frame[column].std()
    return bad



class Validator:
    """The project's validator on one shared GX context; one SUMMARY run per table."""

    def __init__(self, home: Path) -> None:
        from nightshift.data import validate

        self.validate = validate
        self.context = validate._context(home / "docs")
        self.runs = 0

    def suite(self, suite: dict[str, Any], folder: Path) -> Any:
        path = folder / f"{suite['name']}.json"
        path.write_text(json.dumps(suite))
        return self.validate.load_suite_file(path)

    def failures(self, frame: pd.DataFrame, suite: Any) -> list[dict[str, Any]]:
        self.runs += 1
        _, result = self.validate._run(self.context, frame, suite, "SUMMARY", f"n{self.runs}")
        return [] if result.success else [dict(f) for f in self.validate._failures(result)]


def caught(kind: str, failures: list[dict[str, Any]], column: str) -> bool:
    rules, on_label = EXPECTED[kind]
    target = LABEL if on_label else column
    if kind == "duplicated":
        return any(f["expectation"] in rules for f in failures)
    return any(f["expectation"] in rules and f["column"] == target for f in failures)


def run_table(name: str, nights: int, baseline_nights: int, drawers: dict[str, Callable[..., dict[str, Any]]],
              validator: Validator, folder: Path) -> dict[str, Any]:
    frame = table(name)
    task = TABLES[name][1]
    features = [c for c in frame.columns if c != LABEL]
    kinds = [k for k in EXPECTED if k != "single_class" or task != "regression"]
    results: dict[str, Any] = {}
    for drawer, draw in drawers.items():
        count = nights if drawer == "new" else baseline_nights
        tally: dict[str, list[int]] = {"fresh": [], **{k: [] for k in kinds}}
        named: dict[str, list[int]] = {k: [] for k in kinds}
        reasons: dict[str, int] = {}
        started = time.perf_counter()
        for night in range(count):
            rng = np.random.default_rng(night)
            order = rng.permutation(len(frame))
            half = len(frame) // 2
            sample = splits(frame.iloc[order[:half]])
            fresh = splits(frame.iloc[order[half:]])
            suite = validator.suite(draw(sample, task), folder)
            refused = False
            for _, part in fresh:
                failures = validator.failures(part, suite)
                for failure in failures:
                    key = f"{failure['expectation']}({failure['column']})"
                    reasons[key] = reasons.get(key, 0) + 1
                refused |= bool(failures)
            tally["fresh"].append(int(refused))
            # one corruption of one split per kind; the column among the sample's non-constant features
            varying = [c for c in features if sample[0][1][c].nunique() > 1]
            for kind in kinds:
                _, part = fresh[int(rng.integers(len(fresh)))]
                column = str(rng.choice(varying))
                failures = validator.failures(corrupt(kind, part, column, rng), suite)
                tally[kind].append(int(bool(failures)))
                named[kind].append(int(caught(kind, failures, column)))
        results[drawer] = {
            "nights": count,
            "seconds": round(time.perf_counter() - started, 1),
            "false_refusal": float(np.mean(tally["fresh"])),
            "refused": {k: float(np.mean(tally[k])) for k in kinds},
            "caught_named": {k: float(np.mean(named[k])) for k in kinds if k != "drift"},
            "top_reasons": dict(sorted(reasons.items(), key=lambda kv: -kv[1])[:5]),
        }
        print(json.dumps({"table": name, "drawer": drawer, **results[drawer]}), flush=True)
    return results


def main() -> None:
    os.environ.setdefault("NIGHTSHIFT_HOME", tempfile.mkdtemp(prefix="bench-suite-"))
    from nightshift.data.suite_init import build_suite

    nights = int(os.environ.get("NIGHTSHIFT_BENCH_SUITE_NIGHTS", "100"))
    baseline_nights = int(os.environ.get("NIGHTSHIFT_BENCH_SUITE_BASELINE_NIGHTS", str(nights)))
    old = baseline_module()
    drawers: dict[str, Callable[..., dict[str, Any]]] = {
        "new": lambda frames, task: build_suite(frames, LABEL, "new", task=task),
        "baseline": lambda frames, task: old.build_suite(frames, LABEL, "baseline"),
    }
    wanted = [a for a in sys.argv[2:] if a in TABLES] or list(TABLES)
    with tempfile.TemporaryDirectory() as tmp:
        validator = Validator(Path(tmp))
        summary = {name: run_table(name, nights, baseline_nights, drawers, validator, Path(tmp))
                   for name in wanted}
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
