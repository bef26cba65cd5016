"""deploy/helm/values.yaml, the official Apache Airflow Helm chart's values for a production install, checked
offline: every key path is one the chart's values schema has, the values have the types that schema asks
for, and what is ours holds together (executor, image, DAG bundle, connections, pool, shared workspace,
service accounts, no literal secret). What needs a cluster or the chart itself is listed in
docs/how-to/kubernetes.md."""

from __future__ import annotations

import inspect
import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
VALUES = ROOT / "deploy" / "helm" / "values.yaml"

# The key paths values.yaml sets, each looked up in the chart's values schema: apache/airflow,
# chart/values.schema.json at commit 002e5532d7d55a375bbf71bd4e72d7e008635073 (the chart release whose
# defaultAirflowTag is 3.0.5). A new key goes here only after it was found there too.
CHART_KEYS = {
    "defaultAirflowRepository", "defaultAirflowTag", "airflowVersion",
    "executor", "allowPodLaunching", "airflowLocalSettings",
    "postgresql", "postgresql.enabled",
    "data", "data.metadataSecretName", "fernetKeySecretName", "apiSecretKeySecretName", "jwtSecretName",
    "dags", "dags.persistence", "dags.persistence.enabled", "dags.gitSync", "dags.gitSync.enabled",
    "config", "env", "secret", "volumes", "volumeMounts",
    "workers", "workers.serviceAccount", "workers.serviceAccount.create", "workers.serviceAccount.name",
    "triggerer", "triggerer.serviceAccount", "triggerer.serviceAccount.create", "triggerer.serviceAccount.name",
    "scheduler", "scheduler.args",
    "dagProcessor", "dagProcessor.enabled",
}
# Keys whose insides the schema leaves to the user (airflow.cfg sections, lists of env, Secrets,
# Kubernetes volumes, args): checked by the tests below instead.
FREE_FORM = {"config", "env", "secret", "volumes", "volumeMounts", "scheduler.args"}
# Names that must never carry a value inline (docs/how-to/kubernetes.md, "An allowlisted environment").
SECRET_WORDS = ("SECRET", "PASSWORD", "TOKEN", "KEY", "CREDENTIAL")


@pytest.fixture(scope="module")
def values() -> dict[str, Any]:
    loaded = yaml.safe_load(VALUES.read_text())
    assert isinstance(loaded, dict)
    return loaded


def _key_paths(node: Any, prefix: str = "") -> set[str]:
    paths: set[str] = set()
    if isinstance(node, dict):
        for key, child in node.items():
            path = f"{prefix}{key}"
            paths.add(path)
            if path not in FREE_FORM:
                paths |= _key_paths(child, f"{path}.")
    return paths


def _env(values: dict[str, Any]) -> dict[str, str]:
    return {item["name"]: item["value"] for item in values["env"]}


def _secret_envs(values: dict[str, Any]) -> dict[str, tuple[str, str]]:
    return {item["envName"]: (item["secretName"], item["secretKey"]) for item in values["secret"]}


def _manifests(name: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((ROOT / "deploy" / name).read_text()) if d]


def test_every_key_is_a_chart_key_looked_up_in_its_schema(values: dict[str, Any]) -> None:
    assert _key_paths(values) == CHART_KEYS


def test_values_have_the_types_the_chart_schema_asks_for(values: dict[str, Any]) -> None:
    for item in values["env"]:  # env: {name, value}, both strings, nothing else
        assert set(item) == {"name", "value"} and all(isinstance(v, str) for v in item.values()), item
    for item in values["secret"]:  # secret: envName and secretName required, secretKey optional
        assert {"envName", "secretName"} <= set(item) <= {"envName", "secretName", "secretKey"}, item
    for section, options in values["config"].items():  # config: sections of scalars
        assert isinstance(options, dict), section
        assert all(isinstance(v, bool | int | float | str) for v in options.values()), section
    assert all(isinstance(a, str) for a in values["scheduler"]["args"])
    for key in ("defaultAirflowRepository", "defaultAirflowTag", "airflowVersion", "executor",
                "fernetKeySecretName", "apiSecretKeySecretName", "jwtSecretName"):
        assert isinstance(values[key], str), key
    assert values["airflowLocalSettings"] is None


def test_volumes_and_mounts_are_valid_kubernetes_objects(values: dict[str, Any]) -> None:
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "task"},
           "spec": {"containers": [{"name": "base", "image": "x", "volumeMounts": values["volumeMounts"]}],
                    "volumes": values["volumes"]}}
    kubernetes_validate.validate(pod, kubernetes_validate.latest_version(), strict=True)


def test_tasks_run_on_kubernetes_from_the_projects_airflow_image(values: dict[str, Any]) -> None:
    assert values["executor"] in {"KubernetesExecutor", "CeleryKubernetesExecutor"}
    assert values["allowPodLaunching"] is True
    tested = (ROOT / "constraints.txt").read_text().splitlines()
    assert f"apache-airflow=={values['airflowVersion']}" in tested  # the Airflow constraints.txt pins
    assert values["defaultAirflowRepository"].endswith("/airflow")
    # The cluster policy comes from the image, where images/airflow puts it; the chart must not mount its own.
    dockerfile = (ROOT / "images" / "airflow" / "Dockerfile").read_text()
    assert "config/airflow_local_settings.py /opt/airflow/config/airflow_local_settings.py" in dockerfile
    assert values["airflowLocalSettings"] is None


