"""`nightshift doctor` (nightshift/doctor.py, issue 37 item 4): each check on an installed Horovod laid out as pip
lays one out (tests/fake_horovod.py), the quick form without importing it, the full form in a child interpreter, the
one-line refusal naming the fix, and the build the fix runs, shipped in the distribution."""

from __future__ import annotations

import json
import os
import sys
import tomllib
from pathlib import Path

import pytest

from nightshift import doctor
from nightshift.cli import main
from nightshift.errors import HorovodUnusable
from tests.fake_horovod import fake_horovod

pytestmark = pytest.mark.slow  # the full form runs in child interpreters

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture
def site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A site folder first on this process's sys.path and on the children's PYTHONPATH, in place of the venv's
    Horovod (forgotten by this process for the test, so `import horovod` would find the fake one)."""
    folder = tmp_path / "site"
    folder.mkdir()
    monkeypatch.syspath_prepend(str(folder))
    for name in [n for n in sys.modules if n == "horovod" or n.startswith("horovod.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(folder), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("NIGHTSHIFT_CACHE", str(tmp_path / "cache"))
    return folder


def _by_name(checks: list[doctor.Check]) -> dict[str, doctor.Check]:
    return {check.name: check for check in checks}


# ---- the quick form: metadata and files --------------------------------------------------------------------

def test_quick_check_names_a_horovod_built_without_torch_and_the_fix(site: Path, tmp_path: Path) -> None:
    fake_horovod(site, torch=False)
    checks = _by_name(doctor.quick_checks())
    assert checks["installed"].ok and checks["installed"].detail == f"Horovod 0.28.1 in {site / 'horovod'}"
    assert not checks["torch"].ok
    problem = doctor.unusable(list(checks.values()), ("torch",))
    assert problem is not None and "\n" not in problem
    assert problem.startswith(f"Horovod 0.28.1 has no torch extension ({site / 'horovod' / 'torch'}/mpi_lib_v2*.so "
                              f"is missing)")
    assert "Fix: run `nightshift doctor --build-horovod`" in problem and f"{tmp_path / 'cache' / 'wheels'}/" in problem
    assert "horovod.torch" not in sys.modules  # nothing of Horovod was imported


def test_quick_check_passes_a_horovod_with_its_torch_extension(site: Path) -> None:
    fake_horovod(site, torch=True)
    checks = _by_name(doctor.quick_checks())
    assert checks["torch"].ok and checks["torch"].detail.startswith("torch extension mpi_lib_v2.")
    assert doctor.unusable(list(checks.values()), ("torch",)) is None
    assert "horovod" not in sys.modules


def test_quick_check_of_an_environment_without_horovod(site: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "path", [p for p in sys.path if "site-packages" not in p])  # no venv: no Horovod
    (check,) = doctor.quick_checks()
    assert check.name == "installed" and not check.ok and "Horovod is not installed" in check.detail
    assert doctor.unusable([check], ("torch",)) is None  # the Airflow image: no Horovod, nothing trains here
    assert "Horovod is not installed" in (doctor.unusable([check]) or "")


# ---- the full form: horovod.torch imported, Gloo asked, in a child ---------------------------------------------

def test_full_check_of_a_horovod_without_torch_names_the_import_error(site: Path) -> None:
    fake_horovod(site, torch=False, gloo=False)
    checks = _by_name(doctor.check_in_child())
    assert checks["installed"].ok
    assert not checks["torch"].ok
    assert checks["torch"].detail.startswith("Horovod 0.28.1: `import horovod.torch` fails: Extension horovod.torch "
                                             "has not been built")
    assert not checks["gloo"].ok and "Gloo support has not been built" in checks["gloo"].detail
    assert not checks["join_patch"].ok
    problem = doctor.unusable(list(checks.values()))
    assert problem is not None and "import horovod.torch" in problem and "no Gloo support" in problem
    assert "Fix: run `nightshift doctor --build-horovod`" in problem


def test_full_check_of_a_horovod_with_torch_but_without_gloo(site: Path) -> None:
    fake_horovod(site, torch=True, gloo=False)
    checks = _by_name(doctor.check_in_child())
    assert checks["torch"].ok and checks["join_patch"].ok
    assert not checks["gloo"].ok
    problem = doctor.unusable(list(checks.values()))
    assert problem is not None and problem.startswith("Horovod 0.28.1 has no Gloo support: horovodrun --gloo would "
                                                      "fail with 'Gloo support has not been built'. Fix: ")


def test_the_join_patch_is_required_of_elastic_jobs_only(site: Path) -> None:
    fake_horovod(site, torch=True, gloo=True, join_patch=False)
    checks = doctor.check_in_child()
    assert all(c.ok for c in checks if c.name != "join_patch")
    assert doctor.unusable(checks, doctor.REQUIRED) is None
    problem = doctor.unusable(checks, doctor.REQUIRED_ELASTIC)
    assert problem is not None and "lacks Nightshift's elastic-join patch" in problem


def test_full_check_passes_a_horovod_with_torch_gloo_and_the_patch(site: Path) -> None:
    fake_horovod(site)
    checks = doctor.check_in_child()
    assert [c.name for c in checks] == ["installed", "torch", "gloo", "join_patch"]
    assert all(c.ok for c in checks), checks
    assert doctor.unusable(checks, doctor.REQUIRED_ELASTIC) is None


def test_a_child_that_dies_checking_is_a_refusal_naming_its_exit(site: Path) -> None:
    fake_horovod(site, crash=True)
    with pytest.raises(HorovodUnusable, match=r"-m nightshift\.doctor\) exited 3 without a result"):
        doctor.check_in_child()


def test_a_child_killed_by_a_signal_names_it_and_the_fix(site: Path) -> None:
    """issue 37 review: a torch extension truncated on disk kills the importing interpreter with SIGBUS, printing
    nothing: the refusal read `exited -7 without a result: ` with neither the cause nor the fix."""
    fake_horovod(site, crash=True)
    (site / "horovod" / "__init__.py").write_text("import os, signal\nos.kill(os.getpid(), signal.SIGBUS)\n")
    with pytest.raises(HorovodUnusable, match=r"killed by SIGBUS .*Fix: run `nightshift doctor --build-horovod`"):
        doctor.check_in_child()


def test_the_projects_own_horovod_passes_every_check() -> None:
    """What `make setup` installs (the patched wheel): what the other tests' trainers run on."""
    checks = doctor.check_in_child()
    assert all(c.ok for c in checks), checks


