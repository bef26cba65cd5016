"""Nightshift's Airflow plugin: extra links on task pages, and a lineage page.

- Extra links (every task; a link is disabled when its task has nothing to point to): "MLflow run" (the
  training run, from the `mlflow_run_id` XCom of `train` and `report`; its experiment from the
  `mlflow_experiment_id` XCom, else MLflow's own run page finds it), "Model version" (the registered version, from
  the `model_version` XCom of `register`), "GX Data Docs" (the page of a failed validation, from the
  `data_docs` XCom of `validate_data`, served by this plugin) and "Search report" (the pictures of a
  `model_search` run, from the `report` XCom of its `finish` task, served by this plugin) and "Decision page"
  (the `evaluate` task's page of the night's decision, nightshift.decision_page, served by this plugin).
- A FastAPI app under `/nightshift`: `/nightshift/lineage?pipeline=<dag_id>` lists a pipeline's recent runs as
  dataset version -> model version -> deployment (from its run ledger in NIGHTSHIFT_HOME; without `pipeline`,
  `nightly_retrain`'s) and links the other pipelines' pages, `/nightshift/lineage.json?pipeline=<dag_id>` the
  same as JSON, `/nightshift/data-docs/...` the GX Data Docs pages. The page is also a nav entry; above its
  table a chart of the season (nightshift.season): the primary metric night by night, each night's decision,
  the dataset versions and the drift.
  `/nightshift/decisions/<dag_id>/<MLflow run id>/decision.html` serves a night's decision page (written by
  `evaluate` to NIGHTSHIFT_HOME/decisions/), linked from the lineage page and the `evaluate` task. A page or an
  MLflow run that `nightshift gc` removed (its removal log, nightshift.removals) is shown on the lineage page as
  removed, with when and why, instead of a link; the route answers 410 Gone with the same words.
  `/nightshift/search/` lists the model searches' report pages (NIGHTSHIFT_HOME/search/<pipeline>/<study>/
  report.html, written by `nightshift.search.report_html`; search/<study>/report.html before searches were per
  pipeline), `/nightshift/search/<pipeline>/<study>/report.html` serves one.

Every endpoint is behind Airflow's auth manager, as the REST API is: a request without a valid token
(the `Authorization: Bearer` header or the UI's `_token` cookie) gets 401, and a user who may not read the
runs of the pipeline's DAG gets 403 (run parameters, failure reasons and sample data values are the DAG's):
the lineage pages ask about the DAG `pipeline` names, and list only the pipelines the user may read; a Data
Docs page under `pipelines/<dag_id>/` asks about that DAG, any other page about `nightly_retrain`; a decision
page about the DAG its path names; a search
report of a pipeline asks about its search DAG (`<dag_id>__search`; nightly_retrain's and the older ones,
`model_search`), and the list of reports shows only those the user may open. `pipeline` must be a DAG id (it
names a folder), else 422; `limit` (lineage, searches) is 1..1000, else 422. `/nightshift/openapi.json` asks
for a login too; FastAPI's `/docs` and `/redoc` pages (scripts from a CDN) are off. Pages are served with a
Content-Security-Policy: GX Data Docs run no script (their CDN scripts and styles are blocked, see
DATA_DOCS_CSP), the lineage, decision and search index pages neither.
Set NIGHTSHIFT_MLFLOW_UI_URL to where the MLflow UI answers (default http://127.0.0.1:5000; `make airflow`
starts one there and sets it).
"""

from __future__ import annotations

import html
import os
import re
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import quote

from airflow.plugins_manager import AirflowPlugin
from airflow.sdk import BaseOperatorLink
from fastapi import Request  # FastAPI resolves the annotations of the app's dependencies in this module

