"""The Kueue set-up in deploy/kueue/ and the RBAC that lets Airflow read it.

Every Kueue object must validate against the `v1beta2` schema of its CRD in ../shared/schemas/, strictly
(unknown fields are errors: the published CRDs would let a v1beta1 spelling such as `cohort` through).
JSON Schema does not evaluate the CRDs' CEL rules (`x-kubernetes-validations`) nor Kueue's admission
webhook, so this file re-implements the rules these manifests could break, proves each check catches
its violation, and fails when a CRD gains a rule it does not know. Then the semantics: queues point at
queues that exist, quotas add up to the nodes, limits are reachable, priorities are ordered, and the
RBAC grants reading Kueue objects and nothing more.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from fractions import Fraction
from pathlib import Path
from typing import Any

import pytest
import yaml

from operators.kueue_quota import GPU_RESOURCE, flavor_quotas, lendable, max_admissible, parse_quantity
from tests.conftest import SHARED
from tests.unit.operators.conftest import strict

ROOT = Path(__file__).resolve().parents[2]
KUEUE_DIR = ROOT / "deploy" / "kueue"
RBAC = ROOT / "deploy" / "rbac.yaml"
SCHEMAS = SHARED / "schemas"
KUEUE_GROUP = "kueue.x-k8s.io"
KUEUE_VERSION = "v1beta2"
CRD_FILES = {
    "ClusterQueue": "kueue.x-k8s.io_clusterqueues.yaml",
    "LocalQueue": "kueue.x-k8s.io_localqueues.yaml",
    "ResourceFlavor": "kueue.x-k8s.io_resourceflavors.yaml",
    "WorkloadPriorityClass": "kueue.x-k8s.io_workloadpriorityclasses.yaml",
}
NAMESPACE = "nightshift"
COHORT = "nightshift-gpus"
# What deploy/kueue/clusterqueues.yaml is sized for (its header says so).
GPU_NODES = 4
GPUS_PER_NODE = 8
READ_VERBS = {"get", "list", "watch"}


def _load(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


OBJECTS = [(p.name, obj) for p in sorted(KUEUE_DIR.glob("*.yaml")) for obj in _load(p)]
KUEUE_OBJECTS = [(f, o) for f, o in OBJECTS if o["kind"] in CRD_FILES]
CORE_OBJECTS = [(f, o) for f, o in OBJECTS if o["kind"] not in CRD_FILES]


def _ids(objects: list[tuple[str, dict[str, Any]]]) -> list[str]:
    return [f"{f}:{o['kind']}/{o['metadata']['name']}" for f, o in objects]


def _named(kind: str) -> dict[str, dict[str, Any]]:
    return {o["metadata"]["name"]: o for _, o in OBJECTS if o["kind"] == kind}


def _crd_version(kind: str) -> dict[str, Any]:
    crd = yaml.safe_load((SCHEMAS / CRD_FILES[kind]).read_text())
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == KUEUE_VERSION]
    return version


@pytest.fixture(scope="session")
def kueue_schemas() -> dict[str, dict[str, Any]]:
    """Each Kueue kind's v1beta2 openAPIV3Schema, picked by version name; skip when ../shared is absent."""
    missing = [name for name in CRD_FILES.values() if not (SCHEMAS / name).exists()]
    if missing:
        pytest.skip(f"Kueue CRD schemas {missing} not found in {SCHEMAS} (needs ../shared/schemas beside the repo)")
    return {kind: _crd_version(kind)["schema"]["openAPIV3Schema"] for kind in CRD_FILES}


# --- what is there -------------------------------------------------------------------------------------


def test_deploy_kueue_has_the_expected_objects() -> None:
    assert {(o["kind"], o["metadata"]["name"]) for _, o in OBJECTS} == {
        ("ResourceFlavor", "gpu-h100"),
        ("ClusterQueue", "nightshift-nightly"),
        ("ClusterQueue", "nightshift-interactive"),
        ("LocalQueue", "nightly"),
        ("LocalQueue", "interactive"),
        ("WorkloadPriorityClass", "nightly-low"),
        ("WorkloadPriorityClass", "interactive-high"),
        ("ClusterRole", "nightshift-kueue-read"),
        ("ClusterRoleBinding", "nightshift-kueue-read"),
    }


