from __future__ import annotations

from pathlib import Path

import pytest

from nightshift import ledger


def test_records_round_trip_newest_last_and_a_torn_line_is_skipped(nightshift_home: Path) -> None:
    for i in range(5):
        ledger.append_record("d", {"run_id": f"r{i}", "status": "success" if i % 2 == 0 else "failed"})
    path = ledger.ledger_path("d")
    assert path.is_relative_to(nightshift_home)
    with path.open("a") as handle:
        handle.write('{"run_id": "torn')
    assert [r["run_id"] for r in ledger.read_records("d")] == ["r0", "r1", "r2", "r3", "r4"]
    assert [r["run_id"] for r in ledger.read_records("d", newest=2)] == ["r3", "r4"]
    assert ledger.last_successful("d")["run_id"] == "r4"
    assert ledger.last_successful("d", exclude_run_id="r4")["run_id"] == "r2"


def test_the_registry_tags_a_version_with_the_ledgers_code_version(monkeypatch: pytest.MonkeyPatch) -> None:
    from nightshift import registry

    monkeypatch.setenv("NIGHTSHIFT_GIT_COMMIT", "abc1234")
    assert ledger.code_version() == "abc1234"
    assert registry.code_version is ledger.code_version  # one answer, not two that can disagree
