"""Worker and GPU counts, and the `gpu` pool slots they take: one home for the operator and the cluster policy.

`HorovodKubernetesOperator` (its configs, `operators.horovod_config`) and the cluster policy
(`config/airflow_local_settings.py`, which Airflow imports in every component) read the same three fields
the same way: `num_workers`, `gpus_per_worker` and `gpus`, each an int or the string a rendered template
gives ("4"), or a whole-field ``{{ params.NAME }}`` template that the policy resolves from the run's params
before the task runs. The pool-slot formula is here too, so both size a task alike.

Standard library only and no import of this project's other modules (the policy imports it in the
scheduler and the API server); no exception of its own: each caller turns a None from `parse_count` into
its own (`InvalidJobConfig`, worded by `count_problem`, at execute; the policy keeps the task's parse-time
slots and logs why).
"""

from __future__ import annotations

import re

__all__ = ["COUNT_MINIMUMS", "count_problem", "param_name", "parse_count", "pool_slots"]

# The count fields of a Horovod task and the least value each takes.
COUNT_MINIMUMS: dict[str, int] = {"num_workers": 1, "gpus_per_worker": 0, "gpus": 0}
# The one template form known before the task runs: the whole field is one param, e.g. "{{ params.workers }}".
_PARAM_TEMPLATE = re.compile(r"""^\s*\{\{\s*params(?:\.(\w+)|\[\s*(['"])(\w+)\2\s*\])\s*\}\}\s*$""")


def parse_count(value: object, minimum: int) -> int | None:
    """`value` as an int >= `minimum`: an int (not a bool) or a string of digits; None for anything else."""
    number: int | None = None
    if isinstance(value, int) and not isinstance(value, bool):
        number = value
    elif isinstance(value, str) and re.fullmatch(r"-?[0-9]{1,18}", value.strip()):  # ASCII digits, one sign
        number = int(value.strip())
    return number if number is not None and number >= minimum else None


def count_problem(name: str, value: object, minimum: int) -> str:
    """What is wrong with `value` as the count `name` (e.g. "num_workers (Param 'workers')")."""
    return f"{name} must be an integer >= {minimum}, got {value!r}"


def param_name(template: object) -> str | None:
    """The param a whole-field ``{{ params.NAME }}`` (or ``{{ params['NAME'] }}``) template reads; else None."""
    if not isinstance(template, str):
        return None
    match = _PARAM_TEMPLATE.match(template)
    return (match.group(1) or match.group(3)) if match else None


def pool_slots(num_workers: int, gpus_per_worker: int, gpus: int = 0) -> int:
    """Slots a job takes in the `gpu` pool: the GPUs it asks for (`gpus`, the total, when set; else
    `num_workers` x `gpus_per_worker`), at least one."""
    return gpus if gpus > 0 else max(1, num_workers * gpus_per_worker)