def test_kueue_objects_are_v1beta2_and_only_local_queues_are_namespaced() -> None:
    for _, obj in KUEUE_OBJECTS:
        assert obj["apiVersion"] == f"{KUEUE_GROUP}/{KUEUE_VERSION}", obj["metadata"]["name"]
        if obj["kind"] == "LocalQueue":
            assert obj["metadata"]["namespace"] == NAMESPACE
        else:
            assert "namespace" not in obj["metadata"], f"{obj['kind']} is cluster-scoped"


# --- the v1beta2 schemas, strictly ---------------------------------------------------------------------


@pytest.mark.parametrize("obj", [o for _, o in KUEUE_OBJECTS], ids=_ids(KUEUE_OBJECTS))
def test_every_kueue_object_validates_strictly_against_its_crd(
    obj: dict[str, Any], kueue_schemas: dict[str, dict[str, Any]]
) -> None:
    import jsonschema

    jsonschema.validate(obj, strict(kueue_schemas[obj["kind"]]))


def _cluster_queue(name: str = "nightshift-nightly") -> dict[str, Any]:
    return copy.deepcopy(_named("ClusterQueue")[name])


def test_strict_schema_rejects_the_v1beta1_cohort_field(kueue_schemas: dict[str, dict[str, Any]]) -> None:
    """v1beta2 renamed `spec.cohort` to `spec.cohortName`; the old name must not slip through as unknown."""
    import jsonschema

    cq = _cluster_queue()
    cq["spec"]["cohort"] = cq["spec"].pop("cohortName")
    with pytest.raises(jsonschema.ValidationError, match="cohort"):
        jsonschema.validate(cq, strict(kueue_schemas["ClusterQueue"]))
    # ...which the published schema alone would have accepted.
    jsonschema.validate(cq, kueue_schemas["ClusterQueue"])


def test_strict_schema_rejects_a_misspelt_quota(kueue_schemas: dict[str, dict[str, Any]]) -> None:
    import jsonschema

    cq = _cluster_queue()
    quota = cq["spec"]["resourceGroups"][0]["flavors"][0]["resources"][0]
    quota["borowingLimit"] = quota.pop("borrowingLimit")
    with pytest.raises(jsonschema.ValidationError, match="borowingLimit"):
        jsonschema.validate(cq, strict(kueue_schemas["ClusterQueue"]))


# --- CEL rules (x-kubernetes-validations) --------------------------------------------------------------

TAINT_EFFECTS = ("NoSchedule", "PreferNoSchedule", "NoExecute")
MSG_BORROWING_NO_COHORT = "borrowingLimit must be nil when cohort is empty"
MSG_PREFERENCE = "preference can only be set when both whenCanBorrow and whenCanPreempt are TryNextFlavor"
MSG_BORROW_WITHIN_COHORT = "reclaimWithinCohort=Never and borrowWithinCohort.Policy!=Never"
MSG_FLAVOR_RESOURCES = "flavors must have the same number of resources as the coveredResources"
MSG_TOPOLOGY_LABELS = "at least one nodeLabel is required when topology is set"
MSG_TAINT_EFFECT = "supported taint effect values: 'NoSchedule', 'PreferNoSchedule', 'NoExecute'"
MSG_TOLERATION_NO_KEY = "operator must be Exists when 'key' is empty, which means 'match all values and all keys'"
MSG_TOLERATION_SECONDS = "effect must be 'NoExecute' when 'tolerationSeconds' is set"
MSG_TOLERATION_OPERATOR = "supported toleration values: 'Equal'(default), 'Exists'"
MSG_TOLERATION_VALUE = "a value must be empty when 'operator' is 'Exists'"

# Rules on `oldSelf` (immutability): only an update can break them, never a manifest on its own.
UPDATE_ONLY_RULES = {
    "LocalQueue": {"field is immutable"},
    "ResourceFlavor": {"topologyName is immutable when topologyName is set"},
}


