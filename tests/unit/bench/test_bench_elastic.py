"""bench_elastic.run_job reads the whole of both pipes of `nightshift run-mpijob`: the launcher's start time comes from
a stderr line, the job's summary from stdout."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import bench_elastic


def test_run_job_keeps_every_line_of_both_pipes_and_the_launch_time(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    fake = tmp_path / "nightshift"
    fake.write_text("#!/bin/sh\n"
                    "i=0; while [ $i -lt 2000 ]; do echo \"err $i\" >&2; echo \"out $i\"; i=$((i+1)); done\n"
                    "echo '2 worker(s) ready in 1.5s; starting the launcher' >&2\n"
                    "echo 'err last' >&2; echo 'out last'; exit 3\n")
    fake.chmod(0o755)
    monkeypatch.setattr(bench_elastic, "NIGHTSHIFT", str(fake))
    run = bench_elastic.run_job({"metadata": {"name": "job"}}, tmp_path)
    assert run.code == 3
    assert run.stderr.splitlines()[0] == "err 0" and run.stderr.splitlines()[-1] == "err last"
    assert len(run.stderr.splitlines()) == 2002 and len(run.stdout.splitlines()) == 2001
    assert run.launched_s is not None
