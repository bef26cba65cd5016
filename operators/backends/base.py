"""The training backend interface (issue 25).

H4 stub: a minimal copy of the interface H2 writes, so that `operators.backends.hosts` runs before H2's branch
lands; H2's base.py replaces this file when merged.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from operators.mpijob_spec import TaskIdentity


class TrainingBackend(ABC):
    """Where a Horovod training job runs: submit it, wait for it (streaming its logs), cancel it, clean up."""

    name: ClassVar[str]

    def __init__(self, operator: Any) -> None:
        self.operator = operator  # reads operator.job / cluster / execution / tracking

    @abstractmethod
    def submit(self, identity: TaskIdentity, context: Any) -> dict[str, Any]:
        """Start the job for this task try; the result dict the task returns (without the MLflow run)."""

    @abstractmethod
    def wait(self, result: dict[str, Any], context: Any) -> None:
        """Block until the job ends, streaming its logs; raise the operator's error when it failed."""

    @abstractmethod
    def cancel(self) -> None:
        """Stop the job (the task's on_kill)."""

    @abstractmethod
    def cleanup(self, result: dict[str, Any], *, succeeded: bool, error: BaseException | None) -> None:
        """Remove what the job left, after success or failure."""
