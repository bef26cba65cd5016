"""The `local` backend: horovodrun on the Airflow worker's machine (`operators.local_launcher`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from operators.backends.base import TrainingBackend
from operators.errors import TaskInterrupted
from operators.mpijob_spec import split_command, with_checkpoint_dir

if TYPE_CHECKING:
    from operators.horovod import HorovodKubernetesOperator
    from operators.local_launcher import LocalHorovodLauncher
    from operators.mpijob_spec import TaskIdentity


class LocalBackend(TrainingBackend):
    """`num_workers x gpus_per_worker` ranks of horovodrun here; `gpus` makes this machine the one node."""

    name = "local"

    def __init__(self, operator: HorovodKubernetesOperator) -> None:
        super().__init__(operator)
        self.launcher: LocalHorovodLauncher | None = None

    def submit(self, identity: TaskIdentity, context: Mapping[str, Any]) -> dict[str, Any]:
        from operators.local_launcher import LocalHorovodLauncher, check_local_capacity

        op = self.operator
        if op.job.gpus:  # this machine is the one node: one worker with all the GPUs asked for
            op._use(job=replace(op.job, num_workers=1, gpus_per_worker=int(op.job.gpus), gpus=0))
        job = op.job
        ranks = check_local_capacity(int(job.num_workers), int(job.gpus_per_worker))
        checkpoint_dir = op.resolve_checkpoint_dir(identity, self.name)
        Path(checkpoint_dir).mkdir(parents=True, exist_ok=True)
        command = with_checkpoint_dir(split_command(job.command), checkpoint_dir)
        self.log.info("Training with %d rank(s) here (%d worker(s) x %d GPU(s)); checkpoints of this task "
                      "(every try): %s", ranks, job.num_workers, job.gpus_per_worker, checkpoint_dir)
        self.launcher = LocalHorovodLauncher(
            ranks,
            command,
            env=dict(job.env or {}),
            timeout=op.execution.timeout,
            logger=self.log,
        )
        if op._killed:  # on_kill ran before there was a process to kill
            raise TaskInterrupted("starting horovodrun: the task was killed (on_kill); nothing was started")
        self.launcher.start()
        if op._killed:  # on_kill ran while horovodrun started: its kill may have come before the process
            self.launcher.kill()
            raise TaskInterrupted("starting horovodrun: the task was killed (on_kill); its ranks were stopped")
        return {"backend": self.name, "checkpoint_dir": checkpoint_dir, "num_workers": job.num_workers,
                "gpus_per_worker": job.gpus_per_worker}

    def wait(self, result: dict[str, Any], context: Mapping[str, Any]) -> None:
        assert self.launcher is not None, "submit starts the launcher"
        self.launcher.wait()

    def cancel(self) -> None:
        if self.launcher is not None:
            self.launcher.kill()

    def cleanup(self, result: dict[str, Any], *, succeeded: bool, error: BaseException | None) -> None:
        """Whatever ended the wait (a timeout, a kill, an error of ours), no rank outlives the try."""
        process = self.launcher.process if self.launcher is not None else None
        if process is not None and process.poll() is None:
            assert self.launcher is not None
            self.launcher.kill()
