"""The registered model, used as a stranger would: no Nightshift installed, only the model's own files.

A version goes through the real path (log → evaluate → register). Then, in a fresh `python3.11 -m venv`
that has never seen this project, torch comes from the same local file the project installs
(`pip install torch==2.13.0`) and everything else from the model's own `requirements.txt`; the model is
loaded from the registry's artifact location with `mlflow.pyfunc.load_model` and scores the demo test
split with the accuracy `evaluate` recorded on the version. `mlflow models serve --env-manager
virtualenv` (run by that venv's own MLflow) builds the model's environment offline, from a wheelhouse on
disk, and answers a request. Last, MLServer with its MLflow runtime, installed from the serving image's
pinned set (images/serving/requirements.txt), serves the artifact folder over the V2 protocol, as the
`nightshift-mlserver-torch` KServe runtime does.

Caching: the venvs, the wheelhouse and MLflow's environment live under `$NIGHTSHIFT_CACHE/served-model`
(default `~/.cache/nightshift`, about 4 GB: three environments with torch), keyed by a hash of what they
are built from (the model's `requirements.txt` and `python_env.yaml`, or the image's requirements; the
interpreter; RECIPE): a change builds new ones and drops the old. The model and its code are never cached:
each run loads the version it just registered. Measured here on 2 busy cores: cold about 7 minutes,
cached about 40 seconds. `NIGHTSHIFT_STANDALONE_FRESH=1` rebuilds everything.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlparse
from urllib.request import url2pathname

import numpy as np
import pandas as pd
import pytest
import requests
import yaml

from nightshift import registry
from nightshift.datasets import read_split_frame
from nightshift.deploy.kserve import storage_uri
from nightshift.evaluate import evaluate
from nightshift.netutil import free_port, free_ports
from nightshift.tracking import log_training_run
from tests.trained_model import write_trained_output

pytestmark = pytest.mark.integration

MODEL = "digits-standalone"
# Bump when the way the cached environments are built changes.
RECIPE = "1"
FORBIDDEN = ("great_expectations", "dvc", "horovod", "sklearn", "airflow")

STRANGER_SCRIPT = """
import importlib.util, json, sys

assert importlib.util.find_spec("nightshift") is None, "Nightshift is installed in the stranger venv"
import mlflow, mlflow.pyfunc, numpy as np, pandas as pd, torch

location, split_csv, max_rows = sys.argv[1], sys.argv[2], int(sys.argv[3])
frame = pd.read_csv(split_csv)
labels = frame.pop("label").to_numpy()
model = mlflow.pyfunc.load_model(location)
predicted = np.concatenate([model.predict(frame.iloc[start:start + max_rows])["predicted_label"].to_numpy()
                            for start in range(0, len(frame), max_rows)])
