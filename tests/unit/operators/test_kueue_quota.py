from __future__ import annotations

from fractions import Fraction
from pathlib import Path
from typing import Any

import pytest
import yaml

from operators.kueue_quota import InvalidQuantity, lendable, max_admissible, parse_quantity

DEPLOY_KUEUE = Path(__file__).resolve().parents[3] / "deploy" / "kueue"
GPU = "nvidia.com/gpu"


def cluster_queue(
    name: str,
    quotas: dict[str, dict[str, Any]],
    *,
    cohort: str | None = "pool",
    flavor: str = "default",
    extra_flavors: dict[str, dict[str, dict[str, Any]]] | None = None,
) -> dict[str, Any]:
    """A ClusterQueue as the API returns it: one resource group covering `quotas`' resources."""
    covered = list(quotas)

    def flavor_entry(flavor_name: str, resources: dict[str, dict[str, Any]]) -> dict[str, Any]:
        return {"name": flavor_name, "resources": [{"name": r, **resources[r]} for r in covered]}

    flavors = [flavor_entry(flavor, quotas)]
    flavors += [flavor_entry(n, q) for n, q in (extra_flavors or {}).items()]
    spec: dict[str, Any] = {"resourceGroups": [{"coveredResources": covered, "flavors": flavors}]}
    if cohort is not None:
        spec["cohortName"] = cohort
    return {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ClusterQueue", "metadata": {"name": name}, "spec": spec}


@pytest.fixture(scope="module")
def deployed() -> dict[str, dict[str, Any]]:
    """deploy/kueue/clusterqueues.yaml, by name."""
    docs = yaml.safe_load_all((DEPLOY_KUEUE / "clusterqueues.yaml").read_text())
    return {d["metadata"]["name"]: d for d in docs if d and d["kind"] == "ClusterQueue"}


@pytest.mark.parametrize(("value", "expected"), [
    (8, 8), ("8", 8), ("500m", Fraction(1, 2)), ("1.5", Fraction(3, 2)), ("64Gi", 64 * 2**30),
    ("2k", 2000), ("1e3", 1000), ("100M", 10**8), (" 4 ", 4),
])
def test_parse_quantity(value: object, expected: Fraction | int) -> None:
    assert parse_quantity(value) == expected


@pytest.mark.parametrize("value", ["eight", "8 GPUs", "", None, True, "1Gb"])
def test_parse_quantity_refuses_what_is_not_a_quantity(value: object) -> None:
    with pytest.raises(InvalidQuantity):
        parse_quantity(value)


def test_uncovered_resource_is_none_and_a_zero_quota_is_zero() -> None:
    cq = cluster_queue("a", {"cpu": {"nominalQuota": 4}, GPU: {"nominalQuota": 0}}, cohort=None)
    assert max_admissible(cq, "amd.com/gpu") is None
    assert max_admissible(cq, GPU) == 0
    assert max_admissible(cluster_queue("empty", {}, cohort=None)) is None


def test_without_a_cohort_only_the_nominal_quota_counts() -> None:
    alone = cluster_queue("a", {GPU: {"nominalQuota": 8}}, cohort=None)
    other = cluster_queue("b", {GPU: {"nominalQuota": 16}}, cohort=None)
    assert max_admissible(alone, GPU, [alone, other]) == 8
    assert max_admissible(alone, GPU) == 8


def test_in_a_cohort_without_limits_the_whole_cohort_can_be_borrowed() -> None:
    a = cluster_queue("a", {GPU: {"nominalQuota": 8}})
    b = cluster_queue("b", {GPU: {"nominalQuota": 16}})
    c = cluster_queue("c", {GPU: {"nominalQuota": "4"}})
    assert max_admissible(a, GPU, [b, c]) == 28
    # The queue itself in the list (callers may pass every ClusterQueue) is not counted twice.
    assert max_admissible(a, GPU, [a, b, c]) == 28


def test_lending_limit_is_what_the_other_queue_lends_not_what_it_keeps() -> None:
    """Kueue's own example (cluster_queue.md, LendingLimit): team-b lends at most 1 of its 12 CPUs."""
    team_a = cluster_queue("team-a-cq", {"cpu": {"nominalQuota": 9}}, cohort="team-ab")
    team_b = cluster_queue("team-b-cq", {"cpu": {"nominalQuota": 12, "lendingLimit": 1}}, cohort="team-ab")
    assert lendable(team_b["spec"]["resourceGroups"][0]["flavors"][0]["resources"][0]) == 1
    assert max_admissible(team_a, "cpu", [team_a, team_b]) == 9 + 1
    # A queue's own lendingLimit does not lower what it may use itself.
    assert max_admissible(team_b, "cpu", [team_a, team_b]) == 12 + 9


def test_borrowing_limit_caps_what_the_cohort_could_lend() -> None:
    """Kueue's own example (cluster_queue.md, BorrowingLimit): team-a borrows at most 1 CPU."""
    team_a = cluster_queue("team-a-cq", {"cpu": {"nominalQuota": 9, "borrowingLimit": 1}}, cohort="team-ab")
    team_b = cluster_queue("team-b-cq", {"cpu": {"nominalQuota": 12}}, cohort="team-ab")
    assert max_admissible(team_a, "cpu", [team_a, team_b]) == 10
    assert max_admissible(team_b, "cpu", [team_a, team_b]) == 21


def test_borrowing_limit_above_what_is_lendable_gives_only_what_is_lendable() -> None:
    a = cluster_queue("a", {GPU: {"nominalQuota": 8, "borrowingLimit": 100}})
    b = cluster_queue("b", {GPU: {"nominalQuota": 16, "lendingLimit": 4}})
    assert max_admissible(a, GPU, [b]) == 12


def test_without_the_cohort_listed_only_the_borrowing_limit_counts() -> None:
    limited = cluster_queue("a", {GPU: {"nominalQuota": 8, "borrowingLimit": 4}})
    unlimited = cluster_queue("b", {GPU: {"nominalQuota": 8}})
    assert max_admissible(limited, GPU) == 12
    assert max_admissible(unlimited, GPU) == 8  # understated, as documented: pass cohort_queues


def test_queues_of_other_cohorts_and_other_flavors_lend_nothing() -> None:
    a = cluster_queue("a", {GPU: {"nominalQuota": 8}}, flavor="h100")
    elsewhere = cluster_queue("b", {GPU: {"nominalQuota": 16}}, cohort="other", flavor="h100")
    other_flavor = cluster_queue("c", {GPU: {"nominalQuota": 16}}, flavor="a100")
    no_gpus = cluster_queue("d", {"cpu": {"nominalQuota": 64}}, flavor="h100")
    assert max_admissible(a, GPU, [a, elsewhere, other_flavor, no_gpus]) == 8


def test_one_workload_gets_one_flavor_so_flavors_do_not_add_up() -> None:
    cq = cluster_queue("a", {GPU: {"nominalQuota": 8}}, cohort=None, flavor="h100",
                       extra_flavors={"a100": {GPU: {"nominalQuota": 4}}})
    assert max_admissible(cq, GPU) == 8
    lender = cluster_queue("b", {GPU: {"nominalQuota": 16}}, flavor="a100")
    both = cluster_queue("a", {GPU: {"nominalQuota": 8}}, flavor="h100",
                         extra_flavors={"a100": {GPU: {"nominalQuota": 4}}})
    assert max_admissible(both, GPU, [lender]) == 4 + 16


def test_a_lending_limit_above_nominal_lends_the_nominal_quota() -> None:
    a = cluster_queue("a", {GPU: {"nominalQuota": 0}})
    b = cluster_queue("b", {GPU: {"nominalQuota": 4, "lendingLimit": 10}})
    assert max_admissible(a, GPU, [b]) == 4


def test_fractional_quotas_round_down() -> None:
    cq = cluster_queue("a", {"cpu": {"nominalQuota": "1500m"}, "memory": {"nominalQuota": "1.5Ki"}}, cohort=None)
    assert max_admissible(cq, "cpu") == 1
    assert max_admissible(cq, "memory") == 1536


def test_deployed_cluster_queues(deployed: dict[str, dict[str, Any]]) -> None:
    """deploy/kueue/clusterqueues.yaml: its table of "most one job gets" is what Kueue would admit."""
    queues = list(deployed.values())
    nightly, interactive = deployed["nightshift-nightly"], deployed["nightshift-interactive"]
    # 24 nominal + the 4 GPUs the interactive queue lends; 8 nominal + the 16 the nightly queue lends.
    assert max_admissible(nightly, GPU, queues) == 28
    assert max_admissible(interactive, GPU, queues) == 24
    # Their borrowing limits are exactly what the other lends, so the answer holds without the cohort too.
    assert max_admissible(nightly, GPU) == 28
    assert max_admissible(interactive, GPU) == 24
    assert max_admissible(nightly, "cpu", queues) == 288 + 48
    assert max_admissible(interactive, "memory", queues) == (1600 + 3200) * 2**30
    assert max_admissible(nightly, "amd.com/gpu", queues) is None
