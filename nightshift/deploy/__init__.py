"""Deployment targets: `local` (an MLflow model server on 127.0.0.1) and `kserve` (an InferenceService)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from nightshift.errors import UsageError

TARGETS = ("local", "kserve")


def deploy(target: str, model_name: str, *, version: str | None = None, alias: str = "challenger",
           data_dir: str | Path | None = None, kserve_api: Any = None, namespace: str = "default",
           **options: Any) -> dict[str, Any]:
    """Deploy `model_name` (`version`, default `@alias`) to `target`; see deploy_local / deploy_kserve."""
    if target == "local":
        from nightshift.deploy.local import deploy_local

        if data_dir is None:
            raise UsageError("the local target needs data_dir (the staged dataset) for its canary batch")
        return deploy_local(model_name, data_dir=data_dir, version=version, alias=alias, **options)
    if target == "kserve":
        from nightshift.deploy.kserve import deploy_kserve

        if kserve_api is None:
            raise UsageError("the kserve target needs a CustomObjectsApi-like client (kserve_api)")
        return deploy_kserve(model_name, api=kserve_api, namespace=namespace, version=version, alias=alias,
                             **options)
    raise UsageError(f"unknown deployment target {target!r}; use one of {', '.join(TARGETS)}")