# ---- the command -------------------------------------------------------------------------------------------

def test_doctor_exits_1_with_the_checks_on_stdout_and_the_fix_on_stderr(
        site: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fake_horovod(site, torch=False)
    assert main(["doctor"]) == 1
    captured = capsys.readouterr()
    report = json.loads(captured.out)
    assert report["ok"] is False and report["horovod"]["torch"]["ok"] is False
    (line,) = captured.err.strip().splitlines()
    assert line.startswith("nightshift doctor: Horovod 0.28.1: `import horovod.torch` fails") and \
        "nightshift doctor --build-horovod" in line


def test_doctor_prints_every_check_and_exits_0_on_a_good_horovod(site: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    fake_horovod(site)
    assert main(["doctor"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] is True and set(report["horovod"]) == {"installed", "torch", "gloo", "join_patch"}


def test_build_horovod_installs_the_wheel_the_build_printed_then_checks_again(
        site: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """The build and pip are the shipped script and pip themselves; here a stand-in script prints a wheel and pip
    is a recorder, so that no 6-minute build runs (make setup runs the real one)."""
    import nightshift.horovod_build as build

    fake_horovod(site)
    wheel = tmp_path / "cache" / "wheels" / "horovod-0.28.1-torch2.13.0-abc" / "horovod-0.28.1-cp311-linux.whl"
    wheel.parent.mkdir(parents=True)
    wheel.write_bytes(b"wheel")
    script = tmp_path / "horovod-wheel.sh"
    script.write_text(f'#!/usr/bin/env bash\necho "building against $1" >&2\necho "{wheel}"\n')
    monkeypatch.setattr(build, "SCRIPT", script)
    installed: list[list[str]] = []
    real_run = build.subprocess.run

    def run(argv: list[str], **kwargs: object) -> object:
        if argv[1:4] == ["-m", "pip", "install"]:
            installed.append(argv)
            return build.subprocess.CompletedProcess(argv, 0)
        return real_run(argv, **kwargs)

    monkeypatch.setattr(build.subprocess, "run", run)
    assert main(["doctor", "--build-horovod"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["installed_wheel"] == str(wheel) and report["ok"] is True
    assert installed == [[sys.executable, "-m", "pip", "install", "--no-deps", "--force-reinstall", str(wheel)]]


def test_a_failed_build_names_the_script_and_what_it_needs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import nightshift.horovod_build as build
    from nightshift.errors import HorovodBuildFailed

    script = tmp_path / "horovod-wheel.sh"
    script.write_text("#!/usr/bin/env bash\necho 'no compiler' >&2\nexit 1\n")
    monkeypatch.setattr(build, "SCRIPT", script)
    with pytest.raises(HorovodBuildFailed, match=r"exited 1 without a wheel .* a C\+\+ compiler, cmake"):
        build.build_wheel(sys.executable)


def test_make_setup_reinstalls_a_rebuilt_wheel_of_the_same_version(tmp_path: Path) -> None:
    """A changed patch makes a new wheel of the same version (0.28.1): a plain `pip install` keeps the installed
    build ("already satisfied"), so make setup must force the reinstall of the wheel it just got."""
    import subprocess

    venv = tmp_path / "venv"
    printed = subprocess.run(["make", "-n", "-B", "-C", str(REPO), f"VENV={venv}", f"{venv}/.nightshift-installed"],
                             capture_output=True, text=True, check=True).stdout.replace("\\\n", " ")
    installs = [line for line in printed.splitlines() if "horovod-wheel.sh" in line]
    assert len(installs) == 1, printed
    assert '--no-deps --force-reinstall "$wheel"' in installs[0], installs[0]


def test_the_build_ships_in_the_distribution_and_is_what_make_and_the_trainer_image_use() -> None:
    import nightshift.horovod_build as build

    assert build.SCRIPT.is_file() and build.PATCH.is_file()
    package_data = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    assert set(package_data["nightshift.horovod_build"]) == {build.SCRIPT.name, build.PATCH.name}
    assert f"$(HOROVOD_BUILD)/{build.SCRIPT.name} $(BIN)/python" in (REPO / "Makefile").read_text()
    assert f"COPY nightshift/horovod_build/{build.PATCH.name} " in (REPO / "images/trainer/Dockerfile").read_text()
    # The script finds its patch beside itself, wherever the distribution is installed.
    assert 'patch_file="$(cd "$(dirname "$0")" && pwd)/horovod-0.28.1-elastic-join.patch"' in build.SCRIPT.read_text()
