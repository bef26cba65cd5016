"""Nightshift's Airflow plugin: extra links on task pages, and a lineage page.

- Extra links (every task; a link is disabled when its task has nothing to point to): "MLflow run" (the
  training run, from the `mlflow_run_id` XCom of `train`), "Model version" (the registered version, from
  the `model_version` XCom of `register`) and "GX Data Docs" (the page of a failed validation, from the
  `data_docs` XCom of `validate_data`, served by this plugin).
- A FastAPI app under `/nightshift`: `/nightshift/lineage` lists recent `nightly_retrain` runs as dataset
  version -> model version -> deployment (from the run ledger in NIGHTSHIFT_HOME), `/nightshift/lineage.json`
  the same as JSON, `/nightshift/data-docs/...` the GX Data Docs pages. The page is also a nav entry.

Every endpoint is behind Airflow's auth manager, as the REST API is: a request without a valid token
(the `Authorization: Bearer` header or the UI's `_token` cookie) gets 401, and a user who may not read
`nightly_retrain`'s runs gets 403 (run parameters, failure reasons and sample data values are the DAG's).
Set NIGHTSHIFT_MLFLOW_UI_URL to where the MLflow UI answers (default http://127.0.0.1:5000).
"""

from __future__ import annotations

import html
import os
from pathlib import Path
from typing import Any
from urllib.parse import quote

from airflow.plugins_manager import AirflowPlugin
from airflow.sdk import BaseOperatorLink

from nightshift.ledger import read_records
from nightshift.settings import data_docs_dir

DAG_ID = "nightly_retrain"
PREFIX = "/nightshift"
RECENT = 50


def _mlflow_ui() -> str:
    return os.environ.get("NIGHTSHIFT_MLFLOW_UI_URL", "http://127.0.0.1:5000").rstrip("/")


def _xcom(ti_key: Any, key: str) -> Any:
    """The XCom `key` of the task instance `ti_key`, read from the metadata DB (the API server's side)."""
    from airflow.models.xcom import XComModel
    from airflow.utils.session import create_session

    with create_session() as session:
        query = XComModel.get_many(run_id=ti_key.run_id, key=key, task_ids=ti_key.task_id,
                                   dag_ids=ti_key.dag_id, map_indexes=ti_key.map_index).limit(1)
        row = session.scalars(query).first()
        return XComModel.deserialize_value(row) if row is not None else None


class MlflowRunLink(BaseOperatorLink):
    name = "MLflow run"

    def get_link(self, operator: Any, *, ti_key: Any) -> str:
        run_id = _xcom(ti_key, "mlflow_run_id")
        if not run_id:
            return ""
        experiment = _xcom(ti_key, "mlflow_experiment_id") or "0"
        return f"{_mlflow_ui()}/#/experiments/{quote(str(experiment))}/runs/{quote(str(run_id))}"


class ModelVersionLink(BaseOperatorLink):
    name = "Model version"

    def get_link(self, operator: Any, *, ti_key: Any) -> str:
        version = _xcom(ti_key, "model_version")
        if not isinstance(version, dict) or not version.get("version"):
            return ""
        return f"{_mlflow_ui()}/#/models/{quote(str(version['name']))}/versions/{quote(str(version['version']))}"


class DataDocsLink(BaseOperatorLink):
    name = "GX Data Docs"

    def get_link(self, operator: Any, *, ti_key: Any) -> str:
        page = _xcom(ti_key, "data_docs")
        if not page:
            return ""
        try:
            relative = Path(str(page)).resolve().relative_to(data_docs_dir().resolve())
        except ValueError:
            return ""
        return f"{PREFIX}/data-docs/{quote(relative.as_posix())}"


def lineage_records(limit: int = RECENT) -> list[dict[str, Any]]:
    """The newest `limit` records of the run ledger, newest first."""
    return list(reversed(read_records(DAG_ID, newest=limit)))


def _cell(value: Any) -> str:
    return html.escape("" if value is None else str(value))


