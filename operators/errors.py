"""Exceptions of the Horovod operator: one class per failure kind; messages name the job and the reason."""

from __future__ import annotations

from airflow.sdk.exceptions import AirflowException, AirflowFailException


class HorovodJobError(AirflowException):
    """Base class: a Horovod training job (MPIJob or local horovodrun) did not succeed."""


class InvalidJobConfig(HorovodJobError, ValueError):
    """An operator or spec-builder argument is invalid; the message names the field."""


class HostsBackendUnavailable(InvalidJobConfig):
    """This machine cannot run emulated hosts (backend=hosts): no root, `ip`, `unshare` or `sshd`."""


class MPIJobFailed(HorovodJobError):
    """The MPIJob reached the Failed condition (launcher exited non-zero, a worker died...)."""


class MPIJobWorkerOOMKilled(MPIJobFailed):
    """A pod of the MPIJob was killed for exceeding its memory limit."""


class MPIJobStartupFailure(MPIJobFailed):
    """The MPIJob never started running: nothing of it is worth keeping for inspection."""


class MPIJobImagePullFailed(MPIJobStartupFailure):
    """A pod of the MPIJob cannot pull its image (ErrImagePull, ImagePullBackOff, InvalidImageName)."""


class MPIJobUnschedulable(MPIJobStartupFailure):
    """Pods of the MPIJob stayed unschedulable past startup_timeout."""


class MPIJobStartupTimeout(MPIJobStartupFailure):
    """The MPIJob did not start running within startup_timeout."""


class MPIJobQueueTimeout(MPIJobStartupFailure):
    """Kueue did not admit (or readmit) the MPIJob within queue_timeout; the message says why it waited."""


class MPIJobDeleted(MPIJobFailed):
    """The MPIJob disappeared (404) while the task was waiting for it."""


class MPIJobDeactivated(MPIJobFailed):
    """Kueue deactivated the MPIJob's Workload (spec.active=false): it will not be admitted again by itself."""


class MPIJobCleanupFailed(HorovodJobError):
    """An earlier try's MPIJob (or its pods) was still there after cleanup_timeout: the new try did not submit."""


class KubernetesApiError(HorovodJobError):
    """The Kubernetes API refused a request for a reason retrying does not fix (403, 400, 422...)."""


class KubernetesApiUnavailable(KubernetesApiError):
    """The Kubernetes API kept failing (5xx, 429, connection lost) for longer than api_retry_seconds."""


class MPIJobConflict(HorovodJobError):
    """An MPIJob with the same name exists but belongs to another task try."""


class LocalHorovodUnusable(HorovodJobError, AirflowFailException):
    """This machine's Horovod cannot run the job (no torch or Gloo support, no join patch for an elastic job): the
    task fails at once, without a retry (another try would fail the same way), naming the fix."""


class HorovodRunFailed(HorovodJobError):
    """The local `horovodrun` exited non-zero."""


class HorovodRunTimeout(HorovodJobError):
    """The local `horovodrun` ran past its timeout and was killed."""


class TrainingResultMissing(HorovodJobError):
    """The job succeeded but its MLflow run is not on the tracking server (the pods could not log to it)."""


class TaskInterrupted(HorovodJobError):
    """The task was killed (its on_kill ran) while it prepared, submitted or followed its MPIJob."""
