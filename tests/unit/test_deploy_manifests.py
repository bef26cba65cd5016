"""The cluster manifests in deploy/ and the GitHub workflows that apply them.

Every object in deploy/*.yaml must be a valid Kubernetes object (strict schema: no unknown fields) for
the oldest and newest Kubernetes versions we support, and the Role must grant exactly what the
HorovodKubernetesOperator and the KServe deploy target need.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

kubernetes_validate = pytest.importorskip("kubernetes_validate")

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
WORKFLOWS = ROOT / ".github" / "workflows"
NAMESPACE = "nightshift"
# Oldest Kubernetes minor we document support for, and the newest kubernetes-validate ships.
K8S_VERSIONS = ["1.29", kubernetes_validate.latest_version()]

EXPECTED_RULES = {
    ("kubeflow.org", "mpijobs"): {"create", "get", "list", "watch", "delete", "patch"},
    ("", "pods"): {"get", "list", "watch"},
    ("", "pods/log"): {"get", "list", "watch"},
    ("", "events"): {"get", "list", "watch"},
    # Kueue: why a queued job waits, and which ClusterQueue its LocalQueue feeds (read only).
    ("kueue.x-k8s.io", "workloads"): {"get", "list", "watch"},
    ("kueue.x-k8s.io", "localqueues"): {"get", "list", "watch"},
    ("serving.kserve.io", "inferenceservices"): {"create", "get", "list", "watch", "patch", "delete"},
}


def _load(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def _objects() -> list[tuple[str, dict[str, Any]]]:
    return [(p.name, obj) for p in sorted(DEPLOY.glob("*.yaml")) for obj in _load(p)]


def _by_kind(kind: str) -> list[dict[str, Any]]:
    return [obj for _, obj in _objects() if obj["kind"] == kind]


OBJECTS = _objects()


def test_deploy_has_the_expected_objects() -> None:
    kinds = {(obj["kind"], obj["metadata"]["name"]) for _, obj in OBJECTS}
    assert kinds == {
        ("Namespace", NAMESPACE),
        ("ServiceAccount", "nightshift-airflow"),
        ("Role", "nightshift-airflow"),
        ("RoleBinding", "nightshift-airflow"),
        ("PersistentVolumeClaim", "nightshift-workspace"),
    }


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize(
    "obj", [o for _, o in OBJECTS], ids=[f"{f}:{o['kind']}/{o['metadata']['name']}" for f, o in OBJECTS]
)
def test_every_object_validates_strictly(obj: dict[str, Any], version: str) -> None:
    kubernetes_validate.validate(obj, version, strict=True)


def test_validator_rejects_a_misspelt_field() -> None:
    """Guards the test above: strict validation must catch an unknown field, not pass everything."""
    (pvc,) = _by_kind("PersistentVolumeClaim")
    broken = {**pvc, "spec": {**pvc["spec"], "accesModes": pvc["spec"]["accessModes"]}}
    del broken["spec"]["accessModes"]
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, K8S_VERSIONS[-1], strict=True)


def test_namespaced_objects_live_in_the_nightshift_namespace() -> None:
    for _, obj in OBJECTS:
        if obj["kind"] != "Namespace":
            assert obj["metadata"].get("namespace") == NAMESPACE, obj["metadata"]["name"]


def test_role_grants_exactly_the_needed_verbs() -> None:
    (role,) = _by_kind("Role")
    granted: dict[tuple[str, str], set[str]] = {}
    for rule in role["rules"]:
        assert set(rule) <= {"apiGroups", "resources", "verbs"}, "no resourceNames/nonResourceURLs"
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                granted.setdefault((group, resource), set()).update(rule["verbs"])
    assert granted == EXPECTED_RULES
    assert not any("*" in verbs for verbs in granted.values())


def test_role_binding_binds_the_role_to_the_service_account() -> None:
    (binding,) = _by_kind("RoleBinding")
    (role,) = _by_kind("Role")
    (account,) = _by_kind("ServiceAccount")
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": role["metadata"]["name"],
    }
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": account["metadata"]["name"], "namespace": NAMESPACE}
    ]


def test_workspace_claim_is_read_write_many_with_a_configurable_class() -> None:
    (pvc,) = _by_kind("PersistentVolumeClaim")
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]
    assert "storage" in pvc["spec"]["resources"]["requests"]
    # Left to the cluster's default, with a commented line showing where to name one.
    assert "storageClassName" not in pvc["spec"]
    assert "# storageClassName:" in (DEPLOY / "workspace-pvc.yaml").read_text()


def test_kserve_example_serves_an_mlflow_model_over_v2() -> None:
    (isvc,) = _load(DEPLOY / "kserve" / "inferenceservice-example.yaml")
    assert isvc["apiVersion"] == "serving.kserve.io/v1beta1"
    assert isvc["kind"] == "InferenceService"
    assert isvc["metadata"]["namespace"] == NAMESPACE
    model = isvc["spec"]["predictor"]["model"]
    assert model["modelFormat"]["name"] == "mlflow"
    assert model["protocolVersion"] == "v2"
    assert "://" in model["storageUri"]
    # Its container resources are ordinary Kubernetes ResourceRequirements.
    requirements = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "x"},
        "spec": {"containers": [{"name": "c", "resources": model["resources"]}]},
    }
    kubernetes_validate.validate(requirements, K8S_VERSIONS[-1], strict=True)


# --- .github/workflows ---------------------------------------------------------------------------


def _workflow(name: str) -> dict[str, Any]:
    data = yaml.safe_load((WORKFLOWS / name).read_text())
    assert isinstance(data, dict)
    # YAML 1.1 reads the bare key `on` as the boolean True.
    data["on"] = data.pop(True, data.get("on"))
    return data


def _run_lines(job: dict[str, Any]) -> str:
    return "\n".join(step.get("run", "") for step in job["steps"])


def _uses(job: dict[str, Any]) -> list[str]:
    return [step["uses"] for step in job["steps"] if "uses" in step]


def test_ci_workflow_lints_checks_dags_and_tests_on_pull_requests() -> None:
    wf = _workflow("ci.yml")
    assert "pull_request" in wf["on"]
    assert wf["on"]["push"]["branches"] == ["main"]
    jobs = wf["jobs"]
    assert {"lint", "dag-integrity", "test"} <= set(jobs)
    assert "make lint" in _run_lines(jobs["lint"])
    assert ".venv/bin/pytest tests/dags" in _run_lines(jobs["dag-integrity"])
    assert "make test" in _run_lines(jobs["test"])
    for name, job in jobs.items():
        assert job["runs-on"].startswith("ubuntu"), name
        assert job["steps"], name
        setup = [s for s in job["steps"] if s.get("uses", "").startswith("actions/setup-python")]
        assert setup and setup[0]["with"]["python-version"] == "3.11", name
        assert setup[0]["with"]["cache"] == "pip", name
        caches = [s for s in job["steps"] if s.get("uses", "").startswith("actions/cache")]
        assert caches and caches[0]["with"]["path"] == "~/.cache/nightshift", name


def _mpi_operator_in_the_readme() -> str:
    (version,) = set(re.findall(r"kubeflow/mpi-operator/(v[0-9.]+)/deploy", (DEPLOY / "README.md").read_text()))
    return version


def test_the_mpi_operator_installed_unsuspends_launchers_with_their_scheduling_directives() -> None:
    """Kueue unsuspends every job it admits; before v0.8.0 the MPI Operator then lost the launcher's
    scheduling directives (kubeflow/mpi-operator#772; prepared as v0.7.1, which never shipped). The README says
    where the CRD we validate against comes from."""
    version = _mpi_operator_in_the_readme()
    assert tuple(int(part) for part in version[1:].split(".")) >= (0, 8, 0), version
    readme = (DEPLOY / "README.md").read_text()
    assert "caa3c47fc42e" in readme and "../shared/schemas" in readme


def test_kind_workflow_builds_cpu_image_installs_operator_and_runs_cluster_tests() -> None:
    wf = _workflow("kind-e2e.yml")
    (job,) = wf["jobs"].values()
    uses = _uses(job)
    assert any(u.startswith("helm/kind-action@") for u in uses)
    build = next(s for s in job["steps"] if s.get("uses", "").startswith("docker/build-push-action"))
    assert build["with"]["file"] == "images/trainer/Dockerfile"
    assert build["with"]["build-args"] == "VARIANT=cpu"
    assert build["with"]["load"] is True
    runs = _run_lines(job)
    assert "kind load docker-image" in runs
    assert "kubectl apply --server-side" in runs and "mpi-operator" in runs
    assert wf["env"]["MPI_OPERATOR_VERSION"] == _mpi_operator_in_the_readme()
    for manifest in sorted(DEPLOY.glob("*.yaml")):
        assert f"deploy/{manifest.name}" in runs, f"kind-e2e does not apply {manifest.name}"
    assert ".venv/bin/pytest -m kubernetes tests/integration" in runs
    assert "KUBECONFIG" in runs


def test_pull_requests_get_the_plan_diff_against_their_base_in_the_job_summary() -> None:
    workflow = yaml.safe_load((WORKFLOWS / "ci.yml").read_text())
    job = workflow["jobs"]["plan-diff"]
    assert job["if"] == "github.event_name == 'pull_request'"
    checkout = job["steps"][0]
    assert checkout["uses"].startswith("actions/checkout@") and checkout["with"]["fetch-depth"] == 0
    (step,) = [s for s in job["steps"] if "nightshift plan" in s.get("run", "")]
    assert step["env"]["BASE"] == "origin/${{ github.base_ref }}"
    assert '--against "$BASE"' in step["run"] and "$GITHUB_STEP_SUMMARY" in step["run"]
    for gate in ("lint", "dag-integrity"):
        assert gate in workflow["jobs"] and "pull_request" in workflow[True]  # YAML 1.1 reads `on:` as True
