"""The plugin's FastAPI app (plugins/nightshift_plugin.py `create_app`) in-process, with a TestClient.

Anonymous requests reach Airflow's own auth dependency (`get_user`), which answers 401 before it needs an
auth manager or a database; an authorised user is stood in for by overriding the plugin's access checks
(the real auth manager's 403/200 is tests/integration/test_plugin_auth.py's business).
"""

from __future__ import annotations

import re
from pathlib import Path
from types import ModuleType
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


@pytest.fixture
def logged_in(plugin: ModuleType) -> Any:
    """A client of another instance of the app, whose user passes every access check the routes carry."""
    app = plugin.create_app()
    for route in app.routes:
        for dependency in getattr(route, "dependencies", ()):
            app.dependency_overrides[dependency.dependency] = lambda: None
    assert app.dependency_overrides
    return client(app)


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
