from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


def run_json(code: str, env: dict[str, str], cwd: Path = REPO) -> Any:
    """Run `code` in a fresh interpreter; it prints one JSON document as its last stdout line."""
    proc = subprocess.run([sys.executable, "-c", code], env=env, cwd=cwd, capture_output=True, text=True,
                          timeout=300, check=False)
    assert proc.returncode == 0, f"child failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])
