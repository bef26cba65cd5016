"""The GX data gate: the suite in gx/, `validate_data`, `nightshift validate` (the DAG's operator:
tests/dags/test_gx_gate.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from nightshift.cli import main
from nightshift.data.validate import check_data, gx_dir, load_suite, read_table, validate_data
from nightshift.errors import DataError, DataValidationFailed

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture
def bad_file(demo_data: Path, tmp_path: Path) -> Path:
    frame = pd.read_parquet(demo_data / "train.parquet")
    frame.loc[3, "pixel_5"] = np.nan
    frame.loc[4, "pixel_7"] = 17.5
    frame.loc[5, "label"] = 12
    path = tmp_path / "bad.parquet"
    frame.to_parquet(path, index=False)
    return path


def test_good_data_passes_with_a_data_docs_page(demo_data: Path, nightshift_home: Path) -> None:
    report = validate_data(demo_data)
    assert report["success"] is True
    assert [Path(f["path"]).name for f in report["files"]] == ["test.parquet", "train.parquet",
                                                                 "validation.parquet"]
    assert sum(f["rows"] for f in report["files"]) == 1797
    page = Path(report["files"][0]["data_docs"] or "")
    assert page.is_file() and page.suffix == ".html"
    assert nightshift_home in page.parents  # Data Docs live in NIGHTSHIFT_HOME, never in the repo


def test_failure_names_each_expectation_with_samples(bad_file: Path) -> None:
    with pytest.raises(DataValidationFailed) as caught:
        validate_data(bad_file)
    message = str(caught.value)
    assert "\n" not in message
    assert "expect_columns_values_to_not_be_null(pixel_5) [no nulls or NaN] e.g. ['NaN']" in message
    assert "expect_columns_values_to_be_finite_between(pixel_7)" in message and "17.5" in message
    assert "expect_column_values_to_be_in_set(label) [labels are in 0..9] e.g. [12]" in message
    assert "failed 3 expectation(s)" in message
    docs = message.split("Data Docs: ")[1]
    assert Path(docs).is_file()


def test_cli_validate_exit_codes(demo_data: Path, bad_file: Path, tmp_path: Path,
                                 capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["validate", str(demo_data / "test.parquet"), "--no-data-docs"]) == 0
    assert json.loads(capsys.readouterr().out)["success"] is True

    assert main(["validate", str(bad_file), "--no-data-docs"]) == 1
    out, err = capsys.readouterr()
    report = json.loads(out)
    assert report["success"] is False
    failed = {(f["expectation"], f["column"]) for f in report["files"][0]["failures"]}
    assert ("expect_column_values_to_be_in_set", "label") in failed
    assert err.count("\n") == 1 and err.startswith("nightshift validate: ")

    truncated = tmp_path / "truncated.parquet"
    truncated.write_bytes((demo_data / "train.parquet").read_bytes()[:3000])
    for unreadable in (tmp_path / "missing.parquet", truncated, tmp_path):
        assert main(["validate", str(unreadable)]) == 2
        out, err = capsys.readouterr()
        assert out == "" and err.count("\n") == 1 and "Traceback" not in err

    with pytest.raises(SystemExit) as usage:
        main(["validate"])
    assert usage.value.code == 2


def test_read_table_names_the_problem(tmp_path: Path) -> None:
    empty = tmp_path / "empty.parquet"
    empty.touch()
    with pytest.raises(DataError, match="empty"):
        read_table(empty)
    text = tmp_path / "notes.parquet"
    text.write_text("label,pixel_0\n1,2\n")
    with pytest.raises(DataError, match="not a readable Parquet file"):
        read_table(text)
    empty_dir = tmp_path / "empty-dir"
    empty_dir.mkdir()
    with pytest.raises(DataError, match=r"holds no \.parquet files"):
        check_data(empty_dir)


def test_suite_covers_every_rule_of_the_issue() -> None:
    suite = load_suite()
    types = {e.expectation_type for e in suite.expectations}
    assert {
        "expect_table_columns_to_match_set",
        "expect_table_column_types_to_be",
        "expect_columns_values_to_not_be_null",
        "expect_columns_values_to_be_finite_between",
        "expect_column_values_to_be_in_set",
        "expect_table_row_count_to_be_between",
        "expect_compound_columns_to_be_unique_by_hash",
        "expect_column_value_shares_to_be_at_least",
    } <= types
    assert all(e.meta.get("rule") for e in suite.expectations)  # every failure can name its rule
    # Wide expectations: GX's fixed cost per expectation must not grow with the number of columns.
    assert len(suite.expectations) == len(types) == 8
    columns = ["label"] + [f"pixel_{i}" for i in range(64)]
    wide = {e.expectation_type: e.configuration.kwargs for e in suite.expectations}
    assert wide["expect_table_column_types_to_be"]["column_types"] == {
        c: "int64" if c == "label" else "float32" for c in columns}
    assert wide["expect_columns_values_to_not_be_null"]["column_list"] == columns
    assert wide["expect_columns_values_to_be_finite_between"]["column_list"] == columns[1:]
    assert wide["expect_compound_columns_to_be_unique_by_hash"]["column_list"] == columns


def _failures_of(frame: pd.DataFrame, tmp_path: Path) -> dict[tuple[str, str | None], dict]:
    path = tmp_path / "table.parquet"
    frame.to_parquet(path, index=False)
    report = check_data(path, data_docs=False)
    assert report["success"] is False
    return {(f["expectation"], f["column"]): dict(f) for f in report["files"][0]["failures"]}


def test_wide_expectations_name_each_failing_column_with_its_count_and_samples(demo_data: Path,
                                                                               tmp_path: Path) -> None:
    frame = pd.read_parquet(demo_data / "train.parquet")
    frame.loc[[3, 8, 9], "pixel_5"] = np.nan
    frame.loc[4, "pixel_7"] = -0.5
    frame.loc[[6, 7], "pixel_63"] = [np.inf, 16.5]
    frame["label"] = frame["label"].astype("Int64")
    frame.loc[10, "label"] = pd.NA
    frame = frame.drop(columns=["pixel_20"]).astype({"pixel_40": "float64"})
    failures = _failures_of(frame, tmp_path)

    nulls = {c: f for (e, c), f in failures.items() if e == "expect_columns_values_to_not_be_null"}
    assert set(nulls) == {"pixel_5", "label", "pixel_20"}
    assert nulls["pixel_5"]["unexpected_count"] == 3 and nulls["pixel_5"]["sample"] == ["NaN"] * 3
    assert nulls["label"]["unexpected_count"] == 1 and nulls["label"]["sample"] == ["NaN"]  # pd.NA, as JSON
    assert nulls["pixel_20"]["observed"] == "missing column"

    outside = {c: f for (e, c), f in failures.items() if e == "expect_columns_values_to_be_finite_between"}
    assert set(outside) == {"pixel_7", "pixel_63", "pixel_20"}  # NaN in pixel_5 is the null rule's
    assert outside["pixel_7"]["sample"] == [-0.5] and outside["pixel_7"]["unexpected_count"] == 1
    assert outside["pixel_63"]["sample"] == ["inf", 16.5] and outside["pixel_63"]["rule"]

    types = {c: f["observed"] for (e, c), f in failures.items() if e == "expect_table_column_types_to_be"}
    assert types == {"label": "Int64", "pixel_20": "missing column", "pixel_40": "float64"}
    json.dumps(list(failures.values()))  # the CLI prints the report as JSON


def test_duplicate_rows_are_found_by_hash_and_confirmed_by_value(demo_data: Path, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    frame = pd.read_parquet(demo_data / "train.parquet")
    doubled = pd.concat([frame, frame.iloc[:20]], ignore_index=True)  # 40 of 1,277 rows: 3.1% > 1%
    failures = _failures_of(doubled, tmp_path)
    found = failures[("expect_compound_columns_to_be_unique_by_hash", None)]
    assert found["unexpected_count"] == 40
    assert found["sample"][0] == {"row": 1257, "duplicate_of": 0}

    # Every row hashing alike (the worst collision): candidates are compared by value, so none counts.
    real = pd.util.hash_pandas_object
    monkeypatch.setattr(pd.util, "hash_pandas_object",
                        lambda obj, **kw: pd.Series(np.zeros(len(obj), dtype="uint64")) if kw.get("index") is False
                        else real(obj, **kw))
    path = tmp_path / "unique.parquet"
    frame.to_parquet(path, index=False)
    assert check_data(path, data_docs=False)["success"] is True


def test_gx_file_context_in_git_loads_and_its_checkpoint_runs(demo_data: Path, tmp_path: Path,
                                                              nightshift_home: Path) -> None:
    """`gx/` is a real GX file context; run its checkpoint from a copy so the repo is not written to."""
    import great_expectations as gx

    import nightshift.data.expectations  # noqa: F401

    shutil.copytree(gx_dir(), tmp_path / "gx")
    context = gx.get_context(mode="file", project_root_dir=str(tmp_path))
    assert context.suites.get("digits").name == "digits"
    checkpoint = context.checkpoints.get("digits")
    result = checkpoint.run(batch_parameters={"dataframe": read_table(demo_data / "test.parquet")})
    assert result.success
    assert (nightshift_home / "gx" / "data_docs").is_dir()


def _suite_file(tmp_path: Path, expectations: list[dict[str, object]]) -> Path:
    path = tmp_path / "suite.json"
    path.write_text(json.dumps({"name": "reviewed", "expectations": expectations}))
    return path


@pytest.mark.parametrize(("expectations", "named"), [
    ([], "no expectations"),
    # GX's ExpectationSuite logs and drops an expectation whose type it does not know: the typo'd rule would
    # be no rule at all, and a suite of only such rules passes every table.
    ([{"type": "expect_column_values_to_not_be_null", "kwargs": {"column": "label"}},
      {"type": "expect_column_values_to_be_in_sett", "kwargs": {"column": "label", "value_set": [0, 1]}}],
     "expect_column_values_to_be_in_sett"),
    ([{"type": "expect_column_values_to_be_between", "kwargs": {"column": "label", "min_valu": 0}}],
     "expect_column_values_to_be_between"),
])
def test_a_suite_that_would_check_less_than_it_says_is_refused(tmp_path: Path, expectations: list[dict[str, object]],
                                                                named: str) -> None:
    """issue 37 review: a suite that is empty, or one whose expectation GX cannot build, refuses the data (a
    UsageError naming the suite and the expectation) instead of passing it unchecked."""
    from nightshift.data.validate import load_suite_file
    from nightshift.errors import UsageError

    suite = _suite_file(tmp_path, expectations)
    with pytest.raises(UsageError, match=named) as caught:
        load_suite_file(suite)
    assert str(suite) in str(caught.value)


@pytest.mark.parametrize("content", ["{not json", "[1, 2]", '{"name": "x"}', json.dumps(
    {"expectations": [{"type": "expect_column_to_exist", "kwargs": {"column": "label"}}]})])
def test_a_suite_file_edited_into_no_suite_is_refused_naming_it(tmp_path: Path, content: str) -> None:
    """issue 37 review: the declaration's suite is checked when the DAG file is parsed; edited since, the gate
    raised a bare JSONDecodeError or KeyError (a retried task failure with a traceback, not a refusal)."""
    from nightshift.data.validate import load_suite_file
    from nightshift.errors import UsageError

    suite = tmp_path / "suite.json"
    suite.write_text(content)
    with pytest.raises(UsageError, match=r"is not a GX expectation suite"):
        load_suite_file(suite)


def test_an_empty_split_fails_even_a_suite_without_a_row_count(demo_data: Path, tmp_path: Path) -> None:
    """issue 37 review: a 0-row split passes every column rule vacuously; the gate refuses it whatever the
    suite says."""
    suite = _suite_file(tmp_path, [{"type": "expect_column_values_to_be_in_set",
                                    "kwargs": {"column": "label", "value_set": list(range(10))}}])
    data = tmp_path / "data"
    shutil.copytree(demo_data, data)
    pd.read_parquet(data / "test.parquet").iloc[:0].to_parquet(data / "test.parquet", index=False)
    with pytest.raises(DataError, match=r"test\.parquet has 0 rows"):
        check_data(data, data_docs=False, suite_file=suite)


def test_an_expectation_that_raised_refuses_the_table_and_says_why(demo_data: Path, tmp_path: Path) -> None:
    """issue 37 review: an expectation GX could not run (here a column the table lacks) fails the table, and the
    report names the error GX raised (GX keys it by metric: it read as `observed None`)."""
    suite = _suite_file(tmp_path, [{"type": "expect_column_values_to_not_be_null", "kwargs": {"column": "nope"}}])
    report = check_data(demo_data / "test.parquet", data_docs=False, suite_file=suite)
    assert report["success"] is False
    (failure,) = report["files"][0]["failures"]
    assert failure["column"] == "nope"
    assert str(failure["observed"]).startswith("error: ") and "nope" in str(failure["observed"])


def test_data_docs_sites_share_one_copy_of_gxs_static_assets(bad_file: Path, nightshift_home: Path) -> None:
    """GX copies ~4 MB of fonts and images into every site, and each validation has a site of its own: each night
    of bad data grew NIGHTSHIFT_HOME by 4.2 MB in issue 36's season benchmark. Every site keeps its own files (the
    plugin serves a site folder whole), hard links to one copy per content."""
    pages = [check_data(bad_file)["files"][0]["data_docs"] for _ in range(2)]
    sites = [Path(page or "").parents[4] for page in pages]
    assert sites[0] != sites[1] and all((site / "static").is_dir() for site in sites)
    assets = sorted(p.relative_to(sites[0]) for p in (sites[0] / "static").rglob("*") if p.is_file())
    assert len(assets) > 5
    for asset in assets:
        first, second = (sites[0] / asset).stat(), (sites[1] / asset).stat()
        assert (first.st_dev, first.st_ino) == (second.st_dev, second.st_ino), asset
        assert first.st_nlink == 3 and first.st_size > 0  # the two sites' paths and the one shared copy
