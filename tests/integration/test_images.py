"""`make images` on this machine: the three images build with podman (scripts/images.py) and run.

A test run builds the images once (tests/images_build.py: started in the background when the run begins, waited
for by every test that needs an image). The build is cached by podman's layer cache: the first run on a machine
takes tens of minutes (Horovod compiles; see images/README.md, "Build and try the images on one machine"), later
runs only check the cache. Skipped, with the reason, only where podman cannot run (`make setup` as root installs it).
`pytest -m images` runs only these.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import uuid
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tests import images_build

ROOT = Path(__file__).resolve().parents[2]


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("images_script", ROOT / "scripts" / "images.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


IMAGES = _script()
ENV = images_build.env()

pytestmark = [pytest.mark.images]

VERSION, _ = IMAGES.project_pins()
TAGS: dict[str, str] = IMAGES.tags(VERSION)


@pytest.fixture(scope="module")
def built() -> str:
    """What `scripts/images.py` (what `make images` runs) printed in this test run's one build, which this waits
    for (tests/images_build.py); skips every test of the module, saying why, only where podman cannot build."""
    why_not = images_build.why_podman_cannot_build()
    if why_not is not None:
        pytest.skip(why_not)
    try:
        return images_build.ensure_images()
    except images_build.ImagesBuildFailed as err:
        pytest.fail(str(err))


def _inspect(tag: str) -> dict[str, Any]:
    out = subprocess.run(["podman", "image", "inspect", tag], capture_output=True, text=True, env=ENV,
                         timeout=60, check=True)
    (image,) = json.loads(out.stdout)
    return dict(image)


def _run(tag: str, *command: str, entrypoint: str | None = None) -> subprocess.CompletedProcess[str]:
    name = f"nightshift-images-test-{uuid.uuid4().hex[:8]}"
    cmd = ["podman", "--runtime", "runc", "run", "--rm", "--name", name, "--network", "none"]
    if entrypoint is not None:
        cmd += ["--entrypoint", entrypoint]
    try:
        return subprocess.run([*cmd, tag, *command], capture_output=True, text=True, env=ENV, timeout=300,
                              check=False)
    finally:
        subprocess.run(["podman", "rm", "--force", "--ignore", name], capture_output=True, env=ENV, check=False)


@pytest.mark.parametrize("image", sorted(TAGS))
def test_make_images_prints_each_image_and_its_size(built: str, image: str) -> None:
    (line,) = [line for line in built.splitlines() if line.startswith(TAGS[image] + " ")]
    assert line.endswith(" MB") and float(line.split()[-2].replace(",", "")) > 0


@pytest.mark.parametrize("image", sorted(TAGS))
def test_each_image_runs_as_non_root_and_carries_the_commit(built: str, image: str) -> None:
    config = _inspect(TAGS[image])["Config"]
    assert config.get("User") not in {None, "", "root", "0", "0:0"}
    env = dict(item.split("=", 1) for item in config["Env"])
    assert env["NIGHTSHIFT_GIT_COMMIT"] == IMAGES.git_commit()
    assert "PIP_CERT" not in env  # the CA bundle was a build secret only
    result = _run(TAGS[image], "id", "-u", entrypoint="")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() not in {"", "0"}


def test_the_ca_bundle_is_no_layer_of_any_image(built: str) -> None:
    """The build secret (this machine's CA bundle, IMAGES.ca_bundle()) is in no image: no file of any image's
    filesystem has its bytes, wherever it was put, and no secret mount is left."""
    import hashlib

    bundle = IMAGES.ca_bundle()
    assert bundle.is_file()
    data = bundle.read_bytes()
    for tag in TAGS.values():
        mounted = subprocess.run(["podman", "--runtime", "runc", "image", "mount", tag], capture_output=True,
                                 text=True, env=ENV, timeout=120, check=False)
        assert mounted.returncode == 0, mounted.stderr
        try:
            found = subprocess.run(["find", mounted.stdout.strip(), "-xdev", "-type", "f", "-size", f"{len(data)}c"],
                                   capture_output=True, text=True, timeout=300, check=True).stdout.split("\n")
            same = [f for f in found if f and hashlib.sha256(Path(f).read_bytes()).digest() ==
                    hashlib.sha256(data).digest()]
            assert same == [], f"{tag} holds the build's CA bundle: {same}"
        finally:
            subprocess.run(["podman", "--runtime", "runc", "image", "unmount", tag], capture_output=True, env=ENV,
                           timeout=120, check=False)
        result = _run(tag, "ls", "/run/secrets", entrypoint="")
        assert "pip-ca" not in result.stdout, tag


def test_trainer_imports_horovod_and_nightshift(built: str) -> None:
    code = "import os, horovod.torch, nightshift, torch; print(torch.__version__, os.environ['NIGHTSHIFT_GIT_COMMIT'])"
    result = _run(TAGS["trainer"], "python", "-c", code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["2.13.0+cpu", IMAGES.git_commit()]
    check = _run(TAGS["trainer"], "horovodrun", "--check-build")
    assert check.returncode == 0, check.stderr
    assert "[X] PyTorch" in check.stdout and "[X] Gloo" in check.stdout and "[X] MPI" in check.stdout


def test_serving_has_mlserver_with_the_mlflow_runtime(built: str) -> None:
    code = "import importlib.metadata, mlserver, mlserver_mlflow, torch; print(importlib.metadata.version('mlserver'))"
    result = _run(TAGS["serving"], "python", "-c", code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "1.7.1"


def test_airflow_runs_airflow_with_the_project_installed(built: str) -> None:
    version = _run(TAGS["airflow"], "version")  # the entrypoint's convention: `airflow version`
    assert version.returncode == 0, version.stderr
    assert version.stdout.strip().splitlines()[-1] == IMAGES.project_pins()[1]["apache-airflow"]
    code = "import operators, nightshift, os; print(os.environ['AIRFLOW_HOME'])"
    result = _run(TAGS["airflow"], "python", "-c", code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "/opt/airflow"
