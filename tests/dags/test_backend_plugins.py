"""The DAGs' `backend` and `deploy_target` Params list what the registries hold: a backend and a target that a
NIGHTSHIFT_PLUGINS module registers appear in them (and a declaration may name them) without editing the
project; a declared backend nobody registered fails its own DAG file, naming the choices."""

from __future__ import annotations

import runpy
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.dags.conftest import REPO
from tests.dags.test_pipeline_factory import _declare
from tests.unit.operators.test_backends import forget_toy_plugin, install_toy_plugin

DAGS = REPO / "dags"


@pytest.fixture(autouse=True)
def toy_plugin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.delenv("NIGHTSHIFT_BACKEND", raising=False)
    monkeypatch.syspath_prepend(str(DAGS))  # as Airflow puts the DAG folder on sys.path
    plugin_dir = tmp_path / "plugin"
    plugin_dir.mkdir()
    install_toy_plugin(plugin_dir, monkeypatch)
    yield
    forget_toy_plugin()


def _enum(dag: object, name: str) -> list[str]:
    return list(dag.params.get_param(name).schema["enum"])  # type: ignore[attr-defined]


def test_the_param_enums_come_from_the_registries() -> None:
    retrain = runpy.run_path(str(DAGS / "nightly_retrain.py"), run_name="nightly_retrain_under_test")["dag"]
    search = runpy.run_path(str(DAGS / "model_search.py"), run_name="model_search_under_test")["dag"]
    assert _enum(retrain, "backend") == _enum(search, "backend") == ["hosts", "kubernetes", "local", "toy", "auto"]
    assert _enum(retrain, "deploy_target") == ["local", "kserve", "toy-serve"]
    assert "`toy`" in retrain.doc_md and "`toy-serve`" in retrain.doc_md and "`toy`" in search.doc_md


def test_a_declaration_may_name_a_plugins_backend_and_target_but_no_unknown_one(tmp_path: Path) -> None:
    from nightly_tasks import factory

    dag = factory.pipeline_dag(_declare(tmp_path, "toyed", **{"training.backend": "toy",
                                                               "deploy.target": "toy-serve"}))
    assert dag.params.get_param("backend").value == "toy"
    assert dag.params.get_param("deploy_target").value == "toy-serve"
    bad = factory.pipeline_dag(_declare(tmp_path, "slurmed", dag_id="slurmed", model_name="slurmed",
                                        **{"training.backend": "slurm", "dataset.asset": "slurmed"}))
    assert isinstance(bad, factory.InvalidPipelineDag)
    assert "training.backend: unknown training backend 'slurm'; choose one of hosts, kubernetes, local, toy, auto" \
        in str(bad.problem)
