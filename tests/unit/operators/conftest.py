from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from operators.validation import strict
from tests.conftest import SHARED

__all__ = ["MPIJOB_CRD", "horovod_operator", "make_context", "strict"]

MPIJOB_CRD = SHARED / "schemas" / "kubeflow.org_mpijobs.yaml"


@pytest.fixture(scope="session")
def mpijob_schema() -> dict[str, Any]:
    """The MPIJob CRD's openAPIV3Schema (v2beta1), read from ../shared; skip when it is not there."""
    if not MPIJOB_CRD.exists():
        pytest.skip(f"MPIJob CRD schema not found at {MPIJOB_CRD} (needs ../shared/schemas beside the repo)")
    import yaml

    crd = yaml.safe_load(Path(MPIJOB_CRD).read_text())
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


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
    ti = FakeTI(dag_id=dag_id, task_id=task_id, run_id=run_id, try_number=try_number, map_index=map_index)
    return {"ti": ti, "run_id": run_id}


XCOMS: dict[tuple[str, str, str, int, str], Any] = {}  # (dag_id, run_id, task_id, key): what a task pushed, as the
# metadata DB keeps it across a deferral (a test's contexts of one try share it)


class FakeTI(SimpleNamespace):
    """A task instance's identity and its XCom (push and pull by task and key), as the Task SDK's."""

    def xcom_push(self, key: str, value: Any) -> None:
        XCOMS[(self.dag_id, self.run_id, self.task_id, self.map_index, key)] = value

    def xcom_pull(self, task_ids: str, key: str = "return_value", map_indexes: int | None = None) -> Any:
        """As the Task SDK's: without map_indexes, every map index's value of that task (a list when mapped)."""
        found = [v for (d, r, t, m, k), v in XCOMS.items() if (d, r, t, k) == (self.dag_id, self.run_id, task_ids,
                                                                               key) and map_indexes in (None, m)]
        if map_indexes is None and len({m for (_, _, t, m, _) in XCOMS if t == task_ids}) > 1:
            return found
        return found[0] if found else None


@pytest.fixture(autouse=True)
def _fresh_xcoms() -> Any:
    XCOMS.clear()
    yield
    XCOMS.clear()


def horovod_operator(**arguments: Any) -> Any:
    """A HorovodKubernetesOperator from flat keyword arguments, as tests write them: each setting (a field of
    operators.horovod_config's configs) goes into its config, the rest (task_id, pool...) to the operator."""
    from operators.horovod import HorovodKubernetesOperator
    from operators.horovod_config import SETTING_GROUPS, configs_from

    settings = {name: arguments.pop(name) for name in list(arguments) if name in SETTING_GROUPS}
    return HorovodKubernetesOperator(**configs_from(**settings), **arguments)
