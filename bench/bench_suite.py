"""`nightshift suite init` on real tables (issue 34 item 6): false refusals of fresh samples, corruptions caught.

Method, per table (scikit-learn's bundled digits, wine, breast cancer, diabetes, iris, no download, and a
generated heavy-tailed table) and per night (seeded, so a rerun gives the same numbers):

1. shuffle the table and cut it in two halves; split each half 60/20/20 into train/validation/test;
2. draw a suite from the first half's three splits (`build_suite`, the table's task given), and, as the
   baseline, with the drawing of main before this change (`git show BASELINE:nightshift/data/suite_init.py`);
3. a fresh night: validate each split of the second half with the project's validator (GX, result format
   SUMMARY); the night is falsely refused when any split fails;
4. corruptions, on the first NIGHTSHIFT_BENCH_SUITE_CORRUPT_NIGHTS nights, each applied to one split of the
   second half chosen by the night's seed, each validated once: a numeric feature set to its median
   (`constant`; among the features less than MODE_SHARE one value: a column 95% zeros stuck at zero is what a
   fresh file of it looks like, see suite_init), every label equal to the most common class (`single_class`,
   classification only), every row repeated five times (`duplicated`), a feature times 1,000 (`units`), 10% of a
   feature's values null (`nulls`), a feature divided by 3 (`rescaled`: a sensor rescaled, a unit changed by a small
   factor; it leaves many quantiles in range, so the spread rule alone may catch it; reported, not a goal: the
   issue's list stops at x1000). A corruption is caught when the split is refused by a failure naming the
   expected rule and column (`refused` counts any refusal);
5. gradual drift, which should pass (`drift`: a continuous feature shifted by a quarter of its standard deviation;
   `drift_discrete`, for a table with discrete features, at most DISCRETE_VALUES distinct values: a change of
   their shares of the same size, see `share_drift`; a quarter-sd shift of a 1/2 flag would make values never
   seen, 1.125 and 2.125, which is not drift but a re-coding).

Run: `python -m bench suite [TABLE...]` (NIGHTSHIFT_BENCH_SUITE_NIGHTS, default 100 nights;
..._CORRUPT_NIGHTS, default 30; ..._FIRST_NIGHT, default 0, to add nights to an earlier run;
..._BASELINE_NIGHTS for the baseline drawing, default 0).
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
    "digits": ("load_digits", "multiclass"),
    "wine": ("load_wine", "multiclass"),
    "breast_cancer": ("load_breast_cancer", "binary"),
    "diabetes": ("load_diabetes", "regression"),
    "iris": ("load_iris", "multiclass"),
    "heavy_tailed": ("heavy_tailed", "binary"),
}
LABEL = "target"
# The rules (expectation types) that should name each corruption, and whether they name the label or a feature.
EXPECTED: dict[str, tuple[set[str], bool]] = {
    "constant": ({"expect_columns_quantiles_to_be_between", "expect_columns_stdev_to_be_between",
                  "expect_columns_value_shares_to_be_between"}, False),
    "single_class": ({"expect_column_unique_value_count_to_be_between", "expect_column_value_shares_to_be_at_least"},
                     True),
    "duplicated": ({"expect_compound_columns_to_be_unique_by_hash"}, False),
    "units": ({"expect_columns_quantiles_to_be_between", "expect_columns_stdev_to_be_between",
               "expect_columns_values_to_be_finite_between", "expect_columns_value_shares_to_be_between"}, False),
    "nulls": ({"expect_columns_values_to_not_be_null", "expect_column_values_to_not_be_null"}, False),
    "rescaled": ({"expect_columns_quantiles_to_be_between", "expect_columns_stdev_to_be_between",
                  "expect_columns_values_to_be_finite_between", "expect_columns_value_shares_to_be_between"}, False),
    "drift": (set(), False),
    "drift_discrete": (set(), False),
}
DRIFTS = ("drift", "drift_discrete")
RESCALE = 3


def heavy_tailed(rows: int = 600, seed: int = 0) -> pd.DataFrame:
    """A generated table of heavy-tailed features: three lognormal columns (sigma 1 to 1.5, values up to
    hundreds of times their median), one normal, and a binary `target` that depends on them."""
    rng = np.random.default_rng(seed)
    frame = pd.DataFrame({"income": rng.lognormal(3.0, 1.0, rows), "claims": rng.lognormal(0.0, 1.5, rows),
                          "duration": rng.lognormal(1.0, 1.2, rows), "score": rng.normal(0.0, 1.0, rows)})
    logit = np.log(frame["income"]) - 3.0 + 0.5 * np.log(frame["claims"]) + frame["score"]
    frame[LABEL] = (logit + rng.normal(0.0, 1.0, rows) > 0).astype("int64")
    return frame


def discrete(frame: pd.DataFrame, column: str) -> bool:
    from nightshift.data.suite_init import DISCRETE_VALUES

    return frame[column].nunique() <= DISCRETE_VALUES


def share_drift(values: pd.Series, population: pd.Series, rng: np.random.Generator) -> pd.Series:
    """Gradual drift of a discrete column: a change of its shares, never a value it does not hold. Rows step up to
    the next of the column's values in `population` (the whole table), the same fraction f of each value's rows;
    f is the largest that moves no value's population share by more than a quarter of its own standard deviation
    sqrt(p(1 - p)) (for a two-valued column: the mean moves by a quarter of its standard deviation, the size of the
    continuous columns' drift). The shares are the population's, not the file's: a file that holds a rare value
    twice as often by chance must not have its chance doubled again."""
    distinct, counts = np.unique(population.to_numpy(), return_counts=True)
    shares = counts / counts.sum()
    per_f = -shares.copy()                 # each value's change of share per unit of f
    per_f[-1] = 0.0
    per_f[1:] += shares[:-1]
    moving = np.abs(per_f) > 0
    f = min(1.0, float(np.min(0.25 * np.sqrt(shares * (1 - shares))[moving] / np.abs(per_f[moving]))))
    out = values.copy()
    for index, value in enumerate(distinct[:-1]):
        rows = np.flatnonzero(values.to_numpy() == value)
        moved = rng.choice(rows, size=round(f * rows.size), replace=False)
        out.iloc[moved] = distinct[index + 1]
    return out


def table(name: str) -> pd.DataFrame:
    from sklearn import datasets

    loader, _ = TABLES[name]
    if loader == "heavy_tailed":
        return heavy_tailed()
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


def corrupt(kind: str, frame: pd.DataFrame, column: str, rng: np.random.Generator,
            population: pd.DataFrame) -> pd.DataFrame:
    bad = frame.copy()
    if kind == "constant":
        bad[column] = bad[column].median()
    elif kind == "single_class":
        bad[LABEL] = frame[LABEL].mode().iloc[0]
    elif kind == "duplicated":
        bad = pd.concat([frame] * 5, ignore_index=True)
    elif kind == "units":
        bad[column] = bad[column] * 1000
    elif kind == "rescaled":
        bad[column] = bad[column] / RESCALE
    elif kind == "nulls":
        rows = rng.choice(len(bad), size=max(1, math.ceil(0.1 * len(bad))), replace=False)
        bad.loc[rows, column] = np.nan
    elif kind == "drift":
        bad[column] = bad[column] + 0.25 * frame[column].std()
    elif kind == "drift_discrete":
        bad[column] = share_drift(frame[column], population[column], rng)
    return bad


class Validator:
    """The project's validator on one shared GX context; one SUMMARY run per table."""

    def __init__(self, home: Path) -> None:
        from nightshift.data import validate

        self.validate = validate
        self.context = validate._context(home / "docs")
        self.runs = 0
        self.seconds = 0.0

    def suite(self, suite: dict[str, Any], folder: Path) -> Any:
        path = folder / f"{suite['name']}.json"
        path.write_text(json.dumps(suite))
        return self.validate.load_suite_file(path)

    def failures(self, frame: pd.DataFrame, suite: Any) -> list[dict[str, Any]]:
        self.runs += 1
        started = time.perf_counter()
        _, result = self.validate._run(self.context, frame, suite, "SUMMARY", f"n{self.runs}")
        self.seconds += time.perf_counter() - started
        return [] if result.success else [dict(f) for f in self.validate._failures(result)]


def caught(kind: str, failures: list[dict[str, Any]], column: str) -> bool:
    rules, on_label = EXPECTED[kind]
    target = LABEL if on_label else column
    if kind == "duplicated":
        return any(f["expectation"] in rules for f in failures)
    return any(f["expectation"] in rules and f["column"] == target for f in failures)


def upper_bound(refused: int, nights: int, confidence: float = 0.95) -> float:
    """One-sided Clopper-Pearson upper bound of a rate seen `refused` times in `nights`."""
    from scipy.stats import beta

    return 1.0 if refused >= nights else float(beta.ppf(confidence, refused + 1, nights - refused))


def columns_for(kind: str, sample: pd.DataFrame, features: list[str], whole: pd.DataFrame) -> list[str]:
    """The features a corruption or drift of `kind` may pick (see the module's method)."""
    from nightshift.data.suite_init import MODE_SHARE

    varying = [c for c in features if sample[c].nunique() > 1]
    if kind == "constant":
        return [c for c in varying if sample[c].value_counts(normalize=True).iloc[0] < MODE_SHARE]
    if kind == "drift":
        return [c for c in varying if not discrete(whole, c)]
    if kind == "drift_discrete":
        return [c for c in varying if discrete(whole, c)]
    return varying


def run_table(name: str, nights: int, corrupt_nights: int, baseline_nights: int,
              drawers: dict[str, Callable[..., dict[str, Any]]], validator: Validator,
              folder: Path, first: int = 0) -> dict[str, Any]:
    frame = table(name)
    task = TABLES[name][1]
    features = [c for c in frame.columns if c != LABEL]
    kinds = [k for k in EXPECTED if (k != "single_class" or task != "regression")
             and (k != "drift_discrete" or any(discrete(frame, c) and frame[c].nunique() > 1 for c in features))]
    results: dict[str, Any] = {}
    for drawer, draw in drawers.items():
        count = nights if drawer == "new" else baseline_nights
        if not count:
            continue
        tally: dict[str, list[int]] = {"fresh": [], **{k: [] for k in kinds}}
        named: dict[str, list[int]] = {k: [] for k in kinds}
        reasons: dict[str, int] = {}
        started = time.perf_counter()
        runs, validating = validator.runs, validator.seconds
        for night in range(first, first + count):
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
            if night >= corrupt_nights:
                continue
            # one corruption of one split per kind, on a column the kind may pick in the sample's half
            whole_sample = pd.concat([part for _, part in sample], ignore_index=True)
            for kind in kinds:
                _, part = fresh[int(rng.integers(len(fresh)))]
                # a column that varies in the split it corrupts (x1000 or a median of a constant changes nothing)
                candidates = [c for c in columns_for(kind, whole_sample, features, frame) if part[c].nunique() > 1]
                if not candidates:
                    continue
                column = str(rng.choice(candidates))
                failures = validator.failures(corrupt(kind, part, column, rng, frame), suite)
                tally[kind].append(int(bool(failures)))
                named[kind].append(int(caught(kind, failures, column)))
                if kind in DRIFTS:
                    for failure in failures:
                        key = f"{kind}: {failure['expectation']}({failure['column']})"
                        reasons[key] = reasons.get(key, 0) + 1
        false = int(np.sum(tally["fresh"]))
        results[drawer] = {
            "nights": count,
            "first_night": first,
            "seconds": round(time.perf_counter() - started, 1),
            "seconds_per_validation": round((validator.seconds - validating) / max(validator.runs - runs, 1), 3),
            "false_refusals": false,
            "false_refusal": false / count,
            "false_refusal_upper_95": round(upper_bound(false, count), 4),
            "corrupt_nights": {k: len(tally[k]) for k in kinds},
            "refused": {k: float(np.mean(tally[k])) if tally[k] else None for k in kinds},
            "caught_named": {k: float(np.mean(named[k])) if named[k] else None for k in kinds if k not in DRIFTS},
            "top_reasons": dict(sorted(reasons.items(), key=lambda kv: -kv[1])[:8]),
        }
        print(json.dumps({"table": name, "drawer": drawer, **results[drawer]}), flush=True)
    return results


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="bench-suite-") as home:
        os.environ.setdefault("NIGHTSHIFT_HOME", home)
        run(home)


def run(home: str) -> None:
    from nightshift.data.suite_init import build_suite

    nights = int(os.environ.get("NIGHTSHIFT_BENCH_SUITE_NIGHTS", "100"))
    corrupt_nights = int(os.environ.get("NIGHTSHIFT_BENCH_SUITE_CORRUPT_NIGHTS", "30"))
    baseline_nights = int(os.environ.get("NIGHTSHIFT_BENCH_SUITE_BASELINE_NIGHTS", "0"))
    first = int(os.environ.get("NIGHTSHIFT_BENCH_SUITE_FIRST_NIGHT", "0"))
    drawers: dict[str, Callable[..., dict[str, Any]]] = {
        "new": lambda frames, task: build_suite(frames, LABEL, "new", task=task)}
    if baseline_nights:
        old = baseline_module()
        drawers["baseline"] = lambda frames, task: old.build_suite(frames, LABEL, "baseline")
    wanted = [a for a in sys.argv[1:] if a in TABLES] or list(TABLES)
    validator = Validator(Path(home))
    summary = {name: run_table(name, nights, corrupt_nights, baseline_nights, drawers, validator, Path(home), first)
               for name in wanted}
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