import nightshift
print(json.dumps({
    "accuracy": float((predicted == labels).mean()), "rows": len(labels),
    "predicted": predicted.tolist(), "nightshift": nightshift.__file__, "torch": torch.__version__,
    "mlflow": mlflow.__version__, "tops": sorted({name.split(".")[0] for name in sys.modules}),
}))
"""


def _cache_root() -> Path:
    root = Path(os.environ.get("NIGHTSHIFT_CACHE") or Path.home() / ".cache" / "nightshift") / "served-model"
    root.mkdir(parents=True, exist_ok=True)
    return root


@contextlib.contextmanager
def _locked(root: Path) -> Iterator[None]:
    """One builder at a time per cache (two test runs on one machine share it)."""
    with open(root / ".lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _cached_venv(root: Path, name: str, key: str, python: str, requirements: Path, work: Path) -> Path:
    """`root/<name>-<key>`: a fresh venv with torch from the project's local file, then `requirements`.

    Built once per key (under the cache lock; a half-built one is rebuilt); other keys of `name` go.
    """
    venv, marker = root / f"{name}-{key}", root / f"{name}-ready-{key}"
    if os.environ.get("NIGHTSHIFT_STANDALONE_FRESH") or not marker.exists():
        for stale in root.glob(f"{name}-*"):
            if stale.is_dir():
                shutil.rmtree(stale, ignore_errors=True)
            else:
                stale.unlink(missing_ok=True)
        env = _stranger_env()
        _run([python, "-m", "venv", str(venv)], work, env)
        pip = [str(venv / "bin" / "python"), "-m", "pip", "--disable-pip-version-check", "-q"]
        # torch first, from the same local file the project installs (this machine's pip finds it).
        _run([*pip, "install", "torch==2.13.0"], work, env)
        _run([*pip, "install", "-r", str(requirements)], work, env)
        marker.write_text("")
    return venv


def _stranger_env(venv: Path | None = None, **extra: str) -> dict[str, str]:
    """The environment of someone who has never seen this project: no PYTHONPATH, no project venv."""
    drop = ("PYTHON", "VIRTUAL_ENV", "NIGHTSHIFT_", "MLFLOW_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    project_bin = str(Path(sys.executable).parent)
    path = [p for p in env.get("PATH", "").split(os.pathsep) if p and p != project_bin]
    if venv is not None:
        path.insert(0, str(venv / "bin"))
    return {**env, "PATH": os.pathsep.join(path), **extra}


def _run(command: list[str], cwd: Path, env: dict[str, str], timeout: float = 600) -> str:
    result = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, f"{' '.join(command)} failed:\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}"
    return result.stdout


@pytest.fixture(scope="module")
def version(tmp_path_factory: pytest.TempPathFactory, demo_data: Path) -> Iterator[dict[str, Any]]:
    """A registered version with the test accuracy `evaluate` recorded on it, and its artifact location."""
    home = tmp_path_factory.mktemp("standalone-home")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("NIGHTSHIFT_HOME", str(home))
        patch.delenv("MLFLOW_TRACKING_URI", raising=False)
        patch.delenv("NIGHTSHIFT_PLUGINS", raising=False)
        out = write_trained_output(tmp_path_factory.mktemp("standalone-trained"), demo_data, epochs=3)
        run_id = log_training_run(out, experiment="standalone", tags={"nightshift.run_key": "standalone"})
        decision = evaluate(run_id, data_dir=demo_data, model_name=MODEL, gate={"floor": 0.0})
        registered = registry.register(run_id, model_name=MODEL, evaluation=decision)
        found = registry.get_version(MODEL, registered["version"])
        location = storage_uri(MODEL, registered["version"])
        yield {"version": registered["version"], "location": location,
               "path": Path(url2pathname(urlparse(location).path)),
               "accuracy": registry.evaluated_accuracy(found), "home": home}


@pytest.fixture(scope="module")
def stranger(version: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A venv with torch from the project's local file and the model's requirements.txt, nothing else;
    and a wheelhouse of exactly that set (plus pip's build dependencies) for offline installs."""
    python = shutil.which("python3.11")
    if python is None:
        pytest.skip("python3.11 is not on PATH (the stranger venv is made with `python3.11 -m venv`)")
    model = version["path"]
    python_env = yaml.safe_load((model / "python_env.yaml").read_text())
    interpreter = _run([python, "-c", "import sys; print(sys.version)"], model, _stranger_env())
    key = hashlib.sha256(b"\0".join([
        (model / "requirements.txt").read_bytes(), (model / "python_env.yaml").read_bytes(),
        interpreter.encode(), RECIPE.encode()])).hexdigest()[:16]
    root = _cache_root()
    wheelhouse, marker = root / f"wheelhouse-{key}", root / f"wheelhouse-ready-{key}"
    timings: dict[str, float] = {}
    work = tmp_path_factory.mktemp("stranger")
    with _locked(root):
        start = time.monotonic()
        venv = _cached_venv(root, "venv", key, python, model / "requirements.txt", work)
        timings["venv_s"] = time.monotonic() - start
        if os.environ.get("NIGHTSHIFT_STANDALONE_FRESH") or not marker.exists():
            for stale in root.glob("wheelhouse-*"):
                if stale.is_dir():
                    shutil.rmtree(stale, ignore_errors=True)
                else:
                    stale.unlink(missing_ok=True)
            pip = [str(venv / "bin" / "python"), "-m", "pip", "--disable-pip-version-check", "-q"]
            frozen = work / "frozen.txt"
            frozen.write_text(_run([*pip, "freeze"], work, _stranger_env()))
            _run([*pip, "download", "-d", str(wheelhouse), "-r", str(frozen),
                  *python_env.get("build_dependencies", [])], work, _stranger_env())
            marker.write_text("")
        timings["cold_s"] = time.monotonic() - start
    return {"venv": venv, "python": venv / "bin" / "python", "wheelhouse": wheelhouse, "key": key,
            "root": root, "python_env": python_env, "timings": timings, "work": work}


