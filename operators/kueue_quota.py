"""How much of a resource one workload can ever be admitted with in a Kueue ClusterQueue.

Pure functions over ClusterQueue objects as the API returns them (plain dicts, `kueue.x-k8s.io/v1beta2`:
`spec.cohortName`, `spec.resourceGroups[].flavors[].resources[]` with `nominalQuota`, `borrowingLimit`,
`lendingLimit`). No Airflow or Kubernetes client here: the operator fetches the objects, this decides.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from fractions import Fraction
from typing import Any

GPU_RESOURCE = "nvidia.com/gpu"

_QUANTITY = re.compile(r"^([+-]?(?:\d+(?:\.\d*)?|\.\d+))(?:(Ki|Mi|Gi|Ti|Pi|Ei|[numkMGTPE])|[eE]([+-]?\d+))?$")
_BINARY = {"Ki": 1, "Mi": 2, "Gi": 3, "Ti": 4, "Pi": 5, "Ei": 6}
_DECIMAL = {"n": -9, "u": -6, "m": -3, "": 0, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}


class InvalidQuantity(ValueError):
    """A ClusterQueue quota is not a Kubernetes quantity (e.g. "8", "500m", "64Gi")."""


def parse_quantity(value: object) -> Fraction:
    """A Kubernetes quantity (int, or a string such as "8", "500m", "1.5", "64Gi", "1e3") as an exact number."""
    if isinstance(value, bool):
        raise InvalidQuantity(f"{value!r} is not a quantity")
    if isinstance(value, int):
        return Fraction(value)
    match = _QUANTITY.match(str(value).strip()) if isinstance(value, str | float) else None
    if match is None:
        raise InvalidQuantity(f"{value!r} is not a Kubernetes quantity")
    number, suffix, exponent = match.groups()
    amount = Fraction(number)
    if exponent is not None:
        return amount * Fraction(10) ** int(exponent)
    suffix = suffix or ""
    if suffix in _BINARY:
        return amount * 1024 ** _BINARY[suffix]
    return amount * Fraction(10) ** _DECIMAL[suffix]


def _name(obj: Mapping[str, Any]) -> str | None:
    return (obj.get("metadata") or {}).get("name")


def _cohort(cluster_queue: Mapping[str, Any]) -> str | None:
    return (cluster_queue.get("spec") or {}).get("cohortName") or None


def flavor_quotas(cluster_queue: Mapping[str, Any], resource: str) -> dict[str, Mapping[str, Any]]:
    """The quota entry (`{name, nominalQuota, borrowingLimit?, lendingLimit?}`) of `resource`, per flavor name."""
    out: dict[str, Mapping[str, Any]] = {}
    for group in (cluster_queue.get("spec") or {}).get("resourceGroups") or []:
        if resource not in (group.get("coveredResources") or []):
            continue
        for flavor in group.get("flavors") or []:
            for quota in flavor.get("resources") or []:
                if quota.get("name") == resource:
                    out[flavor["name"]] = quota
    return out


def lendable(quota: Mapping[str, Any]) -> Fraction:
    """What a ClusterQueue lets the rest of its cohort use of one [flavor, resource]: `lendingLimit`, at most
    its nominal quota, or all of the nominal quota when no lendingLimit is set (it keeps
    `nominalQuota - lendingLimit` for itself)."""
    nominal = parse_quantity(quota.get("nominalQuota", 0))
    if quota.get("lendingLimit") is None:
        return nominal
    return max(Fraction(0), min(nominal, parse_quantity(quota["lendingLimit"])))


def max_admissible(
    cluster_queue: Mapping[str, Any],
    resource: str = GPU_RESOURCE,
    cohort_queues: Iterable[Mapping[str, Any]] | None = None,
) -> int | None:
    """The most of `resource` a single workload can ever be admitted with in `cluster_queue`, or None when
    the ClusterQueue does not cover `resource` (Kueue would never admit a workload asking for it there).

    The rule, per flavor F of `resource` in the ClusterQueue (Kueue's `potentialAvailable` for a
    ClusterQueue whose cohort has no quota of its own):

    - without a cohort (`spec.cohortName` empty): `nominalQuota(F)`;
    - in a cohort: `nominalQuota(F)` plus what the other ClusterQueues of that cohort can lend of F, each
      `min(lendingLimit, nominalQuota)` when it sets `lendingLimit` and its whole `nominalQuota` when it
      does not (`lendingLimit` is how much a queue lends; it keeps `nominalQuota - lendingLimit`). A queue
      only lends the [flavor, resource] pairs it lists itself.
    - `borrowingLimit(F)`, when set, caps that: at most `nominalQuota(F) + borrowingLimit(F)`.
    - The queue's own `lendingLimit` does not lower what it may use itself.

    The answer is the largest over the flavors, not their sum: Kueue assigns each pod set one flavor per
    resource, and an MPIJob's GPUs are all in its worker pod set. Quantities are rounded down to whole
    units (GPUs, CPU cores, bytes).

    `cohort_queues` are the other ClusterQueues (passing every ClusterQueue is fine: the queue itself and
    queues of other cohorts are skipped). Without them only the queue's own `borrowingLimit` counts as
    borrowable (assumed available in full), and a queue in a cohort with no `borrowingLimit` gets its
    nominal quota only, which understates it: pass the cohort whenever the queue has one. A Kueue `Cohort`
    object with its own quota, or a parent cohort, adds capacity this function does not see.
    """
    own = flavor_quotas(cluster_queue, resource)
    if not own:
        return None
    cohort = _cohort(cluster_queue)
    others = []
    if cohort is not None and cohort_queues is not None:
        me = _name(cluster_queue)
        others = [cq for cq in cohort_queues if _cohort(cq) == cohort and (me is None or _name(cq) != me)]

    best = Fraction(0)
    for flavor, quota in own.items():
        nominal = parse_quantity(quota.get("nominalQuota", 0))
        limit = nominal
        if cohort is not None:
            borrowing = quota.get("borrowingLimit")
            if cohort_queues is not None:
                pool = sum((lendable(q) for cq in others
                            if (q := flavor_quotas(cq, resource).get(flavor)) is not None), Fraction(0))
                limit = nominal + pool
                if borrowing is not None:
                    limit = min(limit, nominal + parse_quantity(borrowing))
            elif borrowing is not None:
                limit = nominal + parse_quantity(borrowing)
        best = max(best, limit)
    return math.floor(best)
