"""The `local` backend: horovodrun on the Airflow worker's machine (`operators.local_launcher`)."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from operators.backends.base import BackendRun, TrainingBackend
from operators.errors import TaskInterrupted
from operators.mpijob_spec import split_command, with_checkpoint_dir

if TYPE_CHECKING:
    from operators.local_launcher import LocalHorovodLauncher
    from operators.mpijob_spec import TaskIdentity


DISCOVERY_PREFIX = "nightshift-elastic-"


def remove_stale_discovery_folders() -> list[str]:
    """Discovery-script folders of elastic tries whose task process is gone (killed outright: no clean-up ran)."""
    removed = []
    for path in Path(tempfile.gettempdir()).glob(f"{DISCOVERY_PREFIX}*-*"):
        owner = path.name[len(DISCOVERY_PREFIX):].split("-", 1)[0]
        if not (owner.isascii() and owner.isdigit()) or not path.is_dir() or path.is_symlink():
            continue
        try:
            os.kill(int(owner), 0)
        except ProcessLookupError:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(str(path))
        except (PermissionError, OverflowError, ValueError):
            continue  # another user's live process, or a name that is no process of ours
    return removed


class LocalBackend(TrainingBackend):
    """`num_workers x gpus_per_worker` ranks of horovodrun here; `gpus` makes this machine the one node.

    Elastic jobs run on this one host: horovodrun's elastic driver with `min_workers` to `max_workers` (x
    `gpus_per_worker`) ranks, its host discovery script a temporary file printing `localhost:<ranks>` (removed
    when the try ends; one left by a task process that was killed outright is removed by the next elastic try
    here). No host comes or goes here: a rank that fails gets the only host blacklisted, which fails the job
    (horovodrun stops when every host is), and the task's next try resumes from the checkpoint on disk.
    """

    supports_elastic = True

    def __init__(self, run: BackendRun) -> None:
        super().__init__(run)
        self.launcher: LocalHorovodLauncher | None = None
        self._tmp: Path | None = None  # an elastic job's discovery script's folder

    def submit(self, identity: TaskIdentity, context: Mapping[str, Any]) -> dict[str, Any]:
        from operators.local_launcher import (
            LocalHorovodLauncher,
            check_local_capacity,
            check_local_horovod,
            write_discovery_script,
        )

        run = self.run
        if run.job.gpus:  # this machine is the one node: one worker with all the GPUs asked for
            run.use_job(replace(run.job, num_workers=1, gpus_per_worker=int(run.job.gpus), gpus=0))
        job = run.job
        ranks = check_local_capacity(int(job.num_workers), int(job.gpus_per_worker))
        elastic = job.elastic_range()
        check_local_horovod(elastic=elastic is not None)
        checkpoint_dir = run.checkpoint_dir(identity)
        Path(checkpoint_dir).mkdir(parents=True, exist_ok=True)
        command = with_checkpoint_dir(split_command(job.command), checkpoint_dir)
        self.log.info("Training with %d rank(s) here (%d worker(s) x %d GPU(s)); checkpoints of this task "
                      "(every try): %s", ranks, job.num_workers, job.gpus_per_worker, checkpoint_dir)
        try:
            discovery, fewest = None, None
            if elastic is not None:  # num_workers is max_workers (settled)
                fewest = elastic[0] * max(int(job.gpus_per_worker), 1)
                remove_stale_discovery_folders()
                self._tmp = Path(tempfile.mkdtemp(prefix=f"{DISCOVERY_PREFIX}{os.getpid()}-"))
                discovery = str(write_discovery_script(self._tmp, ranks))
                self.log.info("Elastic: %d to %d rank(s) on this host (host discovery: %s)", fewest, ranks,
                              discovery)
            self.launcher = LocalHorovodLauncher(
                ranks,
                command,
                env=dict(job.env or {}),
                timeout=run.execution.timeout,
                logger=self.log,
                min_processes=fewest,
                discovery_script=discovery,
            )
            if run.killed:  # on_kill ran before there was a process to kill
                raise TaskInterrupted("starting horovodrun: the task was killed (on_kill); nothing was started")
            self.launcher.start()
            if run.killed:  # on_kill ran while horovodrun started: its kill may have come before the process
                self.launcher.kill()
                raise TaskInterrupted("starting horovodrun: the task was killed (on_kill); its ranks were stopped")
        except BaseException:
            self._remove_tmp()  # execute() cleans up only after a submit that returned
            raise
        result: dict[str, Any] = {"backend": self.name, "checkpoint_dir": checkpoint_dir,
                                  "num_workers": job.num_workers, "gpus_per_worker": job.gpus_per_worker}
        if elastic is not None:
            result["min_workers"] = elastic[0]
        return result

    def _remove_tmp(self) -> None:
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None

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
        self._remove_tmp()
