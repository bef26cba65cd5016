"""A pipeline's training parameters from its best.json (nightshift.search.best.training_defaults): each pipeline
reads its own (NIGHTSHIFT_HOME/search/<dag_id>/best.json), nightly_retrain also the one from before searches were
per pipeline."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from nightshift.errors import UsageError
from nightshift.search.best import best_path, legacy_best_path, training_defaults, write_best
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
    assert resolved["best"] == {"path": str(nightshift_home / "search" / "nightly_retrain" / "best.json"), "version": 2,
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


def test_two_pipelines_searches_keep_their_own_best_json(nightshift_home: Path) -> None:
    mine = write_best({**best(lr=0.2), "pipeline": "nightly_retrain"})
    theirs = write_best({**best(lr=0.01), "pipeline": "diabetes_retrain", "objective": "val_rmse", "value": 55.0})
    again = write_best({**best(lr=0.02), "pipeline": "diabetes_retrain", "objective": "val_rmse", "value": 52.0})
    assert (mine["version"], theirs["version"], again["version"]) == (1, 1, 2), "each file versions on its own"
    assert best_path("diabetes_retrain") == nightshift_home / "search" / "diabetes_retrain" / "best.json"
    assert sorted(p.name for p in best_path("diabetes_retrain").parent.glob("best*")) == [
        "best-v1.json", "best-v2.json", "best.json"]
    assert json.loads(best_path().read_text())["train_options"] == {"lr": 0.2}, "the other search left it alone"
    assert training_defaults(UNSET, pipeline="nightly_retrain")["options"]["lr"] == 0.2
    resolved = training_defaults(UNSET, pipeline="diabetes_retrain")
    assert resolved["options"]["lr"] == 0.02 and resolved["best"]["path"] == str(best_path("diabetes_retrain"))
    assert training_defaults(UNSET, pipeline="cancer_retrain")["summary"].endswith("(no best.json)")


def test_the_best_json_from_before_pipelines_is_read_for_nightly_retrain_only(nightshift_home: Path) -> None:
    write_best(best(lr=0.3), legacy_best_path())  # NIGHTSHIFT_HOME/search/best.json, naming no pipeline
    assert legacy_best_path() == nightshift_home / "search" / "best.json"
    legacy = training_defaults(UNSET, pipeline="nightly_retrain")
    assert legacy["options"]["lr"] == 0.3 and legacy["best"]["path"] == str(legacy_best_path())
    other = training_defaults(UNSET, pipeline="digits_copy")
    assert other["options"]["lr"] == 0.05 and other["summary"].endswith("(no best.json)")
    write_best({**best(lr=0.4), "pipeline": "nightly_retrain"})  # nightly_retrain's own, once a search wrote it
    assert training_defaults(UNSET, pipeline="nightly_retrain")["options"]["lr"] == 0.4
    assert json.loads(legacy_best_path().read_text())["train_options"] == {"lr": 0.3}, "never written again"


def test_a_best_json_in_another_pipelines_folder_is_not_read() -> None:
    """A file copied into the wrong folder: its own `pipeline` says whose it is."""
    best_path("cancer_retrain").parent.mkdir(parents=True)
    best_path("cancer_retrain").write_text(json.dumps({**best(lr=0.3), "pipeline": "diabetes_retrain", "version": 1}))
    resolved = training_defaults(UNSET, pipeline="cancer_retrain")
    assert resolved["options"]["lr"] == 0.05 and "best.json is for pipeline 'diabetes_retrain'" in resolved["summary"]
