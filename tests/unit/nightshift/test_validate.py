"""The GX data gate: the suite in gx/, `validate_data`, `nightshift validate`, and the GX Airflow provider."""

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
    assert "expect_column_values_to_not_be_null(pixel_5) [no nulls or NaN] e.g. ['NaN']" in message
    assert "expect_column_values_to_be_finite_between(pixel_7)" in message and "17.5" in message
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
        "expect_column_type_to_be",
        "expect_column_values_to_not_be_null",
        "expect_column_values_to_be_finite_between",
        "expect_column_values_to_be_in_set",
        "expect_table_row_count_to_be_between",
        "expect_compound_columns_to_be_unique",
        "expect_column_value_shares_to_be_at_least",
    } <= types
    assert all(e.meta.get("rule") for e in suite.expectations)  # every failure can name its rule


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


class _TaskInstance:
    """The one piece of the Airflow task context the provider's operator touches."""

    def __init__(self) -> None:
        self.xcom: dict[str, object] = {}

    def xcom_push(self, key: str, value: object) -> None:
        self.xcom[key] = value


@pytest.mark.integration
def test_gx_airflow_provider_runs_the_suite_and_fails_the_task_on_bad_data(demo_data: Path,
                                                                          bad_file: Path) -> None:
    """What the DAG will do: GXValidateDataFrameOperator with `read_table` and `load_suite`."""
    from great_expectations_provider.common.errors import GXValidationFailed
    from great_expectations_provider.operators.validate_dataframe import GXValidateDataFrameOperator

    def operator(path: Path) -> GXValidateDataFrameOperator:
        return GXValidateDataFrameOperator(
            task_id="validate_data",
            configure_dataframe=lambda: read_table(path),
            configure_expectations=lambda context: load_suite(),
            result_format="SUMMARY",
        )

    ti = _TaskInstance()
    operator(demo_data / "validation.parquet").execute(context={"ti": ti})  # type: ignore[arg-type]
    assert ti.xcom["return_value"]["success"] is True  # type: ignore[index]

    with pytest.raises(GXValidationFailed) as caught:
        operator(bad_file).execute(context={"ti": _TaskInstance()})  # type: ignore[arg-type]
    assert "expect_column_values_to_be_in_set" in str(caught.value)
