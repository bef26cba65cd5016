"""The Airflow image (`make images`: localhost/nightshift/airflow:<version>) works in a container.

One container of the image, on a network namespace of its own (`--network none`: only its loopback), runs
`airflow db migrate` and then the API server on its 127.0.0.1:8080; every check runs in it with `podman exec`:

- `airflow dags list-import-errors` is empty, and `nightly_retrain` and `model_search` are listed;
- the plugin's routes answer through the real API server: 401 without a token, 200 with the token the simple
  auth manager gives its admin (the password it generated, read inside the container);
- `airflow dags test nightly_retrain` on `nightshift demo-data`'s digits, written inside the container under
  NIGHTSHIFT_HOME/demo-data (a data root): validate_data (GX), stage_dataset (DVC) and check_changes run;
  every task after them is marked successful without running (`--mark-success-pattern`: train needs the
  trainer image, and on Kubernetes a cluster);
- a data source outside the data roots is refused in the image.

The image is brought to the checkout first with `scripts/images.py --only airflow` (podman's layer cache: seconds
when nothing changed). Skipped, with the reason, where podman cannot run or the image was never built.
"""

from __future__ import annotations

import json
import subprocess
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from tests import images_build
from tests.integration.test_images import ENV, IMAGES, TAGS

pytestmark = [pytest.mark.images, pytest.mark.timeout(900)]

IMAGE = TAGS["airflow"]
PORT = 8080  # the container's own loopback (--network none): nothing on this machine's ports
LIFETIME_S = 1800
DATA = "/home/airflow/.nightshift/demo-data/digits"  # under NIGHTSHIFT_HOME/demo-data: a default data root
RUN_TASKS = ("validate_data", "stage_dataset", "check_changes")
# `dags test` matches task ids with fullmatch: every task but those three is marked successful, not run.
MARK_SUCCESS = "(?!(" + "|".join(RUN_TASKS) + ")$).*"
# Airflow prints its own log lines on stdout: a probe's answer is the last line after this marker.
MARK = "NIGHTSHIFT-RESULT "


def _podman(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["podman", "--runtime", "runc", *args], capture_output=True, text=True, env=ENV,
                          timeout=timeout, check=False)


