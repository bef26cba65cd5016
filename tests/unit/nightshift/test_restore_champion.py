"""A night that registers nothing: the deploy task restores @champion's dead local server (dags/nightly_tasks/steps
restore_champion; the restart itself with a real server: tests/integration/test_deploy_local.py), and the night's
ledger record says so without turning a skipped night into a promotion; what rev-restore found in the first cut:
the champion read outside the deploy lock, a reused PID stopped as the dead server, a stopped server restarted."""

from __future__ import annotations

import fcntl
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest


def test_another_target_restores_nothing(nightshift_home: Path, digits_pipeline: Any,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    from dags.nightly_tasks import steps
    from nightshift.deploy import local

    def never(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("restore_local called for the kserve target")

    monkeypatch.setattr(local, "restore_local", never)
    assert steps.restore_champion(digits_pipeline, {"path": "/nowhere"}, {"deploy_target": "kserve"}) is None


def test_a_skipped_night_whose_champion_was_restarted_stays_skipped_and_names_the_restart(
        nightshift_home: Path, digits_pipeline: Any) -> None:
    from dags.nightly_tasks import steps
    from nightshift import ledger
    from nightshift.season import decision

    restarted = {"target": "local", "status": "restarted", "model_name": "nightshift-digits", "version": "2",
                 "url": "http://127.0.0.1:40002", "reason": "v2's server no longer answered",
                 "previous": {"url": "http://127.0.0.1:40001", "version": "2"}}
    steps.report(digits_pipeline, "nightly_retrain", "r6", {},
                 {"stage_dataset": {"hash": "md5:x", "rows": 10}, "skip_training": {"skipped": True},
                  "deploy": restarted})
    (record,) = [json.loads(line) for line in ledger.ledger_path("nightly_retrain").read_text().splitlines()]
    assert record["outcome"] == ("training skipped (unchanged); @champion v2 restarted (v2's server no longer "
                                 "answered)")
    assert decision(record) == "skipped"
    assert record["serving_url"] == "http://127.0.0.1:40002" and record["deploy_status"] == "restarted"
    assert record["model_version"] is None  # nothing was registered tonight


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_the_champion_is_read_with_the_deploy_lock_held(nightshift_home: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    # Read before the lock, a deployment of v2 running meanwhile was undone: v1 restarted, @champion moved back.
    from nightshift import registry, settings
    from nightshift.deploy import local

    local._write_record("m", {"model_name": "m", "version": "1", "pid": _dead_pid(), "port": 1,
                              "url": "http://127.0.0.1:1", "model_path": "/nowhere"})
    held: list[bool] = []

    def version_by_alias(model_name: str, alias: str) -> None:
        with (settings.serving_dir() / f".{model_name}.lock").open("w") as handle:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                held.append(True)
            else:
                fcntl.flock(handle, fcntl.LOCK_UN)
                held.append(False)
        return None

    monkeypatch.setattr(registry, "version_by_alias", version_by_alias)
    assert local.restore_local("m", data_dir="/nowhere") is None  # no champion: nothing to serve
    assert held and held[-1] is True  # the decision that counts was made under the lock


def test_a_stopped_server_stays_stopped(nightshift_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # `nightshift deploy --stop` removes the record and keeps @champion: not a crash to repair.
    from nightshift import registry
    from nightshift.deploy import local

    monkeypatch.setattr(registry, "version_by_alias", lambda *a: pytest.fail("no record: nothing to look up"))
    assert local.read_record("m") is None
    assert local.restore_local("m", data_dir="/nowhere") is None


def test_a_reused_pid_serving_another_model_folder_is_not_stopped(tmp_path: Path) -> None:
    # The dead server's PID, reused after a reboot by another model's server, was stopped by its restart.
    from nightshift.deploy import local

    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "mlflow", "serve", "-m",
                              str(tmp_path / "other-v1-40001")], start_new_session=True)
    try:
        deadline = time.monotonic() + 60  # its command line is the parent's until it has exec'd (a loaded machine)
        while not local._is_model_server(other.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert local._is_model_server(other.pid)
        assert local.stop_server(other.pid, model_path=str(tmp_path / "mine-v2-40002")) is False
        assert other.poll() is None
        assert local.stop_server(other.pid, timeout=5, model_path=str(tmp_path / "other-v1-40001")) is True
        assert other.wait(timeout=10) is not None
    finally:
        if other.poll() is None:
            other.kill()
            other.wait()