def test_a_stranger_venv_loads_the_registered_version_and_matches_its_recorded_accuracy(
        version: dict[str, Any], stranger: dict[str, Any], demo_data: Path, tmp_path: Path) -> None:
    requirements = (version["path"] / "requirements.txt").read_text().split()
    assert "torch==2.13.0" in requirements and not any("+" in r for r in requirements)
    frozen = _run([str(stranger["python"]), "-m", "pip", "freeze"], tmp_path, _stranger_env())
    assert "nightshift" not in frozen.lower()
    split = read_split_frame(demo_data, "test")
    split.to_csv(tmp_path / "test.csv", index=False)
    script = tmp_path / "stranger.py"
    script.write_text(STRANGER_SCRIPT)
    # -I: no PYTHONPATH, no user site, not even the script's folder on sys.path; cwd is not the repo.
    out = _run([str(stranger["python"]), "-I", str(script), version["location"], str(tmp_path / "test.csv"),
                "4096"], tmp_path, _stranger_env(stranger["venv"]))
    seen = json.loads(out.strip().splitlines()[-1])
    assert Path(seen["nightshift"]).is_relative_to(version["path"] / "code"), seen["nightshift"]
    assert seen["rows"] == len(split)
    assert version["accuracy"] is not None
    assert seen["accuracy"] == version["accuracy"], (seen["accuracy"], version["accuracy"])
    assert not set(FORBIDDEN) & set(seen["tops"])
    assert seen["torch"].startswith("2.13.0")


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """Stop the server this test started: its session (MLflow's CLI and the uvicorn it execs)."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)  # uvicorn's workers, if any outlived their parent


def test_mlflow_serves_it_with_its_own_virtualenv_offline(version: dict[str, Any], stranger: dict[str, Any],
                                                          demo_data: Path, tmp_path: Path) -> None:
    pyenv = shutil.which("pyenv")
    if pyenv is None:
        pytest.skip("MLflow's virtualenv manager needs pyenv to find the model's Python; none on PATH")
    wanted = str(stranger["python_env"]["python"])
    installed = subprocess.run([pyenv, "versions", "--bare"], capture_output=True, text=True).stdout.split()
    if wanted not in installed:
        pytest.skip(f"pyenv has no Python {wanted} (the model's python_env.yaml); offline, MLflow could not "
                    f"install it (`pyenv install {wanted}` needs the network)")
    envs = stranger["root"] / "mlflow-envs"
    ready = stranger["root"] / f"mlflow-env-ready-{stranger['key']}"
    port = free_port()
    log_path = tmp_path / "serve.log"
    # Offline: no index at all, no pip configuration of this machine; only the wheelhouse on disk.
    env = _stranger_env(stranger["venv"], PIP_NO_INDEX="1", PIP_FIND_LINKS=str(stranger["wheelhouse"]),
                        PIP_CONFIG_FILE=os.devnull, MLFLOW_ENV_ROOT=str(envs))
    with _locked(stranger["root"]):
        if os.environ.get("NIGHTSHIFT_STANDALONE_FRESH") or not ready.exists():
            shutil.rmtree(envs, ignore_errors=True)  # a build killed half-way would be reused as is
        start = time.monotonic()
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                [str(stranger["venv"] / "bin" / "mlflow"), "models", "serve", "-m", version["location"],
                 "--env-manager", "virtualenv", "-h", "127.0.0.1", "-p", str(port), "--workers", "1"],
                cwd=tmp_path, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True)
        try:
            url = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 600
            while True:
                assert proc.poll() is None, f"mlflow models serve exited {proc.returncode}:\n" + \
                    log_path.read_text(errors="replace")[-4000:]
                with contextlib.suppress(requests.RequestException):
                    if requests.get(f"{url}/ping", timeout=2).status_code == 200:
                        break
                assert time.monotonic() < deadline, log_path.read_text(errors="replace")[-4000:]
                time.sleep(1)
            ready.write_text(json.dumps({"startup_s": time.monotonic() - start}))
            rows = read_split_frame(demo_data, "test").head(5)
            labels = rows.pop("label")
            response = requests.post(f"{url}/invocations", timeout=60,
                                     json={"dataframe_split": json.loads(rows.to_json(orient="split",
                                                                                      index=False))})
            assert response.status_code == 200, response.text
            served = pd.DataFrame(response.json()["predictions"])
        finally:
            _stop(proc)
    # The same answers as the model loaded here, in the project's own environment.
    import mlflow.pyfunc

    expected = mlflow.pyfunc.load_model(version["location"]).predict(rows)
    assert served["predicted_label"].tolist() == expected["predicted_label"].tolist()
    assert np.allclose(served.drop(columns=["predicted_label"]).to_numpy(),
                       expected.drop(columns=["predicted_label"]).to_numpy(), atol=1e-6)
    assert len(labels) == 5


# --- KServe's runtime: MLServer with its MLflow runtime, as images/serving installs it -------------------

SERVING_REQUIREMENTS = Path(__file__).resolve().parents[2] / "images" / "serving" / "requirements.txt"


@pytest.fixture(scope="module")
def mlserver(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A venv with the serving image's Python set: torch, then images/serving/requirements.txt."""
    python = shutil.which("python3.11")
    if python is None:
        pytest.skip("python3.11 is not on PATH")
    work = tmp_path_factory.mktemp("mlserver-venv")
    interpreter = _run([python, "-c", "import sys; print(sys.version)"], work, _stranger_env())
    key = hashlib.sha256(b"\0".join([SERVING_REQUIREMENTS.read_bytes(), interpreter.encode(),
                                      RECIPE.encode()])).hexdigest()[:16]
    root = _cache_root()
    with _locked(root):
        return _cached_venv(root, "mlserver", key, python, SERVING_REQUIREMENTS, work)


