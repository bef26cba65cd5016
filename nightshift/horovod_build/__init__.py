"""The patched Horovod 0.28.1 wheel's build, shipped in the distribution so that an installed Nightshift can make the
Horovod it needs (`nightshift doctor --build-horovod`); `make` and the trainer image use the same files.

`horovod-wheel.sh PYTHON` builds the sdist against the torch installed in PYTHON, with torch and Gloo support, C++17
(PyTorch >= 2.1 needs it) and `horovod-0.28.1-elastic-join.patch`, and caches the wheel in
`cache_dir()/horovod-0.28.1-torch<version>-<patch digest>/` (it prints the wheel's path; a cached one is reused).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from nightshift.errors import HorovodBuildFailed

HERE = Path(__file__).resolve().parent
SCRIPT = HERE / "horovod-wheel.sh"
PATCH = HERE / "horovod-0.28.1-elastic-join.patch"
BUILD_MINUTES = 6  # on 2 cores


def cache_dir() -> Path:
    """Where the script keeps the wheels it built: $NIGHTSHIFT_CACHE/wheels (default ~/.cache/nightshift/wheels)."""
    return Path(os.environ.get("NIGHTSHIFT_CACHE") or Path.home() / ".cache" / "nightshift") / "wheels"


def build_wheel(python: str = sys.executable) -> Path:
    """The patched wheel for `python`'s torch: built now (its progress on stderr), or the cached one."""
    try:
        proc = subprocess.run(["bash", str(SCRIPT), python], stdout=subprocess.PIPE, text=True, check=False)
    except OSError as err:
        raise HorovodBuildFailed(f"cannot run {SCRIPT}: {err}; it needs bash") from err
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines or not Path(lines[-1]).is_file():
        raise HorovodBuildFailed(f"{SCRIPT} {python} exited {proc.returncode} without a wheel (its reason is in the "
                                 f"output above); it needs torch installed in {python}, a C++ compiler, cmake, patch "
                                 f"and the package index")
    return Path(lines[-1])


def install_wheel(wheel: Path, python: str = sys.executable) -> None:
    """Install `wheel` into `python`'s environment in place of the Horovod there (its dependencies are already in)."""
    proc = subprocess.run([python, "-m", "pip", "install", "--no-deps", "--force-reinstall", str(wheel)],
                          check=False)
    if proc.returncode != 0:
        raise HorovodBuildFailed(f"pip could not install {wheel} into {python}'s environment (exit {proc.returncode}; "
                                 f"see above)")
