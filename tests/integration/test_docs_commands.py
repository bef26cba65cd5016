"""The commands of the documentation, run as a reader runs them: the runnable blocks of the getting-started,
emulated hosts (host runtime), streams and model search pages, in that order, each page in a fresh bash, in a fresh
NIGHTSHIFT_HOME (the reader's `~/.nightshift`), servers started in the background and stopped by process group
(tests/docs_commands.py). A failure names the page, the block and the command that broke.

Getting started runs from the repository root with `.venv/bin` off PATH (the page puts it there); the other pages run
in a folder of their own with `.venv/bin` on PATH, as the getting-started note leaves the reader's shell. Two of the
page's commands run smaller here, as the pages themselves show: `make demo DEMO_ARGS="--epochs 3 --backend local"`
(the DAG's runs at length, on emulated hosts too, are tests/integration/test_nightly_retrain.py's and
test_hosts_backend.py's) and the model search with `--trials 4 --max-epochs 3`.
`make test` is the suite this test runs in, so it is not run. The podman part of the emulated hosts page needs the
trainer image: tests/integration/test_docs_commands_podman.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.docs_commands import REPO, Reader, page_blocks, run_page
from tests.integration.airflow_helpers import airflow_database

pytestmark = pytest.mark.integration
VENV_BIN = REPO / ".venv" / "bin"
# Variables a reader's fresh shell has none of (a test run's, `make test`'s, another home's); the machine's own stay
# (NIGHTSHIFT_CACHE, NIGHTSHIFT_POSTGRES_URL).
KEPT = ("NIGHTSHIFT_CACHE", "NIGHTSHIFT_POSTGRES_URL")
DROPPED_PREFIXES = ("NIGHTSHIFT_", "MLFLOW_", "AIRFLOW", "PYTEST_", "VIRTUAL_ENV", "MAKEFLAGS", "MAKELEVEL", "MFLAGS",
                    "MAKE_TERMOUT", "MAKE_TERMERR")


def reader_env(home: Path, tmp: Path, *, venv_on_path: bool) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k in KEPT or not k.startswith(DROPPED_PREFIXES)}
    path = [p for p in env.get("PATH", "").split(os.pathsep) if p and Path(p) != VENV_BIN]
    env["PATH"] = os.pathsep.join([str(VENV_BIN), *path] if venv_on_path else path)
    env.update({"NIGHTSHIFT_HOME": str(home), "TMPDIR": str(tmp)})
    return env


def stop_model_servers(home: Path, env: dict[str, str]) -> None:
    """`nightshift deploy --stop` in the reader's home; where it cannot (a loaded machine), SIGTERM to the PIDs of
    the serving records (the model server runs in a session of its own: a page's process group does not hold it)."""
    try:
        subprocess.run([str(VENV_BIN / "nightshift"), "deploy", "--stop"], env=env, capture_output=True,
                       timeout=600, check=False)
    except subprocess.TimeoutExpired:
        for record in (home / "serving").glob("*.json"):
            with contextlib.suppress(ValueError, KeyError, TypeError, OSError):
                os.kill(int(json.loads(record.read_text())["pid"]), signal.SIGTERM)


@pytest.fixture(scope="module")
def reader(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Reader]:
    """A reader's machine: a fresh home, a folder to stand in, a TMPDIR of the test's (`mktemp -d` on the pages),
    Airflow's metadata database of its own (dropped after); what the pages leave running is stopped after."""
    root = tmp_path_factory.mktemp("docs-reader")
    home, work, tmp = root / "home", root / "work", root / "tmp"
    for folder in (work, tmp):
        folder.mkdir()
    with airflow_database("nightshift_docs") as database:
        env = {**reader_env(home, tmp, venv_on_path=True), **database.env}
        reader = Reader(work, env, root / "state")
        try:
            yield reader
        finally:  # the page stops the model server itself; this is for a page that failed before
            stop_model_servers(home, env)


@pytest.fixture(scope="module")
def getting_started(reader: Reader) -> str:
    """The getting-started page, from the repository root (`make demo`, then PATH, then `nightshift deploy --stop`)."""
    env = {**reader.env, "PATH": reader_env(Path(), Path(), venv_on_path=False)["PATH"]}
    return run_page(reader, "getting-started.md", cwd=REPO, env=env, timeout_s=1200,
                    replace={"make demo": 'make demo DEMO_ARGS="--epochs 3 --backend local"'},
                    skip={"make test   # set everything up, then run the test suite (what CI runs)":
                          "the test suite, which this test is part of"})


@pytest.mark.timeout(1500)  # the page's make demo (in the fixture): two DAG runs, minutes on a loaded 2-core machine
def test_getting_started_runs_as_written(getting_started: str, reader: Reader) -> None:
    # what the page says the demo prints, and that its last block stopped the model server
    assert "=== run 1: nightly_retrain on the demo data" in getting_started
    assert "run 2 did not promote" in getting_started
    assert "The champion v1 keeps serving at http://127.0.0.1:" in getting_started
    assert '"stopped": true' in getting_started.rsplit("The champion v1", 1)[1]
    home = Path(reader.env["NIGHTSHIFT_HOME"])
    assert (home / "mlflow.db").is_file() and (home / "demo-data" / "digits" / "train.parquet").is_file()


@pytest.mark.timeout(1200)
def test_emulated_hosts_run_as_written(reader: Reader) -> None:
    from tests.integration.test_run_mpijob import MISSING

    if MISSING:
        pytest.skip(f"run-mpijob (host runtime): {MISSING}")
    page = "how-to/emulated-hosts.md"
    host_blocks = [b for b in page_blocks(page) if "podman" not in b.section]
    out = run_page(reader, page, only=host_blocks, timeout_s=900, server_wait_s=300)
    # "Where to see the result": the pods' prefixed lines, the MLflow UI on the store, and the files of the run
    # each pod's lines, prefixed with its name (the job's: train-<hash>-try<the task's try number>), and success
    (job,) = set(re.findall(r"MPIJob (train-[0-9a-f]+-try1) succeeded", out))
    assert f"[{job}-launcher] " in out and f"[{job}-worker-1] " in out
    assert "http://127.0.0.1:5001 answered 200" in out
    [home] = {p.parents[3] for p in Path(reader.env["TMPDIR"]).glob("*/workspaces/nightly_retrain/try1/model")}
    metrics = json.loads((home / "workspaces" / "nightly_retrain" / "try1" / "model" / "metrics.json").read_text())
    assert metrics["world_size"] == 2
    # the job logged to the store the page's --service served (and its MLflow UI read)
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{home / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("nightly_retrain")
    assert experiment is not None
    (run,) = client.search_runs([experiment.experiment_id], "tags.`nightshift.run_key` = 'nightly_retrain/try1'")
    assert run.data.metrics["val_accuracy"] == pytest.approx(metrics["val_accuracy"])
    assert any((home / "checkpoints" / "nightly_retrain" / "try1" / "train").iterdir())


def test_streams_run_as_written(getting_started: str, reader: Reader) -> None:
    """On the champion the getting-started page's `make demo` registered."""
    for tool in ("redis-server", "redis-cli"):
        if shutil.which(tool) is None:
            pytest.skip(f"`{tool}` not found (apt-get install -y redis-server)")
    out = run_page(reader, "how-to/streams.md", timeout_s=600)
    # XRANGE shows the output entry as the page describes it; the consumer prints its summary when stopped
    assert '"id":"a1"' in out.replace(" ", "") and '"model_version":"1"' in out.replace(" ", "")
    assert '"predictions": 1' in out and '"stopped_by"' in out


def test_model_search_runs_as_written(reader: Reader) -> None:
    out = run_page(reader, "how-to/model-search.md", timeout_s=600,
                   replace={"--trials 16 --max-epochs 9": "--trials 4 --max-epochs 3"})
    report = json.loads(out[out.rindex("\n{\n") + 1:out.rindex("}") + 1])  # the search's, after demo-data's
    assert len(report["trials"]) == 4 and report["best"]["value"] > 0
    assert (reader.cwd / "data" / "digits" / "train.parquet").is_file()
