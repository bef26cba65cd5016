from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"
TESTS = Path(__file__).resolve().parent
# The demo pipeline's declaration: the nightly_retrain DAG is built from it (dags/nightly_tasks/factory.py).
DIGITS_YAML = REPO / "pipelines" / "digits.yaml"

# torch's OpenMP threads spin after each parallel region before they sleep (libgomp's default). With three
# xdist workers, Airflow and several trainer ranks on 2 cores, that spinning takes the cores from processes
# with work to do: two 2-thread trainers at once used 33% less CPU and 30% less time with PASSIVE (measured
# here, 2026-11-26). Every child inherits it; rank environments pass it on (operators/local_launcher.py).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# Every MLflow tracking server a test starts (directly, or as run-mpijob's --service) without MLflow's own job
# execution: by default `mlflow server` starts eight huey consumers for server-side jobs nobody here submits, ~32 s
# more CPU a server (10 processes against 2; measured here, 2026-11-29); rehearsal 12 spent 767 s of CPU in MLflow
# processes. The product's servers set it themselves (operators/backends/hosts.py, scripts/airflow.sh).
os.environ.setdefault("MLFLOW_SERVER_ENABLE_JOB_EXECUTION", "false")

# Modules that cost minutes (from `--durations=0` of a full run), started first so that with pytest-xdist the
# longest ones do not start last and leave the other workers idle at the end. The order only matters for speed.
LONGEST_FIRST = (
    "tests/integration/test_run_mpijob.py",
    "tests/integration/test_docs_commands.py",
    "tests/integration/test_airflow_standalone.py",
    "tests/integration/test_celery_executor.py",
    "tests/integration/test_served_model_standalone.py",
    "tests/integration/test_nightly_retrain.py",
    "tests/integration/test_user_pipelines.py",
    "tests/integration/test_wheel_install.py",
    "tests/integration/test_hosts_backend.py",
    "tests/integration/test_run_mpijob_elastic.py",
    "tests/integration/test_season.py",
    "tests/integration/test_new_data_event.py",
    "tests/integration/test_stream_scoring.py",
    "tests/integration/test_search.py",
    "tests/integration/test_dag_bundle.py",
    "tests/integration/test_train_horovod.py",
    "tests/unit/test_airflow_script.py",
    "tests/integration/test_deploy_local.py",
    "tests/unit/nightshift/test_stage.py",
    "tests/unit/nightshift/test_stage_faults.py",
    "tests/unit/nightshift/test_train_cli.py",
    "tests/integration/test_operator_checkpoint_retry.py",
    "tests/unit/operators/test_plan.py",
    "tests/unit/nightshift/test_tracking.py",
    "tests/integration/test_gpu_pool_slots.py",
    "tests/integration/test_operator_local.py",
    "tests/integration/test_kueue_preemption.py",
)
# The modules that use the images this run builds (tests/images_build.py: started in the background when the run
# begins; a cold build compiles Horovod, tens of minutes on 2 cores): queued last, so that the workers run everything
# else while the build goes on, and only then wait for it.
NEEDS_IMAGES = (
    "tests/integration/test_run_mpijob_podman.py",
    "tests/integration/test_docs_commands_podman.py",
    "tests/integration/test_airflow_image.py",
    "tests/integration/test_serving_image.py",
    "tests/integration/test_images.py",
)
# Modules under tests/unit that start processes (a trainer, a DVC repository, redis-server, PostgreSQL, a child
# interpreter importing Airflow or MLflow) or cost more than ~2 s, and all of tests/dags (`airflow dags test` and
# DAG parsing in children): `slow`, kept out of `make test-fast`, run by `make test`.
SLOW_MODULES = frozenset({
    "tests/unit/test_airflow_script.py",
    "tests/unit/test_images_build.py",
    "tests/unit/test_demo_metadata_db.py",
    "tests/unit/nightshift/test_deploy_kserve.py",
    "tests/unit/nightshift/test_evaluate_tables.py",
    "tests/unit/nightshift/test_resume_key_faults.py",
    "tests/unit/nightshift/test_search.py",
    "tests/unit/nightshift/test_settings.py",
    "tests/unit/nightshift/test_stage.py",
    "tests/unit/nightshift/test_stage_faults.py",
    "tests/unit/nightshift/test_tabular_training.py",
    "tests/unit/nightshift/test_tracking.py",
    "tests/unit/nightshift/test_train_cli.py",
    "tests/unit/operators/test_plan.py",
    "tests/unit/stream/test_announce.py",
    "tests/unit/stream/test_stream_faults.py",
})
SLOW_FOLDERS = ("tests/dags/",)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark by folder (tests/integration: integration), mark slow modules, and run the longest modules first
    (`make test` runs them with `--dist loadfile`: a module's tests on one worker, its module fixtures once)."""
    def module(item: pytest.Item) -> str:
        return Path(str(item.path)).resolve().relative_to(TESTS.parent).as_posix()

    for item in items:
        where = module(item)
        if where.startswith("tests/integration/"):
            item.add_marker(pytest.mark.integration)
        if where in SLOW_MODULES or where.startswith(SLOW_FOLDERS):
            item.add_marker(pytest.mark.slow)
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    rank.update({name: len(LONGEST_FIRST) + 1 + i for i, name in enumerate(NEEDS_IMAGES)})
    items.sort(key=lambda item: rank.get(module(item), len(LONGEST_FIRST)))  # stable: the rest keep their order


def _runs_image_tests(config: pytest.Config) -> bool:
    """Whether this run may collect a module of NEEDS_IMAGES (by its paths and -m), judged before collection."""
    markexpr = str(config.getoption("markexpr", "") or "")
    if config.getoption("collectonly", False) or "not integration" in markexpr or "not images" in markexpr:
        return False
    for arg in config.args or [str(REPO)]:
        target = (config.invocation_params.dir / arg.split("::")[0]).resolve()
        for name in NEEDS_IMAGES:
            wanted = REPO / name
            if target == wanted or target in wanted.parents:
                return True
    return False


def pytest_configure(config: pytest.Config) -> None:
    """In the process that runs (or distributes) the tests: the id every xdist worker shares
    (tests/images_build.py), and, when the run includes tests that need the images and podman can build, this run's
    one image build, started now in the background so that it overlaps the tests that need none."""
    if hasattr(config, "workerinput"):
        return
    from tests import images_build

    images_build.run_id()
    if _runs_image_tests(config) and _podman_can_build():
        images_build.start_in_background()


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Any:
    """A test marked `images` first waits for this run's image build (tests/images_build.py), outside its own
    timeout (pytest-timeout's timer starts inside this wrapper): a cold build takes tens of minutes, the test
    itself keeps the timeout it would have on a machine with the images. The test's fixtures then get the build's
    result at once (and fail with its output if it failed)."""
    if (item.get_closest_marker("images") is not None and item.get_closest_marker("skip") is None
            and _podman_can_build()):
        from tests import images_build

        try:
            images_build.ensure_images()
        except images_build.ImagesBuildFailed:
            pass  # the test's fixture fails with the build's output
    yield


_podman_verdict: list[str | None] = []


def _podman_can_build() -> bool:
    if not _podman_verdict:
        from tests import images_build

        _podman_verdict.append(images_build.why_podman_cannot_build())
    return _podman_verdict[0] is None


def pytest_unconfigure(config: pytest.Config) -> None:
    """The run is over: a build still going (the run was cut short) is stopped, and the run's folder removed."""
    if hasattr(config, "workerinput"):
        return
    from tests import images_build

    images_build.stop_build()
    images_build.remove_run_dir()


@pytest.fixture(autouse=True)
def nightshift_home(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Every test gets its own NIGHTSHIFT_HOME, so no test touches ~/.nightshift or another's state."""
    home = tmp_path_factory.mktemp("nightshift-home")
    monkeypatch.setenv("NIGHTSHIFT_HOME", str(home))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    tracking = sys.modules.get("nightshift.tracking")
    if tracking is not None:  # a process configures MLflow once: this test's process starts afresh, on this home
        monkeypatch.setattr(tracking, "_configured", None)
    return home


@pytest.fixture
def digits_pipeline() -> Any:
    """The demo pipeline (pipelines/digits.yaml), as the nightly_retrain DAG's steps get it."""
    from nightshift.pipelines import load_pipeline

    return load_pipeline(DIGITS_YAML)


@pytest.fixture(scope="session")
def demo_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo digits dataset, written once per session; tests must not modify it."""
    from nightshift.data.demo import write_demo_dataset

    out = tmp_path_factory.mktemp("demo-data")
    write_demo_dataset(out, seed=0)
    return out


@pytest.fixture
def airflow_env(tmp_path: Path, nightshift_home: Path) -> dict[str, str]:
    """A throwaway AIRFLOW_HOME with this repo's dags and plugins; Airflow is only ever imported in children."""
    env = dict(os.environ)
    env.update({
        "AIRFLOW_HOME": str(tmp_path / "airflow-home"),
        "AIRFLOW__CORE__DAGS_FOLDER": str(REPO / "dags"),
        "AIRFLOW__CORE__PLUGINS_FOLDER": str(REPO / "plugins"),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{tmp_path / 'airflow.db'}",
        "NIGHTSHIFT_HOME": str(nightshift_home),
    })
    return env
