"""The plugin's FastAPI app (plugins/nightshift_plugin.py `create_app`) in-process, with a TestClient.

Anonymous requests reach Airflow's own auth dependency (`get_user`), which answers 401 before it needs an
auth manager or a database. A logged-in user is stood in for by overriding `get_user`, and the auth manager
by one that lets the user read the runs of the DAGs a test names: Airflow's own `requires_access_dag` still
decides (the real auth managers' 403/200 is tests/integration/test_plugin_auth.py's business).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest

from tests.unit.test_lineage_page import plugin

__all__ = ["plugin"]  # the shared fixture, used here by name

PUBLIC: set[str] = set()  # no route of the plugin answers without a login


@pytest.fixture
def app(plugin: ModuleType) -> Any:
    return plugin.create_app()


def client(app: Any) -> Any:
    from fastapi.testclient import TestClient

    return TestClient(app, raise_server_exceptions=False)


class DagReaders:
    """An auth manager: a user may read the DAGs in its `readable` (None: every DAG) and nothing else."""

    def __init__(self) -> None:
        self.asked: list[Any] = []

    def is_authorized_dag(self, *, method: Any, user: Any, access_entity: Any = None, details: Any = None) -> bool:
        dag_id = getattr(details, "id", None)
        self.asked.append((method, str(access_entity), dag_id))
        return user.readable is None or dag_id in user.readable


@pytest.fixture
def auth(monkeypatch: pytest.MonkeyPatch) -> DagReaders:
    from airflow.api_fastapi.core_api import security
    from airflow.models.dag import DagModel

    manager = DagReaders()
    monkeypatch.setattr(security, "get_auth_manager", lambda: manager)
    monkeypatch.setattr(DagModel, "get_team_name", staticmethod(lambda dag_id, **_: None))  # no metadata DB
    return manager


@pytest.fixture
def as_user(plugin: ModuleType, auth: DagReaders) -> Callable[..., Any]:
    """as_user(*dag_ids): a client of another instance of the app, logged in as a user who may read the runs
    of `dag_ids` only (none named: of every DAG)."""
    from airflow.api_fastapi.core_api.security import get_user

    def make(*readable: str) -> Any:
        user = SimpleNamespace(username="someone", readable=set(readable) if readable else None)
        app = plugin.create_app()
        app.dependency_overrides[get_user] = lambda: user
        return client(app)

    return make


@pytest.fixture
def logged_in(as_user: Callable[..., Any]) -> Any:
    """A client whose user may read every DAG's runs."""
    return as_user()


def concrete(path: str) -> str:
    """A URL that the route `path` matches: each path parameter filled in."""
    return re.sub(r"\{[^}]+\}", "x/index.html", path)


def test_every_route_needs_a_login(app: Any) -> None:
    anonymous = client(app)
    routes = [(method, route.path) for route in app.routes for method in sorted(getattr(route, "methods", ()))
              if method != "HEAD"]
    assert ("GET", "/lineage") in routes and ("GET", "/data-docs/{path:path}") in routes
    answers = {(method, path): anonymous.request(method, concrete(path)).status_code for method, path in routes
               if path not in PUBLIC}
    assert answers and all(status == 401 for status in answers.values()), answers


def test_the_api_description_is_behind_the_login_and_the_docs_pages_are_off(app: Any, logged_in: Any) -> None:
    assert client(app).get("/openapi.json").status_code == 401
    described = logged_in.get("/openapi.json")
    assert described.status_code == 200 and "/lineage.json" in described.json()["paths"]
    for page in ("/docs", "/redoc", "/docs/oauth2-redirect"):  # Swagger UI and ReDoc load scripts from a CDN
        assert logged_in.get(page).status_code == 404, page


@pytest.mark.parametrize("path", ["/lineage", "/lineage.json", "/search/"])
def test_limit_is_between_1_and_1000(logged_in: Any, app: Any, path: str) -> None:
    for bad in ("0", "-1", "1001", "x"):
        assert logged_in.get(path, params={"limit": bad}).status_code == 422, bad
    for good in ("1", "1000"):
        assert logged_in.get(path, params={"limit": good}).status_code == 200, good
    assert logged_in.get(path).status_code == 200
    assert client(app).get(path, params={"limit": "0"}).status_code == 401  # the login is asked first