from nightshift.decision_page import page_path
from nightshift.errors import DagIdInvalid, UsageError
from nightshift.ledger import dag_ids, read_records
from nightshift.pipelines.spec import SEARCH_DAG_SUFFIX
from nightshift.removals import airflow_run_cleaned, db_cleaned, describe, readable_when, removed_links
from nightshift.retention import LINEAGE_RUNS
from nightshift.search.report_html import REPORT_NAME
from nightshift.season import season_svg
from nightshift.settings import PIPELINE_DOCS, checked_dag_id, data_docs_dir, home, pipeline_data_docs_dir

DAG_ID = "nightly_retrain"
SEARCH_DAG_ID = "model_search"
PREFIX = "/nightshift"
RECENT = LINEAGE_RUNS  # the records shown by default; nightshift gc keeps their decision pages
MAX_LIMIT = 1000  # the most records or reports one request may ask for (`limit`: 1..MAX_LIMIT, else 422)

# Every page is served in the Airflow UI's origin, where the `_token` cookie authenticates API calls: no page
# of this plugin may run a script that is not its own or fetch anything from elsewhere.
# GX Data Docs pages load jQuery, Bootstrap and vega from CDNs (unpinned, no integrity) and inline scripts
# that need them; served here they run no script at all, and load only what lies beside them (GX's own
# static styles, fonts and images). Our suites' pages draw no chart; what is lost is Bootstrap's styling and
# interactivity (sorting, "show failed only"); the results are plain HTML and read the same.
DATA_DOCS_CSP = ("default-src 'none'; script-src 'none'; style-src 'self' 'unsafe-inline'; img-src 'self' data:; "
                 "font-src 'self' data:; frame-ancestors 'self'; base-uri 'none'; form-action 'none'")
PAGE_CSP = "default-src 'none'; style-src 'unsafe-inline'; frame-ancestors 'self'; base-uri 'none'; form-action 'none'"


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


def mlflow_run_url(run_id: str, experiment_id: str | None = None) -> str:
    """The MLflow UI's page of a run; without the experiment, MLflow's `#/runs/<id>` page looks it up."""
    if experiment_id:
        return f"{_mlflow_ui()}/#/experiments/{quote(str(experiment_id))}/runs/{quote(str(run_id))}"
    return f"{_mlflow_ui()}/#/runs/{quote(str(run_id))}"


class MlflowRunLink(BaseOperatorLink):
    name = "MLflow run"

    def get_link(self, operator: Any, *, ti_key: Any) -> str:
        run_id = _xcom(ti_key, "mlflow_run_id")
        if not run_id:
            return ""
        # `train` pushes its experiment; `report` (a dict returned as several XComs) only the run id.
        return mlflow_run_url(str(run_id), _xcom(ti_key, "mlflow_experiment_id"))


class ModelVersionLink(BaseOperatorLink):
    name = "Model version"

    def get_link(self, operator: Any, *, ti_key: Any) -> str:
        version = _xcom(ti_key, "model_version")
        if not isinstance(version, dict) or not version.get("version"):
            return ""
        return f"{_mlflow_ui()}/#/models/{quote(str(version['name']))}/versions/{quote(str(version['version']))}"


def data_docs_url(page: Any, prefix: str = PREFIX) -> str:
    """This plugin's URL of a Data Docs page (a file under the Data Docs root), or "" for any other path."""
    if not page:
        return ""
    try:
        relative = Path(str(page)).resolve().relative_to(data_docs_dir().resolve())
    except ValueError:
        return ""
    return f"{prefix}/data-docs/{quote(relative.as_posix())}"


class DataDocsLink(BaseOperatorLink):
    name = "GX Data Docs"

    def get_link(self, operator: Any, *, ti_key: Any) -> str:
        return data_docs_url(_xcom(ti_key, "data_docs"))


