"""A throwaway git checkout laid out as the project is, for tests of code versions."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path


def git_checkout(path: Path) -> Path:
    """`path` as a git checkout with `nightshift/__init__.py` committed (author, committer and HOME its own)."""
    (path / "nightshift").mkdir(parents=True)
    (path / "nightshift" / "__init__.py").write_text("x = 1\n")
    env = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t",
           "PATH": os.environ["PATH"], "HOME": str(path)}
    for args in (["init", "-q"], ["add", "."], ["commit", "-qm", "c"]):
        subprocess.run(["git", "-C", str(path), *args], check=True, env=env, capture_output=True)
    return path
