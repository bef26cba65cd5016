"""The plugin's pages and JSON behind Airflow's auth, in the real API server app (in a child process).

A request without a token gets 401, a user who may not read `nightly_retrain` gets 403 on every page,
and a user who may gets the lineage page, its JSON and the Data Docs, but never a file outside them. The
model search reports ask for their search DAG (`model_search` for the older ones) instead, another pipeline's
lineage and Data Docs for its own DAG: a user who may read only `nightly_retrain` gets 403 for them, and the
lineage page does not list them.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.dags.conftest import REPO, run_json

pytestmark = pytest.mark.integration

PROBE = f"""
import json, sys
sys.path[:0] = [{str(REPO / 'dags')!r}]
from fastapi.testclient import TestClient
from airflow.api_fastapi.app import create_app, get_auth_manager
from airflow.api_fastapi.auth.managers.simple.user import SimpleAuthManagerUser
from nightshift import ledger as lineage
lineage.append_record("nightly_retrain", {{"run_id": "r1", "status": "success", "dataset_version": "abc123",
                      "model_version": "7", "serving_url": "http://127.0.0.1:1", "outcome": "promoted v7",
                      "reason": "sample bad value 99.5"}})
client = TestClient(create_app("core"))
manager = get_auth_manager()
tokens = {{name: manager.generate_jwt(SimpleAuthManagerUser(username=name, role=role))
          for name, role in (("alice", "viewer"), ("outsider", "viewer"), ("retrainer", "viewer"))}}
paths = ["/nightshift/lineage", "/nightshift/lineage.json", "/nightshift/data-docs/run/index.html",
         "/nightshift/decisions/nightly_retrain/0123abcd/decision.html"]
out = {{"anonymous": [client.get(p).status_code for p in paths]}}
for name, token in tokens.items():
    answers = [client.get(p, headers={{"Authorization": f"Bearer {{token}}"}}) for p in paths]
    out[name] = [a.status_code for a in answers]
    out[name + "_bodies"] = [a.text for a in answers]
    out[name + "_csp"] = answers[2].headers.get("content-security-policy", "")
    out[name + "_decision_csp"] = answers[3].headers.get("content-security-policy", "")
cookie = client.get("/nightshift/lineage", cookies={{"_token": tokens["alice"]}})
out["cookie"] = cookie.status_code
escape = client.get("/nightshift/data-docs/..%2F..%2F..%2F..%2F..%2Fetc%2Fpasswd",
                    headers={{"Authorization": "Bearer " + tokens["alice"]}})
out["escape"] = [escape.status_code, "root:" in escape.text]
lineage.append_record("churn_model", {{"run_id": "c1", "status": "success", "dataset_version": "churn777"}})
churn = ["/nightshift/lineage?pipeline=churn_model", "/nightshift/lineage.json?pipeline=churn_model",
         "/nightshift/data-docs/pipelines/churn_model/run/index.html",
         "/nightshift/decisions/churn_model/c0ffee01/decision.html"]
for name in ("alice", "retrainer"):
    bearer = {{"Authorization": "Bearer " + tokens[name]}}
    answers = [client.get(p, headers=bearer) for p in churn]
    out["churn_" + name] = [a.status_code for a in answers]
    out["churn_" + name + "_bodies"] = [a.text for a in answers]
    out["churn_" + name + "_listed"] = "churn_model" in client.get("/nightshift/lineage", headers=bearer).text
out["churn_escape"] = client.get("/nightshift/lineage.json?pipeline=..%2F..%2Fx",
                                 headers={{"Authorization": "Bearer " + tokens["alice"]}}).status_code
out["openapi"] = [client.get("/nightshift/openapi.json").status_code,
                  client.get("/nightshift/openapi.json", cookies={{"_token": tokens["alice"]}}).status_code]
search = ["/nightshift/search/", "/nightshift/search/demo/report.html"]
out["search_anonymous"] = [client.get(p).status_code for p in search]
for name, token in tokens.items():
    answers = [client.get(p, headers={{"Authorization": f"Bearer {{token}}"}}) for p in search]
    out["search_" + name] = [a.status_code for a in answers]
    out["search_" + name + "_bodies"] = [a.text for a in answers]
out["search_escape"] = [client.get(p, headers={{"Authorization": "Bearer " + tokens["alice"]}}).status_code
                        for p in ("/nightshift/search/best.json", "/nightshift/search/..%2F..%2F..%2Fetc%2Fpasswd",
                                  "/nightshift/search/demo/..%2F..%2Fgx%2Fdata_docs%2Frun%2Findex.html")]