def _cluster_queue_cel(cq: dict[str, Any]) -> list[str]:
    """The ClusterQueue v1beta2 CEL rules, after the API server's defaulting (as it evaluates them)."""
    spec = cq.get("spec", {})
    errors = []
    groups = spec.get("resourceGroups")
    if "cohortName" not in spec and groups is not None and any(
        "borrowingLimit" in r for g in groups for f in g["flavors"] for r in f["resources"]
    ):
        errors.append(MSG_BORROWING_NO_COHORT)
    fungibility = spec.get("flavorFungibility", {})
    if "preference" in fungibility and not (
        fungibility.get("whenCanBorrow", "MayStopSearch") == "TryNextFlavor"
        and fungibility.get("whenCanPreempt", "TryNextFlavor") == "TryNextFlavor"
    ):
        errors.append(MSG_PREFERENCE)
    preemption = spec.get("preemption", {})
    borrow_within = preemption.get("borrowWithinCohort", {})
    if preemption.get("reclaimWithinCohort", "Never") == "Never" and borrow_within.get("policy", "Never") != "Never":
        errors.append(MSG_BORROW_WITHIN_COHORT)
    for group in groups or []:
        if any(len(f["resources"]) != len(group["coveredResources"]) for f in group["flavors"]):
            errors.append(MSG_FLAVOR_RESOURCES)
    return errors


def _resource_flavor_cel(rf: dict[str, Any]) -> list[str]:
    spec = rf.get("spec", {})
    errors = []
    if "topologyName" in spec and len(spec.get("nodeLabels", {})) < 1:
        errors.append(MSG_TOPOLOGY_LABELS)
    if any(t.get("effect") not in TAINT_EFFECTS for t in spec.get("nodeTaints", [])):
        errors.append(MSG_TAINT_EFFECT)
    tolerations = spec.get("tolerations", [])
    if any("key" not in t and t.get("operator") != "Exists" for t in tolerations):
        errors.append(MSG_TOLERATION_NO_KEY)
    if any("tolerationSeconds" in t and t.get("effect") != "NoExecute" for t in tolerations):
        errors.append(MSG_TOLERATION_SECONDS)
    if any("operator" in t and t["operator"] not in ("Equal", "Exists") for t in tolerations):
        errors.append(MSG_TOLERATION_OPERATOR)
    if any(t.get("operator") == "Exists" and "value" in t for t in tolerations):
        errors.append(MSG_TOLERATION_VALUE)
    if any("effect" in t and t["effect"] not in TAINT_EFFECTS for t in tolerations):
        errors.append(MSG_TAINT_EFFECT)
    return errors


CEL_CHECKS: dict[str, Callable[[dict[str, Any]], list[str]]] = {
    "ClusterQueue": _cluster_queue_cel,
    "ResourceFlavor": _resource_flavor_cel,
    "LocalQueue": lambda _: [],
    "WorkloadPriorityClass": lambda _: [],
}
CEL_MESSAGES = {
    "ClusterQueue": {MSG_BORROWING_NO_COHORT, MSG_PREFERENCE, MSG_BORROW_WITHIN_COHORT, MSG_FLAVOR_RESOURCES},
    "ResourceFlavor": {MSG_TOPOLOGY_LABELS, MSG_TAINT_EFFECT, MSG_TOLERATION_NO_KEY, MSG_TOLERATION_SECONDS,
                       MSG_TOLERATION_OPERATOR, MSG_TOLERATION_VALUE},
    "LocalQueue": set(),
    "WorkloadPriorityClass": set(),
}


def _crd_rule_messages(node: Any) -> set[str]:
    if isinstance(node, list):
        return set().union(*(_crd_rule_messages(n) for n in node)) if node else set()
    if not isinstance(node, dict):
        return set()
    found = {rule["message"] for rule in node.get("x-kubernetes-validations", [])}
    return found.union(*(_crd_rule_messages(v) for v in node.values()))


@pytest.mark.parametrize("kind", sorted(CRD_FILES))
def test_the_cel_checks_cover_every_rule_of_the_crd(kind: str, kueue_schemas: dict[str, dict[str, Any]]) -> None:
    """A rule added to the CRD fails here until it is checked above (or known to apply to updates only)."""
    in_crd = _crd_rule_messages(kueue_schemas[kind])
    assert in_crd == CEL_MESSAGES[kind] | UPDATE_ONLY_RULES.get(kind, set())


@pytest.mark.parametrize("obj", [o for _, o in KUEUE_OBJECTS], ids=_ids(KUEUE_OBJECTS))
def test_every_kueue_object_satisfies_the_cel_rules(obj: dict[str, Any]) -> None:
    assert CEL_CHECKS[obj["kind"]](obj) == []


