"""Run a Horovod job on this machine: `horovodrun -np N -H localhost:N --gloo <command>` as a subprocess.

Only an allowlist of the Airflow worker's environment reaches the ranks (`child_environment`): horovodrun
copies every variable it is given onto each rank's shell command line, where `ps` shows it, so the
worker's database URL, secrets and cloud credentials must never be among them.

The subprocess gets its own session (process group); its output is copied line by line into the task
log; on timeout or `kill()` the whole process tree is terminated (horovodrun starts each rank through a
middleman in a session of its own, so the tree is walked, not just the group signalled).
"""

from __future__ import annotations

import logging
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from operators.errors import HorovodRunFailed, HorovodRunTimeout, InvalidJobConfig, LocalHorovodUnusable
from operators.mpijob_spec import ELASTIC_COOLDOWN_RANGE, check_no_credentials, with_elastic_flag

log = logging.getLogger(__name__)

TAIL_LINES = 30
KILL_GRACE_SECONDS = 5.0

# What a rank may inherit from the Airflow worker: how to find programs and libraries, locale, the
# Nightshift and MLflow locations, and the knobs of torch, Horovod, Gloo, NCCL and CUDA. Anything else
# (AIRFLOW__*, database URLs, cloud credentials, tokens) stays behind; pass what a job needs in `env`.
ENV_ALLOWLIST = frozenset({
    "PATH", "HOME", "USER", "LOGNAME", "SHELL", "LANG", "LANGUAGE", "TZ", "TMPDIR",
    "PYTHONPATH", "PYTHONHASHSEED", "VIRTUAL_ENV", "LD_LIBRARY_PATH",
    "MLFLOW_TRACKING_URI", "MLFLOW_DISABLE_TELEMETRY", "DO_NOT_TRACK",
    "CUDA_VISIBLE_DEVICES", "CUBLAS_WORKSPACE_CONFIG", "OMP_NUM_THREADS", "MKL_NUM_THREADS",
    "OMP_WAIT_POLICY",
})
ENV_ALLOWED_PREFIXES = ("LC_", "NIGHTSHIFT_", "HOROVOD_", "GLOO_", "NCCL_")


def looks_secret(name: str) -> bool:
    """Never passed on, whatever the prefix: a name that says it holds a secret (*SECRET*, *PASSWORD*, a word
    TOKEN/PAT/JWT/CREDS/HMAC/BEARER/PW, *_KEY, ...; whole words, so MAX_TOKENS and NCCL_IB_PKEY pass)."""
    from nightshift.redaction import secret_name

    return secret_name(name)


def carries_credentials(value: str) -> bool:
    """A value holding a password, whatever the variable's name: a URL's userinfo, a query parameter
    (?password=, ?X-Amz-Signature=) or a key=value DSN (password=, Pwd=)."""
    from nightshift.redaction import carries_secret

    return carries_secret(value)


