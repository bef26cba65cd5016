"""Helper: this checkout's distribution as a wheel, built as a user's `pip wheel` would build it."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from tests.integration.airflow_helpers import REPO

# What the wheel is built from: the distribution's sources, copied so that no build/ lands in the checkout.
SOURCES = ("pyproject.toml", "README.md", "nightshift", "nightshift_plan", "operators", "dags/nightly_tasks")


def build_wheel(out: Path) -> Path:
    """`pip wheel --no-deps` of a copy of this checkout's distribution sources."""
    source = out / "source"
    for name in SOURCES:
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, source / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--quiet",
                    str(source), "-w", str(out / "dist")], check=True, capture_output=True, timeout=300)
    return next((out / "dist").glob("nightshift-*.whl"))
