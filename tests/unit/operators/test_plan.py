"""`nightshift plan --conf JSON`, run as a user runs it: the MPIJob a nightly_retrain run would submit."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.conftest import REPO

NIGHTSHIFT = str(Path(sys.executable).with_name("nightshift"))
TRACKING = "http://mlflow.nightshift.svc:5000"


def plan(conf: dict[str, Any] | str, **env: str) -> subprocess.CompletedProcess[str]:
    text = conf if isinstance(conf, str) else json.dumps(conf)
    child = {**os.environ, "NIGHTSHIFT_HOME": "/nightshift", "MLFLOW_TRACKING_URI": TRACKING,
             "AIRFLOW__CORE__FERNET_KEY": "planted-fernet", **env}
    for name in ("NIGHTSHIFT_CLUSTER_MLFLOW_URI", "NIGHTSHIFT_KUEUE_QUEUE", "NIGHTSHIFT_GPUS_PER_NODE"):
        if name not in env:
            child.pop(name, None)
    return subprocess.run([NIGHTSHIFT, "plan", "--conf", text], capture_output=True, text=True, env=child,
                          cwd=REPO, timeout=120, check=False)


def plan_here(conf: dict[str, Any], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
              **env: str) -> tuple[int, str, str]:
    """`plan` in this process (exit code, stdout, stderr), with the environment `plan()` gives its child: the
    CLI itself is run as a process once (test_four_workers_of_eight_gpus); each process costs ~20 s of CPU
    importing Airflow and parsing the DAG."""
    from nightshift.cli import main

    for name, value in {"NIGHTSHIFT_HOME": "/nightshift", "MLFLOW_TRACKING_URI": TRACKING,
                        "AIRFLOW__CORE__FERNET_KEY": "planted-fernet", **env}.items():
        monkeypatch.setenv(name, value)
    for name in ("NIGHTSHIFT_CLUSTER_MLFLOW_URI", "NIGHTSHIFT_KUEUE_QUEUE", "NIGHTSHIFT_GPUS_PER_NODE"):
        if name not in env:
            monkeypatch.delenv(name, raising=False)
    code = main(["plan", "--conf", json.dumps(conf)])
    out, err = capsys.readouterr()
    return code, out, err


def test_four_workers_of_eight_gpus(validate_mpijob: Any) -> None:
    done = plan({"backend": "kubernetes", "workers": 4, "gpus_per_worker": 8}, NIGHTSHIFT_SHARED_PVC="team-rwx")
    assert done.returncode == 0, done.stderr
    objects = list(yaml.safe_load_all(done.stdout))
    assert [o["kind"] for o in objects] == ["MPIJob"]
    job = objects[0]
    validate_mpijob(job)
    assert job["spec"]["slotsPerWorker"] == 8
    workers = job["spec"]["mpiReplicaSpecs"]["Worker"]
    assert workers["replicas"] == 4
    assert workers["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 8
    launcher = job["spec"]["mpiReplicaSpecs"]["Launcher"]["template"]["spec"]
    command = launcher["containers"][0]["command"]
    assert command[:6] == ["horovodrun", "--gloo", "-np", "32", "--hostfile", "/etc/mpi/hostfile"]
    for role in ("Launcher", "Worker"):
        pod = job["spec"]["mpiReplicaSpecs"][role]["template"]["spec"]
        assert pod["volumes"] == [{"name": "nightshift-shared", "persistentVolumeClaim": {"claimName": "team-rwx"}}]
        mounts = [m["mountPath"] for m in pod["containers"][0]["volumeMounts"]]
        assert mounts == ["/nightshift"]
        env = {e["name"]: e["value"] for e in pod["containers"][0]["env"]}
        assert env["MLFLOW_TRACKING_URI"] == TRACKING
        assert not [name for name in env if name.startswith("AIRFLOW")]
    paths = [arg.split("=", 1)[-1] for arg in command[command.index("nightshift.train"):] if "/" in arg]
    assert paths and all(p.startswith("/nightshift/") for p in paths if p.startswith("/")), paths
    assert "--checkpoint-dir" in command and "planted-fernet" not in done.stdout
    assert command[command.index("--device") + 1] == "cuda"  # a GPU worker never falls back to the CPU


def test_just_say_how_many_gpus_and_which_queue(validate_mpijob: Any, monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    conf = {"backend": "kubernetes", "gpus": 12, "queue": "nightly", "priority": "nightly-low"}
    code, out, err = plan_here(conf, monkeypatch, capsys, NIGHTSHIFT_GPUS_PER_NODE="8")
    assert code == 0, err
    (job,) = yaml.safe_load_all(out)
    validate_mpijob(job)
    assert job["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "nightly"
    assert job["metadata"]["labels"]["kueue.x-k8s.io/priority-class"] == "nightly-low"
    assert job["spec"]["runPolicy"]["suspend"] is True
    workers = job["spec"]["mpiReplicaSpecs"]["Worker"]
    each = workers["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"]
    assert workers["replicas"] * each == 12 and each <= 8
    code, _, err = plan_here(conf, monkeypatch, capsys)
    assert code == 2 and "set NIGHTSHIFT_GPUS_PER_NODE" in err


def test_a_queue_without_a_priority_plans_a_job_with_no_priority_label(
        validate_mpijob: Any, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv("NIGHTSHIFT_KUEUE_PRIORITY", raising=False)
    code, out, err = plan_here({"backend": "kubernetes", "gpus": 12, "queue": "nightly"}, monkeypatch, capsys,
                               NIGHTSHIFT_GPUS_PER_NODE="8")
    assert code == 0, err
    (job,) = yaml.safe_load_all(out)
    validate_mpijob(job)
    assert job["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "nightly"
    assert "kueue.x-k8s.io/priority-class" not in job["metadata"]["labels"]
    assert job["spec"]["runPolicy"]["suspend"] is True


def test_an_elastic_run_plans_max_workers_replicas_and_the_elastic_launcher(
        validate_mpijob: Any, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = plan_here({"backend": "kubernetes", "min_workers": 1, "max_workers": 3, "workers": 2,
                                "queue": ""}, monkeypatch, capsys)
    assert code == 0, err
    (job,) = yaml.safe_load_all(out)
    validate_mpijob(job)
    assert job["spec"]["mpiReplicaSpecs"]["Worker"]["replicas"] == 3  # max_workers; `workers` is ignored
    command = job["spec"]["mpiReplicaSpecs"]["Launcher"]["template"]["spec"]["containers"][0]["command"]
    assert command[:14] == ["horovodrun", "--gloo", "-np", "3", "--min-np", "1", "--max-np", "3", "--slots-per-host",
                            "1", "--host-discovery-script", "/etc/mpi/discover_hosts.sh", "--blacklist-cooldown-range",
                            "2"]
    assert command[command.index("nightshift.train") - 2] == "python" and command[-1] == "--elastic"
    assert "suspend" not in job["spec"]["runPolicy"] and "kueue.x-k8s.io/queue-name" not in job["metadata"]["labels"]


@pytest.mark.parametrize(("conf", "message"), [
    ({"min_workers": 3, "max_workers": 2}, "train: min_workers (3) is more than max_workers (2): set min_workers at "
                                           "most max_workers (rendered from the run's Params 'min_workers', "
                                           "'max_workers')"),
    ({"max_workers": 2}, "train: elastic training needs both min_workers and max_workers, and min_workers is empty"),
    ({"min_workers": 0, "max_workers": 2}, "Invalid input for param min_workers: 0 is less than the minimum of 1"),
    ({"min_workers": 1, "max_workers": 2, "queue": "nightly"},
     "train: elastic training (min_workers=1, max_workers=2) cannot wait in Kueue queue 'nightly': Kueue admits the "
     "job's full size (max_workers) as one unit"),
])
def test_a_bad_elastic_conf_is_refused_naming_the_setting(conf: dict[str, Any], message: str,
                                                          monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = plan_here({"backend": "kubernetes", **conf}, monkeypatch, capsys)
    assert code == 2 and message in err, err
    assert out == ""


def test_the_local_backend_creates_no_kubernetes_object(monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = plan_here({"workers": 2}, monkeypatch, capsys)
    assert code == 0 and not list(yaml.safe_load_all(out))


def test_the_hosts_backend_plans_the_mpijob_it_runs_with_its_mlflow_service(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], validate_mpijob: Any) -> None:
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)  # hosts serves the task's own store to the pods
    code, out, err = plan_here({"backend": "hosts", "workers": 3}, monkeypatch, capsys)
    assert code == 0, err
    (job,) = list(yaml.safe_load_all(out))
    validate_mpijob(job)
    assert job["spec"]["mpiReplicaSpecs"]["Worker"]["replicas"] == 3
    env = {e["name"]: e.get("value") for e in
           job["spec"]["mpiReplicaSpecs"]["Launcher"]["template"]["spec"]["containers"][0]["env"]}
    assert env["MLFLOW_TRACKING_URI"] == "http://mlflow.nightshift.svc:5000"


@pytest.mark.parametrize(("conf", "message"), [
    ({"backend": "kubernetes", "workerz": 4}, "unknown conf key(s) workerz"),
    ({"workers": "four"}, "Invalid input for param workers: 'four' is not of type 'integer'"),
    ({"workers": 0}, "Invalid input for param workers: 0 is less than the minimum of 1"),
    ({"backend": "slurm"}, "Invalid input for param backend: 'slurm' is not one of"),
    ('["workers", 4]', "must be a JSON object"),
    ({"backend": "kubernetes", "model_kwargs": "channels=8"}, "the model_kwargs Param is not JSON"),
])
def test_a_bad_conf_exits_non_zero_with_the_params_message(conf: dict[str, Any] | str, message: str,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    from nightshift.cli import main

    text = conf if isinstance(conf, str) else json.dumps(conf)
    try:
        code = main(["plan", "--conf", text])
    except SystemExit as exit_:  # argparse's own usage errors
        code = exit_.code  # type: ignore[assignment]
    out, err = capsys.readouterr()
    assert code == 2 and message in err, err
    assert out == "" and len(err.strip().splitlines()) == 1


def test_a_tracking_store_the_pods_cannot_reach_is_refused(monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = plan_here({"backend": "kubernetes"}, monkeypatch, capsys,
                             MLFLOW_TRACKING_URI="sqlite:////nightshift/mlflow.db")
    assert code == 2
    assert "needs an MLflow tracking server that the pods reach" in err


def test_validation_is_strict_a_misspelt_field_fails(mpijob_schema: dict[str, Any]) -> None:
    from operators.mpijob_spec import MPIJobConfig, TaskIdentity, build_mpijob
    from operators.validation import ManifestInvalid, validate

    job = build_mpijob(MPIJobConfig(image="t:1", command=["python"], num_workers=2), TaskIdentity("d", "t", "r"))
    assert validate(job) is True
    job["spec"]["slotsPerWorkerr"] = job["spec"].pop("slotsPerWorker")
    with pytest.raises(ManifestInvalid, match=r"MPIJob .* spec: Additional properties .*'slotsPerWorkerr'"):
        validate(job)


@pytest.mark.integration
def test_against_a_ref_a_change_of_default_workers_shows_as_replicas_and_nothing_else(tmp_path: Path) -> None:
    clone = tmp_path / "clone"
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@example.invalid"]
    subprocess.run(["git", "clone", "-q", str(REPO), str(clone)], check=True, timeout=120)
    declaration = clone / "pipelines" / "digits.yaml"  # nightly_retrain's Param defaults come from it
    text = declaration.read_text()
    assert "\n  workers: 2\n" in text
    declaration.write_text(text.replace("\n  workers: 2\n", "\n  workers: 3\n"))
    subprocess.run([*git, "-C", str(clone), "commit", "-qam", "three workers"], check=True)
    env = {**os.environ, "NIGHTSHIFT_HOME": "/nightshift", "MLFLOW_TRACKING_URI": TRACKING,
           "PYTHONPATH": str(clone), "NIGHTSHIFT_SCHEMAS": str(REPO.parent / "shared" / "schemas")}
    done = subprocess.run([sys.executable, "-m", "nightshift.cli", "plan", "--conf", '{"backend": "kubernetes"}',
                           "--against", "HEAD~1"], cwd=clone, env=env, capture_output=True, text=True, timeout=300,
                          check=False)
    assert done.returncode == 0, done.stderr
    changed = [line for line in done.stdout.splitlines()
               if line[:1] in "+-" and not line.startswith(("+++", "---"))]
    # The worker replicas, and the process count the launcher starts that follows from them: nothing else.
    assert sorted(changed) == sorted(["-      replicas: 2", "+      replicas: 3", "-            - '2'",
                                      "+            - '3'"]), done.stdout
    assert "-np" in done.stdout  # the '2' -> '3' is horovodrun's -np


def test_the_namespace_is_resolved_as_the_task_resolves_it_and_placeholders_are_named(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """The connection's namespace (no cluster.namespace set), not "default"; the stand-in values are listed."""
    connection = json.dumps({"conn_type": "kubernetes", "extra": {"namespace": "nightshift", "in_cluster": False}})
    code, out, err = plan_here({"backend": "kubernetes"}, monkeypatch, capsys,
                               AIRFLOW_CONN_KUBERNETES_DEFAULT=connection)
    assert code == 0, err
    (job,) = list(yaml.safe_load_all(out))
    assert job["metadata"]["namespace"] == "nightshift"
    assert "placeholders, filled in at run time: md5:dataset-version" in err
    # and where it came from, beside it and on stderr
    assert "\n  namespace: nightshift  # from Airflow connection kubernetes_default\n" in out
    assert "nightshift plan: namespace nightshift (from Airflow connection kubernetes_default)" in err


