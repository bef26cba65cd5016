from __future__ import annotations

from pathlib import Path

import pytest

from nightshift import ledger
from nightshift.errors import CodeVersionUnknown
from tests.git_checkout import git_checkout


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


def test_code_version_never_answers_unknown(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Issue 20.17: a git failure used to give "unknown", so every code change compared as unchanged."""
    monkeypatch.delenv("NIGHTSHIFT_GIT_COMMIT", raising=False)
    root = git_checkout(tmp_path / "repo")
    monkeypatch.setattr(ledger, "_repo_root", lambda: root)
    head = ledger.code_version()
    assert len(head) == 40
    (root / "nightshift" / "__init__.py").write_text("x = 2\n")
    assert ledger.code_version().startswith(head + "+dirty.")
    (root / ".git" / "HEAD").write_text("ref: refs/heads/gone\n")  # a checkout whose git fails
    with pytest.raises(CodeVersionUnknown, match="NIGHTSHIFT_GIT_COMMIT"):
        ledger.code_version()
    monkeypatch.setenv("PATH", str(tmp_path / "no-git-here"))  # git not installed
    with pytest.raises(CodeVersionUnknown, match="install git or set NIGHTSHIFT_GIT_COMMIT"):
        ledger.code_version()
    assert ledger.code_version("bundle-commit") == "bundle-commit"  # the bundle's commit needs no git


def test_an_untracked_module_is_another_code_version(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A new, uncommitted module changes what runs as much as an edit: `git diff HEAD` alone did not see it (so a
    run could skip training as "same code"); files git ignores and files outside the code paths do not count."""
    monkeypatch.delenv("NIGHTSHIFT_GIT_COMMIT", raising=False)
    root = git_checkout(tmp_path / "repo")
    monkeypatch.setattr(ledger, "_repo_root", lambda: root)
    head = ledger.code_version()
    (root / ".gitignore").write_text("*.pyc\n")
    (root / "nightshift" / "cache.pyc").write_bytes(b"ignored")
    (root / "notes.txt").write_text("outside the code paths\n")
    assert ledger.code_version() == head
    (root / "nightshift" / "new.py").write_text("def f(): return 1\n")
    first = ledger.code_version()
    assert first.startswith(head + "+dirty.")
    (root / "nightshift" / "new.py").write_text("def f(): return 2\n")
    assert ledger.code_version() not in (first, head)
    assert ledger.git_version(root) != ledger.git_version(root, ("nightshift",))  # the whole tree: notes.txt too


def test_an_installed_package_is_versioned_by_its_sources(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("NIGHTSHIFT_GIT_COMMIT", raising=False)
    (tmp_path / "nightshift").mkdir()
    (tmp_path / "nightshift" / "trainer.py").write_text("a = 1\n")
    monkeypatch.setattr(ledger, "_repo_root", lambda: tmp_path)  # site-packages: no .git
    first = ledger.code_version()
    assert first.startswith("src.")
    (tmp_path / "nightshift" / "trainer.py").write_text("a = 2\n")
    assert ledger.code_version() not in (first, "unknown")
    (tmp_path / "nightshift" / "trainer.py").unlink()
    with pytest.raises(CodeVersionUnknown, match="no Python sources"):
        ledger.code_version()


def test_a_ledger_is_found_by_dag_id_and_never_outside_its_folder(nightshift_home: Path) -> None:
    from nightshift.errors import DagIdInvalid

    ledger.append_record("churn.v2", {"run_id": "r1"})
    ledger.append_record("nightly_retrain", {"run_id": "r2"})
    (nightshift_home / "airflow" / "dags").mkdir()  # an AIRFLOW_HOME folder, no ledger
    assert ledger.dag_ids() == ["churn.v2", "nightly_retrain"]
    for bad in ("..", ".", "../x", "a/b", "", "x" * 251, "-x"):
        with pytest.raises(DagIdInvalid, match="is not a DAG id"):
            ledger.ledger_path(bad)
        with pytest.raises(DagIdInvalid):
            ledger.append_record(bad, {"run_id": "r3"})
    assert ledger.ledger_path("x" * 250).parent.name == "x" * 250  # Airflow's longest DAG id


def test_switching_elastic_training_on_is_a_change_that_trains(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 26: the elastic trainer trains otherwise; a fixed-size run's fingerprint is what it always was."""
    monkeypatch.setenv("NIGHTSHIFT_GIT_COMMIT", "abc1234")
    plain = {"epochs": 5, "learning_rate": 0.05, "batch_size": 32, "workers": 2}
    fixed = ledger.fingerprint("sha256:d", {**plain, "min_workers": None, "max_workers": None})
    assert fixed["training"] == plain
    elastic = ledger.fingerprint("sha256:d", {**plain, "min_workers": 1, "max_workers": 2})
    assert not ledger.unchanged_since(fixed, elastic)
    assert not ledger.unchanged_since(elastic, ledger.fingerprint("sha256:d", {**plain, "min_workers": 2,
                                                                               "max_workers": 2}))
    assert ledger.unchanged_since(elastic, ledger.fingerprint("sha256:d", {**plain, "min_workers": 1,
                                                                           "max_workers": 2}))
    # issue 35 item 7: an elastic run starts max_workers whatever `workers` says: changing it alone retrains nothing
    assert ledger.unchanged_since(elastic, ledger.fingerprint("sha256:d", {**plain, "workers": 5, "min_workers": 1,
                                                                           "max_workers": 2}))
    assert not ledger.unchanged_since(fixed, ledger.fingerprint("sha256:d", {**plain, "workers": 5}))
