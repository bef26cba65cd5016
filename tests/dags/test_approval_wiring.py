"""Issue 34 item 4, the DAG side: when the evaluation says the champion cannot be scored on tonight's data
(`needs_approval`, nightshift.evaluate), the decision goes to a person whatever `require_approval` says.

The chain as the factory builds it for the demo declaration, each task's own code run with a fake context:
`evaluate` passes `needs_approval` on, `register` registers the challenger pending approval (not skipped, not
refused by the registry), the `approve` task (OptionalApprovalOperator) writes a Human-in-the-loop request and
waits although the run's `require_approval` is off, and `deploy` lies behind `approve` only. The same night
without `needs_approval` skips the approval step (so the test cannot pass by always waiting), and a rejection
without it registers nothing.
"""

from __future__ import annotations

import runpy
from types import SimpleNamespace
from typing import Any

import pytest

from tests.dags.conftest import REPO

DAGS = REPO / "dags"
RUN_ID = "0123456789abcdef"
# What nightshift.evaluate.evaluate returns when the champion cannot be scored on tonight's data (a class it
# never saw) and the challenger clears the floor: not passed on its own, a person decides.
UNSCORABLE = {
    "passed": False, "needs_approval": True, "run_id": RUN_ID, "split": "test",
    "reasons": ["champion v3 cannot be scored on tonight's data ('label' holds ['7'], classes it does not know)",
                "accuracy 0.9500 >= floor 0.8000",
                "the decision goes to a person: approve or reject the new model in the approval step"],
    "gate": {"primary": "accuracy"}, "challenger": {"accuracy": 0.95, "f1_macro": 0.94, "log_loss": 0.2},
    "champion": None,
}