def test_limit_keeps_the_newest_records(logged_in: Any, plugin: ModuleType) -> None:
    from nightshift.ledger import append_record

    for n in range(3):
        append_record(plugin.DAG_ID, {"run_id": f"r{n}", "status": "success"})
    assert [r["run_id"] for r in logged_in.get("/lineage.json", params={"limit": 2}).json()] == ["r2", "r1"]
    with pytest.raises(ValueError, match="limit"):
        plugin.lineage_records(0)


def csp(response: Any) -> dict[str, str]:
    policy = response.headers.get("content-security-policy", "")
    directives = [d.strip().partition(" ") for d in policy.split(";") if d.strip()]
    return {name: sources.strip() for name, _, sources in directives}


def test_data_docs_pages_run_no_script_and_fetch_nothing_from_elsewhere(logged_in: Any,
                                                                       nightshift_home: Path) -> None:
    page = nightshift_home / "gx" / "data_docs" / "run" / "index.html"
    page.parent.mkdir(parents=True)
    page.write_text('<html><head><script src="https://cdn.jsdelivr.net/npm/vega@5"></script></head></html>')
    answer = logged_in.get("/data-docs/run/index.html")
    assert answer.status_code == 200 and "vega@5" in answer.text  # the page as GX wrote it, under a policy:
    policy = csp(answer)
    assert policy.get("default-src") == "'none'" and policy.get("script-src") == "'none'", policy
    for directive, sources in policy.items():
        assert not re.search(r"https?:|\*|//", sources), (directive, sources)  # no third-party origin
    assert policy.get("frame-ancestors") == "'self'"  # the Airflow UI may frame it, nobody else
    assert answer.headers.get("x-content-type-options") == "nosniff"


def test_the_plugins_own_pages_run_no_script(logged_in: Any) -> None:
    for path in ("/lineage", "/search/"):
        policy = csp(logged_in.get(path))
        assert policy.get("default-src") == "'none'" and "script-src" not in policy, (path, policy)


def test_each_pipeline_shows_its_own_runs_and_the_default_is_nightly_retrain(as_user: Callable[..., Any]) -> None:
    from nightshift.ledger import append_record

    append_record("nightly_retrain", {"run_id": "digits-run", "status": "success"})
    append_record("churn_model", {"run_id": "churn-run", "status": "success", "dataset_version": "c0ffee"})
    user = as_user()
    assert [r["run_id"] for r in user.get("/lineage.json").json()] == ["digits-run"]  # old links: as before
    assert [r["run_id"] for r in user.get("/lineage.json", params={"pipeline": "churn_model"}).json()] == ["churn-run"]
    page = user.get("/lineage", params={"pipeline": "churn_model"})
    assert page.status_code == 200 and "<h2>churn_model lineage</h2>" in page.text and "c0ffee" in page.text
    assert "digits-run" not in page.text and "href='./lineage?pipeline=nightly_retrain'" in page.text
    unknown = user.get("/lineage", params={"pipeline": "no_such_dag"})  # no ledger: an empty page, not a 500
    assert unknown.status_code == 200 and "No runs of no_such_dag recorded yet" in unknown.text
    assert user.get("/lineage.json", params={"pipeline": "no_such_dag"}).json() == []


NOT_DAG_IDS = ("../x", "..", ".", "a/b", "/etc", "x" * 251, "", "-x", "nightly_retrain\n", "a b")


