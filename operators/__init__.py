"""Airflow glue for Nightshift: the HorovodKubernetesOperator and its launcher, trigger and spec builder.

`from operators import HorovodKubernetesOperator` works and stays light: the operator module is imported
on first use, so a DAG file importing this package pays only for what it uses.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from operators.horovod import HorovodKubernetesOperator
    from operators.triggers import MPIJobTrigger

__all__ = ["HorovodKubernetesOperator", "MPIJobTrigger"]


def __getattr__(name: str) -> Any:
    if name == "HorovodKubernetesOperator":
        from operators.horovod import HorovodKubernetesOperator

        return HorovodKubernetesOperator
    if name == "MPIJobTrigger":
        from operators.triggers import MPIJobTrigger

        return MPIJobTrigger
    raise AttributeError(f"module 'operators' has no attribute {name!r}")
