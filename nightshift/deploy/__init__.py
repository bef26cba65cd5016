"""Deployment targets: `local` (an MLflow model server on 127.0.0.1) and `kserve` (an InferenceService)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from nightshift.errors import UsageError

TARGETS = ("local", "kserve")
# Statuses after which `@champion` names the deployed version.
CHAMPION_STATUSES = frozenset({"created", "promoted", "already_serving"})


def _announced(result: dict[str, Any]) -> dict[str, Any]:
    """Tell running `score-stream` consumers about the champion (nightshift.stream.announce), only where
    $NIGHTSHIFT_REDIS_URL is set; `announced` says whether Redis took it. A failure is a warning: consumers
    also poll the registry."""
    if os.environ.get("NIGHTSHIFT_REDIS_URL") and result.get("status") in CHAMPION_STATUSES:
        from nightshift.stream.announce import announce_champion

        result["announced"] = announce_champion(str(result["model_name"]), str(result["version"]))
    return result


def deploy(target: str, model_name: str, *, version: str | None = None, alias: str = "challenger",
           data_dir: str | Path | None = None, kserve_api: Any = None, namespace: str = "default",
           **options: Any) -> dict[str, Any]:
    """Deploy `model_name` (`version`, default `@alias`) to `target`; see deploy_local / deploy_kserve."""
    if target == "local":
        from nightshift.deploy.local import deploy_local

        if data_dir is None:
            raise UsageError("the local target needs data_dir (the staged dataset) for its canary batch")
        return _announced(deploy_local(model_name, data_dir=data_dir, version=version, alias=alias, **options))
    if target == "kserve":
        from nightshift.deploy.kserve import deploy_kserve

        if kserve_api is None:
            raise UsageError("the kserve target needs a CustomObjectsApi-like client (kserve_api)")
        return _announced(deploy_kserve(model_name, api=kserve_api, namespace=namespace, version=version,
                                        alias=alias, **options))
    raise UsageError(f"unknown deployment target {target!r}; use one of {', '.join(TARGETS)}")