def decision_url(dag_id: str, run_id: Any, prefix: str = PREFIX, *, removed: bool | None = None) -> str:
    """This plugin's URL of the decision page of MLflow run `run_id` of the DAG `dag_id` (its route says when and
    why `nightshift gc` removed a page it removed), or "" when `evaluate` wrote none (a run from before decision
    pages, an evaluation that failed). `removed`: whether the removal log has it, when the caller read the log."""
    try:
        path = page_path(dag_id, str(run_id))
    except UsageError:
        return ""
    if not path.is_file():
        if removed is None:
            removed = ("decision_page", str(run_id)) in removed_links(dag_id)
        if not removed:
            return ""
    return f"{prefix}/decisions/{quote(dag_id, safe='')}/{quote(str(run_id), safe='')}/{path.name}"


class DecisionPageLink(BaseOperatorLink):
    name = "Decision page"

    def get_link(self, operator: Any, *, ti_key: Any) -> str:
        if ti_key.task_id != "evaluate":
            return ""
        decision = _xcom(ti_key, "return_value")
        if not isinstance(decision, dict) or not decision.get("run_id"):
            return ""
        return decision_url(ti_key.dag_id, decision["run_id"])


def search_root() -> Path:
    return home() / "search"


def search_report_url(page: Any, prefix: str = PREFIX) -> str:
    """This plugin's URL of a search report page (a `report.html` under NIGHTSHIFT_HOME/search), else ""."""
    if not page or Path(str(page)).name != REPORT_NAME:
        return ""
    try:
        relative = Path(str(page)).resolve().relative_to(search_root().resolve())
    except ValueError:
        return ""
    return f"{prefix}/search/{quote(relative.as_posix())}"


class SearchReportLink(BaseOperatorLink):
    name = "Search report"

    def get_link(self, operator: Any, *, ti_key: Any) -> str:
        if ti_key.dag_id != SEARCH_DAG_ID and not str(ti_key.dag_id).endswith(SEARCH_DAG_SUFFIX):
            return ""
        return search_report_url(_xcom(ti_key, "report"))


def search_dag_for(page: Path) -> str | None:
    """The search DAG whose readers may see the report `page` (a path under NIGHTSHIFT_HOME/search): a pipeline's
    search/<dag_id>/<study>/report.html is its search DAG's, `<dag_id>__search` (nightly_retrain's: model_search),
    an older search/<study>/report.html model_search's; None for any other path (no report of a search)."""
    try:
        parts = Path(page).resolve().relative_to(search_root().resolve()).parts
    except ValueError:
        return None
    if len(parts) == 2:
        return SEARCH_DAG_ID
    if len(parts) != 3 or parts[0] in (".", ".."):
        return None
    if parts[0] == DAG_ID:
        return SEARCH_DAG_ID
    try:
        return checked_dag_id(parts[0] + SEARCH_DAG_SUFFIX)
    except DagIdInvalid:  # a folder no DAG id names: nobody's
        return None


def search_reports(limit: int = RECENT, readable: Any = None) -> list[Path]:
    """The newest `limit` search report pages (search/<pipeline>/<study>/, or search/<study>/ from before searches
    were per pipeline), newest first; `readable(dag_id)`: only those of the search DAGs it says yes to."""
    root = search_root()
    pages = [p for pattern in (f"*/*/{REPORT_NAME}", f"*/{REPORT_NAME}") for p in root.glob(pattern) if p.is_file()]
    if readable is not None:
        pages = [p for p in pages if (dag_id := search_dag_for(p)) is not None and readable(dag_id)]
    return sorted(pages, key=lambda p: p.stat().st_mtime, reverse=True)[:limit]


