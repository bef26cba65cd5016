"""What this machine needs to run an MPIJob on emulated hosts, as pure checks: the `hosts` training backend
refuses before it starts anything, and `make demo` picks its backend, from the same answers."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from urllib.parse import urlsplit

# Tools run-mpijob runs, and the Debian package each comes from.
TOOLS = {"ip": "iproute2", "unshare": "util-linux", "sshd": "openssh-server", "ssh": "openssh-client",
         "ssh-keygen": "openssh-client"}
# sshd and ip live in sbin, which a non-login PATH may lack.
SEARCH_PATH = os.pathsep.join([os.environ.get("PATH", ""), "/usr/local/sbin", "/usr/sbin", "/sbin"])


def _can_unshare() -> str | None:
    """None when a network namespace can be made here; else why not (a container without CAP_SYS_ADMIN)."""
    try:
        done = subprocess.run(["unshare", "--net", "--mount", "--uts", "true"], capture_output=True, text=True,
                              timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired) as err:
        return str(err)
    return None if done.returncode == 0 else (done.stderr.strip() or f"exit code {done.returncode}")


def missing(*, platform: str | None = None, euid: int | None = None,
            which: Callable[..., str | None] = shutil.which,
            probe: Callable[[], str | None] | None = _can_unshare) -> list[str]:
    """What this machine lacks for emulated hosts, one item each (empty: it has everything): Linux, root, the
    tools in TOOLS, and (when `probe` is given and the rest is there) the right to make network namespaces."""
    if (platform or sys.platform) != "linux":
        return ["Linux (network namespaces)"]
    lacking = []
    if (os.geteuid() if euid is None else euid) != 0:
        lacking.append("root (network namespaces and mounts)")
    for tool, package in TOOLS.items():
        if which(tool, path=SEARCH_PATH) is None:
            lacking.append(f"`{tool}` (apt-get install -y {package})")
    if not lacking and probe is not None:
        why = probe()
        if why:
            lacking.append(f"the right to create network namespaces (`unshare --net` failed: {why})")
    return lacking


def served_store_problem(tracking_uri: str) -> str | None:
    """None when run-mpijob can serve this MLflow tracking store to the hosts (a `--service` MLflow server on
    the job's network, reading the store from this machine's disk); else why not. The hosts have no route off
    their links: a tracking server or a database elsewhere is out of their reach, and of the service's."""
    parts = urlsplit(tracking_uri)
    scheme = parts.scheme.lower()
    if scheme == "sqlite" and parts.path.strip("/") in ("", ":memory:"):
        return (f"the tracking store {tracking_uri!r} is an in-memory SQLite database: the MLflow service would "
                f"log the run to a store of its own, lost when it stops; use sqlite:///PATH")
    if scheme in ("", "file", "sqlite") and tracking_uri.strip().lower() != "databricks":
        return None
    scheme = scheme or tracking_uri.strip()
    return (f"the tracking store is {scheme}://..., which the emulated hosts cannot reach (they have no route "
            f"off their own links); the hosts backend serves a store on this machine's disk: unset "
            f"MLFLOW_TRACKING_URI (NIGHTSHIFT_HOME's SQLite store) or set it to sqlite:///PATH")