def test_plan_says_the_namespace_is_the_default_and_why(monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    """Outside a cluster (no connection, no cluster.namespace) the namespace is "default", and plan says so."""
    monkeypatch.delenv("AIRFLOW_CONN_KUBERNETES_DEFAULT", raising=False)
    code, out, err = plan_here({"backend": "kubernetes"}, monkeypatch, capsys)
    assert code == 0, err
    (job,) = list(yaml.safe_load_all(out))
    assert job["metadata"]["namespace"] == "default"
    why = "the default: no cluster.namespace and no Airflow connection kubernetes_default"
    assert f"namespace default ({why})" in err, err
    assert f"\n  namespace: default  # {why}\n" in out


def test_the_tasks_cluster_namespace_comes_before_the_connections(monkeypatch: pytest.MonkeyPatch) -> None:
    import dataclasses

    from nightshift_plan.plan import load_dag, plan_explained, render_yaml

    connection = json.dumps({"conn_type": "kubernetes", "extra": {"namespace": "nightshift"}})
    for name, value in {"NIGHTSHIFT_HOME": "/nightshift", "MLFLOW_TRACKING_URI": TRACKING,
                        "AIRFLOW__CORE__FERNET_KEY": "planted-fernet",
                        "AIRFLOW_CONN_KUBERNETES_DEFAULT": connection}.items():
        monkeypatch.setenv(name, value)
    dag = load_dag()
    train = dag.get_task("train")
    train._use(cluster=dataclasses.replace(train.cluster, namespace="team-a"))  # ClusterConfig(namespace=...)
    planned = plan_explained({"backend": "kubernetes"}, dag=dag)
    assert planned.objects[0]["metadata"]["namespace"] == planned.namespace == "team-a"
    assert planned.namespace_source == "from the train task's cluster.namespace"
    assert "\n  namespace: team-a  # from the train task's cluster.namespace\n" in render_yaml(
        planned.objects, planned.namespace_source)
    assert plan_explained({"backend": "local"}, dag=dag).namespace is None  # no object, no namespace


def test_only_each_objects_own_namespace_line_gets_the_comment() -> None:
    from nightshift_plan.plan import render_yaml

    objects = [{"kind": "MPIJob", "metadata": {"name": "a", "namespace": "ns"},
                "spec": {"template": {"metadata": {"namespace": "ns"}}, "args": ["namespace: ns"]}},
               {"kind": "ConfigMap", "metadata": {"namespace": "ns", "name": "b"}}]
    text = render_yaml(objects, "from here")
    assert text.count("# from here") == 2 and "  namespace: ns  # from here\n  name: b\n" in text
    assert list(yaml.safe_load_all(text)) == objects
    assert render_yaml(objects) == yaml.safe_dump_all(objects, sort_keys=False)
