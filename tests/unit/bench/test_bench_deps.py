"""The dependency-set benchmark's pure parts: its options (after `python -m bench deps`), its run order and its
table of medians with new/old."""

from __future__ import annotations

import pytest

from bench.bench_deps import parse_args, schedule, table


def test_the_options_follow_the_benchmark_names() -> None:
    args = parse_args(["deps", "--old", "/o/bin/python", "--new=/n/bin/python", "--repeats", "4"])
    assert args is not None
    assert (args.old, args.new, args.repeats, args.parse_repeats) == ("/o/bin/python", "/n/bin/python", 4, 5)


def test_without_its_options_it_is_skipped_when_every_benchmark_runs() -> None:
    assert parse_args([]) is None
    assert parse_args(["trainer", "data"]) is None
    assert parse_args(["--nights", "6"]) is None  # another benchmark's options


def test_both_sets_are_required_and_repeats_are_positive(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse_args(["deps", "--old", "/o/bin/python"])
    assert "--new" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(["deps", "--old", "a", "--new", "b", "--repeats", "0"])
    assert "at least 1" in capsys.readouterr().err


def test_each_benchmark_alternates_old_and_new_in_every_repeat() -> None:
    order = schedule(3)
    assert len(order) == 12
    assert order[:4] == [(1, "trainer", "old"), (1, "trainer", "new"), (1, "parse", "old"), (1, "parse", "new")]
    for bench in ("trainer", "parse"):
        sets = [which for _, b, which in order if b == bench]
        assert sets == ["old", "new"] * 3


def test_the_table_has_each_sets_median_and_new_over_old() -> None:
    runs = {"old": [{"parse (s)": 2.0, "ratio": 1.0}, {"parse (s)": 4.0, "ratio": 1.2}, {"parse (s)": 3.0}],
            "new": [{"parse (s)": 3.3, "ratio": 1.1}, {"parse (s)": 3.0}, {"parse (s)": 9.0}]}
    lines = table(runs).splitlines()
    assert lines[0].startswith("| measure | old (median) | new (median) | new / old | new / old per repeat")
    # per repeat: 3.3/2, 3/4, 9/3
    assert lines[2] == "| parse (s) | 3.000 | 3.300 | 1.100 | 1.650 (0.750-3.000) | 3, 3 |"
    assert lines[3] == "| ratio | 1.100 | 1.100 | 1.000 | 1.100 (1.100-1.100) | 2, 1 |"


def test_a_measure_one_set_lacks_has_no_ratio() -> None:
    lines = table({"old": [{"a": 1.0}], "new": [{"b": 2.0}]}).splitlines()
    assert lines[2:] == ["| a | 1.000 | — | — | — | 1, 0 |", "| b | — | 2.000 | — | — | 0, 1 |"]