def test_dags_come_from_the_git_bundle_of_this_repository(values: dict[str, Any]) -> None:
    assert values["dags"]["persistence"]["enabled"] is False and values["dags"]["gitSync"]["enabled"] is False
    (bundle,) = json.loads(values["config"]["dag_processor"]["dag_bundle_config_list"])
    assert bundle["classpath"] == "airflow.providers.git.bundles.git.GitDagBundle"
    kwargs = bundle["kwargs"]
    assert (ROOT / kwargs["subdir"] / "nightly_retrain.py").is_file()
    from airflow.providers.git.bundles.git import GitDagBundle

    accepted = set(inspect.signature(GitDagBundle.__init__).parameters) | {"refresh_interval", "version",
                                                                          "view_url_template"}
    assert set(kwargs) <= accepted, set(kwargs) - accepted
    # The repository (and a token for it) is the bundle's connection, from a Secret.
    assert f"AIRFLOW_CONN_{kwargs['git_conn_id'].upper()}" in _secret_envs(values)


def test_connections_and_credentials_come_from_secrets_only(values: dict[str, Any]) -> None:
    secret_envs = _secret_envs(values)
    assert "AIRFLOW_CONN_KUBERNETES_DEFAULT" in secret_envs  # the operator's kubernetes_conn_id default
    assert {"MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"} <= set(secret_envs)
    uri = _env(values)["MLFLOW_TRACKING_URI"]
    assert re.match(r"https?://[^/@]+(/|$)", uri), "pods log to a tracking server, with no user:password in it"
    for name in _env(values):
        assert not any(word in name.upper() for word in SECRET_WORDS), f"{name} is set inline"
        assert not name.startswith("AIRFLOW_CONN_"), f"{name}: connections come from a Secret"
    # The chart would otherwise generate or inline these; an external PostgreSQL, no password here.
    assert values["postgresql"]["enabled"] is False
    assert values["data"] == {"metadataSecretName": "nightshift-airflow-metadata"}
    for key in ("fernetKey", "jwtSecret", "apiSecretKey", "webserverSecretKey"):
        assert key not in values
    assert not re.search(r"://[^/\s:@]+:[^/\s@]+@", VALUES.read_text()), "a URL with a password in it"


def test_workspace_is_the_shared_claim_mounted_at_nightshift_home(values: dict[str, Any]) -> None:
    from nightshift.settings import DEFAULT_SHARED_CLAIM

    (claim,) = [d for d in _manifests("workspace-pvc.yaml") if d["kind"] == "PersistentVolumeClaim"]
    env = _env(values)
    assert env["NIGHTSHIFT_SHARED_PVC"] == DEFAULT_SHARED_CLAIM == claim["metadata"]["name"]
    (volume,) = [v for v in values["volumes"] if "persistentVolumeClaim" in v]
    assert volume["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
    (mount,) = [m for m in values["volumeMounts"] if m["name"] == volume["name"]]
    assert mount["mountPath"] == env["NIGHTSHIFT_HOME"] and not mount.get("readOnly")
    assert env["NIGHTSHIFT_TRAINER_IMAGE"].split("/")[-1].startswith("trainer:")


def test_task_pods_and_the_triggerer_use_the_projects_service_account(values: dict[str, Any]) -> None:
    (account,) = [d for d in _manifests("rbac.yaml") if d["kind"] == "ServiceAccount"]
    for component in ("workers", "triggerer"):
        assert values[component]["serviceAccount"] == {"create": False, "name": account["metadata"]["name"]}


def test_the_scheduler_creates_the_gpu_pool_before_it_starts(values: dict[str, Any]) -> None:
    args = values["scheduler"]["args"]
    assert args[:2] == ["bash", "-c"]
    assert re.fullmatch(r'airflow pools set gpu [1-9][0-9]* "[^"]+" && exec airflow scheduler', args[2])


def test_the_docs_name_every_secret_the_values_reference(values: dict[str, Any]) -> None:
    guide = (ROOT / "docs" / "how-to" / "kubernetes.md").read_text()
    section = guide.split("## From `make demo` to a cluster", 1)[1].split("\n## ", 1)[0]
    names = {name for name, _ in _secret_envs(values).values()}
    names |= {values["data"]["metadataSecretName"], values["fernetKeySecretName"],
              values["apiSecretKeySecretName"], values["jwtSecretName"]}
    for name in names:
        assert name in section, f"docs/how-to/kubernetes.md does not say how to create the Secret {name}"
    for _, (name, key) in _secret_envs(values).items():
        assert f"--from-literal={key}=" in section, f"docs/how-to/kubernetes.md does not create {name}'s key {key}"
    assert "deploy/helm/values.yaml" in section
