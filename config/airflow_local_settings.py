"""Airflow cluster policy: a Horovod task takes `workers * gpus_per_worker` slots of its pool, per run.

`HorovodKubernetesOperator` takes its worker and GPU counts from the run's params (template fields such as
``"{{ params.workers }}"``), but a task's `pool_slots` is fixed when the DAG is parsed. Airflow calls
`task_instance_mutation_hook` where it creates or reconciles task instances (`DagRun.verify_integrity`, in
the API server for a triggered run and in the scheduler for a scheduled one; `clear_task_instances`;
mapped expansion), with the DagRun when it has one. Here the hook reads the run's effective params (the
DAG's and the task's Param defaults, overridden by the run's conf as Airflow does at execute), resolves
the count fields (for a mapped task, its `partial()` arguments) and sets `pool_slots` by the formula the
operator uses for plain ints (`operators.counts.pool_slots`: the total `gpus`, else `workers x
gpus_per_worker`, at least 1), parsing each count as the operator does (`operators.counts.parse_count`).
An elastic task (its `elastic` field's `max_workers` resolves to a number) takes `max_workers` in place of
`workers`: the job starts with that many.

A run asking for more slots than its pool has would never be scheduled: Airflow leaves the task instance
`scheduled` (the UI lists "Pool Slots Available" among the dependencies blocking it, the scheduler logs a
warning every loop) and the run holds the DAG's `max_active_runs` until `dagrun_timeout`. Such a task
instance is created failed instead, with the reason (slots asked, pool size, what to change) in the run's
note, which the UI shows on the run, and in the log of the component that created it.

Airflow imports this module in every component (it must be importable as `airflow_local_settings`:
`scripts/airflow.sh` puts this folder on PYTHONPATH; an image copies it to `$AIRFLOW_HOME/config/`).
It imports nothing at the top but the standard library (Airflow imports it while it initialises, and a
failed import stops every component), no DAG code, and never raises: a policy that raises breaks the
scheduler. `operators.counts` (standard library only) is imported inside the hook, whose failures are logged.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from airflow.models.dagrun import DagRun
    from airflow.models.taskinstance import TaskInstance
    from sqlalchemy.orm import Session

__all__ = ["task_instance_mutation_hook"]

log = logging.getLogger(__name__)

OPERATOR_NAME = "HorovodKubernetesOperator"
OPERATOR_PACKAGE = "operators"
NOTE_MAX_CHARS = 1000  # dag_run_note.content is a String(1000)


class Unresolved(Exception):
    """A count this policy cannot work out before the task runs (the task keeps its parse-time slots)."""


def task_instance_mutation_hook(task_instance: TaskInstance, dag_run: DagRun | None = None) -> None:
    """Size a Horovod task instance's pool slots from its run's params; never raises."""
    try:
        _size_pool_slots(task_instance, dag_run)
    except Exception:  # a policy that raises takes the scheduler (or the trigger request) down with it
        log.exception("gpu pool policy: could not size %s; its pool_slots stay %s",
                      _describe(task_instance), getattr(task_instance, "pool_slots", "?"))


def _size_pool_slots(ti: TaskInstance, dag_run: DagRun | None) -> None:
    task = getattr(ti, "task", None)
    run = dag_run if dag_run is not None else _loaded_dag_run(ti)
    if task is None and run is not None:  # an existing TI reconciled by verify_integrity has no task yet
        dag = getattr(run, "dag", None)
        task = dag.get_task(ti.task_id) if dag is not None and dag.has_task(ti.task_id) else None
    if task is None or not is_horovod_task(task):
        return
    if run is None:
        # TaskInstance.__init__ calls the hook before the instance belongs to a run; the caller calls it
        # again with the run (DagRun.verify_integrity), so this is not worth a warning.
        log.debug("gpu pool policy: %s has no DagRun yet", _describe(ti))
        return
    from operators.counts import COUNT_MINIMUMS, pool_slots

    try:
        params = effective_params(task, run)
        counts = {name: resolve_count(field_value(task, name, optional=name == "gpus"), params, name, minimum)
                  for name, minimum in COUNT_MINIMUMS.items()}
        most = elastic_max_workers(task, params)
        if most is not None:
            counts["num_workers"] = most
    except Unresolved as err:
        log.warning("gpu pool policy: %s keeps %s pool slot(s): %s", _describe(ti), ti.pool_slots, err)
        return
    # `gpus`, when set, is the job's total (the operator packs it into workers at execute).
    slots = pool_slots(**counts)
    ti.pool_slots = slots
    total = _pool_total(ti.pool, run)
    if total is not None and slots > total:
        _fail_oversized(ti, run, counts, slots, total)
    else:
        log.info("gpu pool policy: %s takes %d slot(s) of pool %r (%d workers x %d GPUs)", _describe(ti),
                 slots, ti.pool, counts["num_workers"], counts["gpus_per_worker"])


def is_horovod_task(task: Any) -> bool:
    """True for a `HorovodKubernetesOperator` (by class name) and its subclasses in the `operators` package.

    The scheduler holds a serialized operator: only its class name (`task_type`) and module
    (`_task_module`) are known. A subclass is recognised by importing its module, which is done only for
    this project's package (never a DAG file's module, whose import would run DAG code in the scheduler);
    a subclass defined elsewhere is not sized.
    """
    task_type = getattr(task, "task_type", None)
    if task_type == OPERATOR_NAME:
        return True
    module = getattr(task, "_task_module", None) or ""
    if not isinstance(task_type, str) or not (module == OPERATOR_PACKAGE or
                                               module.startswith(OPERATOR_PACKAGE + ".")):
        return False
    try:
        import importlib

        from operators.horovod import HorovodKubernetesOperator

        cls = getattr(importlib.import_module(module), task_type, None)
        return isinstance(cls, type) and issubclass(cls, HorovodKubernetesOperator)
    except Exception:
        log.warning("gpu pool policy: cannot import %s.%s to check it", module, task_type, exc_info=True)
        return False


def effective_params(task: Any, dag_run: Any) -> dict[str, Any]:
    """The params a task sees at execute: DAG Param defaults, then the task's, then the run's conf.

    The conf overrides them only when `[core] dag_run_conf_overrides_params` is on (Airflow's default),
    as `airflow.sdk.definitions.param.process_params` does on the worker.
    """
    params: dict[str, Any] = {}
    dag = getattr(task, "dag", None)
    for source in (getattr(dag, "params", None), getattr(task, "params", None)):
        if isinstance(source, Mapping):
            params.update({key: source[key] for key in source})
    conf = getattr(dag_run, "conf", None)
    if conf and isinstance(conf, Mapping) and _conf_overrides_params():
        params.update(conf)
    return params


def field_value(task: Any, name: str, *, optional: bool = False) -> Any:
    """The field as parsed: the task's attribute, or for a mapped task its `partial()` argument.

    An `optional` field that has none (the total `gpus` of a mapped task's partial() without it) is 0.
    """
    value = getattr(task, name, None)
    partial_kwargs = getattr(task, "partial_kwargs", None)
    if value is None and isinstance(partial_kwargs, Mapping):
        value = partial_kwargs.get(name)
    if value is None and optional:
        return 0
    if value is None:
        raise Unresolved(f"{name} has no value before the task runs (an expanded argument?)")
    return value


def resolve_count(value: Any, params: Mapping[str, Any], name: str, minimum: int) -> int:
    """A count field as the operator will see it: an int, a string of digits, or ``{{ params.NAME }}``, parsed
    as the operator parses it (`operators.counts`)."""
    from operators.counts import param_name, parse_count

    raw = value
    if (key := param_name(value)) is not None:
        if key not in params:
            raise Unresolved(f"{name}={value!r} names param {key!r}, which the run does not have")
        raw = params[key]
    elif isinstance(value, str) and ("{{" in value or "{%" in value):
        raise Unresolved(f"{name}={value!r} is a template other than '{{{{ params.NAME }}}}'")
    number = parse_count(raw, minimum)
    if number is None:
        raise Unresolved(f"{name} is {raw!r}, not an integer >= {minimum} (the task will fail at execute)")
    return number


def elastic_max_workers(task: Any, params: Mapping[str, Any]) -> int | None:
    """An elastic task's `max_workers` (JobConfig.elastic: an int or ``{{ params.NAME }}``); None when the task is
    not elastic (no `elastic`, or its max_workers is empty: a Param left null)."""
    elastic = getattr(task, "elastic", None)
    partial_kwargs = getattr(task, "partial_kwargs", None)
    if elastic is None and isinstance(partial_kwargs, Mapping):
        elastic = partial_kwargs.get("elastic")
    if not isinstance(elastic, Mapping) or elastic.get("max_workers") is None:
        return None
    from operators.counts import param_name

    value = elastic["max_workers"]
    if (key := param_name(value)) is not None:
        value = params.get(key)
    if value is None or (isinstance(value, str) and value.strip() in {"", "None"}):
        return None
    return resolve_count(value, params, "max_workers", 1)


def _fail_oversized(ti: TaskInstance, run: DagRun, counts: dict[str, int], slots: int, total: int) -> None:
    from airflow.utils.state import TaskInstanceState

    if ti.state not in (None, TaskInstanceState.SCHEDULED):
        return  # queued, running or finished (or being cleared): not for this policy to fail
    ti.state = TaskInstanceState.FAILED
    reason = (
        f"{ti.task_id} asks for {slots} slots of pool {ti.pool!r} ({counts['num_workers']} workers x "
        f"{counts['gpus_per_worker']} GPUs per worker) but the pool has {total}, so Airflow would never "
        f"schedule it: it was marked failed before it ran. Trigger again with fewer workers or GPUs per worker, "
        f"or enlarge the pool (airflow pools set {ti.pool} {slots} ...; NIGHTSHIFT_GPU_SLOTS for "
        f"scripts/airflow.sh)."
    )
    log.error("gpu pool policy: %s: %s", _describe(ti), reason)
    _add_run_note(run, reason)


def _add_run_note(run: DagRun, text: str) -> None:
    """Add `text` to the run's note, which the UI shows on the run (the one place a person looks)."""
    session = _session_of(run)
    if session is None:
        return
    with session.no_autoflush:
        note = run.note or ""
    if text not in note:
        run.note = f"{note}\n\n{text}".strip()[:NOTE_MAX_CHARS]


def _pool_total(pool: str, dag_run: Any) -> int | None:
    """The pool's size, read in the caller's session (the hook must not open or commit one); None if unknown.

    An unlimited pool (-1) or a missing one (the scheduler reports that itself) gives None.
    """
    from airflow.models.pool import Pool
    from sqlalchemy import select

    session = _session_of(dag_run)
    if session is None:
        return None
    with session.no_autoflush:
        slots = session.scalar(select(Pool.slots).where(Pool.pool == pool))
    return None if slots is None or slots < 0 else int(slots)


def _session_of(obj: Any) -> Session | None:
    from sqlalchemy.orm import object_session

    try:
        return object_session(obj)
    except Exception:  # not a mapped object
        return None


def _loaded_dag_run(ti: Any) -> Any:
    """The TI's DagRun if SQLAlchemy already loaded it; never triggers a lazy load (a query, or an error)."""
    try:
        from sqlalchemy import inspect
        from sqlalchemy.orm.base import NO_VALUE

        state = inspect(ti, raiseerr=False)
        if state is None:
            return None
        value = state.attrs.dag_run.loaded_value
        return None if value is NO_VALUE else value
    except Exception:
        return None


def _conf_overrides_params() -> bool:
    from airflow.configuration import conf

    return conf.getboolean("core", "dag_run_conf_overrides_params", fallback=True)


def _describe(ti: Any) -> str:
    return f"{getattr(ti, 'dag_id', '?')}.{getattr(ti, 'task_id', '?')} run {getattr(ti, 'run_id', '?')}"
