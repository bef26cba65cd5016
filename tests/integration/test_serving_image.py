"""The serving image serves the registered `@champion` over the V2 protocol in a container, as KServe runs it.

A small model is trained (tests/trained_model.py), logged and registered in a SQLite MLflow store under tmp and
given `@champion`. `models:/<name>@champion` is resolved as the kserve deploy target resolves it (the alias's
version, its artifact location, rendered into the InferenceService's `storageUri`); that folder is what KServe's
storage initializer leaves in `/mnt/models`, so it is mounted there read-only. The container is run as the
`nightshift-mlserver-torch` ServingRuntime (deploy/kserve/servingruntime.yaml) runs it: the image's own
command (`mlserver start /mnt/models`), the runtime's environment (MLServer's MLflow runtime, the model named
after the InferenceService), its user and securityContext (no capabilities, no privilege escalation). Its V2
port is published on 127.0.0.1 only. The demo test split, sent in one V2 request, must come back with exactly
the predictions the in-process pyfunc (`mlflow.pyfunc.load_model("models:/<name>@champion")`) gives; malformed
requests get a 4xx. The container is removed whatever happens.

Uses the image `make images` built (localhost/nightshift/serving:<version>); skips, saying why, where podman
cannot run or that image is missing. `pytest -m images` runs it with the other image tests.
"""

from __future__ import annotations

import contextlib
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlparse
from urllib.request import url2pathname

import numpy as np
import pytest
import requests
import yaml

from tests import images_build
from tests.integration.test_images import ENV, ROOT, TAGS

pytestmark = [pytest.mark.images, pytest.mark.timeout(900)]

IMAGE = TAGS["serving"]
RUNTIME = ROOT / "deploy" / "kserve" / "servingruntime.yaml"
MODEL = "nightshift-digits-serving-image"
NAMESPACE = "nightshift"
READY_WITHIN_S = 300  # MLServer starts its inference worker and loads torch: seconds here, minutes on a busy host


def _podman(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["podman", "--runtime", "runc", *args], capture_output=True, text=True, env=ENV,
                          timeout=timeout, check=False)


@pytest.fixture(scope="module")
def image() -> str:
    """The serving image this test run built (tests/images_build.py: waited for); skips only where podman
    cannot build."""
    why_not = images_build.why_podman_cannot_build()
    if why_not is not None:
        pytest.skip(why_not)
    try:
        images_build.ensure_images()
    except images_build.ImagesBuildFailed as err:
        pytest.fail(str(err))
    return IMAGE


@pytest.fixture(scope="module")
def champion(tmp_path_factory: pytest.TempPathFactory, demo_data: Path) -> Iterator[dict[str, Any]]:
    """A registered version with @champion in a SQLite store under tmp, the InferenceService the kserve target
    renders for it, the folder its storageUri names, and the in-process pyfunc's predictions for the test split."""
    import mlflow.pyfunc

    from nightshift import registry, tracking
    from nightshift.datasets import read_split_frame
    from nightshift.deploy.kserve import DEFAULT_RUNTIME, inference_service, service_name, storage_uri
    from tests.trained_model import write_trained_output

    home = tmp_path_factory.mktemp("serving-image-home")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("NIGHTSHIFT_HOME", str(home))
        patch.delenv("MLFLOW_TRACKING_URI", raising=False)
        patch.delenv("NIGHTSHIFT_PLUGINS", raising=False)
        patch.setattr(tracking, "_configured", None)
        uri = f"sqlite:///{home / 'mlflow.db'}"
        assert tracking.tracking_uri() == uri
        out = write_trained_output(tmp_path_factory.mktemp("serving-image-trained"), demo_data, epochs=2)
        run_id = tracking.log_training_run(out, experiment="serving-image",
                                           tags={"nightshift.run_key": "serving-image"})
        registered = registry.register(run_id, model_name=MODEL)
        registry.set_alias(MODEL, registry.CHAMPION, registered["version"])
        # models:/MODEL@champion, resolved as deploy_kserve resolves it: the alias's version, its artifacts.
        version = str(registry.version_by_alias(MODEL, registry.CHAMPION).version)
        isvc = inference_service(service_name(MODEL), NAMESPACE, storage_uri(MODEL, version), model_version=version,
                                 runtime=DEFAULT_RUNTIME)
        location = isvc["spec"]["predictor"]["model"]["storageUri"]
        assert urlparse(location).scheme == "file", location  # the embedded store: a folder on this machine
        split = read_split_frame(demo_data, "test")
        features = split.drop(columns=["label"])
        expected = mlflow.pyfunc.load_model(f"models:/{MODEL}@{registry.CHAMPION}").predict(features)
        yield {"version": version, "isvc": isvc, "path": Path(url2pathname(urlparse(location).path)),
               "features": features, "labels": split["label"].to_numpy(), "expected": expected}


