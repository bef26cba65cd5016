"""nightly_retrain's training parameters from best.json (nightshift.search.best.training_defaults)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from nightshift.errors import UsageError
from nightshift.search.best import best_path, training_defaults, write_best
from nightshift.search.errors import BestConfigInvalid

UNSET = {"learning_rate": None, "batch_size": None, "momentum": None, "model_kwargs": None}


def best(**train_options: Any) -> dict[str, Any]:
    return {"study": "model_search__r1", "storage": "sqlite:////x/optuna.db", "trial": 5, "objective": "val_accuracy",
            "value": 0.93, "params": {}, "train_options": train_options, "data": "/d", "mlflow": {}}


def test_without_best_json_the_built_in_defaults_apply() -> None:
    resolved = training_defaults(UNSET)
    assert resolved["options"] == {"lr": 0.05, "batch_size": 32, "momentum": 0.9, "model": "digits_cnn",
                                   "model_kwargs": {}}
    assert set(resolved["sources"].values()) == {"built-in"} and resolved["best"] is None
    assert resolved["summary"] == "built-in defaults for lr, batch_size, momentum, model_kwargs (no best.json)"


def test_params_left_empty_take_best_json_and_explicit_ones_win(nightshift_home: Path) -> None:
    write_best(best(lr=0.2, batch_size=64, momentum=0.7, model_kwargs={"channels": 12}, epochs=9, seed=3))
    write_best(best(lr=0.25, batch_size=64, momentum=0.7, model_kwargs={"channels": 12}, epochs=9, seed=3))
    resolved = training_defaults({**UNSET, "batch_size": 16})
    assert resolved["options"] == {"lr": 0.25, "batch_size": 16, "momentum": 0.7, "model": "digits_cnn",
                                   "model_kwargs": {"channels": 12}}
    assert resolved["sources"] == {"lr": "best.json", "batch_size": "trigger", "momentum": "best.json",
                                   "model_kwargs": "best.json", "model": "built-in"}
    assert resolved["best"] == {"path": str(nightshift_home / "search" / "best.json"), "version": 2,
                                "study": "model_search__r1", "trial": 5, "value": 0.93,
                                "storage": "sqlite:////x/optuna.db"}
    assert resolved["not_applied"] == {"epochs": 9, "seed": 3}
    assert resolved["summary"] == "lr, momentum, model_kwargs from best.json v2 (study model_search__r1, trial 5)"


def test_the_model_comes_with_its_arguments() -> None:
    write_best(best(model="mlp", model_kwargs={"hidden": 8}))
    assert training_defaults(UNSET)["options"]["model"] == "mlp"
    explicit = training_defaults({**UNSET, "model_kwargs": {}})  # the trigger's arguments are the DAG model's
    assert explicit["options"]["model"] == "digits_cnn" and explicit["options"]["model_kwargs"] == {}
    assert explicit["sources"]["model_kwargs"] == "trigger"


def test_every_param_given_never_reads_the_file() -> None:
    best_path().parent.mkdir(parents=True)
    best_path().write_text("{not json")
    given = {"learning_rate": 0.1, "batch_size": 8, "momentum": 0.5, "model_kwargs": {"hidden": 4}}
    resolved = training_defaults(given)
    assert resolved["options"]["lr"] == 0.1 and resolved["summary"] == "trigger values"
    with pytest.raises(BestConfigInvalid):
        training_defaults({**given, "momentum": None})


@pytest.mark.parametrize("content, fragment", [
    ("{not json", "is not JSON"),
    ("[1, 2]", "must hold a JSON object, not list"),
    (json.dumps({"study": "s", "trial": 1, "version": 1}), "has no 'train_options' (dict)"),
    (json.dumps({**best(lr=0.1), "version": 1, "trial": "5"}), "has no 'trial' (int), got '5'"),
    (json.dumps({**best(lr=-1), "version": 1}), "train_options.lr must be a positive number, got -1"),
    (json.dumps({**best(batch_size=True), "version": 1}), "train_options.batch_size must be a positive integer"),
    (json.dumps({**best(momentum=1.5), "version": 1}), "train_options.momentum must be a number in [0, 1)"),
    (json.dumps({**best(model_kwargs=[1]), "version": 1}), "train_options.model_kwargs must be a JSON object"),
])
def test_a_malformed_best_json_is_refused_naming_the_file(content: str, fragment: str) -> None:
    best_path().parent.mkdir(parents=True)
    best_path().write_text(content)
    with pytest.raises(BestConfigInvalid) as caught:
        training_defaults(UNSET)
    message = str(caught.value)
    assert message.startswith(str(best_path())) and fragment in message, message
    assert "fix or delete it" in message


def test_model_kwargs_from_the_trigger_form_may_be_json_text() -> None:
    write_best(best(model_kwargs={"channels": 12}))
    assert training_defaults({**UNSET, "model_kwargs": '{"hidden": 8}'})["options"]["model_kwargs"] == {"hidden": 8}
    emptied = training_defaults({**UNSET, "model_kwargs": " "})  # an emptied field: best.json's
    assert emptied["options"]["model_kwargs"] == {"channels": 12} and emptied["sources"]["model_kwargs"] == "best.json"
    for bad, fragment in (("channels=8", "the model_kwargs Param is not JSON"), ("[8]", "must be a JSON object"),
                          (7, "must be a JSON object")):
        with pytest.raises(UsageError, match=fragment):
            training_defaults({**UNSET, "model_kwargs": bad})
