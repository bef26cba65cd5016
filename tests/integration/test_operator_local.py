"""The local backend for real: 2-process `horovodrun --gloo` runs, failures, timeouts and on_kill."""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

import pytest

from operators.errors import HorovodRunFailed, HorovodRunTimeout
from operators.local_launcher import LocalHorovodLauncher
from tests.unit.operators.conftest import horovod_operator, make_context

pytestmark = pytest.mark.integration

RANK_SCRIPT = (
    "import os; print('hello from rank', os.environ['HOROVOD_RANK'], 'of', os.environ['HOROVOD_SIZE'])"
)
# Each rank records its pid, then sleeps: a long-running job to time out or kill.
SLEEPER = (
    "import os, sys, time, pathlib; d = pathlib.Path(sys.argv[1]); "
    "(d / os.environ['HOROVOD_RANK']).write_text(str(os.getpid())); "
    "print('sleeping', flush=True); time.sleep(120)"
)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is dead for our purpose
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except FileNotFoundError:
        return False


def wait_for_pids(pid_dir: Path, n: int, timeout: float = 120) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        files = list(pid_dir.iterdir())
        if len(files) == n and all(f.read_text() for f in files):
            return [int(f.read_text()) for f in files]
        time.sleep(0.1)
    raise AssertionError(f"ranks did not start within {timeout}s")


def test_operator_runs_two_processes_and_streams_their_output(capsys: pytest.CaptureFixture[str]) -> None:
    op = horovod_operator(
        task_id="train", num_workers=2, command=["python", "-c", RANK_SCRIPT], backend="local"
    )
    result = op.execute(make_context(run_id="manual__local"))  # type: ignore[arg-type]
    out = capsys.readouterr().out
    assert "hello from rank 0 of 2" in out and "hello from rank 1 of 2" in out
    assert result["backend"] == "local"
    assert result["checkpoint_dir"].endswith("checkpoints/nightly_retrain/manual__local/train")
    assert Path(result["checkpoint_dir"]).is_dir()


# Each rank looks for the planted value in its own environment and in every process's command line (it
# gets the value in two halves, which appear on command lines only apart).
LEAK_PROBE = (
    "import os, pathlib; planted = os.environ['PROBE_HEAD'] + os.environ['PROBE_TAIL']\n"
    "hits = [p.parent.name for p in pathlib.Path('/proc').glob('[0-9]*/cmdline') "
    "if planted and planted.encode() in (p.read_bytes() if p.exists() else b'')]\n"
    "print('rank', os.environ['HOROVOD_RANK'], 'env', 'AWS_SECRET_ACCESS_KEY' in os.environ, "
    "'airflow', any(k.startswith('AIRFLOW__') for k in os.environ), 'cmdlines', len(hits))"
)


def test_no_secret_of_the_worker_reaches_a_rank_or_a_command_line(capsys: pytest.CaptureFixture[str],
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    planted = "planted-secret-7f3a9c"
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", planted)
    monkeypatch.setenv("AIRFLOW__DATABASE__SQL_ALCHEMY_CONN", f"postgresql://airflow:{planted}@db/airflow")
    op = horovod_operator(task_id="train", num_workers=2, backend="local",
                                   command=["python", "-c", LEAK_PROBE],
                                   env={"PROBE_HEAD": planted[:9], "PROBE_TAIL": planted[9:]})
    op.execute(make_context(run_id="manual__leak"))  # type: ignore[arg-type]
    out = capsys.readouterr().out
    for rank in (0, 1):
        assert f"rank {rank} env False airflow False cmdlines 0" in out, out[-3000:]
    assert planted not in out


def test_failure_reports_exit_code_and_last_lines() -> None:
    script = (
        "import os, sys; r = os.environ['HOROVOD_RANK']; "
        "print('rank', r, 'bad input'); sys.exit(3 if r == '1' else 0)"
    )
    run = LocalHorovodLauncher(2, [sys.executable, "-c", script])
    with pytest.raises(HorovodRunFailed, match=r"exited with code \d+") as exc:
        run.run()
    assert "rank 1 bad input" in str(exc.value)


def test_timeout_kills_every_rank(tmp_path: Path) -> None:
    run = LocalHorovodLauncher(2, [sys.executable, "-c", SLEEPER, str(tmp_path)], timeout=15)
    start = time.monotonic()
    with pytest.raises(HorovodRunTimeout, match="longer than 15s") as exc:
        run.run()
    assert time.monotonic() - start < 40
    assert "sleeping" in str(exc.value)
    pids = [int(f.read_text()) for f in tmp_path.iterdir()]
    assert len(pids) == 2 and not any(alive(p) for p in pids)


def test_on_kill_stops_the_process_tree(tmp_path: Path) -> None:
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    op = horovod_operator(
        task_id="train",
        num_workers=2,
        command=[sys.executable, "-c", SLEEPER, str(pid_dir)],
        backend="local",
        checkpoint_dir=str(tmp_path / "ck"),
    )
    errors: list[BaseException] = []

    def execute() -> None:
        try:
            op.execute(make_context())  # type: ignore[arg-type]
        except BaseException as err:
            errors.append(err)

    thread = threading.Thread(target=execute)
    thread.start()
    pids = wait_for_pids(pid_dir, 2)
    assert all(alive(p) for p in pids)
    launcher = getattr(op._backend, "launcher", None)  # the local backend's LocalHorovodLauncher
    horovodrun_pid = launcher.pid if launcher else None
    op.on_kill()
    thread.join(60)
    assert not thread.is_alive(), "execute did not return after on_kill"
    assert errors and isinstance(errors[0], HorovodRunFailed), errors
    assert horovodrun_pid is not None and not alive(horovodrun_pid)
    assert not any(alive(p) for p in pids)


def test_a_killed_job_reports_a_non_zero_exit_code(tmp_path: Path) -> None:
    # kill() must leave reaping horovodrun to Popen: a process reaped elsewhere reads as exit code 0.
    run = LocalHorovodLauncher(2, [sys.executable, "-c", SLEEPER, str(tmp_path)])
    process = run.start()
    try:
        pids = wait_for_pids(tmp_path, 2)
    finally:
        run.kill()
    assert process.returncode not in (None, 0)
    assert not any(alive(p) for p in pids)