def _without_cohort(cq: dict[str, Any]) -> None:
    del cq["spec"]["cohortName"]


def _preference_alone(cq: dict[str, Any]) -> None:
    cq["spec"]["flavorFungibility"] = {"preference": "BorrowingOverPreemption"}


def _borrow_within_cohort_without_reclaim(cq: dict[str, Any]) -> None:
    cq["spec"]["preemption"] = {"borrowWithinCohort": {"policy": "LowerPriority"}}


def _flavor_missing_memory(cq: dict[str, Any]) -> None:
    cq["spec"]["resourceGroups"][0]["flavors"][0]["resources"].pop()


def _tolerations(*tolerations: dict[str, Any]) -> Callable[[dict[str, Any]], None]:
    def mutate(rf: dict[str, Any]) -> None:
        rf["spec"]["tolerations"] = list(tolerations)

    return mutate


def _topology_without_labels(rf: dict[str, Any]) -> None:
    rf["spec"]["topologyName"] = "default"
    rf["spec"].pop("nodeLabels")


def _bad_node_taint(rf: dict[str, Any]) -> None:
    rf["spec"]["nodeTaints"] = [{"key": "nvidia.com/gpu", "effect": "NoRun"}]


CEL_VIOLATIONS = [
    ("cq-borrowing-without-cohort", "ClusterQueue", _without_cohort, MSG_BORROWING_NO_COHORT),
    ("cq-preference-alone", "ClusterQueue", _preference_alone, MSG_PREFERENCE),
    ("cq-borrow-within-cohort-without-reclaim", "ClusterQueue", _borrow_within_cohort_without_reclaim,
     MSG_BORROW_WITHIN_COHORT),
    ("cq-flavor-missing-a-resource", "ClusterQueue", _flavor_missing_memory, MSG_FLAVOR_RESOURCES),
    ("rf-topology-without-labels", "ResourceFlavor", _topology_without_labels, MSG_TOPOLOGY_LABELS),
    ("rf-node-taint-effect", "ResourceFlavor", _bad_node_taint, MSG_TAINT_EFFECT),
    ("rf-toleration-without-key", "ResourceFlavor", _tolerations({"operator": "Equal", "effect": "NoSchedule"}),
     MSG_TOLERATION_NO_KEY),
    ("rf-toleration-seconds", "ResourceFlavor",
     _tolerations({"key": "k", "operator": "Exists", "effect": "NoSchedule", "tolerationSeconds": 60}),
     MSG_TOLERATION_SECONDS),
    ("rf-toleration-operator", "ResourceFlavor", _tolerations({"key": "k", "operator": "In"}),
     MSG_TOLERATION_OPERATOR),
    ("rf-toleration-exists-with-value", "ResourceFlavor",
     _tolerations({"key": "k", "operator": "Exists", "value": "v"}), MSG_TOLERATION_VALUE),
    ("rf-toleration-effect", "ResourceFlavor", _tolerations({"key": "k", "operator": "Exists", "effect": "NoRun"}),
     MSG_TAINT_EFFECT),
]


@pytest.mark.parametrize(("kind", "mutate", "message"), [v[1:] for v in CEL_VIOLATIONS],
                         ids=[v[0] for v in CEL_VIOLATIONS])
def test_each_cel_check_catches_its_violation(kind: str, mutate: Callable[[dict[str, Any]], None],
                                              message: str) -> None:
    for obj in _named(kind).values():
        broken = copy.deepcopy(obj)
        mutate(broken)
        assert message in CEL_CHECKS[kind](broken), broken["metadata"]["name"]


# --- Kueue's ClusterQueue admission webhook (not CEL, but enforced on create and update) -----------------
# As in kubernetes-sigs/kueue pkg/webhooks/clusterqueue_webhook.go: a resource and a flavor belong to one
# resource group; a flavor lists its resources in coveredResources' order; quantities are not negative;
# borrowingLimit and lendingLimit need a cohort; lendingLimit is at most nominalQuota.

MSG_NAME_ORDER = "must match the name in coveredResources"
MSG_DUPLICATE = "Duplicate value"
MSG_NEGATIVE = "must be greater than or equal to 0"
MSG_LENDING_NO_COHORT = "lendingLimit must be nil when cohort is empty"
MSG_LENDING_ABOVE_NOMINAL = "lendingLimit must be less than or equal to the nominalQuota"