print(json.dumps(out))
"""


def test_pages_need_a_login_and_read_access_to_the_dag(airflow_env: dict[str, str], tmp_path: Path,
                                                        nightshift_home: Path) -> None:
    page = nightshift_home / "gx" / "data_docs" / "run" / "index.html"
    page.parent.mkdir(parents=True)
    page.write_text("<html>data docs: sample bad value 99.5</html>")
    churn_page = nightshift_home / "gx" / "data_docs" / "pipelines" / "churn_model" / "run" / "index.html"
    churn_page.parent.mkdir(parents=True)
    churn_page.write_text("<html>churn data docs: sample 42.5</html>")
    report = nightshift_home / "search" / "demo" / "report.html"
    report.parent.mkdir(parents=True)
    report.write_text("<html>search report: trial 7 PRUNED</html>")
    (nightshift_home / "search" / "best.json").write_text('{"study": "demo"}')
    for dag_id, run, text in (("nightly_retrain", "0123abcd", "<html>decision: accuracy 0.9123</html>"),
                              ("churn_model", "c0ffee01", "<html>churn decision</html>")):
        decision = nightshift_home / "decisions" / dag_id / run / "decision.html"
        decision.parent.mkdir(parents=True)
        decision.write_text(text)
    env = {**airflow_env,
           "AIRFLOW__CORE__AUTH_MANAGER": "tests.integration.auth_managers.DagScopedAuthManager",
           "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": "alice:viewer,outsider:viewer,retrainer:viewer",
           "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE": str(tmp_path / "passwords.json"),
           "PYTHONPATH": str(REPO)}
    airflow = str(Path(sys.executable).with_name("airflow"))
    subprocess.run([airflow, "db", "migrate"], env=env, cwd=REPO, check=True, capture_output=True, timeout=300)
    out = run_json(PROBE, env)
    assert out["anonymous"] == [401, 401, 401, 401]
    assert out["outsider"] == [403, 403, 403, 403]
    assert not any("abc123" in body or "99.5" in body or "0.9123" in body for body in out["outsider_bodies"])
    assert out["alice"] == [200, 200, 200, 200]
    html, records, docs, decision = out["alice_bodies"]
    assert "abc123" in html and "v7" in html and '"run_id":"r1"' in records.replace(" ", "") and "99.5" in docs
    assert out["cookie"] == 200  # the UI's session cookie is a login too
    assert out["escape"] == [404, False]
    assert "script-src 'none'" in out["alice_csp"]  # Data Docs run no script in the UI's origin
    assert decision == "<html>decision: accuracy 0.9123</html>"  # a night's decision page (issue 38 item 2)
    assert "default-src 'none'" in out["alice_decision_csp"] and "script-src" not in out["alice_decision_csp"]
    assert out["openapi"] == [401, 200]  # the API's description: a login too (it answered 500 once)
    assert out["retrainer"] == [200, 200, 200, 200]  # nightly_retrain's pages: yes

    # Another pipeline's lineage and Data Docs: its own DAG's readers only, and listed to them only.
    assert out["churn_alice"] == [200, 200, 200, 200] and out["churn_alice_listed"]
    html, records, docs, decision = out["churn_alice_bodies"]
    assert "churn777" in html and '"run_id":"c1"' in records.replace(" ", "") and "42.5" in docs
    assert "churn decision" in decision
    assert out["churn_retrainer"] == [403, 403, 403, 403] and not out["churn_retrainer_listed"]
    assert not any("churn777" in body or "42.5" in body or "churn decision" in body
                   for body in out["churn_retrainer_bodies"])
    assert out["churn_escape"] == 422  # not a DAG id: never a path

    # The search reports: their search DAG's (model_search's, for one from before searches were per pipeline); the
    # list answers every login, showing only the reports the user may open.
    assert out["search_anonymous"] == [401, 401]
    assert out["search_outsider"] == out["search_retrainer"] == [200, 403]
    assert not any("trial 7" in body or "demo" in body for body in out["search_retrainer_bodies"])
    assert out["search_alice"] == [200, 200]
    index, report = out["search_alice_bodies"]
    assert "href='../search/demo/report.html'" in index and report == "<html>search report: trial 7 PRUNED</html>"
    assert out["search_escape"] == [404, 404, 404]  # only report pages, only under NIGHTSHIFT_HOME/search
