"""The release path end to end with a real MLflow store and real `mlflow models serve` processes.

One scenario, in order (the tests share a store and the running servers, because a model server
takes ~10-20 s to start here): the first model becomes champion; bad requests get 4xx while it keeps
serving; a better model replaces it; a worse one is rejected; a corrupt artifact fails deployment while
the champion keeps answering; the CLI's register retried twice yields one version.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests

from nightshift import registry
from nightshift.deploy import local
from nightshift.deploy.local import (
    _alive,
    deploy_local,
    free_port,
    read_record,
    start_server,
    stop_local,
    stop_server,
    wait_healthy,
)
from nightshift.deploy.smoke import canary_batch, smoke_test
from nightshift.errors import ChallengerRejected, DeploymentFailed
from nightshift.evaluate import evaluate
from nightshift.registry import register, version_by_alias
from nightshift.tracking import log_training_run
from tests.trained_model import write_trained_output

pytestmark = pytest.mark.integration

MODEL = "digits-it"
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory, demo_data: Path) -> Iterator[dict[str, Any]]:
    """A shared NIGHTSHIFT_HOME and three trained outputs: ok (A), better (B), bad (C)."""
    home = tmp_path_factory.mktemp("release-home")
    root = tmp_path_factory.mktemp("trained")
    outs = {
        "A": write_trained_output(root / "A", demo_data, epochs=3, seed=0),
        "B": write_trained_output(root / "B", demo_data, epochs=8, seed=1),
        "C": write_trained_output(root / "C", demo_data, epochs=1, steps_per_epoch=1, seed=2),
    }
    state: dict[str, Any] = {"home": home, "data": demo_data, "outs": outs, "pids": []}
    yield state
    os.environ["NIGHTSHIFT_HOME"] = str(home)
    try:
        stop_local(MODEL)
    finally:
        os.environ.pop("NIGHTSHIFT_HOME", None)
        for pid in state["pids"]:
            stop_server(pid)


@pytest.fixture(autouse=True)
def shared_home(world: dict[str, Any], nightshift_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NIGHTSHIFT_HOME", str(world["home"]))


def _release(world: dict[str, Any], key: str) -> dict[str, Any]:
    run_id = log_training_run(world["outs"][key], experiment="release-it", tags={"nightshift.run_key": key})
    decision = evaluate(run_id, data_dir=world["data"], model_name=MODEL)
    return {"run_id": run_id, "decision": decision}


def _post(url: str, **kwargs: Any) -> requests.Response:
    return requests.post(f"{url}/invocations", timeout=30, **kwargs)


def _rows(world: dict[str, Any], n: int) -> dict[str, Any]:
    import pandas as pd

    frame = pd.read_parquet(world["data"] / "test.parquet").drop(columns=["label"]).head(n)
    return {"dataframe_split": {"columns": list(frame.columns), "data": frame.to_numpy().tolist()}}


def test_first_model_becomes_champion(world: dict[str, Any]) -> None:
    a = _release(world, "A")
    assert a["decision"]["passed"], a["decision"]["reasons"]
    assert a["decision"]["champion"] is None
    reg = register(a["run_id"], model_name=MODEL, evaluation=a["decision"],
                   lineage={"dataset_version": "md5:abc", "dag_id": "nightly_retrain", "dag_run_id": "r1"})
    assert version_by_alias(MODEL, "champion") is None  # registering alone does not promote
    result = deploy_local(MODEL, data_dir=world["data"])
    world["pids"].append(result["pid"])
    assert result["status"] == "promoted" and result["version"] == reg["version"] == "1"
    assert result["smoke"]["accuracy"] >= a["decision"]["challenger"]["accuracy"] - 0.05
    assert str(version_by_alias(MODEL, "champion").version) == "1"
    record = read_record(MODEL)
    assert record is not None and record["pid"] == result["pid"] and record["url"] == result["url"]
    tags = registry.get_version(MODEL, "1").tags
    assert tags["nightshift.dataset_version"] == "md5:abc" and tags["nightshift.dag_id"] == "nightly_retrain"
    assert tags["nightshift.training_run_id"] == a["run_id"] and tags["nightshift.code_commit"]
    assert "param.lr" in tags and "metric.val_accuracy" in tags and "nightshift.eval.accuracy" in tags
    world["A"] = {**a, **result}


@pytest.mark.parametrize("case", ["wrong_shape", "wrong_type", "empty_body", "several_mb", "out_of_range",
                                  "not_json", "too_many_rows"])
def test_bad_requests_get_4xx_and_the_server_keeps_serving(world: dict[str, Any], case: str) -> None:
    url = world["A"]["url"]
    good = _rows(world, 3)
    columns = good["dataframe_split"]["columns"]
    if case == "wrong_shape":
        response = _post(url, json={"dataframe_split": {"columns": columns[:10], "data": [[1.0] * 10]}})
    elif case == "wrong_type":
        response = _post(url, json={"dataframe_split": {"columns": columns, "data": [["x"] * 64]}})
    elif case == "empty_body":
        response = _post(url, data=b"", headers={"Content-Type": "application/json"})
    elif case == "several_mb":
        body = json.dumps({"dataframe_split": {"columns": columns, "data": [[8.0] * 64] * 20000}})
        assert len(body) > 4_000_000
        response = _post(url, data=body, headers={"Content-Type": "application/json"})
    elif case == "out_of_range":
        response = _post(url, json={"dataframe_split": {"columns": columns, "data": [[1e9] * 64]}})
    elif case == "not_json":
        response = _post(url, data=os.urandom(3_000_000), headers={"Content-Type": "application/json"})
    else:
        response = _post(url, json={"dataframe_split": {"columns": columns, "data": [[1.0] * 64] * 5000}})
    assert 400 <= response.status_code < 500, (response.status_code, response.text[:300])
    after = _post(url, json=good)
    assert after.status_code == 200 and len(after.json()["predictions"]) == 3


def test_better_model_replaces_champion_and_old_server_stops(world: dict[str, Any],
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Also: the free port chosen first is taken by another process (another model's server, deployed at the
    same time) before this server binds it: the server lands on another port, and the first try leaves no
    process or model folder behind."""
    b = _release(world, "B")
    assert b["decision"]["passed"], b["decision"]["reasons"]
    assert b["decision"]["champion"]["version"] == "1"
    register(b["run_id"], model_name=MODEL, evaluation=b["decision"])
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        taken = other.getsockname()[1]
        ports = iter([taken])
        monkeypatch.setattr(local, "free_port", lambda: next(ports, None) or free_port())
        result = deploy_local(MODEL, data_dir=world["data"])
    world["pids"].append(result["pid"])
    assert result["status"] == "promoted" and result["version"] == "2"
    assert result["port"] != taken and result["model_path"].endswith(f"-{result['port']}")
    assert not (Path(result["model_path"]).parent / f"{MODEL}-v2-{taken}").exists()
    assert [p for p in Path("/proc").glob("[0-9]*") if _is_server_for(p, f"2-{taken}")] == []
    assert result["previous"] == {"version": "1", "pid": world["A"]["pid"], "stopped": True}
    assert not _alive(world["A"]["pid"])
    with pytest.raises(requests.ConnectionError):
        requests.get(f"{world['A']['url']}/ping", timeout=5)
    assert str(version_by_alias(MODEL, "champion").version) == "2"
    assert _post(result["url"], json=_rows(world, 5)).status_code == 200
    world["B"] = {**b, **result}


