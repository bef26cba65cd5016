"""Small adapters around the operators the DAG uses, for what their constructors cannot take at parse time.

- `GXDataGateOperator`: the GX Airflow provider's `GXValidateBatchOperator`, run once per Parquet split of
  a data source known only at run time (a DAG param), with the pipeline's suite; a failure names every
  failed expectation with sample bad values and the Data Docs page (nightshift's report).
- `OptionalApprovalOperator`: the standard provider's HITL `ApprovalOperator`, skipped unless the run's
  `require_approval` param is on.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import TYPE_CHECKING, Any

from airflow.providers.standard.operators.hitl import ApprovalOperator
from airflow.sdk.exceptions import AirflowFailException, AirflowSkipException
from great_expectations_provider.operators.validate_batch import GXValidateBatchOperator

if TYPE_CHECKING:
    from airflow.sdk import Context

    from nightshift.pipelines import Pipeline

GX_SOURCE = "nightshift"


def failing_pages(report: Any) -> list[str]:
    """The Data Docs pages of the splits that failed (the link opens the first; a passing split's page
    would show a green report for data that was refused)."""
    return [f["data_docs"] for f in report["files"] if f.get("data_docs") and not f["success"]]


def _batch_definition(gx_context: Any) -> Any:
    # The provider builds the GX context itself and hands it here first: the only place to turn off its
    # progress bars (tqdm on stderr, which the task supervisor logs at ERROR, one line per split).
    from nightshift.data.validate import disable_progress_bars

    disable_progress_bars(gx_context)
    source = gx_context.data_sources.add_or_update_pandas(name=GX_SOURCE)
    return source.add_dataframe_asset(name="split").add_batch_definition_whole_dataframe("whole")


def _suite(suite_file: str, gx_context: Any) -> Any:
    from nightshift.data.validate import load_suite_file

    return load_suite_file(suite_file)


class GXDataGateOperator(GXValidateBatchOperator):
    """Validate every split of `data_source` (empty: the new-data event's source when one started the run, else
    the pipeline's declared data) with the GX provider and the pipeline's suite.

    Returns {"path", "files": {split: rows}}; raises AirflowFailException (no retry: bad data does not heal)
    naming each failed expectation, its rule and sample unexpected values, and the Data Docs page.
    """

    template_fields: Sequence[str] = (*GXValidateBatchOperator.template_fields, "data_source")

    def __init__(self, *, pipeline: Pipeline, data_source: str, **kwargs: Any) -> None:
        super().__init__(configure_batch_definition=_batch_definition,
                         configure_expectations=partial(_suite, str(pipeline.suite_path)),
                         result_format="BOOLEAN_ONLY", context_type="ephemeral", **kwargs)
        self.pipeline = pipeline
        self.data_source = data_source

    def execute(self, context: Context) -> dict[str, Any]:  # type: ignore[override]
        from great_expectations_provider.common.errors import GXValidationFailed

        from nightly_tasks.events import event_data_source
        from nightly_tasks.steps import resolve_data_source
        from nightshift.data.validate import check_data, describe_failures, quiet_gx_logging, read_tables
        from nightshift.errors import DataError, UsageError

        quiet_gx_logging()  # before the provider first imports GX, which logs ~200 INFO lines on import
        try:
            # The data_source Param, else (a run a new-data event started) the event's source; both confined.
            path = resolve_data_source(self.pipeline,
                                       str(self.data_source or "") or event_data_source(context) or "")
        except UsageError as err:
            raise AirflowFailException(f"validate_data: {err}") from err
        try:
            # Each split read once: the fingerprint is of the very bytes the suite runs on, so staging trusts
            # this gate only for those bytes.
            validated, frames = read_tables(path)
        except DataError as err:
            raise AirflowFailException(f"validate_data: {err}") from err
        failed: list[str] = []
        for file, frame in frames:
            self.batch_parameters = {"dataframe": frame}
            try:
                super().execute(context)
                self.log.info("GX suite passed on %s (%d rows)", file.name, len(frame))
            except GXValidationFailed as err:
                failed.append(f"{file.name}: {', '.join(err.failed_expectation_types)}")
        result = {"path": str(path), "files": {f.stem: len(frame) for f, frame in frames}}
        if not failed:
            result["fingerprint"] = validated
        if failed:
            # The provider says which expectation types failed; nightshift's report adds the columns,
            # sample bad values and a Data Docs page a person can open.
            # The pages hold sample values: filed under this DAG, the plugin shows them to its readers only.
            report = check_data(path, suite_file=self.pipeline.suite_path, pipeline=self.pipeline.dag_id)
            pages = failing_pages(report)
            if pages:
                context["ti"].xcom_push(key="data_docs", value=pages[0])
            detail = describe_failures(report) if not report["success"] else "; ".join(failed)
            raise AirflowFailException(f"validate_data: data failed the GX suite: {detail}")
        return result


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
