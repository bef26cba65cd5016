"""The season benchmark's pure parts: its script and data (bench.season.script), its oracle (bench.season.oracle),
its table, and how `python -m bench season --nights N` reaches it."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from bench.season import oracle
from bench.season.script import (
    INVALID,
    LOST_CLASS,
    SEASON,
    Landing,
    Night,
    World,
    golden_table,
    night_splits,
    render,
    season,
)


def test_the_default_season_has_thirty_nights_six_faults_and_every_event() -> None:
    nights = season(30)
    assert len(nights) == 30 and nights == list(SEASON)
    assert sum(1 for n in nights if n.fault) >= 6
    assert {n.event for n in nights} == {"steady", "unchanged", "drift", "shift", "bad_data", "lost_class",
                                         "heavy_tail", "label_noise"}
    assert {n.fault for n in nights if n.fault} == {"worker_killed", "scheduler_killed", "postgres_restarted",
                                                    "model_server_killed", "dvc_remote_unwritable"}


def test_a_short_season_is_the_first_nights_and_a_long_one_repeats_the_later_ones() -> None:
    assert season(3) == list(SEASON[:3])
    assert {n.event for n in season(3)} == {"steady", "bad_data", "unchanged"}
    longer = season(40)
    assert longer[:30] == list(SEASON) and longer[30:] == list(SEASON[13:23])
    with pytest.raises(ValueError, match="at least 1"):
        season(0)


def test_a_night_names_a_known_event_and_fault() -> None:
    with pytest.raises(ValueError, match="unknown data event 'flood'"):
        Night("flood")
    with pytest.raises(ValueError, match="unknown fault 'meteor'"):
        Night("steady", "meteor")
    assert not Night("bad_data").valid and Night("drift").valid


def test_the_world_drifts_and_shifts_from_then_on() -> None:
    world = World().after("drift").after("steady").after("shift").after("label_noise")
    assert world == World(brightness=0.9, shift=1)
    image = np.zeros((1, 64), dtype=np.float32)
    image[0, 8 * 3 + 2] = 10.0  # row 3, column 2
    seen = render(image, world).reshape(8, 8)
    assert seen[3, 3] == pytest.approx(9.0) and seen[3, 2] == 0.0 and seen.dtype == np.float32
    assert render(np.full((1, 64), 20.0, dtype=np.float32), World()).max() == 16.0  # the contract's 0..16


def test_each_event_writes_what_it_says() -> None:
    steady = night_splits(1, Night("steady"), World(), 800)
    assert [len(steady[s]) for s in ("train", "validation", "test")] == [560, 120, 120]
    for part in steady.values():
        assert part["label"].dtype == np.int64 and part.drop(columns="label").dtypes.eq(np.float32).all()
        assert part.drop(columns="label").to_numpy().min() >= 0 and part.drop(columns="label").to_numpy().max() <= 16
        assert part["label"].nunique() == 10 and not part.isna().any().any()
    lost = night_splits(2, Night("lost_class"), World(), 800)
    assert all(LOST_CLASS not in set(part["label"]) for part in lost.values())
    bad = night_splits(3, Night("bad_data"), World(), 800)
    assert all(part["label"].dtype == np.float64 and part["pixel_12"].isna().any() for part in bad.values())
    heavy = night_splits(4, Night("heavy_tail"), World(), 800)
    assert all((part["pixel_0"] > 16).any() for part in heavy.values())
    noisy = night_splits(5, Night("label_noise"), World(), 800)
    clean = night_splits(5, Night("steady"), World(), 800)
    changed = (noisy["train"]["label"] != clean["train"]["label"]).mean()
    assert 0.25 < changed < 0.5  # 40% redrawn, a tenth of them to the same label


def test_an_unchanged_night_lands_the_same_bytes_and_the_link_switches(tmp_path: Path) -> None:
    landing = Landing(tmp_path / "landing", tmp_path / "home" / "demo-data" / "digits", rows=800)
    one = landing.write(1, Night("steady"))
    two = landing.write(2, Night("bad_data"))
    three = landing.write(3, Night("unchanged"))
    assert three["digests"] == one["digests"] != two["digests"]
    landing.switch(2)
    assert landing.declared.resolve() == Path(two["folder"]).resolve()
    landing.switch(3)
    assert landing.declared.resolve() == Path(three["folder"]).resolve()
    assert sorted(p.name for p in landing.declared.parent.iterdir()) == ["digits"]  # no temporary link left


def test_the_golden_images_are_never_drawn_for_a_night() -> None:
    from bench.season import script

    _, labels = script._digits()
    pool, golden = script._golden_split(labels)
    assert len(golden) == 400 and not set(pool) & set(golden) and len(pool) + len(golden) == len(labels)
    drawn = script.draw(np.random.default_rng(1), labels, 5000)
    assert not set(drawn) & set(golden) and len(set(drawn)) > 1000
    table = golden_table(World())
    assert len(table) == 400 and table["label"].tolist() == labels[golden].tolist()


@pytest.mark.parametrize(("night", "trained_on", "fault", "expected"), [
    (Night("bad_data"), None, None, "failed:validate_data"),
    (Night("heavy_tail"), {"train": "a"}, "dvc_remote_unwritable", "failed:validate_data"),
    (Night("unchanged"), {"train": "same"}, None, "skipped"),
    (Night("steady"), {"train": "other"}, "dvc_remote_unwritable", "failed:stage_dataset"),
    (Night("steady"), {"train": "other"}, "worker_killed", None),
    (Night("steady"), None, None, None),
])
def test_what_the_data_alone_says(night: Night, trained_on: dict[str, str] | None, fault: str | None,
                                  expected: str | None) -> None:
    digests = {"train": "same"}
    assert oracle.expected_by_data(valid=night.valid, digests=digests, trained_on=trained_on,
                                   fault=fault) == expected
    assert (night.event in INVALID) == (expected == "failed:validate_data")


def test_what_the_golden_table_says() -> None:
    assert oracle.expected_by_model(0.95, None) == "promoted"
    assert oracle.expected_by_model(0.7, None) == "refused"
    assert oracle.expected_by_model(0.95, 0.80) == "promoted"
    assert oracle.expected_by_model(0.80, 0.95) == "refused"
    assert oracle.expected_by_model(0.95, 0.94) == oracle.EITHER
    assert oracle.matches("refused", oracle.EITHER) and oracle.matches("promoted", oracle.EITHER)
    assert not oracle.matches("skipped", oracle.EITHER) and not oracle.matches("failed:train", "promoted")


def test_a_decision_is_read_from_the_ledger_record() -> None:
    assert oracle.decision_of({"status": "failed", "failed_task": "validate_data"}) == "failed:validate_data"
    assert oracle.decision_of({"status": "success", "outcome": "training skipped (unchanged)"}) == "skipped"
    assert oracle.decision_of({"status": "success", "outcome": "promoted v3 (promoted)"}) == "promoted"
    assert oracle.decision_of({"status": "success", "outcome": "not promoted (gate rejected)"}) == "refused"
    assert oracle.decision_of(None) == "no record"


def test_a_lineage_row_is_whole_or_says_what_it_lacks() -> None:
    base = {"dag_id": "d", "run_id": "r", "status": "success", "recorded_at": "t", "dataset_version": "h",
            "dataset_source": "/s", "dataset_rows": 9, "code_version": "c", "training": {"epochs": 5},
            "model_name": "m"}
    assert oracle.lineage_gaps({**base, "outcome": "training skipped (unchanged)"}) == []
    refused = {**base, "outcome": "not promoted (gate rejected)", "mlflow_run_id": "x", "train_metrics": {"a": 1}}
    assert oracle.lineage_gaps(refused) == ["gate"]
    promoted = {**refused, "gate": {"passed": True}, "outcome": "promoted v2 (promoted)", "model_version": "2",
                "serving_url": "http://x", "deploy_status": "promoted"}
    tags = {"nightshift.dataset_version": "h", "nightshift.dag_run_id": "r"}
    assert oracle.lineage_gaps(promoted, tags) == []
    assert oracle.lineage_gaps(promoted, {**tags, "nightshift.dag_run_id": "other"}) == [
        "version tag nightshift.dag_run_id='other', record says 'r'"]
    failed = {"dag_id": "d", "run_id": "r", "status": "failed", "recorded_at": "t", "outcome": "failed at train",
              "failed_task": "train"}
    assert oracle.lineage_gaps(failed) == ["reason"]


def test_a_champion_that_lost_more_than_the_tolerance_is_caught() -> None:
    assert oracle.Scores(0.9, 0.95, 0.95).drop() == 0.0
    drop = oracle.Scores(0.9, 0.95, 0.90).drop()
    assert drop == pytest.approx(0.05) and drop > oracle.TOLERANCE
    assert oracle.Scores(0.9, None, 0.90).drop() is None


def test_bench_options_after_the_name_are_the_benchmarks_own(monkeypatch: pytest.MonkeyPatch) -> None:
    import bench.__main__ as entry
    import bench.bench_season as season_bench

    ran: list[list[str]] = []
    monkeypatch.setattr(season_bench, "main", lambda: ran.append(["season"]) or 3)
    monkeypatch.setattr("sys.argv", ["bench", "season", "--nights", "3"])
    assert entry.main(["season", "--nights", "3"]) == 3 and ran == [["season"]]
    assert season_bench.parse(["--nights", "3", "--rows", "800"]).nights == 3


@pytest.mark.slow
def test_the_project_suite_passes_the_valid_nights_and_refuses_the_others(tmp_path: Path) -> None:
    """The season's premise: its valid nights pass gx/'s digits suite and its contract breaks do not (the oracle
    expects the data gate to refuse exactly those)."""
    from bench.season.script import write_splits
    from nightshift.data.validate import check_data

    world = World()
    for number, event in enumerate(["steady", "drift", "shift", "label_noise", "bad_data", "lost_class",
                                    "heavy_tail"], 1):
        world = world.after(event)
        write_splits(night_splits(number, Night(event), world, 800), tmp_path / event)
        report = check_data(tmp_path / event, data_docs=False)
        assert report["success"] == Night(event).valid, (event, report["files"])


def test_retention_on_the_seasons_clock_cuts_at_the_night_t_nights_back(monkeypatch: pytest.MonkeyPatch,
                                                                        tmp_path: Path,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    """Every window T nights, and "older than T days" at the moved clock is "from before night n - T"."""
    import json
    from datetime import timedelta

    import nightshift.gc
    import nightshift.maintenance
    from bench.season import clock

    seen: dict[str, object] = {}

    def collect(pipeline: object, *, now: float) -> dict[str, object]:
        seen["policy"], seen["gc_cutoff"] = pipeline.retention, now - 7 * clock.DAY  # type: ignore[attr-defined]
        return {"remove": [{"kind": "mlflow_run"}], "removed_bytes": 5}

    def clean(days: float, *, floor_days: float, now: object, url: str) -> dict[str, object]:
        seen["db_cutoff"], seen["url"] = now - timedelta(days=max(days, floor_days)), url  # type: ignore[operator]
        return {"before": "b", "held_by": []}

    def prune(folder: Path, days: float, *, now: float) -> dict[str, object]:
        seen["log_cutoff"], seen["folder"] = now - days * clock.DAY, folder
        return {"removed": [], "removed_bytes": 0}

    monkeypatch.setattr(nightshift.gc, "collect", collect)
    monkeypatch.setattr(nightshift.maintenance, "clean_metadata", clean)
    monkeypatch.setattr(nightshift.maintenance, "prune_logs", prune)
    monkeypatch.setattr("nightshift.tracking.configure", lambda: None)
    monkeypatch.setenv("AIRFLOW_HOME", str(tmp_path))
    since = 1_800_000_000.0
    assert clock.main(["--pipeline", str(Path(__file__).resolve().parents[3] / "pipelines" / "digits.yaml"),
                       "--nights", "7", "--since", str(since), "--metadata-url", "postgresql+psycopg://x/db"]) == 0
    policy = seen["policy"]
    assert (policy.resumable_days, policy.challenger_days, policy.data_versions_days) == (7, 7, 7)  # type: ignore[attr-defined]
    assert policy.keep_runs == 5  # type: ignore[attr-defined]  # the declaration's count stays
    assert seen["gc_cutoff"] == seen["log_cutoff"] == since
    assert seen["db_cutoff"].timestamp() == since  # type: ignore[attr-defined]
    assert seen["folder"] == tmp_path / "logs" and seen["url"] == "postgresql+psycopg://x/db"
    assert json.loads(capsys.readouterr().out)["removed"] == {"mlflow_run": 1}


def test_a_remote_made_read_only_after_the_run_staged_is_a_fault_that_missed() -> None:
    # Season 30b, night 10: the run (its cron tick passed) started as night 9's ended and staged at 03:59:12; the
    # remote went read-only at 03:59:16; the night promoted and was judged against failed:stage_dataset.
    from bench.season.runner import struck

    assert struck("dvc_remote_unwritable", 100.0, 104.0)[0] is None
    assert "the fault missed" in str(struck("dvc_remote_unwritable", 100.0, 104.0)[1])
    assert struck("dvc_remote_unwritable", 105.0, 104.0) == ("dvc_remote_unwritable", None)
    assert struck("dvc_remote_unwritable", None, 104.0) == ("dvc_remote_unwritable", None)  # never staged
    assert struck("worker_killed", 100.0, None) == ("worker_killed", None)


def test_the_golden_scorer_leaves_the_processs_mlflow_settings_as_they_were(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    # mlflow.set_tracking_uri exports MLFLOW_TRACKING_URI: the short season left its (then deleted) store in the
    # pytest worker's environment and the kserve tests that ran after it there wrote into it (rehearsal 14).
    from bench.season.oracle import GoldenScorer

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("MLFLOW_REGISTRY_URI", "sqlite:///elsewhere.db")
    scorer = GoldenScorer(f"sqlite:///{tmp_path / 'mlflow.db'}")
    with pytest.raises(Exception):  # noqa: B017 - whatever MLflow raises for a model that is not there
        scorer.model("models:/nothing-registered/1")
    assert "MLFLOW_TRACKING_URI" not in os.environ
    assert os.environ["MLFLOW_REGISTRY_URI"] == "sqlite:///elsewhere.db"
