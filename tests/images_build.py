"""One `make images` build per test run, which every test that needs an image waits for.

The build (scripts/images.py: the trainer, serving and Airflow images) runs once per test run, whichever test
process asks first: tests/conftest.py starts it in the background when the run begins (so that it overlaps the
tests that need no image), and `ensure_images()` blocks a test until it has finished. With pytest-xdist every
worker sees the same run folder (NIGHTSHIFT_TEST_RUN, set by the controller before the workers start): the first
caller takes the folder's lock and builds, the others wait on the lock and read the result it wrote. A failed build
fails every test that needs an image, with podman's output; it is not built again in the same run.

A skip is only for what this machine cannot do (no podman, not root for the first debootstrap): never for an image
that the run itself builds.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUN_ENV = "NIGHTSHIFT_TEST_RUN"
CONTAINERS_CONF = ROOT / "images" / "podman" / "containers.conf"
SBIN_PATH = os.environ.get("PATH", "") + ":/usr/sbin:/sbin"
DEBIAN_IMAGE = "localhost/debian:bookworm"
# The build gives way to the tests it overlaps (a loaded machine makes timing-sensitive tests slower, not the
# build's caller): it still takes every idle cycle. Both are needed: nice ranks the build's own processes within
# the test run's session (the kernel's autogroup is per session, so the build stays in it), and the RUN steps of
# `podman build` run in containers of their own cgroup, whose CPU weight is --cpu-shares (default 1024).
BUILD_NICE = 10
BUILD_CPU_SHARES = 128
BUILD_TIMEOUT_S = 5000
PR_SET_PDEATHSIG = 1

_lock = threading.Lock()
_building: subprocess.Popen[str] | None = None
_stopping = threading.Event()
_background: threading.Thread | None = None


def env() -> dict[str, str]:
    return {**os.environ, "CONTAINERS_CONF": os.environ.get("CONTAINERS_CONF", str(CONTAINERS_CONF))}


def why_podman_cannot_run() -> str | None:
    """Why podman cannot run containers here (a tool missing, `podman info` failing), or None."""
    missing = [tool for tool in ("podman", "runc") if shutil.which(tool, path=SBIN_PATH) is None]
    if missing:
        return f"{' and '.join(missing)} not installed (`make setup` as root installs podman, buildah, runc)"
    try:
        info = subprocess.run(["podman", "--runtime", "runc", "info"], capture_output=True, text=True, env=env(),
                              timeout=120, check=False)
    except subprocess.TimeoutExpired:
        return "`podman info` did not answer within 120 s"
    if info.returncode != 0:
        return f"podman cannot run here: {info.stderr.strip()[-300:]}"
    return None


def why_podman_cannot_build() -> str | None:
    why_not = why_podman_cannot_run()
    if why_not is not None:
        return why_not
    try:
        has_base = subprocess.run(["podman", "image", "exists", DEBIAN_IMAGE], env=env(), timeout=120,
                                  check=False).returncode
    except subprocess.TimeoutExpired:
        return "`podman image exists` did not answer within 120 s"
    if has_base != 0 and (os.geteuid() != 0 or shutil.which("debootstrap", path=SBIN_PATH) is None):
        return f"{DEBIAN_IMAGE} is missing and only root with debootstrap can make it"
    return None


def run_id() -> str:
    """This test run's id: NIGHTSHIFT_TEST_RUN, set once (by the first process, inherited by xdist's workers)."""
    if not os.environ.get(RUN_ENV):
        os.environ[RUN_ENV] = uuid.uuid4().hex[:12]
    return os.environ[RUN_ENV]


def run_dir() -> Path:
    folder = Path(tempfile.gettempdir()) / f"nightshift-test-images-{run_id()}"
    folder.mkdir(exist_ok=True)
    return folder


class ImagesBuildFailed(RuntimeError):
    """`scripts/images.py` failed in this test run; the message holds the end of its output."""


def ensure_images() -> str:
    """Builds the images once in this test run (or waits for the process building them) and returns what
    `scripts/images.py` printed. Raises ImagesBuildFailed when the build failed (in this call or an earlier one)."""
    folder = run_dir()
    result = folder / "result.json"
    with (folder / "lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # held by whoever builds: the others wait here
        if not result.exists():
            _build(result)
    done = json.loads(result.read_text())
    if done["returncode"] != 0:
        raise ImagesBuildFailed(f"scripts/images.py failed with exit {done['returncode']} after "
                                f"{done['seconds']:.0f} s in this test run:\n{done['output'][-5000:]}")
    return str(done["output"])


def _die_with_parent() -> None:
    """In the build's process: SIGTERM when the thread that started it ends (the test run's process was killed),
    which scripts/images.py turns into stopping its podman build."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def _build(result: Path) -> None:
    global _building
    started = time.monotonic()
    log = result.with_name("build.log")
    with log.open("w") as out, _lock:
        if _stopping.is_set():
            raise ImagesBuildFailed("the test run ended before the image build started")
        # A process group of its own (to stop it whole), in the test run's session (see BUILD_NICE).
        building = _building = subprocess.Popen(
            ["nice", "-n", str(BUILD_NICE), sys.executable, str(ROOT / "scripts" / "images.py"),
             "--cpu-shares", str(BUILD_CPU_SHARES)],
            stdout=out, stderr=subprocess.STDOUT, text=True, env=env(), cwd=ROOT, process_group=0,
            preexec_fn=_die_with_parent)
    try:
        code = building.wait(timeout=BUILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        _end(building)
        code = -1
    except BaseException:  # interrupted (Ctrl-C, a signal): no build goes on without its caller
        _end(building)
        raise
    finally:
        with _lock:
            _building = None
    output = log.read_text(errors="replace")
    if code == -1:
        output += f"\n(killed after {BUILD_TIMEOUT_S} s)"
    partial = result.with_suffix(".tmp")
    partial.write_text(json.dumps({"returncode": code, "seconds": time.monotonic() - started, "output": output}))
    partial.rename(result)


def start_in_background() -> threading.Thread:
    """Starts this run's build in a thread of this process (the test run's controller), so that it overlaps the
    tests that need no image; `ensure_images()` anywhere in the run waits for it."""
    global _background

    def build() -> None:
        try:
            ensure_images()
        except Exception:
            pass  # every test that needs an image fails with the output (or builds again, if this never started)

    _background = threading.Thread(target=build, name="nightshift-images-build", daemon=True)
    _background.start()
    return _background


def _end(building: subprocess.Popen[str]) -> None:
    """SIGTERM to the build's process group (scripts/images.py stops its podman build), SIGKILL after 60 s."""
    if building.poll() is not None:
        return
    try:
        os.killpg(building.pid, signal.SIGTERM)
        building.wait(timeout=60)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(building.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        building.wait()


def stop_build() -> None:
    """Ends a build this process started (the run ended before it did); then waits for the background thread, if
    any, to have written its result."""
    with _lock:
        _stopping.set()
        building = _building
    if building is not None:
        _end(building)
    if _background is not None and _background is not threading.current_thread():
        _background.join(timeout=120)


def remove_run_dir() -> None:
    """The run's lock, result and build log (called when the run is over)."""
    shutil.rmtree(Path(tempfile.gettempdir()) / f"nightshift-test-images-{run_id()}", ignore_errors=True)