def test_mlserver_with_the_serving_images_libraries_serves_it_over_v2(version: dict[str, Any], mlserver: Path,
                                                                       demo_data: Path, tmp_path: Path) -> None:
    """What the nightshift-mlserver-torch runtime runs, minus the container: the same libraries and
    variables, the model folder as KServe's storage initializer leaves it in /mnt/models."""
    models = tmp_path / "mnt-models"
    shutil.copytree(version["path"], models)
    http, grpc, metrics = free_ports(3)
    env = _stranger_env(mlserver, MLSERVER_MODEL_IMPLEMENTATION="mlserver_mlflow.MLflowRuntime",
                        MLSERVER_MODEL_NAME="nightshift-digits", MLSERVER_MODEL_URI=str(models),
                        MLSERVER_HTTP_PORT=str(http), MLSERVER_GRPC_PORT=str(grpc),
                        MLSERVER_METRICS_PORT=str(metrics), MLSERVER_HOST="127.0.0.1")
    log_path = tmp_path / "mlserver.log"
    rows = read_split_frame(demo_data, "test").head(5).drop(columns=["label"])
    url = f"http://127.0.0.1:{http}/v2/models/nightshift-digits"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([str(mlserver / "bin" / "mlserver"), "start", str(models)], cwd=tmp_path, env=env,
                                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None, f"mlserver exited {proc.returncode}:\n" + \
                log_path.read_text(errors="replace")[-4000:]
            with contextlib.suppress(requests.RequestException):
                if requests.get(f"{url}/ready", timeout=2).status_code == 200:
                    break
            assert time.monotonic() < deadline, log_path.read_text(errors="replace")[-4000:]
            time.sleep(1)
        metadata = requests.get(url, timeout=10).json()
        assert [i["name"] for i in metadata["inputs"]] == list(rows.columns)  # the model's signature
        inputs: list[dict[str, Any]] = [{"name": c, "datatype": "FP64", "shape": [len(rows), 1],
                                         "data": rows[c].astype(float).tolist()} for c in rows.columns]
        body: dict[str, Any] = {"parameters": {"content_type": "pd"}, "inputs": inputs}
        response = requests.post(f"{url}/infer", json=body, timeout=60)
        assert response.status_code == 200, response.text
        outputs = {o["name"]: o["data"] for o in response.json()["outputs"]}
        bad = requests.post(f"{url}/infer", timeout=60, json={
            **body, "inputs": [{**inputs[0], "data": [99.0] * len(rows)}, *inputs[1:]]})
    finally:
        _stop(proc)
    assert bad.status_code >= 400 and "must lie in [0, 16]" in bad.text
    import mlflow.pyfunc

    expected = mlflow.pyfunc.load_model(version["location"]).predict(rows)
    assert outputs["predicted_label"] == expected["predicted_label"].tolist()
    assert np.allclose(outputs["prob_3"], expected["prob_3"].to_numpy(), atol=1e-6)
