"""`validate_data`'s operator (nightly_tasks.adapters.GXDataGateOperator): GX core with the pipeline's suite on a
data source known only at run time, a Data Docs page for each split that fails, and a failure that names each
failed expectation (the GX Airflow provider did this before; issue 37 item 1)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest

from tests.dags.conftest import REPO

DAGS = REPO / "dags"


class _TaskInstance:
    """The part of the task context the gate touches: it pushes the Data Docs page of a refused split."""

    def __init__(self) -> None:
        self.xcom: dict[str, object] = {}

    def xcom_push(self, key: str, value: object) -> None:
        self.xcom[key] = value


@pytest.fixture
def gate(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, digits_pipeline: Any) -> Any:
    monkeypatch.syspath_prepend(str(DAGS))  # as Airflow puts the DAG folder on sys.path
    monkeypatch.setenv("NIGHTSHIFT_DATA_ROOTS", str(tmp_path / "roots"))
    from nightly_tasks.adapters import GXDataGateOperator

    def make(data_source: str) -> Any:
        return GXDataGateOperator(task_id="validate_data", pipeline=digits_pipeline, data_source=data_source)

    return make


def _data(demo_data: Path, tmp_path: Path, **bad: tuple[int, object]) -> Path:
    """A copy of the demo splits under the data roots, with train.parquet's cells `column=(row, value)` set."""
    data = tmp_path / "roots" / "incoming"
    shutil.copytree(demo_data, data)
    if bad:
        frame = pd.read_parquet(data / "train.parquet")
        for column, (row, value) in bad.items():
            frame.loc[row, column] = value
        frame.to_parquet(data / "train.parquet", index=False)
    return data


@pytest.fixture
def own_suite(gate: Any, tmp_path: Path, digits_pipeline: Any) -> tuple[Any, Path]:
    """The digits pipeline with a suite file of its own (a copy of gx/'s, for a test to change), and that file."""
    import dataclasses

    own = tmp_path / "own.json"
    shutil.copy(digits_pipeline.suite_path, own)
    return dataclasses.replace(digits_pipeline, suite_path=own), own


def _refuse_nines(suite_file: Path) -> None:
    """Make the suite file stricter: the label 9 (which the demo data has) is refused, by the rule "no nines"."""
    suite = json.loads(suite_file.read_text())
    suite["expectations"].append({"type": "expect_column_values_to_be_in_set",
                                  "kwargs": {"column": "label", "value_set": list(range(9))},
                                  "meta": {"rule": "no nines"}})
    suite_file.write_text(json.dumps(suite))


def _docs_sites(home: Path) -> list[Path]:
    folder = home / "gx" / "data_docs" / "pipelines" / "nightly_retrain"
    return sorted(folder.iterdir()) if folder.is_dir() else []


def test_good_data_passes_every_split_with_the_fingerprint_of_what_was_read(
        gate: Any, demo_data: Path, tmp_path: Path, nightshift_home: Path) -> None:
    from nightshift.data.validate import fingerprint

    data = _data(demo_data, tmp_path)
    ti = _TaskInstance()
    result = gate(str(data)).execute({"ti": ti, "params": {}})
    assert result["path"] == str(data.resolve())
    assert set(result["files"]) == {"train", "validation", "test"} and sum(result["files"].values()) == 1797
    assert result["fingerprint"] == fingerprint(data)
    assert ti.xcom == {}
    assert _docs_sites(nightshift_home) == []  # no page (nor an empty site) for data that passed


def test_bad_data_fails_naming_each_expectation_with_a_data_docs_page_of_the_failed_split(
        gate: Any, demo_data: Path, tmp_path: Path, nightshift_home: Path) -> None:
    from airflow.sdk.exceptions import AirflowFailException

    data = _data(demo_data, tmp_path, pixel_5=(3, np.nan), label=(5, 12))
    ti = _TaskInstance()
    with pytest.raises(AirflowFailException) as caught:
        gate(str(data)).execute({"ti": ti, "params": {}})
    message = str(caught.value)
    assert message.startswith("validate_data: data failed the GX suite: ")
    assert "train.parquet: expect_columns_values_to_not_be_null(pixel_5) [no nulls or NaN] e.g. ['NaN']" in message
    assert "train.parquet: expect_column_values_to_be_in_set(label) [labels are in 0..9] e.g. [12]" in message
    assert "failed 2 expectation(s)" in message and "validation.parquet" not in message
    page = Path(str(ti.xcom["data_docs"]))
    assert page.is_file() and page.suffix == ".html"
    (site,) = _docs_sites(nightshift_home)  # filed under the DAG, one site for the run
    assert site in page.parents
    assert f"Data Docs: {page}" in message


def test_a_data_source_outside_the_data_roots_is_refused_before_reading(
        gate: Any, demo_data: Path, tmp_path: Path) -> None:
    from airflow.sdk.exceptions import AirflowFailException

    with pytest.raises(AirflowFailException, match=r"^validate_data: .*NIGHTSHIFT_DATA_ROOTS"):
        gate(str(demo_data)).execute({"ti": _TaskInstance(), "params": {}})