def test_a_pipeline_that_is_not_a_dag_id_is_refused_before_it_names_a_path(as_user: Callable[..., Any], auth: Any,
                                                                           app: Any, nightshift_home: Path,
                                                                           plugin: ModuleType) -> None:
    from nightshift.errors import DagIdInvalid

    # Where "..", "../x" and "." would lead the ledger path: never read.
    for ledger in (nightshift_home / "runs.jsonl", nightshift_home / "x" / "runs.jsonl",
                   nightshift_home / "airflow" / "runs.jsonl"):
        ledger.parent.mkdir(parents=True, exist_ok=True)
        ledger.write_text('{"run_id": "secret-run"}\n')
    user, anonymous = as_user(), client(app)
    for bad in NOT_DAG_IDS:
        for path in ("/lineage", "/lineage.json"):
            answer = user.get(path, params={"pipeline": bad})
            assert answer.status_code == 422 and "secret-run" not in answer.text, (bad, path, answer.text)
            assert "is not a DAG id" in answer.json()["detail"]
            assert anonymous.get(path, params={"pipeline": bad}).status_code == 401  # the login is asked first
        with pytest.raises(DagIdInvalid, match="is not a DAG id"):
            plugin.lineage_records(pipeline=bad)
    assert not {dag_id for *_, dag_id in auth.asked} & set(NOT_DAG_IDS)  # nor asked the auth manager about it


def test_a_user_reads_only_the_pipelines_whose_runs_they_may_read(as_user: Callable[..., Any], auth: Any) -> None:
    from nightshift.ledger import append_record

    append_record("nightly_retrain", {"run_id": "digits-run", "status": "success"})
    append_record("churn_model", {"run_id": "churn-run", "status": "success", "reason": "sample value 42.5"})
    digits_only = as_user("nightly_retrain")
    for path in ("/lineage", "/lineage.json"):
        refused = digits_only.get(path, params={"pipeline": "churn_model"})
        assert refused.status_code == 403 and "churn-run" not in refused.text and "42.5" not in refused.text
    assert ("GET", "DagAccessEntity.RUN", "churn_model") in auth.asked  # Airflow's check, for the DAG asked for
    page = digits_only.get("/lineage")
    assert page.status_code == 200 and "digits-run" in page.text
    assert "churn_model" not in page.text  # the list holds only what the user may open
    churn_only = as_user("churn_model")
    assert churn_only.get("/lineage").status_code == 403  # the default pipeline is a DAG like any other
    page = churn_only.get("/lineage", params={"pipeline": "churn_model"})
    assert page.status_code == 200 and "churn-run" in page.text and "nightly_retrain" not in page.text


def test_a_pipelines_data_docs_are_for_its_readers_only(as_user: Callable[..., Any], nightshift_home: Path) -> None:
    docs = nightshift_home / "gx" / "data_docs"
    for page, text in ((docs / "pipelines" / "churn_model" / "run" / "x.html", "churn sample 42.5"),
                       (docs / "run" / "index.html", "digits sample 99.5")):  # no owner: nightly_retrain's
        page.parent.mkdir(parents=True)
        page.write_text(text)
    churn_only, digits_only = as_user("churn_model"), as_user("nightly_retrain")
    assert churn_only.get("/data-docs/pipelines/churn_model/run/x.html").text == "churn sample 42.5"
    assert churn_only.get("/data-docs/run/index.html").status_code == 403
    assert digits_only.get("/data-docs/run/index.html").text == "digits sample 99.5"
    for path in ("/data-docs/pipelines/churn_model/run/x.html",
                 "/data-docs/pipelines%2Fchurn_model%2Frun%2Fx.html",  # not through the ownerless pages' route
                 "/data-docs/pipelines/nightly_retrain/..%2Fchurn_model%2Frun%2Fx.html"):  # nor out of its own
        answer = digits_only.get(path)
        assert answer.status_code in (403, 404) and "42.5" not in answer.text, (path, answer.status_code)


