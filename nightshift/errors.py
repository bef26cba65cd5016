"""Project exceptions. Each names one kind of failure; its message says what and what to do."""

from __future__ import annotations


class NightshiftError(Exception):
    """Base class: an error a person can act on. The CLI prints it on one line and exits 2."""

    exit_code = 2


class UsageError(NightshiftError):
    """A bad argument or configuration value."""


class DagIdInvalid(UsageError):
    """A DAG id that cannot name a folder of its own (empty, too long, a '/', '.' or '..', other characters)."""


class DataError(NightshiftError):
    """Input data is missing, empty or unreadable."""


class DataValidationFailed(NightshiftError):
    """The data did not pass its expectation suite."""

    exit_code = 1


class DatasetPushFailed(NightshiftError):
    """The DVC remote did not take every object of a dataset version (full, read-only, unreachable)."""

    exit_code = 1


class CheckpointCorrupt(NightshiftError):
    """A checkpoint file is truncated, unreadable or not a Nightshift checkpoint."""


class CheckpointMismatch(NightshiftError):
    """A checkpoint was written for a different model or configuration."""


class JoinFailed(NightshiftError):
    """An elastic rank could not join its job: Horovod's rendezvous failed every time it tried."""


class CodeVersionUnknown(NightshiftError):
    """Which code is running cannot be told (a git checkout whose git fails, and no commit given)."""


class DeviceUnavailable(NightshiftError):
    """A rank cannot train on the device it was asked for (no GPU, too few GPUs, a CPU-only Horovod)."""


class DeviceMismatch(NightshiftError):
    """The ranks of one job resolved to different kinds of device."""


class TrackingError(NightshiftError):
    """An MLflow run could not be logged or found."""


class EvaluationError(NightshiftError):
    """A model could not be scored on the held-out split."""


class RegistryError(NightshiftError):
    """A model version could not be registered, found or aliased."""


class ChallengerRejected(NightshiftError):
    """The gate decided the new model does not replace the champion."""

    exit_code = 1


class DeploymentFailed(NightshiftError):
    """A deployment did not become healthy or answer correctly; the previous version keeps serving."""


class EventsUnavailable(NightshiftError):
    """The Redis the "new data" events go through does not answer or refuses the command."""

    exit_code = 1


class EventNotHeard(NightshiftError):
    """A "new data" event was published while nobody subscribed to its channel, so it was dropped."""

    exit_code = 1


class BadEvent(NightshiftError):
    """A "new data" event is not one `nightshift publish-data` writes (not JSON, wrong kind, no source)."""


class HorovodUnusable(NightshiftError):
    """The Horovod of this environment cannot run the trainer (missing, no torch or no Gloo support, no join patch)."""

    exit_code = 1


class HorovodBuildFailed(NightshiftError):
    """Building or installing the patched Horovod wheel failed."""

    exit_code = 1


class StreamDemoFailed(NightshiftError):
    """The stream part of `make demo` could not score the test rows (Redis would not start, score-stream failed or
    did not finish)."""

    exit_code = 1