def search_index_html(pages: list[Path]) -> str:
    rows = "\n".join(
        f"<tr><td>{_link(search_report_url(p, prefix='..'), p.parent.relative_to(search_root()).as_posix())}</td>"
        f"<td>{_cell(readable_time(datetime.fromtimestamp(p.stat().st_mtime, UTC).isoformat()))}</td></tr>"
        for p in pages) or "<tr><td colspan='2'>No search has written a report yet.</td></tr>"
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>Nightshift model searches</title>
<style>body{{font-family:sans-serif;margin:1.5em}} td,th{{padding:4px 8px;text-align:left}}</style></head>
<body><h2>model_search reports</h2><p>Newest first; each page shows a study's pictures and trials.</p>
<table><tr><th>pipeline/study</th><th>written</th></tr>
{rows}</table></body></html>"""


def lineage_records(limit: int = RECENT, pipeline: str = DAG_ID) -> list[dict[str, Any]]:
    """The newest `limit` (1..MAX_LIMIT) records of the run ledger of the DAG `pipeline`, newest first; a run
    refused by the data gate gets the Data Docs page of its failing split (the `data_docs` XCom of its
    `validate_data`) as `data_docs`. DagIdInvalid for a `pipeline` that is not a DAG id."""
    if not 1 <= limit <= MAX_LIMIT:  # 0 would read the whole ledger, a negative number drop its newest records
        raise ValueError(f"limit must be between 1 and {MAX_LIMIT}, got {limit}")
    records = list(reversed(read_records(checked_dag_id(pipeline), newest=limit)))
    for record in records:
        if record.get("failed_task") == "validate_data" and not record.get("data_docs") and record.get("run_id"):
            try:
                record["data_docs"] = _run_xcom(pipeline, str(record["run_id"]), "validate_data", "data_docs")
            except Exception:  # the page must show even when the metadata DB does not answer
                record["data_docs"] = None
    return records


def _run_xcom(dag_id: str, run_id: str, task_id: str, key: str) -> Any:
    from types import SimpleNamespace

    return _xcom(SimpleNamespace(dag_id=dag_id, run_id=run_id, task_id=task_id, map_index=-1), key)


def _cell(value: Any) -> str:
    return html.escape("" if value is None else str(value))


def _link(href: str, text: Any, title: Any = None) -> str:
    tip = f" title='{_cell(title)}'" if title else ""
    return f"<a href='{html.escape(href, quote=True)}'{tip}>{_cell(text)}</a>"


def readable_time(value: Any) -> str:
    """An ISO timestamp as "2026-11-22 02:03 UTC"; anything else unchanged."""
    if not value:
        return ""
    try:
        moment = datetime.fromisoformat(str(value))
    except ValueError:
        return str(value)
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return moment.astimezone(UTC).strftime("%Y-%m-%d %H:%M UTC")


def plain_outcome(outcome: Any) -> str:
    """The outcome without a status that repeats its first word: "promoted v1 (promoted)" -> "promoted v1"."""
    text = "" if outcome is None else str(outcome)
    repeated = re.fullmatch(r"(\w+)(.*?)\s*\((\w+)\)", text)
    if repeated and repeated.group(1) == repeated.group(3):
        return repeated.group(1) + repeated.group(2)
    return text.replace("(already_serving)", "(already serving)")


def _http_url(value: Any) -> str:
    url = "" if value is None else str(value)
    return url if url.startswith(("http://", "https://")) else ""


def _removed(what: str, entry: dict[str, Any]) -> str:
    """A link that `nightshift gc` took away: its name, struck through, with when and why."""
    return f"<span class='removed' title='{_cell(describe(entry))}'><s>{_cell(what)}</s> (removed)</span>"


def _row(r: dict[str, Any], dag_id: str = DAG_ID, gone: dict[tuple[str, str], dict[str, Any]] | None = None,
         cleaned: dict[str, Any] | None = None, airflow_keeps: str | None = None) -> str:
    """One run's row; `gone`: the pipeline's removal log (nightshift.removals.removed_links); `cleaned`: the last
    `airflow db clean` (nightshift.removals.db_cleaned); `airflow_keeps`: the run it keeps whatever its age."""
    gone = gone or {}
    gate = r.get("gate") or {}
    challenger = gate.get("challenger") or {}
    accuracy = f"{challenger['accuracy']:.4f}" if isinstance(challenger.get("accuracy"), (int, float)) else ""
    dataset = (r.get("dataset_version") or "")[:12]
    run_id = str(r.get("run_id") or "")
    # Relative links: this page is PREFIX/lineage, whatever base path the API server is under.
    run = _link(f"../dags/{quote(dag_id, safe='')}/runs/{quote(run_id, safe='')}", run_id) if run_id else ""
    if run_id and run_id != airflow_keeps and cleaned is not None and airflow_run_cleaned(r, cleaned):
        run = (f"<span class='removed' title='Airflow&#39;s record of this run was cleaned by the "
               f"nightshift_maintenance DAG on {_cell(readable_when(cleaned.get('cleaned_at')))} (runs started before "
               f"{_cell(readable_when(cleaned['before'].isoformat()))}; NIGHTSHIFT_AIRFLOW_DB_RETENTION_DAYS)'>"
               f"{_cell(run_id)}</span>")
    model = f"v{r['model_version']}" if r.get("model_version") else "—"
    serving_url = _http_url(r.get("serving_url"))
    serving = _link(serving_url, serving_url) if serving_url else "—"
    links = []
    mlflow_run = str(r.get("mlflow_run_id") or "")
    if mlflow_run and ("mlflow_run", mlflow_run) in gone:
        links.append(_removed("MLflow run", gone[("mlflow_run", mlflow_run)]))
    elif mlflow_run:
        experiment = r.get("mlflow_experiment_id") or r.get("experiment_id")
        links.append(_link(mlflow_run_url(mlflow_run, experiment), "MLflow run", title=mlflow_run))
    docs = data_docs_url(r.get("data_docs"), prefix=".")
    if docs:
        links.append(_link(docs, "GX Data Docs"))
    decided = decision_url(dag_id, mlflow_run, prefix=".", removed=False) if mlflow_run else ""
    if decided:
        links.append(_link(decided, "Decision page"))
    elif mlflow_run and ("decision_page", mlflow_run) in gone:
        links.append(_removed("Decision page", gone[("decision_page", mlflow_run)]))
    outcome = _cell(plain_outcome(r.get("outcome")))
    if r.get("reason"):
        outcome += f"<div class='reason'>{_cell(r.get('reason'))}</div>"
    return (f"<tr class='{_cell(r.get('status'))}'>"
            f"<td class='time' title='{_cell(r.get('recorded_at'))}'>{_cell(readable_time(r.get('recorded_at')))}</td>"
            f"<td class='run'>{run}</td><td>{_cell(r.get('status'))}</td>"
            f"<td title='{_cell(r.get('code_version'))}'>{_cell((r.get('code_version') or '')[:10])}</td>"
            f"<td title='{_cell(r.get('dataset_version'))}'>{_cell(dataset)}</td><td>→</td>"
            f"<td>{_cell(model)}</td><td>{_cell(accuracy)}</td><td>→</td><td class='url'>{serving}</td>"
            f"<td class='outcome'>{outcome}</td><td class='links'>{' '.join(links)}</td></tr>")


def removed_page_html(dag_id: str, run_id: str, entry: dict[str, Any]) -> str:
    """The answer (410 Gone) for a decision page `nightshift gc` removed: when, why, and where the decision is still
    told."""
    back = f"../../../lineage?pipeline={quote(dag_id, safe='')}"  # from PREFIX/decisions/<dag_id>/<run>/<page>
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>Decision page removed - Nightshift</title>"
            f"</head><body style='font-family:sans-serif;margin:1.5em'><h2>Decision page removed</h2>"
            f"<p>The decision page of MLflow run {_cell(run_id)} of {_cell(dag_id)} was "
            f"{_cell(describe(entry))}.</p><p>The run's row on the {_link(back, 'lineage page')} "
            f"still shows its decision (outcome, gate, metrics). Change how long pages are kept with the "
            f"pipeline's <code>retention</code> block (<code>keep_runs</code>, <code>resumable_days</code>).</p>"
            f"</body></html>")


def lineage_url(pipeline: str) -> str:
    """The lineage page of `pipeline`, relative to this page (PREFIX/lineage)."""
    return f"./lineage?pipeline={quote(pipeline, safe='')}"


def _pipeline_nav(pipeline: str, pipelines: list[str]) -> str:
    others = [name for name in pipelines if name != pipeline]
    if not others:
        return ""
    links = [f"<strong>{_cell(pipeline)}</strong>", *(_link(lineage_url(name), name) for name in others)]
    return f"<nav>Pipelines: {' | '.join(links)}</nav>"


def lineage_html(records: list[dict[str, Any]], pipeline: str = DAG_ID, pipelines: list[str] | None = None) -> str:
    """The lineage page of the DAG `pipeline`; `pipelines`: the others to link (those this user may read)."""
    empty = (f"No runs of {_cell(pipeline)} recorded yet: a run is recorded when it finishes. Is "
             f"{_cell(pipeline)} the DAG id of a pipeline?")
    gone, cleaned = removed_links(pipeline), db_cleaned()
    # `airflow db clean` keeps each DAG's newest run that was not triggered by hand, however old.
    keeps = next((str(r["run_id"]) for r in records if r.get("run_id") and not str(r["run_id"]).startswith("manual__")),
                 None)
    body = "\n".join(_row(r, pipeline, gone, cleaned, keeps) for r in records) or \
        f"<tr><td colspan='12'>{empty}</td></tr>"
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>{_cell(pipeline)} lineage - Nightshift</title>
<style>body{{font-family:sans-serif;margin:1.5em}}
table{{border-collapse:collapse;width:100%;max-width:100%}}
td,th{{border-bottom:1px solid #ddd;padding:4px 8px;text-align:left;font-size:14px;vertical-align:top}}
td{{overflow-wrap:anywhere;word-break:break-word}}
td.time{{white-space:nowrap}} td.run{{max-width:16em}} td.url{{max-width:14em}}
td.outcome{{max-width:40em;white-space:normal}} td.links{{white-space:nowrap}}
div.reason{{color:#555;font-size:13px;margin-top:2px;white-space:pre-wrap}}
tr.failed td{{color:#a00}} span.removed{{color:#777}}
nav{{margin-bottom:.8em}} svg.season{{max-width:100%;height:auto}}</style></head>
<body>{_pipeline_nav(pipeline, pipelines or [])}<h2>{_cell(pipeline)} lineage</h2>
{season_svg(records)}
<p>Recent runs, newest first: dataset version → model version → deployment. Times in UTC.</p>
<table><tr><th>recorded</th><th>run</th><th>status</th><th>code</th><th>dataset</th><th></th><th>model</th>
<th>test accuracy</th><th></th><th>serving</th><th>outcome</th><th>links</th></tr>
{body}</table></body></html>"""