def test_smoke_test_rejects_a_server_answering_worse_than_evaluated(world: dict[str, Any]) -> None:
    frame, labels = canary_batch(world["data"], 64)
    ok = smoke_test(world["B"]["url"], frame, labels, expected_accuracy=0.5, tolerance=0.05)
    assert ok["rows"] == 64 and ok["accuracy"] > 0.5
    with pytest.raises(DeploymentFailed, match="below the evaluated"):
        smoke_test(world["B"]["url"], frame, (labels + 1) % 10, expected_accuracy=0.9, tolerance=0.05)


def test_guarded_server_fixes_what_mlflow_answers_badly(world: dict[str, Any], tmp_path: Path) -> None:
    """`mlflow models serve`: no Content-Type → 500, invalid JSON → its body echoed ×7; the guard fixes both."""
    url = world["B"]["url"]
    garbage = os.urandom(3_000_000)
    plain = _post(url, data=garbage, headers={"Content-Type": "application/json"})
    assert plain.status_code == 400 and len(plain.content) > len(garbage)  # what mlflow does
    assert _post(url, data=b"{}").status_code == 500

    port = free_port()
    proc = start_server(Path(world["B"]["model_path"]), port, tmp_path / "guarded.log", server="guarded")
    world["pids"].append(proc.pid)
    guarded = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(guarded, proc, tmp_path / "guarded.log", timeout=120)
        assert _post(guarded, json=_rows(world, 5)).status_code == 200
        assert _post(guarded, data=b"{}").status_code == 415
        assert _post(guarded, data=garbage, headers={"Content-Type": "application/json"}).status_code == 413
        small_bad = _post(guarded, data=os.urandom(500_000), headers={"Content-Type": "application/json"})
        assert small_bad.status_code == 400 and len(small_bad.content) < 3000
        assert _post(guarded, json=_rows(world, 5)).status_code == 200
    finally:
        assert stop_server(proc.pid)


