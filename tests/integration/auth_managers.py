"""An auth manager for tests: Airflow's SimpleAuthManager, except that the user `outsider` may read no DAG
and the user `retrainer` may read `nightly_retrain` only (not `model_search`, nor another pipeline).

SimpleAuthManager grants every viewer every DAG; a deployment with per-DAG access (FAB, Keycloak, a
team) denies some. This stands in for such a policy so that tests can ask what a user without access
to `nightly_retrain` sees.
"""

from __future__ import annotations

from typing import Any

from airflow.api_fastapi.auth.managers.simple.simple_auth_manager import SimpleAuthManager

OUTSIDER = "outsider"
RETRAINER = "retrainer"


class DagScopedAuthManager(SimpleAuthManager):
    def is_authorized_dag(self, *, method: Any, user: Any, access_entity: Any = None, details: Any = None) -> bool:
        if user.username == OUTSIDER:
            return False
        if user.username == RETRAINER and getattr(details, "id", None) != "nightly_retrain":
            return False
        return super().is_authorized_dag(method=method, user=user, access_entity=access_entity, details=details)
