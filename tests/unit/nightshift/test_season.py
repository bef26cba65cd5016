"""The season view (nightshift.season): a pipeline's ledger drawn night by night."""

from __future__ import annotations

import re
from typing import Any

from nightshift import season


def night(day: int, outcome: str, *, status: str = "success", challenger: float | None = None,
          champion: float | None = None, dataset: str = "aaaa1111bbbb", drift: float | None = None,
          **extra: Any) -> dict[str, Any]:
    gate = None
    if challenger is not None:
        gate = {"passed": outcome.startswith("promoted"), "primary": "accuracy",
                "challenger": {"accuracy": challenger, "log_loss": 0.3},
                "champion": {"version": "4", "accuracy": champion} if champion is not None else None,
                "rows_outside_train_range": drift}
    return {"recorded_at": f"2026-11-{day:02d}T02:03:00+00:00", "run_id": f"scheduled__{day}", "status": status,
            "outcome": outcome, "dataset_version": dataset, "gate": gate, **extra}


MONTH = [
    night(1, "promoted v1 (promoted)", challenger=0.90, drift=0.0),
    night(2, "training skipped (unchanged)"),
    night(3, "not promoted (gate rejected)", challenger=0.89, champion=0.91, dataset="cccc2222dddd", drift=0.05),
    night(4, "failed at train", status="failed", dataset="cccc2222dddd",
          reason="MPIJobFailed: <script>alert(1)</script>"),
    night(5, "promoted v2 (promoted)", challenger=0.95, champion=0.92, dataset="eeee3333ffff", drift=0.125),
]


def marks(svg: str, tip: str) -> list[str]:
    """The decision marks (the strip under the metric) whose tooltip starts with `tip`."""
    strip = svg[svg.index("<g class='decisions'>"):]
    return re.findall(rf"<g><title>{re.escape(tip)}[^<]*</title>(<[^>]*>)", strip)


def test_each_night_is_marked_with_its_decision() -> None:
    assert [season.decision(r) for r in MONTH] == ["promoted", "skipped", "refused", "failed", "promoted"]
    assert season.decision(night(6, "registered, not deployed (approval rejected or pending)")) == "refused"
    svg = season.season_svg(list(reversed(MONTH)))  # the ledger page hands them newest first
    strip = {tip: marks(svg, f"2026-11-0{day} 02:03 scheduled__{day}: {tip}") for day, tip in
             ((1, "promoted"), (2, "skipped"), (3, "refused"), (4, "failed"), (5, "promoted"))}
    assert "fill='#2e7d32'" in strip["promoted"][0]  # a green dot
    assert "path" in strip["refused"][0] and "#e65100" in strip["refused"][0]  # a cross
    assert strip["skipped"][0].startswith("<path") and "fill='none'" in strip["skipped"][0]  # an open triangle
    assert strip["failed"][0].startswith("<rect") and "#c62828" in strip["failed"][0]  # a red square
    # Oldest left: night 1's mark lies left of night 5's.
    x = [float(re.search(r"cx='([\d.]+)'", marks(svg, f"2026-11-0{d} ")[0]).group(1)) for d in (1, 5)]
    assert x[0] < x[1]


def test_the_champions_metric_and_the_challengers_are_drawn_with_their_values() -> None:
    svg = season.season_svg(MONTH)
    assert "accuracy night by night, decisions and data (oldest left, 5 runs)" in svg
    assert "champion v4 accuracy 0.9100" in svg and "champion v4 accuracy 0.9200" in svg
    assert "challenger accuracy 0.9500" in svg
    assert svg.count("stroke='#1565c0' stroke-width='1.8'") == 1  # one champion line, through nights 3 and 5


def test_data_versions_and_drift() -> None:
    svg = season.season_svg(MONTH)
    bands = re.findall(r"<title>dataset (\w+)</title>", svg)
    assert bands == ["aaaa1111bbbb", "cccc2222dddd", "eeee3333ffff"]  # one band per version, in order
    assert "rows outside the training range 0.125" in svg
    assert "(top of the band = 0.125)" in svg


def test_text_from_the_ledger_is_escaped() -> None:
    svg = season.season_svg(MONTH)
    assert "<script>" not in svg and "&lt;script&gt;alert(1)&lt;/script&gt;" in svg


def test_the_primary_metric_of_older_records_is_the_tasks_default() -> None:
    old = [{"recorded_at": "2026-10-01T00:00:00", "status": "success", "outcome": "promoted v1",
            "gate": {"passed": True, "challenger": {"rmse": 51.0, "mae": 40.0, "r2": 0.4}}}]
    assert season.primary_metric(old) == "rmse"
    assert "rmse night by night" in season.season_svg(old)
    assert season.season_svg([]) == ""
    only_failures = season.season_svg([night(1, "failed at validate_data", status="failed")])
    assert "no night was scored yet" in only_failures


def test_runs_of_one_day_are_told_apart_by_their_time() -> None:
    assert ">11-01</text>" in season.season_svg(MONTH)
    again = season.season_svg([*MONTH, night(5, "promoted v3 (promoted)", challenger=0.96, champion=0.95,
                                             recorded_at="2026-11-05T14:30:00+00:00")])
    assert ">11-05 02:03</text>" in again and ">11-05 14:30</text>" in again
