"""`nightshift doctor`: can this environment's Horovod run the trainer, and what to run when it cannot.

pip, left to itself, builds PyPI's Horovod 0.28.1 sdist in an isolated environment without torch: it installs, and
`horovodrun --gloo` fails at run time with "Gloo support has not been built". The checks, by name:

- `installed`: a Horovod distribution is installed (importlib.metadata) where `import horovod` finds it;
- `torch`: its torch extension is there (`horovod/torch/mpi_lib_v2*.so`) and `horovod.torch` imports;
- `gloo`: it is built with Gloo (`horovod.common.util.gloo_built`, what horovodrun asks);
- `join_patch`: its torch extension carries Nightshift's elastic-join patch (elastic jobs need it).

Two forms: `quick_checks()` reads metadata and probes files, imports nothing of Horovod (the DAG factory runs it
at parse time); `full_checks()` imports horovod.torch and asks for Gloo (the `local` backend runs it in a child
interpreter, `python -m nightshift.doctor`, before it starts horovodrun). The fix is `nightshift doctor
--build-horovod`: the patched wheel's build, shipped in the distribution (nightshift.horovod_build).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import mmap
import signal
import subprocess
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from nightshift.errors import HorovodUnusable

HOROVOD = "horovod"
# The torch extension's file, in the package (its suffix names the interpreter: .cpython-311-x86_64-linux-gnu.so).
TORCH_EXTENSION = "torch/mpi_lib_v2*.so"
# A string only the elastic-join patch (nightshift/horovod_build/horovod-0.28.1-elastic-join.patch) puts there.
JOIN_PATCH_MARKER = b"HOROVOD_GLOO_RENDEZVOUS_TIMEOUT_SECONDS"
# What the trainer needs of Horovod in every job, and in an elastic one.
REQUIRED = ("installed", "torch", "gloo")
REQUIRED_ELASTIC = (*REQUIRED, "join_patch")


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str


def fix() -> str:
    """What to run when a check fails."""
    from nightshift.horovod_build import BUILD_MINUTES, cache_dir

    return (f"run `nightshift doctor --build-horovod` in this environment: it builds Horovod 0.28.1 against the "
            f"installed torch with torch and Gloo support and Nightshift's patches (about {BUILD_MINUTES} minutes on "
            f"2 cores; it needs a C++ compiler and cmake) and installs it; the wheel is kept under {cache_dir()}/ "
            f"(a folder per torch version), for `pip install --no-deps --force-reinstall WHEEL` elsewhere")


def package_dir() -> Path | None:
    """The folder `import horovod` would load, found without importing it; None when there is none."""
    spec = importlib.util.find_spec(HOROVOD)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    return Path(locations[0]) if locations else None


def torch_extensions(package: Path) -> list[Path]:
    return sorted(p for p in package.glob(TORCH_EXTENSION) if p.is_file())


def join_patch_built(extensions: Iterable[Path]) -> bool:
    """Whether a torch extension of Horovod carries the elastic-join patch (its timeout variable's name)."""
    for library in extensions:
        with open(library, "rb") as binary, mmap.mmap(binary.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
            if mapped.find(JOIN_PATCH_MARKER) != -1:
                return True
    return False


def _installed() -> tuple[Check, str, Path | None]:
    try:
        version = metadata.version(HOROVOD)
    except metadata.PackageNotFoundError:
        version = ""
    package = package_dir()
    if not version or package is None:
        return Check("installed", False, f"Horovod is not installed in the environment of {sys.executable}"), \
            version, None
    return Check("installed", True, f"Horovod {version} in {package}"), version, package


def quick_checks() -> list[Check]:
    """`installed` and `torch` from the package's metadata and files alone: nothing of Horovod or torch is imported."""
    installed, version, package = _installed()
    if package is None:
        return [installed]
    extensions = torch_extensions(package)
    torch = Check("torch", bool(extensions), f"torch extension {extensions[0].name}" if extensions else
                  f"Horovod {version} has no torch extension ({package / TORCH_EXTENSION} is missing): it was built "
                  f"without torch, as pip builds PyPI's sdist (in an isolated environment that has no torch)")
    return [installed, torch]


def full_checks() -> list[Check]:
    """Every check, importing horovod.torch (and torch) into this process: run it in a child (`python -m
    nightshift.doctor`) where a broken build must not take the caller down."""
    installed, version, package = _installed()
    if package is None:
        return [installed]
    try:
        import horovod.torch  # noqa: F401
    except Exception as err:  # ImportError: no extension, or one built against another torch (undefined symbol)
        lines = str(err).strip().splitlines()
        torch = Check("torch", False, f"Horovod {version}: `import horovod.torch` fails: "
                                      f"{lines[0] if lines else type(err).__name__}")
    else:
        torch = Check("torch", True, "horovod.torch imports")
    try:
        from horovod.common.util import gloo_built

        built = bool(gloo_built())
        reason = "horovodrun --gloo would fail with 'Gloo support has not been built'"
    except Exception as err:
        built, reason = False, f"asking whether it has Gloo failed: {err}"
    gloo = Check("gloo", built, "built with Gloo" if built else f"Horovod {version} has no Gloo support: {reason}")
    extensions = torch_extensions(package)
    patched = join_patch_built(extensions)
    join = Check("join_patch", patched, "built with Nightshift's elastic-join patch" if patched else
                 f"Horovod {version} lacks Nightshift's elastic-join patch: in an elastic job a process joining later "
                 f"than the collective timeout terminates every rank")
    return [installed, torch, gloo, join]


def unusable(checks: Sequence[Check], required: Sequence[str] = REQUIRED) -> str | None:
    """None when every required check passed; else one line naming each failure and the fix."""
    failed = [c.detail for c in checks if c.name in required and not c.ok]
    return f"{'; '.join(failed)}. Fix: {fix()}" if failed else None


def check_in_child(python: str = sys.executable, env: Mapping[str, str] | None = None,
                   timeout: float = 120) -> list[Check]:
    """`full_checks()` in a child interpreter `python` with environment `env` (the training ranks' own)."""
    try:
        proc = subprocess.run([python, "-m", __name__], env=None if env is None else dict(env), capture_output=True,
                              text=True, timeout=timeout, check=False)
    except (OSError, subprocess.TimeoutExpired) as err:
        raise HorovodUnusable(f"checking this environment's Horovod ({python} -m {__name__}) failed: {err}") from err
    try:
        return [Check(**found) for found in json.loads(proc.stdout.strip().splitlines()[-1])]
    except (ValueError, IndexError, TypeError) as err:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        # A signal, silently: e.g. SIGBUS from a torch extension truncated on disk, SIGSEGV from one built for
        # another torch.
        killer = next((s.name for s in signal.Signals if s == -proc.returncode), f"signal {-proc.returncode}")
        how = (f"was killed by {killer} (importing Horovod crashes the interpreter)" if proc.returncode < 0
               else f"exited {proc.returncode}")
        raise HorovodUnusable(f"checking this environment's Horovod ({python} -m {__name__}) {how} without a "
                              f"result{': ' + ' | '.join(tail) if tail else ''}. Fix: {fix()}") from err


# ---- the command ---------------------------------------------------------------------------------------------

def add_parser(subparsers: Any) -> None:
    doctor = subparsers.add_parser("doctor", help="check that this environment's Horovod can train (torch, Gloo, "
                                                  "the join patch), or build the one it needs")
    doctor.add_argument("--build-horovod", action="store_true",
                        help="build the patched Horovod 0.28.1 wheel against the installed torch (cached), install "
                             "it here, and check again")
    doctor.set_defaults(func=_doctor)


def _doctor(args: argparse.Namespace) -> dict[str, Any]:
    from nightshift.cli import emit

    result: dict[str, Any] = {}
    if args.build_horovod:
        from nightshift.horovod_build import build_wheel, install_wheel

        wheel = build_wheel(sys.executable)
        install_wheel(wheel, sys.executable)
        result["installed_wheel"] = str(wheel)
    checks = check_in_child()  # a child: a Horovod installed just now is the one imported
    result["horovod"] = {c.name: {"ok": c.ok, "detail": c.detail} for c in checks}
    problem = unusable(checks, REQUIRED_ELASTIC)
    result["ok"] = problem is None
    if problem is not None:
        emit(result)  # the checks on stdout; the one-line reason and fix on stderr
        raise HorovodUnusable(problem)
    return result


if __name__ == "__main__":
    print(json.dumps([asdict(check) for check in full_checks()]))
