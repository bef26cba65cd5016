"""The interface every training backend implements; `HorovodKubernetesOperator` drives it and knows no backend.

    backend = backend_class(name)(operator)        # reads operator.job / .cluster / .execution (settled)
    result = backend.submit(identity, context)     # starts the job (may defer the task: kubernetes)
    try:
        backend.wait(result, context)              # blocks, streams logs, raises the operator's errors
    except BaseException as err:
        backend.cleanup(result, succeeded=False, error=err)
        raise
    backend.cleanup(result, succeeded=True, error=None)

`cancel()` is the operator's `on_kill` (it may run in a signal handler, while `wait` blocks in another frame).
A backend that defers (`operator.defer(..., method_name="execute_complete", kwargs={"result": result})`)
implements `complete`, which judges the trigger's event as `wait` judges the job; the operator then cleans
up as above. `deferral_failed` is told when the deferral itself ended badly (timed out, the trigger failed).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from operators.horovod import HorovodKubernetesOperator
    from operators.mpijob_spec import TaskIdentity


class TrainingBackend(ABC):
    """Runs one try of a `HorovodKubernetesOperator`'s job somewhere. One instance per try (per process).

    `submit` returns the result dict the task returns (before MLflow's run is added): it carries at least
    "backend" (this backend's name) and "checkpoint_dir", and whatever `wait`/`cleanup`/`complete` need, since
    after a deferral they run in another process on a fresh instance.
    """

    name: ClassVar[str]
    # Whether a run on this backend creates the MPIJob `operator.build_manifest` renders (what `nightshift plan`
    # prints and validates); False: it creates no Kubernetes object.
    renders_mpijob: ClassVar[bool] = False
    # Whether this backend runs elastic jobs (`JobConfig.elastic`: horovodrun's elastic driver, which goes on
    # when hosts are lost and takes them back). The operator refuses an elastic job, before submitting, on a
    # backend that does not say so: a plugin backend must declare it (True) and run the elastic launcher.
    supports_elastic: ClassVar[bool] = False

    def __init__(self, operator: HorovodKubernetesOperator) -> None:
        self.operator = operator
        self.log = operator.log

    def render(self, identity: TaskIdentity, namespace: str | None = None) -> dict[str, Any]:
        """The MPIJob this backend would run for `identity` (only where `renders_mpijob`): what `plan` prints."""
        return self.operator.build_manifest(identity, namespace)

    @abstractmethod
    def submit(self, identity: TaskIdentity, context: Mapping[str, Any]) -> dict[str, Any]:
        """Start the job for this try; return the result dict."""

    @abstractmethod
    def wait(self, result: dict[str, Any], context: Mapping[str, Any]) -> None:
        """Block until the job ends, streaming its logs; raise the operator's error (operators.errors) for a job
        that did not succeed."""

    @abstractmethod
    def cancel(self) -> None:
        """Stop the job (the task was killed); never raise."""

    @abstractmethod
    def cleanup(self, result: dict[str, Any], *, succeeded: bool, error: BaseException | None) -> None:
        """After `wait` (or `complete`) returned or raised `error`: remove what the job left, per the policy."""

    def complete(self, result: dict[str, Any], event: Mapping[str, Any], context: Mapping[str, Any]) -> None:
        """After a deferral: judge the trigger's `event` as `wait` judges the job (raise for a failure)."""
        raise NotImplementedError(f"the {self.name} backend never defers: it has no trigger event to complete")

    def deferral_failed(self, context: Mapping[str, Any], error: BaseException) -> None:
        """The deferral ended without an event (it timed out, or the trigger failed); `error` is re-raised
        after this returns. Default: nothing to do."""
        return None
