from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from tests.conftest import SHARED

MPIJOB_CRD = SHARED / "schemas" / "kubeflow.org_mpijobs.yaml"


@pytest.fixture(scope="session")
def mpijob_schema() -> dict[str, Any]:
    """The MPIJob CRD's openAPIV3Schema (v2beta1), read from ../shared; skip when it is not there."""
    if not MPIJOB_CRD.exists():
        pytest.skip(f"MPIJob CRD schema not found at {MPIJOB_CRD} (needs ../shared/schemas beside the repo)")
    import yaml

    crd = yaml.safe_load(Path(MPIJOB_CRD).read_text())
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def strict(schema: Any) -> Any:
    """The schema with unknown fields forbidden wherever it lists the known ones.

    The published CRDs allow unknown fields, so a misspelt field (`slotsPerWorkerr`) would pass; an
    object that declares `properties` and neither `additionalProperties` nor
    `x-kubernetes-preserve-unknown-fields` accepts nothing else here.
    """
    if isinstance(schema, list):
        return [strict(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: strict(value) for key, value in schema.items()}
    if ("properties" in schema and "additionalProperties" not in schema
            and not schema.get("x-kubernetes-preserve-unknown-fields")):
        out["additionalProperties"] = False
    return out


@pytest.fixture
def validate_mpijob(mpijob_schema: dict[str, Any]) -> Any:
    import jsonschema

    schema = strict(mpijob_schema)

    def check(manifest: dict[str, Any]) -> None:
        jsonschema.validate(manifest, schema)

    return check


def make_context(
    dag_id: str = "nightly_retrain",
    task_id: str = "train",
    run_id: str = "manual__2026-01-01T00:00:00+00:00",
    try_number: int = 1,
    map_index: int = -1,
) -> dict[str, Any]:
    ti = SimpleNamespace(dag_id=dag_id, task_id=task_id, run_id=run_id, try_number=try_number, map_index=map_index)
    return {"ti": ti, "run_id": run_id}
