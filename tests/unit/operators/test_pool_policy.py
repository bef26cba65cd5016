"""The gpu pool cluster policy (config/airflow_local_settings.py) on the task instances the scheduler builds.

The tasks here go through Airflow's DAG serialization, as the scheduler and the API server hold them; the
run is a stand-in with a `conf` (no database: the pool's size is given where a test needs one).
"""

from __future__ import annotations

import importlib.util
import logging
import uuid
from contextlib import nullcontext
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest

from tests.conftest import REPO

POLICY_FILE = REPO / "config" / "airflow_local_settings.py"
RUN_ID = "manual__2026-01-01T00:00:00+00:00"


@pytest.fixture(scope="module")
def policy() -> ModuleType:
    # Loaded under another name: `airflow_local_settings` on sys.path would be picked up by Airflow itself.
    spec = importlib.util.spec_from_file_location("nightshift_gpu_pool_policy", POLICY_FILE)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def serialized_dag(build: Any) -> Any:
    """The DAG built by `build(dag)` as the scheduler sees it (serialized, then deserialized)."""
    from datetime import UTC, datetime

    from airflow.sdk import DAG, Param
    from airflow.serialization.serialized_objects import DagSerialization

    with DAG("pool_policy", schedule=None, start_date=datetime(2026, 1, 1, tzinfo=UTC),
             params={"workers": Param(2, type="integer"), "gpus_per_worker": Param(1, type="integer")}) as dag:
        build(dag)
    return DagSerialization.from_dict(DagSerialization.to_dict(dag))


def horovod(**kwargs: Any) -> Any:
    from tests.unit.operators.conftest import horovod_operator

    fields = {"task_id": "train", "num_workers": "{{ params.workers }}",
              "gpus_per_worker": "{{ params.gpus_per_worker }}", "command": "python -c pass", "backend": "local"}
    return horovod_operator(**{**fields, **kwargs})


def task_instance(dag: Any, task_id: str = "train") -> Any:
    from airflow.models.taskinstance import TaskInstance

    return TaskInstance(dag.get_task(task_id), run_id=RUN_ID, dag_version_id=uuid.uuid4())


def run(conf: dict[str, Any] | None = None) -> SimpleNamespace:
    return SimpleNamespace(conf=conf or {}, dag=None, note=None)


@pytest.fixture
def pool_of(policy: ModuleType, monkeypatch: pytest.MonkeyPatch) -> Any:
    def set_total(total: int | None) -> None:
        monkeypatch.setattr(policy, "_pool_total", lambda pool, dag_run: total)

    set_total(None)
    return set_total


@pytest.mark.parametrize(("conf", "slots"), [
    ({"workers": 2, "gpus_per_worker": 3}, 6),
    ({}, 2),  # the DAG's Param defaults: 2 x 1
    ({"workers": 5}, 5),  # conf over the defaults, key by key
    ({"gpus_per_worker": 0}, 1),  # a CPU job still takes one slot
    ({"workers": "4", "gpus_per_worker": "2"}, 8),  # strings of digits, as a trigger form may send
])
def test_slots_follow_the_run_conf_over_the_param_defaults(policy: ModuleType, pool_of: Any,
                                                           conf: dict[str, Any], slots: int) -> None:
    ti = task_instance(serialized_dag(lambda dag: horovod()))
    assert ti.pool == "gpu" and ti.pool_slots == 1  # what the operator can say at parse time
    policy.task_instance_mutation_hook(ti, run(conf))
    assert ti.pool_slots == slots


def test_a_gpu_total_takes_that_many_slots(policy: ModuleType, pool_of: Any) -> None:
    from airflow.sdk import Param

    def build(dag: Any) -> None:
        dag.params["gpus"] = Param(0, type="integer")
        horovod(gpus="{{ params.gpus }}")

    dag = serialized_dag(build)
    for conf, slots in (({"gpus": 12}, 12), ({}, 2)):  # 0: workers x gpus_per_worker
        ti = task_instance(dag)
        policy.task_instance_mutation_hook(ti, run(conf))
        assert ti.pool_slots == slots


@pytest.mark.parametrize(("workers", "gpus_per_worker", "gpus"), [(3, 2, 0), (2, 8, 12), ("5", "1", "0")])
def test_a_run_takes_the_slots_the_operator_takes_for_the_same_plain_counts(
        policy: ModuleType, pool_of: Any, workers: Any, gpus_per_worker: Any, gpus: Any) -> None:
    """One formula: the policy sizing a templated task from the run's params gives what the operator gives at
    parse time for the same counts written as plain values."""
    from airflow.sdk import Param

    def build(dag: Any) -> None:
        dag.params["gpus"] = Param(0, type="integer")
        horovod(task_id="templated", gpus="{{ params.gpus }}")
        horovod(task_id="plain", num_workers=workers, gpus_per_worker=gpus_per_worker, gpus=gpus)

    dag = serialized_dag(build)
    templated, plain = task_instance(dag, "templated"), task_instance(dag, "plain")
    assert templated.pool_slots == 1 < plain.pool_slots  # before the run: the operator cannot know
    policy.task_instance_mutation_hook(templated, run({"workers": workers, "gpus_per_worker": gpus_per_worker,
                                                       "gpus": gpus}))
    assert templated.pool_slots == plain.pool_slots


