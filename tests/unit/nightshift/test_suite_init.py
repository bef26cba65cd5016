"""`nightshift suite init`: a GX suite drawn from a known-good sample, which the project's validator then runs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest

from nightshift.data.suite_init import build_suite, init_suite, value_range
from nightshift.errors import UsageError


def sample(rows: int = 200, seed: int = 0) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    frame = pd.DataFrame({
        "size": np.linspace(0.0, 10.0, rows),                    # 0..10: allowed 0..11 (non-negative)
        "temperature": np.linspace(-20.0, 20.0, rows),           # -20..20: allowed -24..24
        "count": rng.integers(3, 8, rows).astype("int64"),       # 3..7 (both seen below): allowed 2..8
        "site": rng.choice(["north", "south"], rows),
        "label": np.arange(rows) % 3,
    })
    frame.loc[[0, 9], "count"] = [3, 7]
    frame["reading"] = frame["size"].where(np.arange(rows) % 10 != 5)  # 10% nulls, min and max kept
    return frame


def by_type(suite: dict[str, Any], kind: str) -> list[dict[str, Any]]:
    return [e["kwargs"] for e in suite["expectations"] if e["type"] == kind]


def test_the_suite_holds_the_samples_rules_with_their_margins() -> None:
    frame = sample()
    suite = build_suite([("train.parquet", frame.iloc[:150]), ("test.parquet", frame.iloc[150:])], "label", "s")
    assert suite["name"] == "s"
    assert all(e["severity"] == "critical" and e["meta"]["rule"] for e in suite["expectations"])
    (columns,) = by_type(suite, "expect_table_columns_to_match_set")
    assert columns["column_set"] == list(frame.columns)
    (types,) = by_type(suite, "expect_table_column_types_to_be")
    assert types["column_types"]["count"] == "int64" and types["column_types"]["size"] == "float64"
    (never_null,) = by_type(suite, "expect_columns_values_to_not_be_null")
    assert "reading" not in never_null["column_list"] and "label" in never_null["column_list"]
    # 10% nulls in the sample: up to 15% allowed
    assert by_type(suite, "expect_column_values_to_not_be_null") == [{"column": "reading", "mostly": 0.85}]
    ranges = {tuple(k["column_list"]): (k["min_value"], k["max_value"])
              for k in by_type(suite, "expect_columns_values_to_be_finite_between")}
    assert ranges == {("size", "reading"): (0.0, 11.0), ("temperature",): (-24.0, 24.0), ("count",): (2, 8)}
    assert by_type(suite, "expect_column_values_to_be_in_set") == [{"column": "label", "value_set": [0, 1, 2]}]
    # files of 50 and 150 rows: half the smallest to ten times the largest
    assert by_type(suite, "expect_table_row_count_to_be_between") == [{"min_value": 25, "max_value": 1500}]


def test_a_float_label_gets_a_range_and_a_string_label_a_set() -> None:
    frame = pd.DataFrame({"x": [1.0, 2.0, 3.0], "price": [100.0, 150.0, 200.0], "kind": ["a", "b", "a"]})
    suite = build_suite([("t.parquet", frame)], "price", "s")
    assert {"column_list": ["price"], "min_value": 90.0, "max_value": 210.0} in \
        by_type(suite, "expect_columns_values_to_be_finite_between")
    suite = build_suite([("t.parquet", frame)], "kind", "s")
    assert by_type(suite, "expect_column_values_to_be_in_set") == [{"column": "kind", "value_set": ["a", "b"]}]


@pytest.mark.parametrize(("values", "integer", "expected"), [
    ([5.0, 5.0], False, (4.5, 5.5)),        # constant: 10% of the value
    ([0.0, 0.0], False, (0.0, 1.0)),        # constant 0: 1, never below 0
    ([-3.0, -1.0], False, (-3.2, -0.8)),    # negative columns are not clamped at 0
    ([1, 10], True, (0, 11)),               # integers rounded outward, clamped at 0
    ([1e9, 1e9 + 1], False, (999999999.9, 1000000001.1)),  # rounding keeps the sample inside
    ([1.0, float("inf")], False, None),     # an infinity: no range
    ([None, None], False, None),
])
def test_value_range(values: list[Any], integer: bool, expected: Any) -> None:
    bounds = value_range(pd.Series(values, dtype="float64" if not integer else "int64"), integer)
    assert bounds == (pytest.approx(expected) if expected else expected)
    if bounds is not None:
        finite = [v for v in values if v is not None]
        assert bounds[0] <= min(finite) and max(finite) <= bounds[1]


def test_a_label_that_is_not_a_column_is_a_usage_error() -> None:
    with pytest.raises(UsageError, match=r"label column 'target' is not in t.parquet .*pass --label"):
        build_suite([("t.parquet", sample())], "target", "s")


def test_init_refuses_to_overwrite_without_force(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from nightshift.pipelines import cli

    data = tmp_path / "sample.parquet"
    sample().to_parquet(data, index=False)
    out = tmp_path / "suite.json"
    out.write_text("keep me")
    with pytest.raises(UsageError, match="exists; pass --force"):
        init_suite(data, "label", out)
    assert out.read_text() == "keep me"

    args = cli.argparse.Namespace(data=str(data), label="label", out=str(out), force=True, name="mine")
    written = cli._init(args)
    suite = json.loads(out.read_text())
    assert suite["name"] == "mine" and written["out"] == str(out) and written["rows"] == 200
    assert written["expectations"][0] == "expect_table_columns_to_match_set: schema: exactly the 6 columns of " \
                                         "the sample"
    review = capsys.readouterr().err
    assert review.startswith(f"wrote {out} ({len(suite['expectations'])} expectations from 200 rows)")
    assert "expect_column_values_to_be_in_set: labels are one of the sample's 3 values (0, 1, 2)" in review
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([data.name, out.name])  # no temporary file left


def test_a_directory_of_splits_is_one_sample(tmp_path: Path) -> None:
    frame = sample()
    for name, part in (("train", frame.iloc[:120]), ("validation", frame.iloc[120:160]), ("test", frame.iloc[160:])):
        part.to_parquet(tmp_path / f"{name}.parquet", index=False)
    written = init_suite(tmp_path, "label", tmp_path / "suite.json")
    assert written["files"] == ["test.parquet", "train.parquet", "validation.parquet"] and written["rows"] == 200


@pytest.mark.slow
def test_the_validator_passes_the_sample_and_names_what_breaks_it(tmp_path: Path) -> None:
    from nightshift.data.validate import load_suite_file, validate_frame

    frame = sample()
    data = tmp_path / "sample.parquet"
    frame.to_parquet(data, index=False)
    out = tmp_path / "suite.json"
    init_suite(data, "label", out)
    suite = load_suite_file(out)
    table = pd.read_parquet(data)
    assert validate_frame(table, suite, data_docs=False)[:2] == (True, [])

    drifted = table.copy()
    drifted.loc[5, "temperature"] = 30.0      # outside -24..24
    drifted.loc[7, "label"] = 3               # a label the sample never had
    success, failures, _ = validate_frame(drifted, suite, data_docs=False)
    assert not success
    named = {(f["expectation"], f["column"]): f for f in failures}
    assert set(named) == {("expect_columns_values_to_be_finite_between", "temperature"),
                          ("expect_column_values_to_be_in_set", "label")}
    assert named[("expect_columns_values_to_be_finite_between", "temperature")]["sample"] == [30.0]
    assert named[("expect_column_values_to_be_in_set", "label")]["sample"] == [3]

    # `nightshift validate --suite FILE` runs it the same way
    from nightshift.data.validate import check_data

    drifted.to_parquet(data, index=False)
    report = check_data(data, data_docs=False, suite_file=out)
    assert report["suite"] == "suite" and not report["success"]
    assert {f["expectation"] for f in report["files"][0]["failures"]} == {
        "expect_columns_values_to_be_finite_between", "expect_column_values_to_be_in_set"}
