"""tests/images_build.py: one image build per test run, waited for by every process of the run; a failed, timed
out or stopped build fails the waiters with its output and leaves no process behind. With a stand-in for
scripts/images.py (a repository root of its own), no podman."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from tests import images_build

REPO = Path(__file__).resolve().parents[2]
FAKE = """
import os, sys, time
root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
with open(os.path.join(root, "starts.log"), "a") as log:
    log.write(f"{os.getpid()} {' '.join(sys.argv[1:])} nice={os.nice(0)}\\n")
print("building", flush=True)
time.sleep(float(os.environ.get("FAKE_SLEEP", "2")))
print("localhost/fake:1  1 MB")
sys.exit(int(os.environ.get("FAKE_RC", "0")))
"""
WAITER = """
import sys
from pathlib import Path
sys.path.insert(0, {repo!r})
from tests import images_build
images_build.ROOT = Path({root!r})
try:
    print("ok", images_build.ensure_images().split()[0])
except images_build.ImagesBuildFailed as err:
    print("failed", str(err).splitlines()[0])
"""


@pytest.fixture
def fake_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "root"
    (root / "scripts").mkdir(parents=True)
    (root / "scripts" / "images.py").write_text(FAKE)
    monkeypatch.setattr(images_build, "ROOT", root)
    monkeypatch.setenv(images_build.RUN_ENV, f"unit-{os.getpid()}-{time.monotonic_ns()}")
    monkeypatch.setattr(images_build, "_stopping", type(images_build._stopping)())
    monkeypatch.setattr(images_build, "_background", None)
    yield root
    images_build.stop_build()
    images_build.remove_run_dir()


def _waiter(root: Path) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", WAITER.format(repo=str(REPO), root=str(root))],
                            stdout=subprocess.PIPE, text=True)


def test_one_build_per_run_whoever_asks_and_every_process_gets_its_output(fake_root: Path) -> None:
    images_build.start_in_background()
    time.sleep(0.3)
    waiters = [_waiter(fake_root) for _ in range(2)]
    outs = [w.communicate(timeout=60)[0].strip() for w in waiters]
    assert outs == ["ok building", "ok building"]
    assert images_build.ensure_images().split()[0] == "building"  # this process too, at once
    starts = (fake_root / "starts.log").read_text().splitlines()
    assert len(starts) == 1, starts
    # niced, and the RUN containers' weight lowered: the build gives way to the tests it overlaps
    assert starts[0].endswith(f"--cpu-shares {images_build.BUILD_CPU_SHARES} nice={images_build.BUILD_NICE}")


def test_a_failed_build_fails_every_waiter_with_its_output_and_is_not_built_again(
        fake_root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_RC", "3")
    with pytest.raises(images_build.ImagesBuildFailed, match=r"exit 3 after .*\n(.|\n)*localhost/fake:1"):
        images_build.ensure_images()
    assert _waiter(fake_root).communicate(timeout=60)[0].startswith("failed scripts/images.py failed with exit 3")
    assert len((fake_root / "starts.log").read_text().splitlines()) == 1


def test_a_build_past_its_time_is_killed_and_reported(fake_root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_SLEEP", "60")
    monkeypatch.setattr(images_build, "BUILD_TIMEOUT_S", 1)
    images_build.start_in_background().join(timeout=90)
    with pytest.raises(images_build.ImagesBuildFailed, match=r"exit -1 (.|\n)*killed after 1 s"):
        images_build.ensure_images()
    (pid,) = [int(line.split()[0]) for line in (fake_root / "starts.log").read_text().splitlines()]
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_a_run_that_ends_first_stops_its_build_and_leaves_no_process(fake_root: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_SLEEP", "60")
    images_build.start_in_background()
    deadline = time.monotonic() + 30
    while not (fake_root / "starts.log").exists():
        assert time.monotonic() < deadline
        time.sleep(0.1)
    (pid,) = [int(line.split()[0]) for line in (fake_root / "starts.log").read_text().splitlines()]
    started = time.monotonic()
    images_build.stop_build()
    assert time.monotonic() - started < 30
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_a_killed_test_run_takes_its_build_with_it(tmp_path: Path, fake_root: Path) -> None:
    """The run's process gets SIGKILL (no unconfigure runs): the build gets SIGTERM from the kernel."""
    script = textwrap.dedent(f"""
        import sys, time
        from pathlib import Path
        sys.path.insert(0, {str(REPO)!r})
        from tests import images_build
        images_build.ROOT = Path({str(fake_root)!r})
        images_build.start_in_background()
        time.sleep(60)
    """)
    run = subprocess.Popen([sys.executable, "-c", script], env={**os.environ, "FAKE_SLEEP": "60"})
    deadline = time.monotonic() + 30
    while not (fake_root / "starts.log").exists():
        assert time.monotonic() < deadline
        time.sleep(0.1)
    (pid,) = [int(line.split()[0]) for line in (fake_root / "starts.log").read_text().splitlines()]
    run.kill()
    run.wait()
    deadline = time.monotonic() + 30
    while psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, "the build outlived the test run that started it"
        time.sleep(0.1)
