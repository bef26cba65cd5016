from __future__ import annotations

import pytest

from nightshift.errors import UsageError
from nightshift.evaluate import GateConfig, decide

CHAMPION = {"accuracy": 0.90, "macro_f1": 0.90, "log_loss": 0.30}


def test_no_champion_needs_the_floor() -> None:
    gate = GateConfig(floor=0.85)
    assert decide({"accuracy": 0.86, "macro_f1": 0.8, "log_loss": 0.5}, None, gate)["passed"]
    rejected = decide({"accuracy": 0.84, "macro_f1": 0.8, "log_loss": 0.5}, None, gate)
    assert not rejected["passed"] and "misses the floor 0.8500" in rejected["reasons"][0]


def test_challenger_must_beat_champion_by_min_improvement() -> None:
    gate = GateConfig(min_improvement=0.01)
    assert decide({**CHAMPION, "accuracy": 0.911}, CHAMPION, gate)["passed"]
    tie = decide(dict(CHAMPION), CHAMPION, gate)
    assert not tie["passed"] and "< min_improvement 0.0100" in tie["reasons"][0]


def test_guard_regression_beyond_tolerance_rejects_even_with_a_better_primary() -> None:
    gate = GateConfig(min_improvement=0.0, guards={"macro_f1": 0.01, "log_loss": 0.05})
    worse_f1 = decide({"accuracy": 0.95, "macro_f1": 0.88, "log_loss": 0.2}, CHAMPION, gate)
    assert not worse_f1["passed"] and any("macro_f1" in r and "beyond" in r for r in worse_f1["reasons"])
    # log loss is lower-is-better: a rise of 0.04 is within 0.05, a rise of 0.06 is not.
    assert decide({"accuracy": 0.95, "macro_f1": 0.9, "log_loss": 0.34}, CHAMPION, gate)["passed"]
    assert not decide({"accuracy": 0.95, "macro_f1": 0.9, "log_loss": 0.36}, CHAMPION, gate)["passed"]


def test_log_loss_as_primary_improves_downwards() -> None:
    gate = GateConfig(primary="log_loss", min_improvement=0.05, guards={}, floor=0.5)
    assert decide({**CHAMPION, "log_loss": 0.2}, CHAMPION, gate)["passed"]
    assert not decide({**CHAMPION, "log_loss": 0.28}, CHAMPION, gate)["passed"]
    assert decide({**CHAMPION, "log_loss": 0.4}, None, gate)["passed"]


@pytest.mark.parametrize("kwargs", [{"primary": "auc"}, {"min_improvement": -0.1},
                                    {"guards": {"macro_f1": -1.0}}, {"guards": {"precision": 0.1}}])
def test_bad_gate_config_names_the_field(kwargs: dict[str, object]) -> None:
    with pytest.raises(UsageError):
        GateConfig(**kwargs)  # type: ignore[arg-type]