def _require_dag_runs_read(dag_id: str | None = DAG_ID) -> Any:
    """The API server's own check: may this user read the runs of `dag_id`? None: of the DAG the route's
    `dag_id` path parameter names."""
    from airflow.api_fastapi.auth.managers.models.resource_details import DagAccessEntity
    from airflow.api_fastapi.core_api.security import requires_access_dag

    return requires_access_dag(method="GET", access_entity=DagAccessEntity.RUN, param_dag_id=dag_id)


def create_app() -> Any:
    from airflow.api_fastapi.core_api.security import get_user
    from fastapi import APIRouter, Depends, FastAPI, HTTPException, Query
    from fastapi.responses import FileResponse, HTMLResponse, JSONResponse

    from nightshift.search.report_html import CSP as REPORT_CSP

    # FastAPI's own /openapi.json, /docs and /redoc answer without a login, and the two pages load Swagger UI
    # and ReDoc from a CDN: off. The description is served below, to a logged-in user only.
    app = FastAPI(title="Nightshift", description="pipelines' lineage and GX Data Docs; model search reports",
                  openapi_url=None, docs_url=None, redoc_url=None)
    page_headers = {"Content-Security-Policy": PAGE_CSP, "X-Content-Type-Options": "nosniff"}
    docs_headers = {"Content-Security-Policy": DATA_DOCS_CSP, "X-Content-Type-Options": "nosniff"}
    limit_query = Query(RECENT, ge=1, le=MAX_LIMIT, description=f"how many, newest first (1..{MAX_LIMIT})")
    pipeline_query = Query(DAG_ID, description=f"the DAG id of the pipeline (default {DAG_ID})")
    logged_in = Depends(get_user)
    lineage = APIRouter()
    pipeline_docs = APIRouter(dependencies=[Depends(_require_dag_runs_read(None))])  # the path's dag_id
    nightly = APIRouter(dependencies=[Depends(_require_dag_runs_read(DAG_ID))])
    search = APIRouter()  # each report asks about its own search DAG (search_dag_for)

    def may_read(request: Request, user: Any, dag_id: str) -> bool:
        try:
            _require_dag_runs_read(dag_id)(request, user)
        except HTTPException as err:
            if err.status_code == 403:
                return False
            raise
        return True

    def readable_pipeline(request: Request, pipeline: str = pipeline_query, user: Any = logged_in) -> str:
        """`pipeline`, once it is known to be a DAG id (it names the ledger's folder) whose runs this user may
        read (Airflow's own check, for the DAG the query names; the login is asked first)."""
        try:
            dag_id = checked_dag_id(pipeline)
        except DagIdInvalid as err:
            raise HTTPException(status_code=422, detail=f"pipeline: {err}") from err
        _require_dag_runs_read(dag_id)(request, user)
        return dag_id

    def readable_pipelines(request: Request, user: Any = logged_in) -> list[str]:
        """The DAGs with a ledger whose runs this user may read: the page links no pipeline that would answer
        403, and shows nobody the name of a pipeline they may not read."""
        return [dag_id for dag_id in dag_ids() if may_read(request, user, dag_id)]

    pipeline_readable, others_readable = Depends(readable_pipeline), Depends(readable_pipelines)

    # Return annotations are left out: with postponed evaluation FastAPI would have to resolve names
    # imported inside this function, and /openapi.json answered 500 when it could not.
    @app.get("/openapi.json", include_in_schema=False, dependencies=[Depends(get_user)])
    def openapi():  # type: ignore[no-untyped-def]
        return JSONResponse(app.openapi())

    @lineage.get("/lineage", response_class=HTMLResponse)
    def lineage_page(limit: int = limit_query, pipeline: str = pipeline_readable,  # type: ignore[no-untyped-def]
                     pipelines: list[str] = others_readable):
        page = lineage_html(lineage_records(limit, pipeline), pipeline, pipelines)
        return HTMLResponse(page, headers=page_headers)

    @lineage.get("/lineage.json")
    def lineage_json(limit: int = limit_query, pipeline: str = pipeline_readable):  # type: ignore[no-untyped-def]
        return JSONResponse(lineage_records(limit, pipeline), headers={"X-Content-Type-Options": "nosniff"})

    def data_docs_page(root: Path, path: str) -> Any:
        root = root.resolve()
        target = (root / path).resolve()
        if root not in target.parents or not target.is_file():
            raise HTTPException(status_code=404, detail="no such Data Docs page")
        return FileResponse(target, headers=docs_headers)

    @pipeline_docs.get("/data-docs/pipelines/{dag_id}/{path:path}")
    def pipeline_data_docs(dag_id: str, path: str):  # type: ignore[no-untyped-def]
        try:
            root = pipeline_data_docs_dir(dag_id)
        except DagIdInvalid as err:
            raise HTTPException(status_code=404, detail="no such Data Docs page") from err
        return data_docs_page(root, path)

    @nightly.get("/data-docs/{path:path}")
    def data_docs(path: str):  # type: ignore[no-untyped-def]
        # Only pages no pipeline owns: a pipeline's pages answer above, to those who may read its runs.
        if (data_docs_dir().resolve() / PIPELINE_DOCS) in (data_docs_dir().resolve() / path).resolve().parents:
            raise HTTPException(status_code=404, detail="no such Data Docs page")
        return data_docs_page(data_docs_dir(), path)

    @pipeline_docs.get("/decisions/{dag_id}/{path:path}")
    def decision_page(dag_id: str, path: str):  # type: ignore[no-untyped-def]
        run_id, _, name = path.partition("/")
        try:
            target = page_path(dag_id, run_id)
        except UsageError as err:
            raise HTTPException(status_code=404, detail="no such decision page") from err
        # No link below decisions/ is followed (a run's folder linked to another DAG's would show that DAG's
        # page to this DAG's readers): `evaluate` writes plain folders. decisions/ itself may be a link.
        real = (home() / "decisions").resolve() / dag_id / run_id / target.name
        gone = removed_links(dag_id).get(("decision_page", run_id))
        if name == target.name and gone is not None and not target.exists() and not target.parent.is_symlink():
            return HTMLResponse(removed_page_html(dag_id, run_id, gone), status_code=410, headers=page_headers)
        if name != target.name or not target.is_file() or target.resolve() != real:
            raise HTTPException(status_code=404, detail="no such decision page: `evaluate` writes one per night "
                                                        "(decisions/<dag_id>/<MLflow run id>/decision.html)")
        return FileResponse(real, media_type="text/html", headers=page_headers)

    @search.get("/search/", response_class=HTMLResponse)
    def search_index(request: Request, limit: int = limit_query,  # type: ignore[no-untyped-def]
                     user: Any = logged_in):
        # Only the reports of search DAGs this user may read: nobody sees another team's pipeline named.
        answers: dict[str, bool] = {}

        def readable(dag_id: str) -> bool:
            if dag_id not in answers:
                answers[dag_id] = may_read(request, user, dag_id)
            return answers[dag_id]

        return HTMLResponse(search_index_html(search_reports(limit, readable)), headers=page_headers)

    @search.get("/search/{path:path}")
    def search_report(request: Request, path: str, user: Any = logged_in):  # type: ignore[no-untyped-def]
        root = search_root().resolve()
        target = (root / path).resolve()
        dag_id = search_dag_for(target) if target.name == REPORT_NAME and root in target.parents else None
        missing = HTTPException(status_code=404, detail="no such search report: a model search writes "
                                                        "search/<pipeline>/<study>/report.html when it finishes")
        if dag_id is None:
            raise missing
        _require_dag_runs_read(dag_id)(request, user)  # the pipeline's search DAG's readers only (else 403)
        if not target.is_file():
            raise missing
        # The page's own policy (inlined plotly.js, no request of any kind), also as a header.
        return FileResponse(target, media_type="text/html",
                            headers={"Content-Security-Policy": REPORT_CSP, "X-Content-Type-Options": "nosniff"})

    app.include_router(lineage)
    app.include_router(pipeline_docs)  # before `nightly`'s /data-docs/{path}, which would match its paths too
    app.include_router(nightly)
    app.include_router(search)
    return app


class NightshiftPlugin(AirflowPlugin):
    name = "nightshift"
    global_operator_extra_links = [MlflowRunLink(), ModelVersionLink(), DataDocsLink(), SearchReportLink(),
                                   DecisionPageLink()]
    fastapi_apps = [{"app": create_app(), "url_prefix": PREFIX, "name": "Nightshift lineage"}]
    external_views = [{"name": "Nightshift lineage", "href": f"{PREFIX}/lineage", "destination": "nav",
                       "url_route": "nightshift-lineage"},
                      {"name": "Nightshift searches", "href": f"{PREFIX}/search/", "destination": "nav",
                       "url_route": "nightshift-searches"}]
