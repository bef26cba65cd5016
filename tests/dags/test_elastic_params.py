"""nightly_retrain's Params `min_workers` / `max_workers` (issue 26): both empty by default (a fixed-size job, the
manifest unchanged), both set make the train task's JobConfig elastic."""

from __future__ import annotations

import sys
from dataclasses import replace
from typing import Any

import pytest

from tests.dags.conftest import REPO


@pytest.fixture
def train(monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setenv("NIGHTSHIFT_HOME", "/workspace")
    monkeypatch.syspath_prepend(str(REPO / "dags"))  # as Airflow puts the DAG folder on sys.path
    sys.modules.pop("nightly_retrain", None)
    import nightly_retrain

    return nightly_retrain.dag


def rendered_job(dag: Any, params: dict[str, Any]) -> Any:
    """The train task's JobConfig settled from `params`, as execute settles it (only the count fields and
    `elastic` are rendered: the others need a task instance's XComs)."""
    task = dag.get_task("train")
    names = ("num_workers", "gpus_per_worker", "gpus", "elastic")
    for name in names:
        setattr(task, name, getattr(task.job, name))  # the templates, as the DAG file declares them
    task._do_render_template_fields(task, names, {"params": params}, task.get_template_env(), set())
    return replace(task.job, **{name: getattr(task, name) for name in names}).settled()


def test_the_params_default_to_not_elastic_and_say_so(train: Any) -> None:
    for name in ("min_workers", "max_workers"):
        param = train.params.get_param(name)
        assert param.value is None and "Empty: not elastic" in param.description
        assert param.schema["type"] == ["null", "integer"] and param.schema["minimum"] == 1
    assert "Ignored when max_workers is set" in train.params.get_param("workers").description
    defaults = {name: train.params[name] for name in train.params}
    job = rendered_job(train, defaults)
    assert job.elastic is None and job.elastic_range() is None and job.num_workers == defaults["workers"]


def test_both_params_make_the_train_job_elastic(train: Any) -> None:
    params = {name: train.params[name] for name in train.params} | {"workers": 2, "min_workers": 1,
                                                                     "max_workers": 3}
    job = rendered_job(train, params)
    assert job.elastic_range() == (1, 3) and job.num_workers == 3