def _cluster_queue_webhook(cq: dict[str, Any]) -> list[str]:
    spec = cq["spec"]
    errors = []
    seen_resources: set[str] = set()
    seen_flavors: set[str] = set()
    for group in spec.get("resourceGroups", []):
        covered = group["coveredResources"]
        if seen_resources & set(covered) or len(set(covered)) != len(covered):
            errors.append(MSG_DUPLICATE)
        seen_resources |= set(covered)
        for flavor in group["flavors"]:
            if flavor["name"] in seen_flavors:
                errors.append(MSG_DUPLICATE)
            seen_flavors.add(flavor["name"])
            for name, quota in zip(covered, flavor["resources"], strict=False):
                if quota["name"] != name:
                    errors.append(MSG_NAME_ORDER)
                for key in ("nominalQuota", "borrowingLimit", "lendingLimit"):
                    if key in quota and parse_quantity(quota[key]) < 0:
                        errors.append(MSG_NEGATIVE)
                if "lendingLimit" in quota:
                    if not spec.get("cohortName"):
                        errors.append(MSG_LENDING_NO_COHORT)
                    if parse_quantity(quota["lendingLimit"]) > parse_quantity(quota["nominalQuota"]):
                        errors.append(MSG_LENDING_ABOVE_NOMINAL)
    return errors


def _swap_cpu_and_memory(cq: dict[str, Any]) -> None:
    resources = cq["spec"]["resourceGroups"][0]["flavors"][0]["resources"]
    resources[1], resources[2] = resources[2], resources[1]


def _gpu_in_two_groups(cq: dict[str, Any]) -> None:
    cq["spec"]["resourceGroups"].append({"coveredResources": [GPU_RESOURCE],
                                         "flavors": [{"name": "other", "resources": [
                                             {"name": GPU_RESOURCE, "nominalQuota": 1}]}]})


def _negative_borrowing(cq: dict[str, Any]) -> None:
    cq["spec"]["resourceGroups"][0]["flavors"][0]["resources"][0]["borrowingLimit"] = -1


def _lending_without_cohort(cq: dict[str, Any]) -> None:
    del cq["spec"]["cohortName"]


def _lending_above_nominal(cq: dict[str, Any]) -> None:
    gpu = cq["spec"]["resourceGroups"][0]["flavors"][0]["resources"][0]
    gpu["lendingLimit"] = gpu["nominalQuota"] + 1


WEBHOOK_VIOLATIONS = [
    (_swap_cpu_and_memory, MSG_NAME_ORDER),
    (_gpu_in_two_groups, MSG_DUPLICATE),
    (_negative_borrowing, MSG_NEGATIVE),
    (_lending_without_cohort, MSG_LENDING_NO_COHORT),
    (_lending_above_nominal, MSG_LENDING_ABOVE_NOMINAL),
]


@pytest.mark.parametrize("name", sorted(_named("ClusterQueue")))
def test_cluster_queues_pass_kueues_webhook_checks(name: str) -> None:
    assert _cluster_queue_webhook(_named("ClusterQueue")[name]) == []


@pytest.mark.parametrize(("mutate", "message"), WEBHOOK_VIOLATIONS, ids=[m.__name__ for m, _ in WEBHOOK_VIOLATIONS])
def test_each_webhook_check_catches_its_violation(mutate: Callable[[dict[str, Any]], None], message: str) -> None:
    for name in _named("ClusterQueue"):
        broken = _cluster_queue(name)
        mutate(broken)
        assert message in _cluster_queue_webhook(broken), name


# --- what the objects mean together ----------------------------------------------------------------------


def _selects(selector: dict[str, Any] | None, labels: dict[str, str]) -> bool:
    """A LabelSelector (matchLabels, matchExpressions) against labels; None selects nothing, as in Kueue."""
    if selector is None:
        return False
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for expr in selector.get("matchExpressions", []):
        key, op, values = expr["key"], expr["operator"], expr.get("values", [])
        ok = {"In": key in labels and labels[key] in values,
              "NotIn": key not in labels or labels[key] not in values,
              "Exists": key in labels,
              "DoesNotExist": key not in labels}[op]
        if not ok:
            return False
    return True