@pytest.fixture
def dag(monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.delenv("NIGHTSHIFT_RETRAIN_CRON", raising=False)
    monkeypatch.syspath_prepend(str(DAGS))  # as Airflow puts the DAG folder on sys.path
    return runpy.run_path(str(DAGS / "nightly_retrain.py"), run_name="nightly_retrain_under_test")["dag"]


@pytest.fixture
def pipeline(dag: Any) -> Any:
    from nightly_tasks.factory import pipeline_for

    built = pipeline_for(dag.dag_id)
    assert built is not None
    return built


class FakeTI:
    """The task instance as the tasks use it: XComs of the upstream tasks by task id, pushes recorded."""

    def __init__(self, xcoms: dict[str, Any]) -> None:
        self.xcoms = xcoms
        self.pushed: dict[str, Any] = {}
        self.id = "0199aaaa-0000-7000-8000-000000000000"
        self.bundle_instance = SimpleNamespace(version="c0ffee")  # code_version without git

    def xcom_pull(self, task_ids: str, key: str = "return_value") -> Any:
        return self.xcoms.get(task_ids)

    def xcom_push(self, key: str, value: Any) -> None:
        self.pushed[key] = value


def _evaluate(monkeypatch: pytest.MonkeyPatch, pipeline: Any, result: dict[str, Any]) -> dict[str, Any]:
    """The `evaluate` task's decision (nightly_tasks.steps.evaluate) for an evaluation that returned `result`."""
    from nightly_tasks import steps

    import nightshift.evaluate
    import nightshift.tracking

    monkeypatch.setattr(nightshift.tracking, "configure", lambda *a, **k: None)
    monkeypatch.setattr(nightshift.evaluate, "evaluate", lambda run_id, **kwargs: dict(result))
    return steps.evaluate(pipeline, {"mlflow_run_id": RUN_ID}, {"path": "/data/staged"},
                          {"min_improvement": 0.001})


def _register(monkeypatch: pytest.MonkeyPatch, pipeline: Any, decision: dict[str, Any]) -> dict[str, Any]:
    """The `register` task (nightly_tasks.steps.register) with the registry's gate kept and MLflow faked: the
    registry's own `register` decides whether this evaluation may be registered, then the fake stands in."""
    from nightly_tasks import steps

    import nightshift.registry
    import nightshift.tracking

    real = nightshift.registry.register
    calls: list[dict[str, Any]] = []

    class Registered(Exception):
        pass

    def reached_mlflow(run_id: str) -> str:
        raise Registered(run_id)

    def register(run_id: str, **kwargs: Any) -> dict[str, Any]:
        calls.append(kwargs)
        try:  # the registry's refusal of an evaluation that did not pass comes before any MLflow call
            real(run_id, **kwargs)
        except Registered:
            pass
        return {"model_name": kwargs["model_name"], "version": "4", "alias": "challenger"}

    monkeypatch.setattr(nightshift.tracking, "configure", lambda *a, **k: None)
    monkeypatch.setattr(nightshift.tracking, "run_model_uri", reached_mlflow)
    monkeypatch.setattr(nightshift.registry, "register", register)
    result = steps.register(pipeline, decision, {"hash": "d1"}, "nightly_retrain", "manual__1", FakeTI({}))
    assert len(calls) == 1 and calls[0]["pending_approval"] is True, calls
    return result


def _approve(monkeypatch: pytest.MonkeyPatch, dag: Any, decision: dict[str, Any], require_approval: bool,
             requests: list[dict[str, Any]]) -> Any:
    """Run the DAG's `approve` task with the run's params and the `evaluate` task's XCom; the Human-in-the-loop
    requests it writes (the standard provider's upsert_hitl_detail, faked) go to `requests`. Raises what the
    task raises: TaskAwaitingInput (Airflow 3.3+) or TaskDeferred while it waits for a person."""
    from airflow.providers.standard.operators import hitl

    monkeypatch.setattr(hitl, "upsert_hitl_detail", lambda **kwargs: requests.append(kwargs))
    approve = dag.get_task("approve")
    assert "evaluate" in approve.get_flat_relative_ids(upstream=True)  # the task it reads the decision from
    ti = FakeTI({"evaluate": decision})
    params = {name: dag.params.get_param(name).value for name in dag.params} | {"require_approval": require_approval}
    return approve.execute({"ti": ti, "task_instance": ti, "params": params, "task": approve, "dag": dag})


def test_an_unscorable_champion_sends_the_decision_to_a_person_although_require_approval_is_off(
        monkeypatch: pytest.MonkeyPatch, dag: Any, pipeline: Any) -> None:
    from airflow.sdk.exceptions import TaskAwaitingInput, TaskDeferred

    assert dag.params.get_param("require_approval").value is False  # the demo's default: no person asked
    decision = _evaluate(monkeypatch, pipeline, UNSCORABLE)
    assert decision["needs_approval"] is True and decision["passed"] is False
    registered = _register(monkeypatch, pipeline, decision)  # not skipped: the person needs a version to approve
    assert registered["version"] == "4"
    requests: list[dict[str, Any]] = []
    with pytest.raises((TaskAwaitingInput, TaskDeferred)):  # waits for the person's answer
        _approve(monkeypatch, dag, decision, False, requests)
    assert len(requests) == 1 and requests[0]["subject"] == "Deploy the new nightshift-digits model?"
    approve = dag.get_task("approve")
    assert approve.options == ["Approve", "Reject"] and approve.defaults == ["Reject"]  # no answer: no deploy
    # `register` runs before the approval (it registers the version asked about as @challenger), `deploy` only
    # after it: a rejection skips deploy (the approval step's direct downstream), and nothing else leads to it
    # but the staged data.
    assert "register" in approve.upstream_task_ids and approve.downstream_task_ids == {"deploy"}
    assert dag.get_task("deploy").upstream_task_ids == {"approve", "stage_dataset"}


def test_a_comparable_night_skips_the_approval_step_unless_required(monkeypatch: pytest.MonkeyPatch, dag: Any,
                                                                   pipeline: Any) -> None:
    from airflow.sdk.exceptions import AirflowSkipException, TaskAwaitingInput, TaskDeferred

    passed = {**UNSCORABLE, "passed": True, "needs_approval": False, "reasons": ["accuracy 0.95 > 0.94"],
              "champion": {"version": 3, "accuracy": 0.94, "f1_macro": 0.93, "log_loss": 0.25}}
    decision = _evaluate(monkeypatch, pipeline, passed)
    assert decision["needs_approval"] is False
    requests: list[dict[str, Any]] = []
    with pytest.raises(AirflowSkipException):
        _approve(monkeypatch, dag, decision, False, requests)
    assert not requests
    with pytest.raises((TaskAwaitingInput, TaskDeferred)):
        _approve(monkeypatch, dag, decision, True, requests)
    assert len(requests) == 1


def test_a_rejection_without_needs_approval_registers_nothing(monkeypatch: pytest.MonkeyPatch,
                                                              pipeline: Any) -> None:
    from airflow.sdk.exceptions import AirflowSkipException
    from nightly_tasks import steps

    rejected = {**UNSCORABLE, "needs_approval": False, "reasons": ["accuracy 0.70 < floor 0.80"]}
    decision = _evaluate(monkeypatch, pipeline, rejected)
    with pytest.raises(AirflowSkipException, match="gate rejected"):
        steps.register(pipeline, decision, {"hash": "d1"}, "nightly_retrain", "manual__1", FakeTI({}))

