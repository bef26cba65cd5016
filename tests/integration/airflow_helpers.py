"""Shared by the Airflow integration tests: the project's Airflow environment (from scripts/demo.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def demo_module() -> ModuleType:
    from scripts import demo

    return demo


def stop_model_server(env: dict[str, str]) -> None:
    """Stop the local model server a run deployed (by the PID in its serving record), if any."""
    subprocess.run([str(BIN / "nightshift"), "deploy", "--stop"], env=env, capture_output=True, timeout=120,
                   check=False)


def registered_versions(nightshift_home: Path, model_name: str = "nightshift-digits") -> list[str]:
    """Versions of `model_name` in the run's MLflow registry, read in a child (fresh tracking URI)."""
    code = (
        "import json\nfrom mlflow import MlflowClient\n"
        f"c = MlflowClient(tracking_uri='sqlite:///{nightshift_home / 'mlflow.db'}')\n"
        f"print(json.dumps(sorted(v.version for v in c.search_model_versions(\"name = '{model_name}'\"))))"
    )
    if not (nightshift_home / "mlflow.db").exists():
        return []
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    import json

    return [str(v) for v in json.loads(out.stdout.strip().splitlines()[-1])]