def lineage_html(records: list[dict[str, Any]]) -> str:
    rows = []
    for r in records:
        gate = r.get("gate") or {}
        challenger = gate.get("challenger") or {}
        accuracy = f"{challenger['accuracy']:.4f}" if "accuracy" in challenger else ""
        dataset = (r.get("dataset_version") or "")[:12]
        model = f"v{r['model_version']}" if r.get("model_version") else "—"
        serving = r.get("serving_url") or "—"
        rows.append(
            f"<tr class='{_cell(r.get('status'))}'><td>{_cell(r.get('recorded_at'))}</td>"
            f"<td>{_cell(r.get('run_id'))}</td><td>{_cell(r.get('status'))}</td>"
            f"<td title='{_cell(r.get('dataset_version'))}'>{_cell(dataset)}</td><td>→</td>"
            f"<td>{_cell(model)}</td><td>{_cell(accuracy)}</td><td>→</td><td>{_cell(serving)}</td>"
            f"<td>{_cell(r.get('outcome'))}{': ' + _cell(r.get('reason')) if r.get('reason') else ''}</td></tr>")
    body = "\n".join(rows) or "<tr><td colspan='10'>No runs recorded yet.</td></tr>"
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>Nightshift lineage</title>
<style>body{{font-family:sans-serif;margin:1.5em}}table{{border-collapse:collapse}}
td,th{{border-bottom:1px solid #ddd;padding:4px 8px;text-align:left;font-size:14px}}
tr.failed td{{color:#a00}}</style></head>
<body><h2>nightly_retrain lineage</h2>
<p>Recent runs, newest first: dataset version → model version → deployment.</p>
<table><tr><th>recorded</th><th>run</th><th>status</th><th>dataset</th><th></th><th>model</th>
<th>test accuracy</th><th></th><th>serving</th><th>outcome</th></tr>
{body}</table></body></html>"""


def _require_dag_runs_read() -> Any:
    """The API server's own check: may this user read the runs of `nightly_retrain`?"""
    from airflow.api_fastapi.auth.managers.models.resource_details import DagAccessEntity
    from airflow.api_fastapi.core_api.security import requires_access_dag

    return requires_access_dag(method="GET", access_entity=DagAccessEntity.RUN, param_dag_id=DAG_ID)


def create_app() -> Any:
    from fastapi import Depends, FastAPI, HTTPException
    from fastapi.responses import FileResponse, HTMLResponse, JSONResponse

    app = FastAPI(title="Nightshift", description="nightly_retrain lineage and GX Data Docs",
                  dependencies=[Depends(_require_dag_runs_read())])

    # Return annotations are left out: with postponed evaluation FastAPI would have to resolve names
    # imported inside this function, and /openapi.json answered 500 when it could not.
    @app.get("/lineage", response_class=HTMLResponse)
    def lineage_page(limit: int = RECENT):  # type: ignore[no-untyped-def]
        return HTMLResponse(lineage_html(lineage_records(limit)))

    @app.get("/lineage.json")
    def lineage_json(limit: int = RECENT):  # type: ignore[no-untyped-def]
        return JSONResponse(lineage_records(limit))

    @app.get("/data-docs/{path:path}")
    def data_docs(path: str):  # type: ignore[no-untyped-def]
        root = data_docs_dir().resolve()
        target = (root / path).resolve()
        if root not in target.parents or not target.is_file():
            raise HTTPException(status_code=404, detail="no such Data Docs page")
        return FileResponse(target)

    return app


class NightshiftPlugin(AirflowPlugin):
    name = "nightshift"
    global_operator_extra_links = [MlflowRunLink(), ModelVersionLink(), DataDocsLink()]
    fastapi_apps = [{"app": create_app(), "url_prefix": PREFIX, "name": "Nightshift lineage"}]
    external_views = [{"name": "Nightshift lineage", "href": f"{PREFIX}/lineage", "destination": "nav",
                       "url_route": "nightshift-lineage"}]
