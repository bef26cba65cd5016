"""Counts and pool slots in one place (operators.counts), and the operator's configs as the MPIJob builder's input."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from typing import Any

import pytest

from operators import counts
from operators.errors import InvalidJobConfig
from operators.horovod_config import ClusterConfig, ExecutionConfig, JobConfig, mpijob_config
from operators.mpijob_spec import MPIJobConfig
from tests.conftest import REPO


def test_the_gpu_total_wins_else_workers_times_gpus_and_never_less_than_one() -> None:
    assert counts.pool_slots(4, 2) == 8
    assert counts.pool_slots(3, 0) == 1  # a CPU job still holds one slot
    assert counts.pool_slots(4, 2, gpus=12) == 12
    assert JobConfig(command="x", num_workers="4", gpus_per_worker=2).pool_slots() == 8  # digits count too
    assert JobConfig(command="x", num_workers="{{ params.workers }}").pool_slots() is None


@pytest.mark.parametrize(("value", "minimum", "number"), [
    (3, 1, 3), (" 7 ", 1, 7), ("0", 0, 0), (0, 1, None), ("-2", 0, None), (True, 0, None), (2.0, 1, None),
    ("two", 1, None), (None, 0, None),
])
def test_one_parser_for_every_count(value: Any, minimum: int, number: int | None) -> None:
    assert counts.parse_count(value, minimum) == number
    if number is None:  # the operator refuses the same value, naming the field
        name = "num_workers" if minimum == 1 else "gpus"
        with pytest.raises(InvalidJobConfig, match=f"{name} must be an integer >= {minimum}, got {value!r}"):
            JobConfig(command="x", **{name: value})


@pytest.mark.parametrize(("template", "name"), [
    ("{{ params.workers }}", "workers"), ("{{params['gpus']}}", "gpus"), ('{{ params["q"] }}', "q"),
    ("{{ params.workers + 1 }}", None), ("{{ dag_run.conf.workers }}", None), ("params.workers", None), (4, None),
])
def test_only_a_whole_field_param_template_names_a_param(template: Any, name: str | None) -> None:
    assert counts.param_name(template) == name


def test_the_counts_module_imports_nothing_but_the_standard_library() -> None:
    """The cluster policy imports it in every Airflow component: no Airflow, no project module besides it."""
    code = ("import sys; before = set(sys.modules); import operators.counts; "
            "print(sorted(m for m in set(sys.modules) - before if m.split('.')[0] not in sys.stdlib_module_names))")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True,
                          env={"PYTHONPATH": str(REPO)})
    assert done.stdout.strip() == "['operators', 'operators.counts']"


def _settled(**changes: Any) -> tuple[JobConfig, ClusterConfig, ExecutionConfig]:
    job = JobConfig(command="python t.py", num_workers="3", gpus_per_worker="2", image="img:1", cpu_request="1",
                    cpu_limit="2", memory_request="1Gi", memory_limit="2Gi")
    cluster = ClusterConfig(
        service_account_name="sa", node_selector={"pool": "gpu"}, tolerations=[{"key": "k", "operator": "Exists"}],
        priority_class_name="high", labels={"team": "a"}, annotations={"a": "b"}, image_pull_policy="Always",
        image_pull_secrets=["reg"], launcher_resources={"limits": {"cpu": "1"}}, worker_command=["sleep", "1"],
        ssh_auth_mount_path="/root/.ssh", network_interfaces=None, kueue_priority="p1")
    execution = ExecutionConfig(clean_pod_policy="All", backoff_limit=2, ttl_seconds_after_finished=None,
                                active_deadline_seconds=600, deferrable=False)
    return job.settled(), dataclasses.replace(cluster, **changes).settled(), execution.settled()


def test_every_setting_the_builder_takes_comes_from_the_config_field_of_its_name() -> None:
    """Each MPIJobConfig field is set from the operator's config of the same name (no default silently
    kept): the configs here set every one of them to a value other than the builder's default."""
    job, cluster, execution = _settled()
    config = mpijob_config(job, cluster, execution, command=["python", "t.py"], namespace="ns",
                           queue_name="q", volumes=[{"name": "v"}], volume_mounts=[{"name": "v", "mountPath": "/v"}],
                           env={"A": "b"})
    declared = {f.name: getattr(c, f.name) for c in (job, cluster, execution) for f in dataclasses.fields(c)}
    defaults = MPIJobConfig(image="i", command=["c"], num_workers=1)
    for f in dataclasses.fields(MPIJobConfig):
        if f.name == "min_workers":  # JobConfig.elastic's, which cannot go with a queue: test_elastic.py
            continue
        value = getattr(config, f.name)
        assert value != getattr(defaults, f.name), f"{f.name} kept the builder's default"
        if f.name in declared and f.name not in {"command", "namespace", "volumes", "volume_mounts", "env"}:
            expected = declared[f.name]
            assert value == (list(expected) if isinstance(expected, tuple | list) else expected), f.name
    assert (config.queue_name, config.priority_class) == ("q", "p1")


def test_unset_settings_take_the_builders_defaults_and_no_queue_drops_the_priority() -> None:
    job, cluster, execution = _settled(launcher_resources=None, worker_command=None, ssh_auth_mount_path=None,
                                       node_selector=None, tolerations=None)
    config = mpijob_config(job, cluster, execution, command=["x"], namespace="ns", queue_name=None, volumes=[],
                           volume_mounts=[], env={})
    defaults = MPIJobConfig(image="i", command=["c"], num_workers=1)
    for name in ("launcher_resources", "ssh_auth_mount_path", "node_selector"):
        assert getattr(config, name) == getattr(defaults, name), name
    assert (list(config.worker_command), list(config.tolerations)) == (list(defaults.worker_command), [])
    assert config.priority_class is None


def test_an_unsettled_count_is_a_programming_error_not_a_manifest() -> None:
    job, cluster, execution = _settled()
    with pytest.raises(TypeError, match=r"JobConfig.num_workers is '\{\{ params.workers \}\}': settle"):
        mpijob_config(dataclasses.replace(job, num_workers="{{ params.workers }}"), cluster, execution,
                      command=["x"], namespace="ns", queue_name=None, volumes=[], volume_mounts=[], env={})


@pytest.mark.parametrize("value", ["--3", "²", "٣", "1" * 5000, "+-2", " 4 4"])
def test_a_count_no_parser_saw_is_refused_naming_the_field(value: str) -> None:
    """Review finding: "--3" and "²" passed the digit check and int() then raised a bare ValueError (naming
    neither the field nor the Param); a 5000-digit string exceeded int()'s limit."""
    from operators.counts import parse_count

    assert parse_count(value, 1) is None
    with pytest.raises(InvalidJobConfig, match="num_workers must be an integer >= 1"):
        JobConfig(command=["x"], num_workers=value).settled()