def test_a_pipelines_search_reports_are_for_its_search_dags_readers_only(as_user: Callable[..., Any],
                                                                         nightshift_home: Path) -> None:
    """A report shows the pipeline's data path, trial parameters and errors: those of `<dag_id>__search`'s runs
    (nightly_retrain's, and those from before searches were per pipeline: model_search's)."""
    search = nightshift_home / "search"
    for page, text in ((search / "diabetes_retrain" / "s1" / "report.html", "diabetes trial 3 FAIL"),
                       (search / "nightly_retrain" / "s2" / "report.html", "digits trial 5"),
                       (search / "old" / "report.html", "older trial 7")):
        page.parent.mkdir(parents=True)
        page.write_text(text)
    digits_only, diabetes_only = as_user("model_search"), as_user("diabetes_retrain__search")
    refused = digits_only.get("/search/diabetes_retrain/s1/report.html")
    assert refused.status_code == 403 and "diabetes" not in refused.text
    assert digits_only.get("/search/nightly_retrain/s2/report.html").text == "digits trial 5"
    assert digits_only.get("/search/old/report.html").text == "older trial 7"
    index = digits_only.get("/search/")
    assert index.status_code == 200 and "nightly_retrain/s2" in index.text and "diabetes_retrain" not in index.text
    assert diabetes_only.get("/search/diabetes_retrain/s1/report.html").text == "diabetes trial 3 FAIL"
    for path in ("/search/nightly_retrain/s2/report.html", "/search/old/report.html",
                 "/search/diabetes_retrain/..%2Fnightly_retrain%2Fs2%2Freport.html"):
        answer = diabetes_only.get(path)
        assert answer.status_code in (403, 404) and "trial" not in answer.text, (path, answer.status_code)
    index = diabetes_only.get("/search/")
    assert index.status_code == 200 and "diabetes_retrain/s1" in index.text
    assert "nightly_retrain" not in index.text and "old" not in index.text


def write_decision_page(dag_id: str, run_id: str, text: str) -> Path:
    from nightshift.decision_page import page_path

    page = page_path(dag_id, run_id)
    page.parent.mkdir(parents=True)
    page.write_text(text)
    return page


def test_a_decision_page_is_for_its_pipelines_readers_only_and_runs_no_script(as_user: Callable[..., Any],
                                                                              app: Any) -> None:
    write_decision_page("churn_model", "c0ffee01", "<html>churn decision: accuracy 0.9123</html>")
    write_decision_page("nightly_retrain", "d161t5", "<html>digits decision</html>")
    path = "/decisions/churn_model/c0ffee01/decision.html"
    assert client(app).get(path).status_code == 401  # anonymous: refused before anything is read
    readers, others = as_user("churn_model"), as_user("nightly_retrain")
    answer = readers.get(path)
    assert answer.status_code == 200 and "accuracy 0.9123" in answer.text
    assert answer.headers["content-type"].startswith("text/html")
    policy = csp(answer)
    assert policy.get("default-src") == "'none'" and "script-src" not in policy, policy
    assert policy.get("frame-ancestors") == "'self'" and answer.headers.get("x-content-type-options") == "nosniff"
    refused = others.get(path)
    assert refused.status_code == 403 and "0.9123" not in refused.text
    assert others.get("/decisions/nightly_retrain/d161t5/decision.html").text == "<html>digits decision</html>"
    for bad in ("/decisions/churn_model/c0ffee01/other.html", "/decisions/churn_model/nope/decision.html",
                "/decisions/churn_model/..%2F..%2Fnightly_retrain%2Fd161t5/decision.html",
                "/decisions/churn_model/c0ffee01%2F..%2F..%2Fnightly_retrain%2Fd161t5/decision.html",
                "/decisions/..%2Fairflow/x/decision.html"):
        answer = readers.get(bad)
        assert answer.status_code in (403, 404) and "digits decision" not in answer.text, (bad, answer.status_code)


