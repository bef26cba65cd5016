"""Small operators of the DAG's own, and adapters around those it uses, for what their constructors cannot take at
parse time.

- `GXDataGateOperator`: validates every Parquet split of a data source known only at run time (a DAG param, or
  the new-data event's) with the pipeline's GX suite, through GX core (nightshift.data.validate); a failure
  names every failed expectation with sample bad values and the Data Docs page.
- `OptionalApprovalOperator`: the standard provider's HITL `ApprovalOperator`, skipped unless the run's
  `require_approval` param is on.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from airflow.providers.standard.operators.hitl import ApprovalOperator
from airflow.sdk import BaseOperator
from airflow.sdk.exceptions import AirflowFailException, AirflowSkipException

if TYPE_CHECKING:
    from airflow.sdk import Context

    from nightshift.pipelines import Pipeline


def failing_pages(report: Any) -> list[str]:
    """The Data Docs pages of the splits that failed (the link opens the first; a passing split's page
    would show a green report for data that was refused)."""
    return [f["data_docs"] for f in report["files"] if f.get("data_docs") and not f["success"]]


class GXDataGateOperator(BaseOperator):
    """Validate every split of `data_source` (empty: the new-data event's source when one started the run, else
    the pipeline's declared data) with the pipeline's GX suite: one ephemeral GX context per try, a pandas data
    source whose batches are the splits as read, and a Data Docs page for each split that fails (filed under the
    DAG: the plugin shows it to the DAG's readers only, as the "GX Data Docs" link).

    Returns {"path", "files": {split: rows}, "fingerprint"} (the fingerprint of the very bytes validated, which
    staging trusts); raises AirflowFailException (no retry: bad data does not heal) naming each failed
    expectation, its rule and sample unexpected values, and the Data Docs page.
    """

    template_fields: Sequence[str] = ("data_source",)

    def __init__(self, *, pipeline: Pipeline, data_source: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.pipeline = pipeline
        self.data_source = data_source

    def execute(self, context: Context) -> dict[str, Any]:
        from nightly_tasks.events import event_data_source
        from nightly_tasks.steps import resolve_data_source
        from nightshift.data.stage import check_layout
        from nightshift.data.validate import check_frames, describe_failures, read_tables
        from nightshift.errors import DataError, UsageError

        try:
            # The data_source Param, else (a run a new-data event started) the event's source; both confined.
            path = resolve_data_source(self.pipeline,
                                       str(self.data_source or "") or event_data_source(context) or "")
        except UsageError as err:
            raise AirflowFailException(f"validate_data: {err}") from err
        try:
            # Each split read once: the fingerprint is of the very bytes the suite runs on, so staging trusts
            # this gate only for those bytes.
            check_layout(path)  # exactly the splits: what staging versions, all of it validated here
            validated, frames = read_tables(path, suite=self.pipeline.suite_path)
            report = check_frames(path, frames, data_docs="failed", suite_file=self.pipeline.suite_path,
                                  pipeline=self.pipeline.dag_id)
        except (DataError, UsageError) as err:
            raise AirflowFailException(f"validate_data: {err}") from err
        for file in report["files"]:
            if file["success"]:
                self.log.info("GX suite passed on %s (%d rows)", Path(file["path"]).name, file["rows"])
        if not report["success"]:
            pages = failing_pages(report)
            if pages:
                context["ti"].xcom_push(key="data_docs", value=pages[0])
            raise AirflowFailException(f"validate_data: data failed the GX suite: {describe_failures(report)}")
        return {"path": str(path), "files": {f.stem: len(frame) for f, frame in frames}, "fingerprint": validated}


class OptionalApprovalOperator(ApprovalOperator):
    """A human approves the deployment in the UI when the run's `require_approval` param is on, and whatever it
    says when the evaluation could not compare the new model with the champion (`needs_approval`: the champion
    cannot be scored on tonight's data, or no longer fits it): then a person decides, not the floor alone."""

    def execute(self, context: Context) -> Any:
        decision = context["ti"].xcom_pull(task_ids="evaluate") or {}
        if decision.get("needs_approval"):
            self.log.info("The evaluation could not compare the new model with the champion: a person decides")
        elif not context["params"].get("require_approval"):
            raise AirflowSkipException("require_approval is off: deploying without a human approval")
        return super().execute(context)