def test_an_unreadable_split_fails_the_gate_naming_the_file(gate: Any, demo_data: Path, tmp_path: Path) -> None:
    from airflow.sdk.exceptions import AirflowFailException

    data = _data(demo_data, tmp_path)
    (data / "validation.parquet").write_bytes(b"not parquet")
    with pytest.raises(AirflowFailException, match=r"validation\.parquet is not a readable Parquet file"):
        gate(str(data)).execute({"ti": _TaskInstance(), "params": {}})


def test_the_data_source_is_a_template_field_rendered_at_run_time(gate: Any) -> None:
    operator = gate("{{ params.data_source or '' }}")
    assert "data_source" in operator.template_fields
    assert operator.data_source == "{{ params.data_source or '' }}"  # stored unchanged; rendered in execute


def test_data_changed_after_the_gate_is_validated_again_with_the_pipelines_own_suite(
        gate: Any, demo_data: Path, tmp_path: Path, nightshift_home: Path, digits_pipeline: Any) -> None:
    """issue 37 review: when the bytes staging reads are not those the gate passed (another fingerprint), staging
    runs the suite again; it ran gx/'s digits suite whatever the pipeline declared, so data its own, stricter
    suite refuses was versioned and trained on (and a pipeline of other columns was refused for digits' columns)."""
    import dataclasses

    from nightly_tasks.steps import stage

    from nightshift.errors import DataValidationFailed

    strict = tmp_path / "strict.json"
    shutil.copy(digits_pipeline.suite_path, strict)
    _refuse_nines(strict)
    pipeline = dataclasses.replace(digits_pipeline, suite_path=strict)
    data = _data(demo_data, tmp_path)  # the demo data has nines: the pipeline's suite refuses it
    with pytest.raises(DataValidationFailed, match=r"no nines"):
        stage(pipeline, {"path": str(data), "fingerprint": "sha256:what-the-gate-passed"}, "nightly_retrain", "r1")


def test_a_suite_changed_after_the_gate_passed_is_run_again_at_staging(
        demo_data: Path, tmp_path: Path, nightshift_home: Path, own_suite: tuple[Any, Path]) -> None:
    """issue 37 review: the gate's fingerprint, which staging trusts instead of running the suite again, covered
    gx/'s digits suite whatever the pipeline's suite was: a pipeline's suite made stricter between the gate and
    staging (a retry of stage hours later) was never run on the data staged."""
    from nightly_tasks.adapters import GXDataGateOperator
    from nightly_tasks.steps import stage

    from nightshift.errors import DataValidationFailed

    pipeline, own = own_suite
    data = _data(demo_data, tmp_path)
    passed = GXDataGateOperator(task_id="validate_data", pipeline=pipeline, data_source=str(data)).execute(
        {"ti": _TaskInstance(), "params": {}})
    _refuse_nines(own)
    with pytest.raises(DataValidationFailed, match=r"no nines"):
        stage(pipeline, passed, "nightly_retrain", "r1")


def test_a_retry_of_staging_runs_a_suite_changed_since_the_first_try(
        demo_data: Path, tmp_path: Path, nightshift_home: Path, own_suite: tuple[Any, Path]) -> None:
    """issue 37 review: a stage retry into the run's workspace returns the recorded version unless the data or
    the suite changed; the record held gx/'s digits suite, so the pipeline's own suite made stricter in between
    was never run on the data the retry handed to training."""
    from nightly_tasks.steps import stage

    from nightshift.errors import DataValidationFailed

    pipeline, own = own_suite
    data = _data(demo_data, tmp_path)
    stage(pipeline, {"path": str(data)}, "nightly_retrain", "r1")  # the first try: staged, and recorded
    _refuse_nines(own)
    with pytest.raises(DataValidationFailed, match=r"no nines"):
        stage(pipeline, {"path": str(data)}, "nightly_retrain", "r1")


@pytest.mark.parametrize(("change", "named"), [
    ("drop train", r"lacks train\.parquet"),
    ("add a copy", r"holds files other than the splits \(extra\.parquet\)"),
])
def test_a_data_source_without_exactly_the_splits_fails_the_gate(gate: Any, demo_data: Path, tmp_path: Path,
                                                                  change: str, named: str) -> None:
    """issue 37 review: the gate validated whatever *.parquet the folder held and passed a folder without
    train.parquet (or with a file staging refuses), so validate_data went green and stage_dataset failed later,
    after its retries."""
    from airflow.sdk.exceptions import AirflowFailException

    data = _data(demo_data, tmp_path)
    if change == "drop train":
        (data / "train.parquet").unlink()
    else:
        shutil.copy(data / "test.parquet", data / "extra.parquet")
    with pytest.raises(AirflowFailException, match=named):
        gate(str(data)).execute({"ti": _TaskInstance(), "params": {}})