def child_environment(source: Mapping[str, str], extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of the ranks: the allowlisted part of `source`, then `extra` (the job's own env)."""
    env = {
        name: value
        for name, value in source.items()
        if (name in ENV_ALLOWLIST or name.startswith(ENV_ALLOWED_PREFIXES)) and not looks_secret(name)
    }
    if "MLFLOW_TRACKING_URI" in env:
        check_no_credentials("MLFLOW_TRACKING_URI", env["MLFLOW_TRACKING_URI"])
    # e.g. NIGHTSHIFT_EVENTS_REDIS_URL=redis://:password@host: the ranks need no such URL; say which, not what.
    for name in sorted(name for name, value in env.items() if carries_credentials(value)):
        log.warning("not passing %s to the ranks: its value holds a password (in a URL or a DSN)", name)
        del env[name]
    return {**env, "PYTHONUNBUFFERED": "1", **(extra or {})}


def find_horovodrun() -> str:
    """`horovodrun` beside this interpreter (a virtualenv), else on PATH."""
    beside = Path(sys.executable).with_name("horovodrun")
    if beside.exists():
        return str(beside)
    found = shutil.which("horovodrun")
    if found is None:
        raise InvalidJobConfig("horovodrun not found beside the Python interpreter or on PATH")
    return found


def check_local_horovod(*, elastic: bool = False) -> None:
    """LocalHorovodUnusable, naming the fix, when the Horovod the ranks would import cannot train: checked in a child
    interpreter with the ranks' environment (`nightshift doctor`'s full form), before horovodrun starts anything."""
    from nightshift.doctor import REQUIRED, REQUIRED_ELASTIC, check_in_child, unusable
    from nightshift.errors import HorovodUnusable

    try:
        problem = unusable(check_in_child(sys.executable, child_environment(os.environ)),
                           REQUIRED_ELASTIC if elastic else REQUIRED)
    except HorovodUnusable as err:
        problem = str(err)
    if problem is not None:
        raise LocalHorovodUnusable(f"backend=local cannot train with this machine's Horovod: {problem}")


def horovodrun_argv(num_processes: int, command: Sequence[str], *, horovodrun: str | None = None,
                    min_processes: int | None = None, discovery_script: str | None = None) -> list[str]:
    """The local launch command; a bare `python` in `command` becomes this interpreter.

    Elastic (`min_processes` and `discovery_script`, a script printing `localhost:<num_processes>`): horovodrun's
    elastic driver on this one host, `min_processes` to `num_processes` ranks, the host re-admitted after a
    cooldown when a rank failed (`mpijob_spec.ELASTIC_COOLDOWN_RANGE`), and the command gets `--elastic`. The
    loopback is named as the ranks' interface: without one, the elastic driver waits for a second host to find
    the hosts' common interfaces, and here there is none.
    """
    if num_processes < 1:
        raise InvalidJobConfig(f"num_workers must be >= 1, got {num_processes}")
    args = list(command)
    if args and args[0] in {"python", "python3"}:
        args[0] = sys.executable
    if min_processes is None or discovery_script is None:
        return [horovodrun or find_horovodrun(), "-np", str(num_processes), "-H", f"localhost:{num_processes}",
                "--gloo", *args]
    low, high = ELASTIC_COOLDOWN_RANGE
    return [horovodrun or find_horovodrun(), "-np", str(num_processes), "--min-np", str(min_processes),
            "--max-np", str(num_processes), "--host-discovery-script", discovery_script,
            "--blacklist-cooldown-range", str(low), str(high), "--network-interfaces", "lo", "--gloo",
            *with_elastic_flag(args)]


def write_discovery_script(directory: str | Path, num_processes: int) -> Path:
    """An elastic job's host discovery script for this machine alone: it prints `localhost:<num_processes>`."""
    script = Path(directory) / "discover_hosts.sh"
    script.write_text(f"#!/bin/sh\necho localhost:{int(num_processes)}\n")
    script.chmod(0o700)
    return script


def local_gpu_count() -> int:
    """GPUs this machine's processes can use (torch's view, which honours CUDA_VISIBLE_DEVICES)."""
    import torch

    return int(torch.cuda.device_count()) if torch.cuda.is_available() else 0


def check_local_capacity(num_workers: int, gpus_per_worker: int, *, cores: int | None = None,
                         gpus: int | None = None) -> int:
    """The number of local ranks for the job, or InvalidJobConfig when this machine cannot run them.

    A CPU job runs one rank per worker and needs a core for each; a GPU job runs one rank per GPU.
    """
    if gpus_per_worker > 0:
        ranks = num_workers * gpus_per_worker
        available = local_gpu_count() if gpus is None else gpus
        if ranks > available:
            raise InvalidJobConfig(
                f"the local backend needs {ranks} GPUs ({num_workers} workers x {gpus_per_worker} GPUs) but this "
                f"machine has {available}; ask for at most {available} GPUs in total, or use backend=kubernetes"
            )
        return ranks
    available = len(os.sched_getaffinity(0)) if cores is None else cores
    if num_workers > available:
        raise InvalidJobConfig(
            f"the local backend runs one process per worker and this machine has {available} cores for "
            f"{num_workers} workers; ask for at most {available} workers, or use backend=kubernetes"
        )
    return num_workers


def _descendants(pid: int) -> list[Any]:
    import psutil

    try:
        return list(psutil.Process(pid).children(recursive=True))
    except psutil.NoSuchProcess:
        return []


class LocalHorovodLauncher:
    """One local horovodrun: start, stream, wait (with timeout), kill."""

    def __init__(
        self,
        num_processes: int,
        command: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        timeout: float | None = None,
        horovodrun: str | None = None,
        logger: logging.Logger | Any = None,
        tail_lines: int = TAIL_LINES,
        min_processes: int | None = None,
        discovery_script: str | None = None,
    ) -> None:
        self.argv = horovodrun_argv(num_processes, command, horovodrun=horovodrun, min_processes=min_processes,
                                    discovery_script=discovery_script)
        self.env = child_environment(os.environ, env)
        self.cwd = cwd
        self.timeout = timeout
        self.log = logger or log
        self.tail: deque[str] = deque(maxlen=tail_lines)
        self.process: subprocess.Popen[bytes] | None = None
        self._lock = threading.Lock()

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process else None

    def start(self) -> subprocess.Popen[bytes]:
        self.log.info("Running: %s", " ".join(self.argv))
        self.process = subprocess.Popen(
            self.argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=self.env,
            cwd=self.cwd,
            start_new_session=True,
        )
        return self.process

    def run(self) -> int:
        """Start and wait; return 0, or raise HorovodRunFailed / HorovodRunTimeout with the last log lines."""
        self.start()
        return self.wait()

    def wait(self) -> int:
        """Follow the started horovodrun to its end, logging its output; return 0, or raise HorovodRunFailed /
        HorovodRunTimeout (counted from now) with the last log lines."""
        process = self.process
        if process is None:
            raise RuntimeError("LocalHorovodLauncher.wait: start() was not called")
        lines: queue.Queue[str | None] = queue.Queue()
        reader = threading.Thread(target=self._read, args=(process, lines), daemon=True)
        reader.start()
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        try:
            while True:
                wait = 0.5 if deadline is None else max(0.0, min(0.5, deadline - time.monotonic()))
                try:
                    line = lines.get(timeout=wait)
                except queue.Empty:
                    line = ""
                if line is None:
                    break
                if line:
                    self.tail.append(line)
                    self.log.info("%s", line)
                if deadline is not None and time.monotonic() >= deadline:
                    self.kill()
                    raise HorovodRunTimeout(
                        f"horovodrun (pid {process.pid}) ran longer than {self.timeout:.0f}s and was killed; "
                        f"last log lines:\n{self._tail_text()}"
                    )
            code = process.wait()
        finally:
            if process.poll() is None:
                self.kill()
        if code != 0:
            raise HorovodRunFailed(
                f"horovodrun (pid {process.pid}) exited with code {code}; last log lines:\n{self._tail_text()}"
            )
        return code

    def _tail_text(self) -> str:
        return "\n".join(self.tail) or "(no output)"

    @staticmethod
    def _read(process: subprocess.Popen[bytes], lines: queue.Queue[str | None]) -> None:
        assert process.stdout is not None
        for raw in iter(process.stdout.readline, b""):
            lines.put(raw.decode("utf-8", errors="replace").rstrip("\n"))
        lines.put(None)

    def kill(self) -> None:
        """Terminate horovodrun and every process under it: SIGTERM, then SIGKILL after a grace period."""
        import psutil

        with self._lock:
            process = self.process
            if process is None or process.poll() is not None:
                # horovodrun is gone; its ranks may not be (they live in sessions of their own).
                tree = _descendants(process.pid) if process else []
                for child in tree:
                    with _suppress_gone():
                        child.kill()
                return
            # horovodrun itself is reaped only through `process` (Popen): were psutil to reap it, Popen's
            # wait would meet ECHILD and report exit code 0, and a killed job would pass for a success.
            tree = _descendants(process.pid)
            self.log.warning("Stopping horovodrun (pid %s) and %d processes under it", process.pid, len(tree))
            with _suppress_gone():
                os.killpg(process.pid, signal.SIGTERM)
            for proc in tree:
                with _suppress_gone():
                    proc.terminate()
            _gone, alive = psutil.wait_procs(tree, timeout=KILL_GRACE_SECONDS)
            for proc in alive:
                with _suppress_gone():
                    proc.kill()
            try:
                process.wait(timeout=KILL_GRACE_SECONDS)
            except subprocess.TimeoutExpired:
                pass
            with _suppress_gone():
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()


class _suppress_gone:
    """Ignore errors from signalling a process that has already exited."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: Any) -> bool:
        if exc_type is None:
            return False
        import psutil

        return issubclass(exc_type, ProcessLookupError | PermissionError | psutil.NoSuchProcess)