def _exec(container: str, *command: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return _podman("exec", container, *command, timeout=timeout)


def _answer(result: subprocess.CompletedProcess[str]) -> Any:
    """The JSON a probe printed after MARK (its last such line)."""
    lines = [line for line in result.stdout.splitlines() if line.startswith(MARK)]
    assert result.returncode == 0 and lines, f"exit {result.returncode}\n{(result.stdout + result.stderr)[-4000:]}"
    return json.loads(lines[-1][len(MARK):])


def _json_output(result: subprocess.CompletedProcess[str]) -> Any:
    """The JSON an `airflow ... -o json` command printed (its last line that parses as a list)."""
    assert result.returncode == 0, f"exit {result.returncode}\n{(result.stdout + result.stderr)[-4000:]}"
    for line in reversed(result.stdout.splitlines()):
        if line.startswith("["):
            return json.loads(line)
    raise AssertionError(f"no JSON list in the output:\n{result.stdout[-4000:]}")


def _logs(container: str) -> str:
    logs = _podman("logs", container)
    return (logs.stdout + logs.stderr)[-4000:]


HEALTH = f"""
import json, time, urllib.request
deadline = time.monotonic() + 240
while True:
    try:
        with urllib.request.urlopen("http://127.0.0.1:{PORT}/api/v2/monitor/health", timeout=5) as answer:
            print({MARK!r} + json.dumps(answer.status))
            break
    except OSError as err:
        if time.monotonic() > deadline:
            print({MARK!r} + json.dumps(repr(err)))
            break
        time.sleep(1)
"""


@pytest.fixture(scope="module")
def container() -> Iterator[str]:
    """A running container of the image: database migrated, DAGs serialized, API server answering."""
    why_not = images_build.why_podman_cannot_build()
    if why_not is not None:
        pytest.skip(why_not)
    try:
        images_build.ensure_images()  # this test run's one build (all three images), waited for
    except images_build.ImagesBuildFailed as err:
        pytest.fail(str(err))

    name = f"nightshift-airflow-image-test-{uuid.uuid4().hex[:8]}"
    started = _podman(
        "run", "--detach", "--rm", "--name", name, "--network", "none",
        "--env", "GX_ANALYTICS_ENABLED=false", "--env", "DVC_NO_ANALYTICS=1", "--env", "DO_NOT_TRACK=true",
        IMAGE, "bash", "-c",
        # `timeout`: a test run killed before its teardown leaves no API server running for ever (--rm then
        # removes the container).
        f"airflow db migrate >/dev/null && exec timeout {LIFETIME_S} airflow api-server --host 127.0.0.1 "
        f"--port {PORT} --workers 1",
    )
    try:
        assert started.returncode == 0, started.stderr
        health = _answer(_exec(name, "python", "-c", HEALTH))
        assert health == 200, f"the API server did not answer: {health}\n{_logs(name)}"
        reserialize = _exec(name, "airflow", "dags", "reserialize")
        assert reserialize.returncode == 0, (reserialize.stdout + reserialize.stderr)[-4000:]
        yield name
    finally:
        _podman("rm", "--force", "--ignore", "--time", "5", name)


def test_image_is_the_checkout(container: str) -> None:
    out = _exec(container, "printenv", "NIGHTSHIFT_GIT_COMMIT")
    assert out.stdout.strip() == IMAGES.git_commit()


def test_no_import_errors_and_both_dags_parse(container: str) -> None:
    assert _json_output(_exec(container, "airflow", "dags", "list-import-errors", "-o", "json")) == []
    dags = {dag["dag_id"]: dag for dag in _json_output(_exec(container, "airflow", "dags", "list", "-o", "json"))}
    assert {"nightly_retrain", "model_search"} <= set(dags)
    assert dags["nightly_retrain"]["fileloc"] == "/opt/airflow/dags/nightly_retrain.py"
    assert not [d for d in dags.values() if "example_dags" in d["fileloc"]]  # no examples: AIRFLOW__CORE__LOAD_EXAMPLES
    tasks = _exec(container, "airflow", "tasks", "list", "nightly_retrain")
    assert tasks.returncode == 0, tasks.stderr[-3000:]
    assert {*RUN_TASKS, "train", "evaluate", "register", "deploy", "report"} <= set(tasks.stdout.split())


ROUTES = f"""
import json, pathlib, urllib.error, urllib.request
base = "http://127.0.0.1:{PORT}"
paths = ["/nightshift/lineage", "/nightshift/lineage.json", "/nightshift/search/", "/nightshift/openapi.json"]

def status(path, token=None):
    request = urllib.request.Request(base + path, headers={{"Authorization": "Bearer " + token}} if token else {{}})
    try:
        with urllib.request.urlopen(request, timeout=30) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()

# The simple auth manager's generated password for its default user `admin`, read here: never on a command line.
passwords = json.loads(next(pathlib.Path("/opt/airflow").glob("simple_auth_manager_passwords.json*")).read_text())
login = urllib.request.Request(base + "/auth/token", method="POST",
                               data=json.dumps({{"username": "admin", "password": passwords["admin"]}}).encode(),
                               headers={{"Content-Type": "application/json"}})
with urllib.request.urlopen(login, timeout=30) as answer:
    token = json.loads(answer.read())["access_token"]
anonymous = {{p: status(p)[0] for p in paths}}
admin = {{p: status(p, token) for p in paths}}
print({MARK!r} + json.dumps({{"anonymous": anonymous, "admin": {{p: a[0] for p, a in admin.items()}},
                             "lineage": admin["/nightshift/lineage"][1][:5000],
                             "missing": status("/nightshift/no-such-page", token)[0]}}))
"""


def test_plugin_routes_answer_401_without_a_token(container: str) -> None:
    answer = _answer(_exec(container, "python", "-c", ROUTES))
    assert set(answer["anonymous"].values()) == {401}, answer["anonymous"]
    assert set(answer["admin"].values()) == {200}, answer["admin"]
    assert "nightly_retrain" in answer["lineage"]  # the plugin's lineage page, not some other app's 200
    assert answer["missing"] == 404


STATES = f"""
import json
from sqlalchemy import select
from airflow.models import DagRun, TaskInstance
from airflow.models.xcom import XComModel
from airflow.utils.session import create_session
with create_session() as session:
    run = session.scalars(select(DagRun).where(DagRun.dag_id == "nightly_retrain")).one()
    tis = session.scalars(select(TaskInstance).where(TaskInstance.dag_id == run.dag_id,
                                                     TaskInstance.run_id == run.run_id))
    states = {{ti.task_id: ti.state for ti in tis}}
    rows = session.scalars(select(XComModel).where(XComModel.dag_id == run.dag_id, XComModel.run_id == run.run_id))
    xcoms = {{f"{{row.task_id}}.{{row.key}}": XComModel.deserialize_value(row) for row in rows}}
print({MARK!r} + json.dumps({{"run_state": run.state, "states": states, "xcoms": xcoms}}, default=str))
"""

STAGED = f"""
import json, pathlib, sys
staged = json.loads(sys.argv[1])
data = pathlib.Path(staged["path"])
print({MARK!r} + json.dumps({{"files": sorted(p.name for p in data.iterdir()),
                             "under_workspace": data.is_relative_to(staged["workspace"])}}))
"""

CONFINED = f"""
import json
from nightshift.errors import UsageError
from nightshift.settings import confined_data_source, data_roots
try:
    confined_data_source("/tmp")
    refused = None
except UsageError as err:
    refused = str(err)
print({MARK!r} + json.dumps({{"roots": [str(r) for r in data_roots()], "refused": refused,
                             "accepted": str(confined_data_source({DATA!r}))}}))
"""


def test_dags_test_runs_validate_stage_and_check_changes(container: str) -> None:
    demo = _exec(container, "nightshift", "demo-data", DATA)
    assert demo.returncode == 0, (demo.stdout + demo.stderr)[-3000:]
    test = _exec(container, "airflow", "dags", "test", "nightly_retrain", "-c", json.dumps({"data_source": DATA}),
                 "--mark-success-pattern", MARK_SUCCESS, timeout=600)
    assert test.returncode == 0, (test.stdout + test.stderr)[-6000:]

    run = _answer(_exec(container, "python", "-c", STATES))
    states, xcoms = run["states"], run["xcoms"]
    assert run["run_state"] == "success", run
    assert {task: states[task] for task in RUN_TASKS} == dict.fromkeys(RUN_TASKS, "success"), states
    # What only the tasks themselves write (a task marked successful pushes nothing): GX's verdict on each
    # split, the DVC-staged dataset version, and the branch check_changes chose on a first run.
    validated = xcoms["validate_data.return_value"]
    assert validated["path"] == DATA and set(validated["files"]) == {"train", "validation", "test"}, validated
    assert "fingerprint" in validated  # set only when the GX suite passed on every split
    staged = xcoms["stage_dataset.return_value"]
    assert staged["rows"] > 0 and len(staged["hash"]) >= 8 and staged["source"] == DATA, staged
    fingerprint = xcoms["check_changes.fingerprint"]
    assert fingerprint["dataset_version"] == staged["hash"], fingerprint
    assert fingerprint["code_version"] == IMAGES.git_commit(), fingerprint  # the image's NIGHTSHIFT_GIT_COMMIT
    assert xcoms.get("check_changes.previous_run") is None  # the first run: nothing to compare with
    assert {"lr", "batch_size", "model"} <= set(xcoms["check_changes.training"]), xcoms["check_changes.training"]
    # The branch: a first run trains (train: marked successful, never run), so skip_training is skipped.
    assert (states["train"], states["skip_training"]) == ("success", "skipped"), states
    assert "train.return_value" not in xcoms

    files = _answer(_exec(container, "python", "-c", STAGED, json.dumps(staged)))
    assert files["under_workspace"] and {"train.parquet", "validation.parquet", "test.parquet"} <= set(
        files["files"]), files

    confined = _answer(_exec(container, "python", "-c", CONFINED))
    assert confined["accepted"] == DATA
    assert confined["refused"] and "NIGHTSHIFT_DATA_ROOTS" in confined["refused"], confined


def test_git_is_installed_for_the_git_dag_bundle(container: str) -> None:
    git = _exec(container, "git", "--version")
    assert git.returncode == 0 and git.stdout.startswith("git version"), git.stderr
    bundle = _exec(container, "python", "-c", "import airflow.providers.git.bundles.git")
    assert bundle.returncode == 0, bundle.stderr[-3000:]