def test_plain_ints_and_the_subscript_form_are_resolved(policy: ModuleType, pool_of: Any) -> None:
    dag = serialized_dag(lambda dag: (horovod(task_id="ints", num_workers=3, gpus_per_worker=2),
                                      horovod(task_id="subscript", gpus_per_worker="{{ params['gpus_per_worker'] }}")))
    ints, subscript = task_instance(dag, "ints"), task_instance(dag, "subscript")
    policy.task_instance_mutation_hook(ints, run({"workers": 8}))
    policy.task_instance_mutation_hook(subscript, run({"workers": 3, "gpus_per_worker": 2}))
    assert (ints.pool_slots, subscript.pool_slots) == (6, 6)


def test_a_mapped_task_keeps_the_slots_it_was_given(policy: ModuleType, pool_of: Any,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    """partial()/expand() configs reach the scheduler only as text: a mapped Horovod task is not sized from
    the run (its `pool_slots` argument stands), and the policy says so instead of failing."""
    from operators.horovod import ClusterConfig, HorovodKubernetesOperator, JobConfig

    def build(dag: Any) -> None:
        HorovodKubernetesOperator.partial(task_id="train", cluster=ClusterConfig(backend="local"), pool_slots=4).expand(
            job=[JobConfig(command="python -c 1", num_workers="{{ params.workers }}", gpus_per_worker=2)])

    dag = serialized_dag(build)
    from airflow.models.taskinstance import TaskInstance

    mapped = TaskInstance(dag.get_task("train"), run_id=RUN_ID, map_index=0, dag_version_id=uuid.uuid4())
    with caplog.at_level(logging.WARNING):
        policy.task_instance_mutation_hook(mapped, run({"workers": 3}))
    assert mapped.pool_slots == 4
    assert "num_workers has no value before the task runs" in caplog.text


def test_the_conf_is_ignored_when_airflow_ignores_it(policy: ModuleType, pool_of: Any,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIRFLOW__CORE__DAG_RUN_CONF_OVERRIDES_PARAMS", "False")
    ti = task_instance(serialized_dag(lambda dag: horovod()))
    policy.task_instance_mutation_hook(ti, run({"workers": 4, "gpus_per_worker": 4}))
    assert ti.pool_slots == 2


def test_other_operators_are_left_alone(policy: ModuleType, pool_of: Any) -> None:
    from airflow.sdk import BaseOperator

    class Lookalike(BaseOperator):
        template_fields = ("num_workers", "gpus_per_worker")

        def __init__(self, **kwargs: Any) -> None:
            super().__init__(task_id="train", pool="gpu")
            self.num_workers, self.gpus_per_worker = "{{ params.workers }}", "{{ params.gpus_per_worker }}"

    ti = task_instance(serialized_dag(lambda dag: Lookalike()))
    policy.task_instance_mutation_hook(ti, run({"workers": 4, "gpus_per_worker": 4}))
    assert ti.pool_slots == 1


def test_the_class_name_identifies_the_operator_in_the_scheduler(policy: ModuleType) -> None:
    """A serialized task carries only `task_type` and `_task_module`; subclasses are checked in `operators`."""
    assert policy.is_horovod_task(SimpleNamespace(task_type="HorovodKubernetesOperator", _task_module="x.y"))
    assert not policy.is_horovod_task(SimpleNamespace(task_type="MPIJobTrigger", _task_module="operators.triggers"))
    assert not policy.is_horovod_task(SimpleNamespace(task_type="Sub", _task_module="dags.unusual_prefix_1"))


@pytest.mark.parametrize(("num_workers", "why"), [
    ("{{ params.nodes }}", "names param 'nodes'"),
    ("{{ params.workers * 2 }}", "a template other than"),
    ("{{ ti.xcom_pull('plan') }}", "a template other than"),
])
def test_what_it_cannot_resolve_keeps_its_slots_with_a_warning(policy: ModuleType, pool_of: Any,
                                                                caplog: pytest.LogCaptureFixture,
                                                                num_workers: str, why: str) -> None:
    ti = task_instance(serialized_dag(lambda dag: horovod(num_workers=num_workers)))
    with caplog.at_level(logging.WARNING):
        policy.task_instance_mutation_hook(ti, run({"workers": 4}))
    assert ti.pool_slots == 1
    assert why in caplog.text


@pytest.mark.parametrize("value", [0, -2, True, "two", None, 2.5])
def test_a_count_that_is_not_a_valid_integer_is_unresolved(policy: ModuleType, value: Any) -> None:
    with pytest.raises(policy.Unresolved, match="not an integer >= 1"):
        policy.resolve_count("{{ params.workers }}", {"workers": value}, "num_workers", 1)
    assert policy.resolve_count("{{params.gpus_per_worker}}", {"gpus_per_worker": 0}, "gpus_per_worker", 0) == 0


def test_without_a_run_it_does_nothing(policy: ModuleType, pool_of: Any) -> None:
    ti = task_instance(serialized_dag(lambda dag: horovod()))  # TaskInstance() calls the hook this way first
    policy.task_instance_mutation_hook(ti, None)
    assert ti.pool_slots == 1


def test_an_existing_task_instance_finds_its_task_through_the_run(policy: ModuleType, pool_of: Any) -> None:
    dag = serialized_dag(lambda dag: horovod())
    ti = task_instance(dag)
    del ti.task  # as loaded from the database by DagRun.verify_integrity
    policy.task_instance_mutation_hook(ti, SimpleNamespace(conf={"workers": 3, "gpus_per_worker": 3}, dag=dag))
    assert ti.pool_slots == 9


def test_it_never_raises(policy: ModuleType, caplog: pytest.LogCaptureFixture) -> None:
    class Broken:
        task_id, dag_id, run_id, pool_slots = "train", "d", RUN_ID, 1

        @property
        def task(self) -> Any:
            raise RuntimeError("boom")

    policy.task_instance_mutation_hook(Broken(), run())
    assert "could not size d.train" in caplog.text and "boom" in caplog.text


class FakeSession:
    no_autoflush = nullcontext()


def test_a_run_asking_for_more_than_the_pool_is_failed_with_a_note(policy: ModuleType, pool_of: Any,
                                                                   monkeypatch: pytest.MonkeyPatch,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    pool_of(8)
    monkeypatch.setattr(policy, "_session_of", lambda obj: FakeSession())
    ti = task_instance(serialized_dag(lambda dag: horovod()))
    dag_run = run({"workers": 4, "gpus_per_worker": 4})
    dag_run.note = "nightly, by hand"
    policy.task_instance_mutation_hook(ti, dag_run)
    assert ti.pool_slots == 16 and ti.state == "failed"
    assert dag_run.note.startswith("nightly, by hand\n\ntrain asks for 16 slots of pool 'gpu' (4 workers x 4 GPUs")
    assert "but the pool has 8" in dag_run.note and "airflow pools set gpu 16" in dag_run.note
    assert "asks for 16 slots" in caplog.text

    policy.task_instance_mutation_hook(ti, dag_run)  # again (a later verify_integrity): no second note
    assert dag_run.note.count("asks for 16") == 1


def test_a_run_that_fits_the_pool_is_not_failed(policy: ModuleType, pool_of: Any) -> None:
    pool_of(16)
    ti = task_instance(serialized_dag(lambda dag: horovod()))
    policy.task_instance_mutation_hook(ti, run({"workers": 4, "gpus_per_worker": 4}))
    assert ti.pool_slots == 16 and ti.state is None


def test_a_task_already_running_is_not_failed(policy: ModuleType, pool_of: Any) -> None:
    pool_of(8)
    ti = task_instance(serialized_dag(lambda dag: horovod()))
    ti.state = "running"
    policy.task_instance_mutation_hook(ti, run({"workers": 4, "gpus_per_worker": 4}))
    assert ti.state == "running"


@pytest.mark.parametrize(("conf", "slots"), [
    ({"min_workers": 1, "max_workers": 4, "gpus_per_worker": 2}, 8),  # max_workers x gpus_per_worker
    ({"gpus_per_worker": 2}, 4),  # both Params empty: not elastic, workers x gpus_per_worker
    ({"max_workers": 3, "workers": 1}, 3),  # elastic has max_workers workers, whatever `workers` says
])
def test_an_elastic_run_takes_max_workers_slots(policy: ModuleType, pool_of: Any, conf: dict[str, Any],
                                                 slots: int) -> None:
    from airflow.sdk import Param

    def build(dag: Any) -> None:
        dag.params["min_workers"] = Param(None, type=["null", "integer"])
        dag.params["max_workers"] = Param(None, type=["null", "integer"])
        horovod(elastic={"min_workers": "{{ params.min_workers }}", "max_workers": "{{ params.max_workers }}"})

    ti = task_instance(serialized_dag(build))
    policy.task_instance_mutation_hook(ti, run(conf))
    assert ti.pool_slots == slots