def test_the_evaluate_task_links_its_decision_page(plugin: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    write_decision_page("churn_model", "c0ffee01", "<html></html>")
    xcoms = {("evaluate", "return_value"): {"run_id": "c0ffee01", "passed": True},
             ("train", "return_value"): {"run_id": "c0ffee01"}}
    monkeypatch.setattr(plugin, "_xcom", lambda ti_key, key: xcoms.get((ti_key.task_id, key)))
    link = plugin.DecisionPageLink()

    def key(task_id: str, dag_id: str = "churn_model") -> SimpleNamespace:
        return SimpleNamespace(dag_id=dag_id, run_id="r", task_id=task_id, map_index=-1)

    assert link.get_link(None, ti_key=key("evaluate")) == "/nightshift/decisions/churn_model/c0ffee01/decision.html"
    assert link.get_link(None, ti_key=key("train")) == ""  # only the evaluate task's
    assert link.get_link(None, ti_key=key("evaluate", "other_dag")) == ""  # no page written for it
    xcoms[("evaluate", "return_value")] = {"run_id": "../../x"}
    assert link.get_link(None, ti_key=key("evaluate")) == ""
    assert any(isinstance(x, plugin.DecisionPageLink) for x in plugin.NightshiftPlugin.global_operator_extra_links)


def test_the_lineage_page_links_decision_pages_and_draws_the_season(as_user: Callable[..., Any]) -> None:
    from nightshift.ledger import append_record

    write_decision_page("churn_model", "c0ffee01", "<html></html>")
    gate = {"passed": True, "primary": "accuracy", "challenger": {"accuracy": 0.93},
            "champion": {"version": "1", "accuracy": 0.91}, "rows_outside_train_range": 0.02}
    append_record("churn_model", {"run_id": "r1", "status": "success", "outcome": "promoted v2 (promoted)",
                                  "mlflow_run_id": "c0ffee01", "gate": gate, "dataset_version": "d1"})
    append_record("churn_model", {"run_id": "r2", "status": "success", "outcome": "training skipped (unchanged)",
                                  "mlflow_run_id": None, "dataset_version": "d1"})
    page = as_user("churn_model").get("/lineage", params={"pipeline": "churn_model"}).text
    assert page.count("Decision page</a>") == 1
    assert "<a href='./decisions/churn_model/c0ffee01/decision.html'>Decision page</a>" in page
    season = page[page.index("<svg"):page.index("</svg>")]
    assert page.index("<svg") < page.index("<table")  # the chart above the table
    assert "accuracy night by night" in season and "champion v1 accuracy 0.9100" in season


def test_a_link_under_decisions_serves_nothing(as_user: Callable[..., Any], tmp_path: Path) -> None:
    """A run's folder (or its page) that is a link, to another DAG's page or out of NIGHTSHIFT_HOME: 404 (the
    route followed it and showed another DAG's page to this DAG's readers); decisions/ itself may be a link."""
    from nightshift.decision_page import page_path

    other = write_decision_page("nightly_retrain", "d161t5", "<html>digits decision</html>")
    mine = page_path("churn_model", "c0ffee01")
    mine.parent.parent.mkdir(parents=True)
    mine.parent.symlink_to(other.parent, target_is_directory=True)
    outside = tmp_path / "outside.html"
    outside.write_text("<html>not a page</html>")
    page_path("churn_model", "c0ffee02").parent.mkdir()
    page_path("churn_model", "c0ffee02").symlink_to(outside)
    readers = as_user("churn_model")
    for run in ("c0ffee01", "c0ffee02"):
        answer = readers.get(f"/decisions/churn_model/{run}/decision.html")
        assert answer.status_code == 404 and "decision" in answer.json()["detail"], (run, answer.status_code)
    home = mine.parents[3]
    (home / "decisions").rename(tmp_path / "decisions")
    (home / "decisions").symlink_to(tmp_path / "decisions", target_is_directory=True)
    answer = as_user("nightly_retrain").get("/decisions/nightly_retrain/d161t5/decision.html")
    assert answer.status_code == 200 and answer.text == "<html>digits decision</html>"


def test_what_gc_removed_shows_as_removed_on_the_lineage_page_and_its_route_answers_410(
        as_user: Callable[..., Any], plugin: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 36 item 1 (a): once `nightshift gc` removed a run's decision page and its MLflow run, the lineage page
    linked neither (the page) or a run MLflow no longer has; now each shows as removed, with when and why, and the
    page's URL (the `evaluate` task's link, a bookmark) answers 410 saying so, not a bare 404."""
    from nightshift import removals
    from nightshift.ledger import append_record

    write_decision_page("churn_model", "c0ffee01", "<html>kept</html>")
    append_record("churn_model", {"run_id": "r0", "status": "success", "mlflow_run_id": "dead0001"})
    append_record("churn_model", {"run_id": "r1", "status": "success", "mlflow_run_id": "c0ffee01"})
    why = "a successful run older than the last 5 finished runs, nothing written for 40.0 d"
    removals.append("churn_model", [
        {"kind": "decision_page", "what": "/home/decisions/churn_model/dead0001", "run_id": "r0",
         "mlflow_run_id": "dead0001", "reason": why},
        {"kind": "mlflow_run", "what": "dead0001", "run_id": "r0", "mlflow_run_id": "dead0001",
         "reason": "unregistered challenger, ended 40.0 d ago (over 30 d)"}])
    readers = as_user("churn_model")
    page = readers.get("/lineage", params={"pipeline": "churn_model"}).text
    removed_row = next(row for row in page.split("<tr") if "dags/churn_model/runs/r0'" in row)
    assert "<s>Decision page</s> (removed)" in removed_row and "<s>MLflow run</s> (removed)" in removed_row
    assert "dead0001/decision.html" not in page and "#/runs/dead0001" not in page  # no dead link
    assert "removed by nightshift gc on " in removed_row and why in removed_row
    kept_row = next(row for row in page.split("<tr") if "dags/churn_model/runs/r1'" in row)
    assert "<a href='./decisions/churn_model/c0ffee01/decision.html'>Decision page</a>" in kept_row
    assert "(removed)" not in kept_row

    answer = readers.get("/decisions/churn_model/dead0001/decision.html")
    assert answer.status_code == 410 and "Decision page removed" in answer.text and why in answer.text
    assert csp(answer).get("default-src") == "'none'"
    assert as_user("nightly_retrain").get("/decisions/churn_model/dead0001/decision.html").status_code == 403
    assert readers.get("/decisions/churn_model/never001/decision.html").status_code == 404  # never written
    assert readers.get("/decisions/churn_model/c0ffee01/decision.html").text == "<html>kept</html>"

    xcoms = {("evaluate", "return_value"): {"run_id": "dead0001", "passed": False}}
    monkeypatch.setattr(plugin, "_xcom", lambda ti_key, key: xcoms.get((ti_key.task_id, key)))
    key = SimpleNamespace(dag_id="churn_model", run_id="r0", task_id="evaluate", map_index=-1)
    assert plugin.DecisionPageLink().get_link(None, ti_key=key) == \
        "/nightshift/decisions/churn_model/dead0001/decision.html"  # leads to the 410 that says why


def test_a_run_airflow_db_clean_took_is_not_linked_to_its_gone_airflow_page(as_user: Callable[..., Any]) -> None:
    """Issue 36 item 1 (a): the maintenance DAG's `airflow db clean` removes a month-old run's rows, and the lineage
    page linked its Airflow run page all the same (Airflow answers that the run does not exist). A run recorded before
    the last clean's cut-off is named, not linked, saying why; Airflow keeps each DAG's newest run not triggered by
    hand, which stays linked."""
    from nightshift.ledger import append_record
    from nightshift.removals import record_db_clean

    for run_id, when in (("scheduled__2026-01-01", "2026-01-01T02:30:00+00:00"),
                         ("manual__2026-01-05", "2026-01-05T10:00:00+00:00"),
                         ("scheduled__2026-01-02", "2026-01-02T02:30:00+00:00"),
                         ("manual__2026-03-01", "2026-03-01T10:00:00+00:00")):
        append_record("churn_model", {"run_id": run_id, "status": "success", "recorded_at": when})
    record_db_clean("2026-02-01T00:00:00+00:00", 30)
    page = as_user("churn_model").get("/lineage", params={"pipeline": "churn_model"}).text
    runs = ("scheduled__2026-01-01", "manual__2026-01-05", "scheduled__2026-01-02", "manual__2026-03-01")
    rows = {run_id: next(row for row in page.split("<tr") if f">{run_id}<" in row) for run_id in runs}
    for cleaned in ("scheduled__2026-01-01", "manual__2026-01-05"):
        assert f"runs/{cleaned}'" not in rows[cleaned] and "cleaned by the nightshift_maintenance DAG" in rows[cleaned]
        assert "runs started before 2026-02-01 00:00 UTC" in rows[cleaned]
    for linked in ("scheduled__2026-01-02", "manual__2026-03-01"):  # Airflow keeps the newest scheduled run
        assert f"<a href='../dags/churn_model/runs/{linked}'>{linked}</a>" in rows[linked]