def test_worse_model_is_rejected_and_nothing_is_registered(world: dict[str, Any]) -> None:
    c = _release(world, "C")
    assert not c["decision"]["passed"]
    assert any("min_improvement" in r for r in c["decision"]["reasons"])
    with pytest.raises(ChallengerRejected):
        register(c["run_id"], model_name=MODEL, evaluation=c["decision"])
    found = registry.tracking.client().search_model_versions(f"name = '{MODEL}' and run_id = '{c['run_id']}'")
    assert list(found) == []
    assert str(version_by_alias(MODEL, "champion").version) == "2"


def test_corrupt_artifact_fails_deployment_and_champion_keeps_answering(world: dict[str, Any]) -> None:
    # A good model whose stored weights get corrupted after registration.
    out = write_trained_output(world["home"] / "D", world["data"], epochs=8, seed=3)
    run_id = log_training_run(out, experiment="release-it", tags={"nightshift.run_key": "D"})
    reg = register(run_id, model_name=MODEL)
    weights = list((world["home"] / "mlartifacts").rglob("model.pt"))
    mv = registry.get_version(MODEL, reg["version"])
    model_id = mv.source.removeprefix("models:/")
    corrupted = [w for w in weights if model_id in str(w)]
    assert corrupted, weights
    for path in corrupted:
        path.write_bytes(b"not a torch file")
    before = read_record(MODEL)
    with pytest.raises(DeploymentFailed, match="keeps serving"):
        deploy_local(MODEL, data_dir=world["data"], startup_timeout=120)
    assert read_record(MODEL) == before
    assert str(version_by_alias(MODEL, "champion").version) == "2"
    assert _post(world["B"]["url"], json=_rows(world, 5)).status_code == 200
    servers = [p for p in Path("/proc").glob("[0-9]*") if _is_server_for(p, reg["version"])]
    assert servers == []


def _is_server_for(proc: Path, version: str) -> bool:
    try:
        return f"{MODEL}-v{version}".encode() in (proc / "cmdline").read_bytes()
    except OSError:
        return False


def test_a_dead_champion_server_is_restarted_and_a_live_one_left_alone(world: dict[str, Any]) -> None:
    # A night that registers nothing deploys nothing: the season's model server killed on an unchanged night left
    # nothing serving until the next promotion (bench season, night 6).
    assert local.restore_local(MODEL, data_dir=world["data"]) is None  # v2 answers: left alone
    assert local.restore_local("nobody-registered-this", data_dir=world["data"]) is None
    before = read_record(MODEL)
    assert before is not None and str(before["version"]) == "2"
    os.killpg(int(before["pid"]), signal.SIGKILL)
    deadline = time.monotonic() + 30
    while _alive(int(before["pid"])) and time.monotonic() < deadline:
        time.sleep(0.2)
    result = local.restore_local(MODEL, data_dir=world["data"], startup_timeout=120)
    assert result is not None
    world["pids"].append(result["pid"])
    assert result["status"] == "restarted" and result["version"] == "2"
    assert result["previous"]["url"] == before["url"] and result["url"] != before["url"]
    assert read_record(MODEL)["url"] == result["url"]
    assert str(version_by_alias(MODEL, "champion").version) == "2"
    assert _post(result["url"], json=_rows(world, 5)).status_code == 200
    assert not Path(before["model_path"]).exists()  # the dead server's model folder is not left behind
    world["B"] = {**world["B"], **result}
    assert local.restore_local(MODEL, data_dir=world["data"]) is None


def test_cli_register_retried_twice_yields_one_version(world: dict[str, Any]) -> None:
    out = world["outs"]["B"]
    env = {**os.environ, "NIGHTSHIFT_HOME": str(world["home"])}
    command = [sys.executable, "-m", "nightshift.cli", "register", "--out", str(out), "--model-name",
               "digits-cli", "--lineage", "dag_id=nightly_retrain", "--lineage", "dataset_version=md5:abc"]
    first = subprocess.run(command, capture_output=True, text=True, env=env, cwd=REPO, timeout=120)
    second = subprocess.run(command, capture_output=True, text=True, env=env, cwd=REPO, timeout=120)
    assert first.returncode == 0, first.stderr[-500:]
    assert second.returncode == 0, second.stderr[-500:]
    one, two = json.loads(first.stdout), json.loads(second.stdout)
    assert (one["version"], one["created"]) == ("1", True)
    assert (two["version"], two["created"]) == ("1", False)
    versions = registry.tracking.client().search_model_versions("name = 'digits-cli'")
    assert [str(v.version) for v in versions] == ["1"]
    assert str(version_by_alias("digits-cli", "challenger").version) == "1"
