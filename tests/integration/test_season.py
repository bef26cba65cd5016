"""A short season under the real scheduler (issue 36), the CI cut of `python -m bench season`.

Three nights of nightly_retrain through scripts/airflow.sh's api-server, scheduler and dag-processor (the
LocalExecutor, a PostgreSQL database of this module's own), on the compressed schedule a season runs on
(NIGHTSHIFT_RETRAIN_CRON="* * * * *"): a steady night whose training loses a Horovod rank (the fault), a night of
bad data (a schema break and NaNs), and a night of unchanged data that starts with the model server SIGKILLed (the
second fault: a night that registers nothing must still leave @champion served). The season's oracle
(bench.season.oracle), which never reads the gate, says what each night should have ended in: the first model
promoted (it reaches the floor on the golden table), the bad data refused by the data gate and never staged, the
unchanged night skipped. Each night must end so, none may wedge, the served model must be @champion after each,
every night's lineage row must be whole, the nights that train nothing must grow NIGHTSHIFT_HOME by at most 1 MB
beyond new DVC objects and registered artifacts (the issue's goal), and nothing may be left behind.
"""

from __future__ import annotations

from typing import Any

import pytest

from bench.season.runner import Season, SeasonConfig, format_row
from bench.season.script import Night
from tests.integration.airflow_helpers import POSTGRES_URL, postgres_answers

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(not postgres_answers(), reason=f"no PostgreSQL answers at {POSTGRES_URL}"),
    # A bound for a hung season, not a speed: at a load of 20 on 2 cores Airflow's start alone took 545 s.
    pytest.mark.timeout(2400),
]

NIGHTS = [Night("steady", "worker_killed"), Night("bad_data"), Night("unchanged", "model_server_killed")]
MB = 1_000_000


@pytest.fixture(scope="module")
def season() -> dict[str, Any]:
    # 800 rows a night: the smallest whose test split holds the suite's 100 rows; the shared server, as CI has.
    config = SeasonConfig(NIGHTS, rows=800, private_postgres=False, maintenance="none", night_bound=900,
                          log=lambda line: print(line, flush=True))
    result = Season(config).run()
    for row in result["rows"]:
        print(row["night"], row["event"], row["fault"], row["decision"], row["expected"], row["checks"], row["notes"])
    return result


def test_each_night_ends_as_the_oracle_says(season: dict[str, Any]) -> None:
    decisions = [(r["decision"], r["expected"]) for r in season["rows"]]
    assert decisions == [("promoted", "promoted"), ("failed:validate_data", "failed:validate_data"),
                         ("skipped", "skipped")], season["rows"]


def test_the_fault_struck_and_no_night_wedged(season: dict[str, Any]) -> None:
    first = season["rows"][0]
    assert any("SIGKILLed" in note for note in first["notes"]), first["notes"]
    third = season["rows"][2]
    assert any(note.startswith("model server pid") for note in third["notes"]), third["notes"]
    assert third["checks"]["serves @champion"], third["notes"]  # restarted by the night's deploy task
    assert [r["checks"].get("not wedged") for r in season["rows"]] == [True, True, True], season["rows"]


def test_every_check_of_every_night_holds(season: dict[str, Any]) -> None:
    failed = {r["night"]: [k for k, ok in r["checks"].items() if not ok] for r in season["rows"] if not r["ok"]}
    assert not failed, f"{failed}\n" + "\n".join(str(r) for r in season["rows"])
    assert season["rows"][1]["checks"]["bad data not staged"] is True
    assert all(r["checks"]["serves @champion"] and r["checks"]["lineage complete"] for r in season["rows"])


def test_nights_that_train_nothing_keep_the_disk_bounded(season: dict[str, Any]) -> None:
    # The first Data Docs site writes the one copy of GX's static assets (4 MB) every later site links to.
    static = season["rows"][1]["by_folder"].get("gx/data_docs/.static", 0)
    assert static < 5 * MB
    for row in season["rows"][1:]:
        once = static if row["night"] == 2 else 0
        assert row["beyond_bytes"] - once <= 1 * MB, (row["night"], row["beyond_bytes"], row["by_folder"])


def test_nothing_is_left_behind(season: dict[str, Any]) -> None:
    assert season["summary"]["leftovers"] == {"processes": [], "ports": [], "mounts": [], "namespaces": []}
    assert season["summary"]["lineage_after_gc"] == []


def test_a_row_reads_as_a_table_line(season: dict[str, Any]) -> None:
    from bench.season.runner import NightRow

    row = NightRow(**{k: v for k, v in season["rows"][1].items() if k != "ok"})
    assert format_row(row).startswith("2 | bad_data | - | failed:validate_data | failed:validate_data | yes")