def test_local_queues_feed_existing_cluster_queues_that_admit_their_namespace() -> None:
    cluster_queues = _named("ClusterQueue")
    for name, lq in _named("LocalQueue").items():
        cq = cluster_queues.get(lq["spec"]["clusterQueue"])
        assert cq is not None, f"LocalQueue {name} points at a missing ClusterQueue {lq['spec']['clusterQueue']}"
        namespace_labels = {"kubernetes.io/metadata.name": lq["metadata"]["namespace"]}
        assert _selects(cq["spec"].get("namespaceSelector"), namespace_labels), name
    # Each ClusterQueue is fed by a LocalQueue: none is unreachable.
    assert {lq["spec"]["clusterQueue"] for lq in _named("LocalQueue").values()} == set(cluster_queues)


def test_namespace_selector_admits_nothing_else() -> None:
    for cq in _named("ClusterQueue").values():
        assert not _selects(cq["spec"]["namespaceSelector"], {"kubernetes.io/metadata.name": "default"})


def test_cluster_queues_name_flavors_that_exist() -> None:
    flavors = set(_named("ResourceFlavor"))
    for name, cq in _named("ClusterQueue").items():
        used = {f["name"] for g in cq["spec"]["resourceGroups"] for f in g["flavors"]}
        assert used and used <= flavors, name


def test_resource_flavor_targets_the_gpu_nodes_and_tolerates_their_taint() -> None:
    (flavor,) = _named("ResourceFlavor").values()
    assert flavor["spec"]["nodeLabels"].get("nvidia.com/gpu.product")
    gpu_taint = {"key": "nvidia.com/gpu", "effect": "NoSchedule"}
    assert any(
        t.get("key") == gpu_taint["key"] and t.get("operator") == "Exists" and t.get("effect") in (None, "NoSchedule")
        for t in flavor["spec"]["tolerations"]
    )


def test_nightly_priority_is_below_interactive() -> None:
    classes = _named("WorkloadPriorityClass")
    assert 0 < classes["nightly-low"]["value"] < classes["interactive-high"]["value"]


def test_cohort_gpus_add_up_to_the_nodes() -> None:
    cluster_queues = list(_named("ClusterQueue").values())
    assert {cq["spec"]["cohortName"] for cq in cluster_queues} == {COHORT}
    nominal = sum(parse_quantity(q["nominalQuota"]) for cq in cluster_queues
                  for q in flavor_quotas(cq, GPU_RESOURCE).values())
    assert nominal == GPU_NODES * GPUS_PER_NODE
    for cq in cluster_queues:
        most = max_admissible(cq, GPU_RESOURCE, cluster_queues)
        assert most is not None and 0 < most <= GPU_NODES * GPUS_PER_NODE, cq["metadata"]["name"]


@pytest.mark.parametrize("resource", [GPU_RESOURCE, "cpu", "memory"])
def test_borrowing_limits_are_reachable(resource: str) -> None:
    """A borrowingLimit above what the rest of the cohort lends would promise quota that never comes."""
    cluster_queues = _named("ClusterQueue")
    for name, cq in cluster_queues.items():
        for flavor, quota in flavor_quotas(cq, resource).items():
            pool = sum(lendable(q) for other, o in cluster_queues.items() if other != name
                       if (q := flavor_quotas(o, resource).get(flavor)) is not None)
            assert "borrowingLimit" in quota and parse_quantity(quota["borrowingLimit"]) <= pool, (name, flavor)


def test_cpu_and_memory_scale_with_gpus_at_one_ratio() -> None:
    """Every quota, limit and queue gives the same CPUs and memory per GPU, so a GPU brings its share."""
    ratios: dict[str, set[Fraction]] = {"cpu": set(), "memory": set()}
    for cq in _named("ClusterQueue").values():
        for flavor, gpu in flavor_quotas(cq, GPU_RESOURCE).items():
            for resource, seen in ratios.items():
                quota = flavor_quotas(cq, resource)[flavor]
                for key in ("nominalQuota", "borrowingLimit", "lendingLimit"):
                    seen.add(parse_quantity(quota[key]) / parse_quantity(gpu[key]))
    assert all(len(seen) == 1 for seen in ratios.values()), ratios


