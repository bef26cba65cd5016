"""Where Nightshift keeps its state outside the repository, overridable by environment variables.

`NIGHTSHIFT_HOME` (default `~/.nightshift`) holds, unless set one by one:
- the MLflow tracking store `mlflow.db` and artifacts `mlartifacts/` (`MLFLOW_TRACKING_URI` wins),
- the DVC remote `dvc-remote/` (`NIGHTSHIFT_DVC_REMOTE`),
- per-run workspaces `workspaces/` and checkpoints `checkpoints/`,
- the local serving record `serving/`.
"""

from __future__ import annotations

import os
from pathlib import Path


def home() -> Path:
    return Path(os.environ.get("NIGHTSHIFT_HOME", Path.home() / ".nightshift")).expanduser()


def data_roots() -> list[Path]:
    """Where a run's `data_source` may lie: NIGHTSHIFT_DATA_ROOTS (paths separated by ':'), else the demo
    data and `data/` under NIGHTSHIFT_HOME."""
    configured = [Path(p).expanduser() for p in os.environ.get("NIGHTSHIFT_DATA_ROOTS", "").split(os.pathsep) if p]
    return configured or [home() / "demo-data", home() / "data"]


def confined_data_source(data_source: str | Path) -> Path:
    """`data_source` resolved (symlinks too), or UsageError when it lies outside every data root.

    A trigger form is a way in for anyone who may trigger the DAG: it must not make the worker read
    (and report sample values of) files it was never meant to serve as training data.
    """
    from nightshift.errors import UsageError

    path = Path(data_source).expanduser().resolve()
    roots = data_roots()
    if not any(path.is_relative_to(root.expanduser().resolve()) for root in roots):
        allowed = ", ".join(str(root) for root in roots)
        raise UsageError(f"data_source {data_source} is outside the allowed data roots ({allowed}); put the data "
                         f"under one of them, or add its directory to NIGHTSHIFT_DATA_ROOTS")
    return path


def mlflow_tracking_uri() -> str:
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{home() / 'mlflow.db'}"


def mlflow_artifact_root() -> str:
    return os.environ.get("NIGHTSHIFT_MLFLOW_ARTIFACTS") or str(home() / "mlartifacts")


def dvc_remote() -> str:
    return os.environ.get("NIGHTSHIFT_DVC_REMOTE") or str(home() / "dvc-remote")


def workspaces_dir() -> Path:
    return Path(os.environ.get("NIGHTSHIFT_WORKSPACES") or home() / "workspaces")


def checkpoints_dir() -> Path:
    return Path(os.environ.get("NIGHTSHIFT_CHECKPOINTS") or home() / "checkpoints")


def data_docs_dir() -> Path:
    """The GX Data Docs site: validation pages, one folder per validation."""
    return home() / "gx" / "data_docs"


def serving_dir() -> Path:
    return Path(os.environ.get("NIGHTSHIFT_SERVING") or home() / "serving")


# --- the cluster contract ----------------------------------------------------------------------------
# On Kubernetes, NIGHTSHIFT_HOME lies on one ReadWriteMany volume mounted at the same path in the
# Airflow workers and in every trainer pod: workspaces (the staged dataset version, the trained
# model) and checkpoints are then the same files on both sides. Results come back through MLflow.

DEFAULT_SHARED_CLAIM = "nightshift-workspace"


def shared_volume_claim() -> str:
    """The PersistentVolumeClaim (ReadWriteMany) holding NIGHTSHIFT_HOME on the cluster."""
    return os.environ.get("NIGHTSHIFT_SHARED_PVC") or DEFAULT_SHARED_CLAIM


def cluster_mlflow_tracking_uri() -> str:
    """The tracking URI trainer pods log to: NIGHTSHIFT_CLUSTER_MLFLOW_URI (an in-cluster address of the
    same server), else the one this process uses."""
    return os.environ.get("NIGHTSHIFT_CLUSTER_MLFLOW_URI") or mlflow_tracking_uri()


# What the libraries Nightshift drives would otherwise send home. Set (unless the user set them) by the
# entry points and right before GX or DVC is first used, never as a side effect of an import.
NO_TELEMETRY = {"GX_ANALYTICS_ENABLED": "false", "DVC_NO_ANALYTICS": "1", "MLFLOW_DISABLE_TELEMETRY": "true",
                "DO_NOT_TRACK": "true"}


def no_telemetry() -> None:
    for name, value in NO_TELEMETRY.items():
        os.environ.setdefault(name, value)
