"""The stream part of `make demo` fails loudly: a score-stream that fails or never finishes is an error that stops the
demo (exit 1), not a line printed before the demo says it is done. A private redis-server (the machine's binary)
and a stand-in for the `nightshift` command the demo runs."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from nightshift.errors import StreamDemoFailed
from nightshift.stream import demo

pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server is not installed")


def _setup(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, script: str) -> tuple[Path, Path]:
    data = tmp_path / "data"
    data.mkdir()
    frame = pd.DataFrame({f"pixel_{i}": np.arange(5, dtype="float32") for i in range(4)})
    frame["label"] = np.arange(5) % 2
    frame.to_parquet(data / "test.parquet")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nightshift").write_text(f"#!/bin/sh\n{script}\n")
    (bin_dir / "nightshift").chmod(0o755)
    monkeypatch.setattr(demo, "BIN", bin_dir)
    home = tmp_path / "home"
    home.mkdir()
    return home, data


def test_a_score_stream_that_fails_fails_the_demo_with_its_message(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    home, data = _setup(tmp_path, monkeypatch, "echo 'no model nightshift-digits@champion' >&2; exit 3")
    with pytest.raises(StreamDemoFailed, match=r"score-stream exited 3: no model nightshift-digits@champion"):
        demo.stream_demo(home, data)
    assert not (home / "redis-demo").exists()  # the private Redis was stopped and its folder removed


def _alive(pid_file: Path) -> bool:
    pid = int(pid_file.read_text())
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


def test_a_score_stream_that_never_finishes_is_stopped_with_its_children_and_named(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pid_file = tmp_path / "child.pid"
    home, data = _setup(tmp_path, monkeypatch, f"sleep 60 & echo $! > {pid_file}; wait")
    with pytest.raises(StreamDemoFailed, match=r"did not finish within 2 s \(0 of 6 rows answered"):
        demo.stream_demo(home, data, timeout=2)
    assert not (home / "redis-demo").exists()
    assert not _alive(pid_file)  # its child went with it (rev-sdemo: kill() reached the direct child only)


def test_a_failure_is_reported_at_once_even_when_a_child_of_score_stream_keeps_its_output_open(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pid_file = tmp_path / "child.pid"
    home, data = _setup(tmp_path, monkeypatch, f"sleep 60 & echo $! > {pid_file}; echo 'bad model' >&2; exit 3")
    started = time.monotonic()
    with pytest.raises(StreamDemoFailed, match=r"score-stream exited 3: bad model"):
        demo.stream_demo(home, data, timeout=30)
    assert time.monotonic() - started < 20  # not the timeout, with "did not finish" instead of the exit code
    assert not _alive(pid_file)


def test_a_missing_command_is_named_and_not_blamed_on_redis(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    home, data = _setup(tmp_path, monkeypatch, "exit 0")
    (tmp_path / "bin" / "nightshift").unlink()
    with pytest.raises(StreamDemoFailed, match=r"cannot run .*bin/nightshift score-stream"):
        demo.stream_demo(home, data)


def test_an_exit_0_that_answered_no_row_is_a_failure(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    home, data = _setup(tmp_path, monkeypatch, "exit 0")
    with pytest.raises(StreamDemoFailed, match=r"exited 0 but answered 0 of 6 rows"):
        demo.stream_demo(home, data)


def test_a_password_file_meant_for_the_users_redis_is_not_passed_to_the_private_one(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NIGHTSHIFT_REDIS_PASSWORD_FILE", str(tmp_path / "their-password"))
    home, data = _setup(tmp_path, monkeypatch, 'echo "file=${NIGHTSHIFT_REDIS_PASSWORD_FILE:-unset}" >&2; exit 3')
    with pytest.raises(StreamDemoFailed, match=r"exited 3: file=unset"):
        demo.stream_demo(home, data)