def test_preemption_and_fair_sharing_knobs() -> None:
    queues = _named("ClusterQueue")
    for name, cq in queues.items():
        preemption = cq["spec"]["preemption"]
        assert preemption["withinClusterQueue"] == "LowerPriority", name
        assert preemption["reclaimWithinCohort"] in ("Any", "LowerPriority"), name
        # Kueue supports borrowWithinCohort with classic preemption only; fair sharing is on (deploy/kueue/README.md).
        assert "borrowWithinCohort" not in preemption, name
        assert parse_quantity(cq["spec"]["fairSharing"]["weight"]) > 0, name
    # People reclaim what they lent from anyone; a scheduled retrain never preempts a person's run.
    assert queues["nightshift-interactive"]["spec"]["preemption"]["reclaimWithinCohort"] == "Any"
    assert queues["nightshift-nightly"]["spec"]["preemption"]["reclaimWithinCohort"] == "LowerPriority"
    assert parse_quantity(queues["nightshift-interactive"]["spec"]["fairSharing"]["weight"]) > parse_quantity(
        queues["nightshift-nightly"]["spec"]["fairSharing"]["weight"]
    )


def test_the_operator_accepts_these_queue_and_priority_names() -> None:
    """The names a DAG run passes as `queue` and `priority` end up as the labels Kueue reads."""
    from operators.mpijob_spec import (
        KUEUE_PRIORITY_LABEL,
        KUEUE_QUEUE_LABEL,
        MPIJobConfig,
        TaskIdentity,
        build_mpijob,
    )

    identity = TaskIdentity(dag_id="nightly_retrain", task_id="train", run_id="scheduled__2026-01-01T02:00:00+00:00")
    for queue in _named("LocalQueue"):
        for priority in _named("WorkloadPriorityClass"):
            config = MPIJobConfig(image="trainer:1", command=["python", "-m", "nightshift.train"], num_workers=2,
                                  gpus_per_worker=8, namespace=NAMESPACE, queue_name=queue, priority_class=priority)
            job = build_mpijob(config, identity)
            assert job["metadata"]["labels"][KUEUE_QUEUE_LABEL] == queue
            assert job["metadata"]["labels"][KUEUE_PRIORITY_LABEL] == priority
            assert job["spec"]["runPolicy"]["suspend"] is True


# --- RBAC: read Kueue objects, nothing more -------------------------------------------------------------


def _granted(role: dict[str, Any]) -> dict[tuple[str, str], set[str]]:
    granted: dict[tuple[str, str], set[str]] = {}
    for rule in role["rules"]:
        assert set(rule) <= {"apiGroups", "resources", "verbs"}, "no resourceNames/nonResourceURLs"
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                granted.setdefault((group, resource), set()).update(rule["verbs"])
    return granted


def test_rbac_grants_exactly_read_verbs_on_kueue_objects() -> None:
    (role,) = [o for o in _load(RBAC) if o["kind"] == "Role"]
    namespaced = {k: v for k, v in _granted(role).items() if k[0] == KUEUE_GROUP}
    assert namespaced == {(KUEUE_GROUP, "workloads"): READ_VERBS, (KUEUE_GROUP, "localqueues"): READ_VERBS}
    (cluster_role,) = _named("ClusterRole").values()
    assert _granted(cluster_role) == {
        (KUEUE_GROUP, "clusterqueues"): READ_VERBS,
        (KUEUE_GROUP, "workloadpriorityclasses"): READ_VERBS,
    }


def test_cluster_role_binding_binds_the_airflow_service_account() -> None:
    (binding,) = _named("ClusterRoleBinding").values()
    (cluster_role,) = _named("ClusterRole").values()
    (account,) = [o for o in _load(RBAC) if o["kind"] == "ServiceAccount"]
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                                  "name": cluster_role["metadata"]["name"]}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account["metadata"]["name"],
                                    "namespace": account["metadata"]["namespace"]}]


@pytest.mark.parametrize("obj", [o for _, o in CORE_OBJECTS], ids=_ids(CORE_OBJECTS))
def test_core_objects_validate_strictly(obj: dict[str, Any]) -> None:
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    from tests.unit.test_deploy_manifests import K8S_VERSIONS

    for version in K8S_VERSIONS:
        kubernetes_validate.validate(obj, version, strict=True)
