"""What can go wrong running an MPIJob on emulated hosts; each message names the job, pod or tool to act on."""

from __future__ import annotations

from nightshift.errors import NightshiftError, UsageError


class ManifestNotSupported(UsageError):
    """The manifest asks for something this machine cannot honour (a GPU, an unknown volume, a field)."""


class HostNotSuitable(NightshiftError):
    """This machine lacks what emulated hosts need: root, `ip`, `sshd`, `unshare`, `tc`."""


class PodStartFailed(NightshiftError):
    """A pod of the job did not start or did not become ready."""


class MPIJobFailed(NightshiftError):
    """The job ran and failed: its launcher exited non-zero, a worker was lost, or it ran out of time."""

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code if exit_code > 0 else 1