def _runtime_container(model_name: str) -> tuple[dict[str, str], list[str]]:
    """The ServingRuntime's container as podman options: its environment (KServe fills `{{.Name}}` with the
    InferenceService's name) and its securityContext."""
    runtime = yaml.safe_load(RUNTIME.read_text())
    (container,) = runtime["spec"]["containers"]
    assert "command" not in container and "args" not in container  # KServe runs the image's own CMD
    env = {item["name"]: str(item["value"]).replace("{{.Name}}", model_name) for item in container["env"]}
    security = container["securityContext"]
    options = ["--user", str(security["runAsUser"])]
    if security.get("allowPrivilegeEscalation") is False:
        options += ["--security-opt", "no-new-privileges"]
    for capability in security.get("capabilities", {}).get("drop", []):
        options += ["--cap-drop", capability.lower()]
    return env, options


def _free_loopback_port() -> int:
    from nightshift.netutil import free_port

    return free_port("127.0.0.1")


@pytest.fixture(scope="module")
def served(image: str, champion: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """The serving container of @champion, Ready; removed afterwards, also when starting it failed."""
    name = champion["isvc"]["metadata"]["name"]
    env, options = _runtime_container(name)
    assert env["MLSERVER_MODEL_URI"] == "/mnt/models" and env["MLSERVER_HTTP_PORT"] == "8080"
    port = _free_loopback_port()
    container = f"nightshift-serving-test-{uuid.uuid4().hex[:8]}"
    env_options = [option for key, value in sorted(env.items()) for option in ("--env", f"{key}={value}")]
    command = ["run", "--rm", "--detach", "--name", container, *options, *env_options,
               "--publish", f"127.0.0.1:{port}:{env['MLSERVER_HTTP_PORT']}",
               "--volume", f"{champion['path']}:{env['MLSERVER_MODEL_URI']}:ro", image]
    url = f"http://127.0.0.1:{port}/v2/models/{name}"
    try:
        started = _podman(*command)
        assert started.returncode == 0, f"podman {' '.join(command)} failed:\n{started.stderr[-3000:]}"
        start = time.monotonic()
        while True:
            state = _podman("inspect", "--format", "{{.State.Running}}", container)
            if state.stdout.strip() != "true":
                pytest.fail(f"the serving container stopped before it was Ready:\n{_logs(container)}")
            with contextlib.suppress(requests.RequestException):
                if requests.get(f"{url}/ready", timeout=2).status_code == 200:
                    break
            if time.monotonic() - start > READY_WITHIN_S:
                pytest.fail(f"{url}/ready not 200 after {READY_WITHIN_S} s:\n{_logs(container)}")
            time.sleep(1)
        yield {"url": url, "container": container, "port": port, "ready_s": time.monotonic() - start}
    finally:
        _podman("rm", "--force", "--ignore", container)


def _logs(container: str) -> str:
    logs = _podman("logs", container)
    return (logs.stdout + logs.stderr)[-5000:]


def _v2_body(features: Any) -> dict[str, Any]:
    """A V2 request for a table: one FP64 input per column, decoded by MLServer's pandas codec."""
    inputs = [{"name": column, "datatype": "FP64", "shape": [len(features), 1],
               "data": features[column].astype(float).tolist()} for column in features.columns]
    return {"parameters": {"content_type": "pd"}, "inputs": inputs}


def test_the_container_serves_champion_with_the_in_process_pyfuncs_predictions(
        served: dict[str, Any], champion: dict[str, Any]) -> None:
    features, expected = champion["features"], champion["expected"]
    published = _podman("port", served["container"])
    assert published.stdout.split() == ["8080/tcp", "->", f"127.0.0.1:{served['port']}"]  # loopback only
    metadata = requests.get(served["url"], timeout=10)
    assert metadata.status_code == 200, metadata.text
    assert [i["name"] for i in metadata.json()["inputs"]] == list(features.columns)  # the model's signature
    response = requests.post(f"{served['url']}/infer", json=_v2_body(features), timeout=120)
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["model_name"] == champion["isvc"]["metadata"]["name"]
    outputs = {o["name"]: o for o in body["outputs"]}
    assert list(outputs) == list(expected.columns)
    predicted = outputs["predicted_label"]
    assert predicted["shape"][0] == len(features) == len(champion["labels"])
    assert predicted["data"] == expected["predicted_label"].tolist()
    for column in expected.columns[1:]:  # prob_0 … prob_9: the same numbers, to the bit
        assert np.array_equal(np.asarray(outputs[column]["data"], dtype=expected[column].dtype),
                              expected[column].to_numpy()), column
    # Not a constant answer: the model learned something, and the labels cover several classes.
    assert len(set(predicted["data"])) > 3
    assert (np.asarray(predicted["data"]) == champion["labels"]).mean() > 0.5


SENTINEL = "s3cr3t-" + uuid.uuid4().hex  # a bearer token that must appear in no answer and no log line


def test_malformed_requests_get_a_4xx(served: dict[str, Any], champion: dict[str, Any]) -> None:
    rows = champion["features"].head(3)
    body = _v2_body(rows)
    url = f"{served['url']}/infer"
    cases = {
        "not JSON": requests.post(url, data=b"{not json", headers={"Content-Type": "application/json"},
                                  timeout=60),
        "V1 instances, no inputs": requests.post(url, json={"instances": rows.to_numpy().tolist()}, timeout=60),
        "a column missing": requests.post(url, json={**body, "inputs": body["inputs"][1:]}, timeout=60),
        "a pixel out of range": requests.post(url, json={**body, "inputs": [
            {**body["inputs"][0], "data": [99.0] * len(rows)}, *body["inputs"][1:]]}, timeout=60),
        # Refused while MLServer decodes the request, before the model runs (both were 500).
        "a shape its data does not fill": requests.post(url, json={**body, "inputs": [
            {**body["inputs"][0], "shape": [len(rows) + 2, 1]}, *body["inputs"][1:]]}, timeout=60),
        "text for a number": requests.post(url, json={**body, "inputs": [
            {**body["inputs"][0], "datatype": "BYTES", "data": ["x"] * len(rows)}, *body["inputs"][1:]]},
            timeout=60),
        # MLflow's schema message quotes the request, with every HTTP header MLServer keeps in it.
        "an unknown content type, with a token": requests.post(
            url, json={**body, "parameters": {"content_type": "nope"}}, timeout=60,
            headers={"Authorization": f"Bearer {SENTINEL}"}),
    }
    for case, response in cases.items():
        assert 400 <= response.status_code < 500, (case, response.status_code, response.text)
        assert SENTINEL not in response.text, case
    logs = _podman("logs", served["container"])
    assert SENTINEL not in logs.stdout + logs.stderr
    assert "must lie in [0, 16]" in cases["a pixel out of range"].text
    # Refused by the model (Nightshift's check) and by MLflow's schema enforcement: MLServer's MLflow runtime
    # answered both 500 until the image's runtime (images/serving/nightshift_mlserver.py) made them 400.
    assert "Model is missing inputs ['pixel_0']" in cases["a column missing"].text
    # The server still answers a good request after the bad ones.
    assert requests.post(url, json=body, timeout=60).status_code == 200
