"""Deployment targets by name: where a registered model version is served.

| name | module | serves the model |
|---|---|---|
| `local` | `nightshift.deploy.local` | an MLflow model server on 127.0.0.1, blue/green |
| `kserve` | `nightshift.deploy.kserve` | a KServe InferenceService with a canary |

A target is a function `(model_name, *, version, alias, data_dir, kserve_api, namespace, **options) -> dict`
(the result: at least "status", "model_name", "version"; see deploy_local / deploy_kserve). A third party adds
one without editing the project: an entry point in the group `nightshift.deploy_targets`
(`name = "package.module:function"`), or a module named in NIGHTSHIFT_PLUGINS calling
`register_target(name, function)`. `nightshift deploy --target`, the DAG's `deploy_target` Param and the
pipeline declaration's `deploy.target` take their choices from `target_names()` (cheap: it imports no target).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from nightshift.errors import UsageError
from nightshift.plugins import Registry

ENTRY_POINT_GROUP = "nightshift.deploy_targets"
BUILTIN_TARGETS = ("local", "kserve")
DeployTarget = Callable[..., dict[str, Any]]

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


def _deploy_local(model_name: str, *, version: str | None, alias: str, data_dir: str | Path | None,
                  kserve_api: Any = None, namespace: str = "default", **options: Any) -> dict[str, Any]:
    from nightshift.deploy.local import deploy_local

    if data_dir is None:
        raise UsageError("the local target needs data_dir (the staged dataset) for its canary batch")
    return deploy_local(model_name, data_dir=data_dir, version=version, alias=alias, **options)


def _deploy_kserve(model_name: str, *, version: str | None, alias: str, data_dir: str | Path | None = None,
                   kserve_api: Any = None, namespace: str = "default", **options: Any) -> dict[str, Any]:
    from nightshift.deploy.kserve import deploy_kserve

    if kserve_api is None:
        raise UsageError("the kserve target needs a CustomObjectsApi-like client (kserve_api)")
    return deploy_kserve(model_name, api=kserve_api, namespace=namespace, version=version, alias=alias, **options)


TARGETS: Registry[dict[str, Any]] = Registry(
    "deployment target", builtins={"local": f"{__name__}:_deploy_local", "kserve": f"{__name__}:_deploy_kserve"},
    entry_point_group=ENTRY_POINT_GROUP, strict=True)


def register_target(name: str, target: DeployTarget | str) -> None:
    """Make `target` (a function as the module's docstring says, or its import path "package.module:function")
    the deployment target `name`; call it from a module named in NIGHTSHIFT_PLUGINS."""
    TARGETS.add(name, target)


def target_names() -> tuple[str, ...]:
    """Every deployment target's name: the built-ins first, then the plugins' (sorted)."""
    names = TARGETS.names()
    return (*(n for n in BUILTIN_TARGETS if n in names), *(n for n in names if n not in BUILTIN_TARGETS))


def deploy(target: str, model_name: str, *, version: str | None = None, alias: str = "challenger",
           data_dir: str | Path | None = None, kserve_api: Any = None, namespace: str = "default",
           **options: Any) -> dict[str, Any]:
    """Deploy `model_name` (`version`, default `@alias`) to `target`; see deploy_local / deploy_kserve."""
    if target not in target_names():
        raise UsageError(f"unknown deployment target {target!r}; use one of {', '.join(target_names())} (a new one "
                         f"is registered by an entry point in {ENTRY_POINT_GROUP} or by a NIGHTSHIFT_PLUGINS module "
                         f"calling nightshift.deploy.register_target)")
    run = TARGETS.get(target)
    return _announced(run(model_name, version=version, alias=alias, data_dir=data_dir, kserve_api=kserve_api,
                          namespace=namespace, **options))
