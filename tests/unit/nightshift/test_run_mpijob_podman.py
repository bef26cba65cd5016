"""`nightshift run-mpijob --runtime podman` without containers: what each pod's `podman run` gets, and refusals."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

import pytest

from nightshift.mpijob_local import podman
from nightshift.mpijob_local.errors import ManifestNotSupported
from nightshift.mpijob_local.manifest import parse_job
from nightshift.mpijob_local.runner import RunOptions, _exit_text
from operators.mpijob_spec import MPIJobConfig, TaskIdentity, build_mpijob

IMAGE = "localhost/nightshift/trainer:cpu"
PASSWD = "root:x:0:0:root:/root:/bin/bash\nmpiuser:x:1000:1000::/home/mpiuser:/bin/bash\n"
# What `podman image inspect` says of the trainer image (images/trainer/Dockerfile).
TRAINER = podman.ImageConfig.from_inspect(IMAGE, {"Config": {
    "User": "1000", "WorkingDir": "/workspace", "ExposedPorts": {"22/tcp": {}},
    "Entrypoint": ["/usr/local/bin/nightshift-entrypoint"],
    "Cmd": ["/usr/sbin/sshd", "-De", "-f", "/home/mpiuser/.sshd_config"]}}, PASSWD)
SHARED = "/srv/nightshift"
CLAIMS = {"nightshift-workspace": "/tmp/home"}


def manifest(**overrides: Any) -> dict[str, Any]:
    config = {
        "image": IMAGE, "command": ["python", "-m", "nightshift.train", "--out", f"{SHARED}/out"], "num_workers": 2,
        "env": {"MLFLOW_TRACKING_URI": "http://mlflow.nightshift.svc:5000", "NIGHTSHIFT_HOME": SHARED},
        "volumes": [{"name": "shared", "persistentVolumeClaim": {"claimName": "nightshift-workspace"}}],
        "volume_mounts": [{"name": "shared", "mountPath": SHARED}],
        **overrides,
    }
    return build_mpijob(MPIJobConfig(**config), TaskIdentity("nightly_retrain", "train", "manual__t", 1))


def _container(source: dict[str, Any], role: str = "Worker") -> dict[str, Any]:
    return source["spec"]["mpiReplicaSpecs"][role]["template"]["spec"]["containers"][0]


def test_pod_specs_keep_the_image_and_whether_command_or_args_were_given() -> None:
    source = manifest()
    del _container(source)["command"]  # the trainer image's contract: workers leave command/args unset
    _container(source, "Launcher")["args"] = _container(source, "Launcher").pop("command")
    job = parse_job(source, claims=CLAIMS, gpus_available=0)
    worker, launcher = job.workers[0], job.launcher
    assert worker.image == IMAGE and worker.command == () and worker.args == ()
    assert worker.argv == ("/usr/sbin/sshd", "-De")  # the host runtime keeps the operator's default
    assert launcher.command == () and launcher.args[:2] == ("horovodrun", "--gloo")
    assert [(m.source, m.kind) for m in launcher.mounts] == [("/tmp/home", "claim")]


def test_argv_follows_kubernetes_command_and_args_over_the_images_entrypoint_and_cmd() -> None:
    job = parse_job(manifest(), claims=CLAIMS, gpus_available=0)
    # command given: it replaces ENTRYPOINT, and CMD is dropped
    entrypoint, args, runs = podman.pod_argv(job.launcher, TRAINER)
    assert entrypoint is not None and entrypoint[:2] == ["horovodrun", "--gloo"] and args == []
    assert runs == entrypoint
    source = manifest()
    del _container(source)["command"]
    _container(source, "Launcher")["args"] = _container(source, "Launcher").pop("command")
    job = parse_job(source, claims=CLAIMS, gpus_available=0)
    # neither: the image's ENTRYPOINT and CMD (the worker's sshd)
    assert podman.pod_argv(job.workers[0], TRAINER) == (
        None, [], ["/usr/local/bin/nightshift-entrypoint", "/usr/sbin/sshd", "-De", "-f",
                   "/home/mpiuser/.sshd_config"])
    assert podman.ready_port(job.workers[0], TRAINER) == 22
    # args only: after the image's ENTRYPOINT (which waits for the hostfile's names)
    entrypoint, args, runs = podman.pod_argv(job.launcher, TRAINER)
    assert entrypoint is None and args[:2] == ["horovodrun", "--gloo"]
    assert runs[0] == "/usr/local/bin/nightshift-entrypoint"
    assert podman.ready_port(job.launcher, TRAINER) is None


def test_the_pod_runs_as_run_as_user_else_as_the_images_user() -> None:
    job = parse_job(manifest(), claims=CLAIMS, gpus_available=0)
    assert podman.pod_user(job.workers[0], TRAINER) == podman.PodUser(1000, 1000, "1000:1000")
    named = podman.ImageConfig(IMAGE, user="mpiuser", passwd=PASSWD)
    assert podman.pod_user(job.workers[0], named).uid == 1000
    root = podman.ImageConfig(IMAGE, passwd=PASSWD)
    assert podman.pod_user(job.workers[0], root) == podman.PodUser(0, 0, "0:0")
    source = manifest()
    pod = source["spec"]["mpiReplicaSpecs"]["Worker"]["template"]["spec"]
    pod["securityContext"] = {"runAsUser": 2000, "runAsGroup": 3000, "fsGroup": 4000}
    _container(source)["securityContext"] = {"runAsUser": 2001}  # the container's wins over the pod's
    worker = parse_job(source, claims=CLAIMS, gpus_available=0).workers[0]
    assert podman.pod_user(worker, TRAINER) == podman.PodUser(2001, 3000, "2001:3000", (4000,))
    with pytest.raises(ManifestNotSupported, match="runs as user 'nobody', which its /etc/passwd lacks"):
        podman.pod_user(job.workers[0], podman.ImageConfig(IMAGE, user="nobody", passwd=PASSWD))
    pod["securityContext"] = {"runAsUser": -1}
    with pytest.raises(ManifestNotSupported, match=r"securityContext.runAsUser must be an integer >= 0"):
        parse_job(source, claims=CLAIMS, gpus_available=0)


def _plan(tmp_path: Path, role: str = "launcher", **kw: Any) -> tuple[podman.ContainerPlan, Any]:
    job = parse_job(manifest(), claims=CLAIMS, gpus_available=0)
    spec = job.launcher if role == "launcher" else job.workers[1]
    secret = tmp_path / "ssh"
    secret.mkdir()
    for name in ("id_rsa", "id_rsa.pub", "authorized_keys"):
        (secret / name).write_text(name)
    me = podman.ImageConfig(IMAGE, user=f"{os.getuid()}:{os.getgid()}")  # chown to ourselves: no root needed
    env = {"MLFLOW_TRACKING_URI": "http://user:pa55@mlflow:5000", "K_MPI_JOB_ROLE": role}
    plan = podman.plan_container(spec, me, owner=4242, namespace=f"nsmj4242-{role}", pod_dir=tmp_path / "pod",
                                 hosts=tmp_path / "hosts", secret=secret, ssh_auth_mount_path="/home/mpiuser/.ssh",
                                 mpi_config=tmp_path / "mpi", env=env, **kw)
    return plan, spec


def test_podman_run_puts_the_container_in_the_pods_host_with_its_files_and_no_secret_on_the_command_line(
        tmp_path: Path) -> None:
    plan, spec = _plan(tmp_path, claim_view={"/tmp/home": "/run/view/0"})
    settings = podman.PodmanSettings(containers_conf="/etc/c.conf", oci_runtime="runc")
    argv = plan.argv(settings)
    assert argv[:3] == ["podman", "--runtime", "runc"]
    pairs = {argv[i]: argv[i + 1] for i in range(len(argv) - 1) if argv[i].startswith("--")}
    assert pairs["--network"] == "ns:/run/netns/nsmj4242-launcher"
    assert pairs["--name"] == f"nightshift-mpijob-4242-{spec.name}" and pairs["--hostname"] == spec.name
    assert pairs["--pull"] == "never" and "--no-hosts" in argv and "--rm" in argv
    assert pairs["--user"] == f"{os.getuid()}:{os.getgid()}"
    volumes = [argv[i + 1] for i, a in enumerate(argv) if a == "--volume"]
    assert volumes == [f"{tmp_path}/hosts:/etc/hosts:ro", f"{tmp_path}/pod/ssh:/home/mpiuser/.ssh:ro",
                       f"{tmp_path}/mpi:/etc/mpi:ro", f"/run/view/0:{SHARED}:rw"]
    # command given: --entrypoint (JSON) replaces the image's; the image comes right before its args
    assert json.loads(pairs["--entrypoint"])[:2] == ["horovodrun", "--gloo"] and argv[-1] == IMAGE
    assert not any("pa55" in a for a in argv)
    env_file = Path(pairs["--env-file"])
    assert stat.S_IMODE(env_file.stat().st_mode) == 0o600
    assert env_file.read_text() == "MLFLOW_TRACKING_URI=http://user:pa55@mlflow:5000\nK_MPI_JOB_ROLE=launcher\n"
    assert settings.env()["CONTAINERS_CONF"] == "/etc/c.conf"
    # the pod's copy of the Secret: 0700 directory, 0600 files, the pod user's
    ssh = tmp_path / "pod" / "ssh"
    assert stat.S_IMODE(ssh.stat().st_mode) == 0o700
    assert {f.name: stat.S_IMODE(f.stat().st_mode) for f in ssh.iterdir()} == {
        "id_rsa": 0o600, "id_rsa.pub": 0o600, "authorized_keys": 0o600}


def test_a_restored_pod_gets_the_same_container_in_its_dead_ones_directory_keeping_its_empty_dirs(
        tmp_path: Path) -> None:
    from nightshift.mpijob_local import files

    source = manifest(volumes=[{"name": "scratch", "emptyDir": {}}],
                      volume_mounts=[{"name": "scratch", "mountPath": "/scratch"}])
    job = parse_job(source, claims=CLAIMS, gpus_available=0)
    secret = tmp_path / "ssh"
    secret.mkdir()
    (secret / "id_rsa").write_text("key")
    mpi = files.write_mpi_config(tmp_path / "mpi", "h\n", "#!/bin/sh\n")
    me = podman.ImageConfig(IMAGE, user=f"{os.getuid()}:{os.getgid()}")

    def plan(spec: Any, env: dict[str, str]) -> podman.ContainerPlan:
        return podman.plan_container(spec, me, owner=7, namespace="nsmj7-w1", pod_dir=tmp_path / spec.name,
                                     hosts=tmp_path / "hosts", secret=secret, ssh_auth_mount_path="/home/u/.ssh",
                                     mpi_config=mpi, env=env, claim_view={})

    first = plan(job.workers[1], {"GEN": "1"})
    scratch = next(Path(v.source) for v in first.volumes if v.target == "/scratch")
    (scratch / "kept").write_text("written by the dead container")
    (tmp_path / job.workers[1].name / "ssh" / "stray").write_text("x")
    again = plan(job.workers[1], {"GEN": "2"})
    assert again.argv(podman.PodmanSettings()) == first.argv(podman.PodmanSettings())  # same name, host, mounts
    assert Path(again.env_file).read_text() == "GEN=2\n"
    assert stat.S_IMODE(Path(again.env_file).stat().st_mode) == 0o600
    assert (scratch / "kept").read_text() == "written by the dead container"
    assert sorted(p.name for p in (tmp_path / job.workers[1].name / "ssh").iterdir()) == ["id_rsa"]
    # The launcher binds the directory of discover_hosts.sh, not the file: a rename there is what it reads next.
    (etc_mpi,) = [v for v in plan(job.launcher, {}).volumes if v.target == "/etc/mpi"]
    assert Path(etc_mpi.source) == mpi and Path(etc_mpi.source).is_dir() and etc_mpi.read_only


def test_workers_get_no_mpi_config_and_keep_the_images_entrypoint_when_only_args_are_given(tmp_path: Path) -> None:
    plan, _ = _plan(tmp_path, role="worker", claim_view={})
    argv = plan.argv(podman.PodmanSettings())
    assert argv[0] == "podman" and argv[1] == "run"
    assert not any(v.endswith(":/etc/mpi:ro") for v in argv)
    assert f"/tmp/home:{SHARED}:rw" in argv  # a claim already its user's is bound as it is


def test_env_podman_cannot_carry_and_gpus_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ManifestNotSupported, match="env KEY holds a line break"):
        podman.env_file_text({"KEY": "two\nlines"}, "p")
    job = parse_job(manifest(gpus_per_worker=1), claims=CLAIMS, gpus_available=2)
    with pytest.raises(ManifestNotSupported, match=r"asks for 1 GPU.*--runtime podman runs CPU pods only"):
        podman.plan_container(job.workers[0], TRAINER, owner=1, namespace="n", pod_dir=tmp_path / "p",
                              hosts=tmp_path, secret=tmp_path, ssh_auth_mount_path="/s", mpi_config=tmp_path,
                              env={}, claim_view={})
    with pytest.raises(ManifestNotSupported, match="':' or ','"):
        podman.Volume("/a:b", "/c").arg()


def test_the_idmapped_view_makes_the_claims_owner_the_pods_user() -> None:
    assert podman.idmap_maps(0, 0, podman.PodUser(1000, 1000, "1000:1000")) == ("0 1000 1\n", "0 1000 1\n")
    assert podman.idmap_maps(1001, 100, podman.PodUser(1000, 0, "1000:0")) == ("1001 1000 1\n", "100 0 1\n")


def test_podman_missing_is_refused_naming_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(podman.shutil, "which", lambda name, *a, **k: None)
    (why,) = podman.missing(podman.PodmanSettings(), [IMAGE])
    assert why == "`podman` not found: install it (apt-get install -y podman runc) or use --runtime host"
    with pytest.raises(ManifestNotSupported, match="--runtime 'docker' must be one of host, podman"):
        RunOptions(runtime="docker")
    assert RunOptions().runtime == "host"


def test_an_image_that_is_not_here_is_refused_and_nothing_is_pulled(monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[tuple[str, ...]] = []

    def fake(settings: podman.PodmanSettings, *args: str, timeout: float = 0) -> Any:
        asked.append(args)
        return type("Done", (), {"returncode": 1, "stdout": "", "stderr": ""})()

    monkeypatch.setattr(podman.shutil, "which", lambda name, *a, **k: f"/usr/bin/{name}")
    monkeypatch.setattr(podman, "run_podman", fake)
    assert podman.missing(podman.PodmanSettings(), [IMAGE, IMAGE, ""]) == [
        f"image {IMAGE} is not in podman's local storage: build it (make images) or `podman load` it; "
        f"--runtime podman pulls nothing",
        "a pod template names no image: --runtime podman runs each pod's image"]
    assert asked == [("image", "exists", IMAGE)]


def test_the_stale_sweep_removes_only_containers_of_dead_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    names = ["nightshift-mpijob-111-job-worker-0", "nightshift-mpijob-222-job-launcher", "other-container"]
    removed: list[list[str]] = []
    monkeypatch.setattr(podman.shutil, "which", lambda name, *a, **k: "/usr/bin/podman")
    monkeypatch.setattr(podman, "list_containers", lambda settings: names)
    monkeypatch.setattr(podman, "remove_containers", lambda settings, stale: removed.append(list(stale)) or [])
    assert podman.remove_stale_containers(podman.PodmanSettings(), lambda pid: pid == 222) == [names[0]]
    assert removed == [[names[0]]]


def test_settings_come_from_options_then_the_environment() -> None:
    env = {"NIGHTSHIFT_CONTAINERS_CONF": "/a.conf", "CONTAINERS_CONF": "/b.conf", "NIGHTSHIFT_OCI_RUNTIME": "runc"}
    assert podman.PodmanSettings.from_environment(environ=env) == podman.PodmanSettings("/a.conf", "runc")
    assert podman.PodmanSettings.from_environment("/c.conf", "crun", environ=env) == podman.PodmanSettings(
        "/c.conf", "crun")
    assert podman.PodmanSettings.from_environment(environ={"CONTAINERS_CONF": "/b.conf"}).containers_conf == "/b.conf"


def test_a_containers_exit_status_above_128_is_a_kill_by_that_signal() -> None:
    assert _exit_text(137, container=True) == "killed by SIGKILL"
    assert _exit_text(137) == "exit code 137" and _exit_text(-9) == "killed by SIGKILL"


def test_a_root_owned_claim_is_refused_not_mapped_to_the_pods_user(tmp_path: Path) -> None:
    """Mapped to the pod's user, root's claim would let the pod make setuid-root files on this machine."""
    from nightshift.mpijob_local.errors import HostNotSuitable

    claim, view = tmp_path / "claim", tmp_path / "view"
    claim.mkdir()
    os.chown(claim, 0, 0)
    try:
        with pytest.raises(HostNotSuitable, match=r"owned by root .*chown 1000:1000 "):
            podman.idmapped_bind(str(claim), view, podman.PodUser(1000, 1000, "1000:1000"))
    finally:
        assert podman.unmount_all(tmp_path) == []


def test_a_podman_that_hangs_or_is_gone_is_a_failed_command_not_an_exception(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    hanging = tmp_path / "bin" / "podman"
    hanging.parent.mkdir()
    hanging.write_text("#!/bin/sh\nexec sleep 30\n")
    hanging.chmod(0o755)
    monkeypatch.setenv("PATH", f"{hanging.parent}:/usr/bin:/bin")
    done = podman.run_podman(podman.PodmanSettings(), "rm", "-f", "x", timeout=0.5)
    assert done.returncode == 124 and done.stderr == "podman rm did not answer within 0s"
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    gone = podman.run_podman(podman.PodmanSettings(), "ps", timeout=5)
    assert gone.returncode == 127 and gone.stderr.startswith("podman ps could not start")


def test_a_host_runtime_sweep_never_calls_podman(monkeypatch: pytest.MonkeyPatch) -> None:
    """A podman that hangs (or holds its storage lock for a build) must not stop host-runtime runs."""
    from nightshift.mpijob_local import runner

    def asked(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the host runtime's sweep asked podman")

    monkeypatch.setattr(podman, "remove_stale_containers", asked)
    monkeypatch.setattr(runner.network, "remove_stale_namespaces", lambda: ["netns nsmj1-l"])
    monkeypatch.setattr(runner.glob, "glob", lambda pattern: [])
    assert runner.remove_stale_runs() == ["netns nsmj1-l"]


def test_close_goes_on_when_podman_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    from nightshift.mpijob_local.runner import LocalRun

    job = parse_job(manifest(), claims=CLAIMS, gpus_available=0)
    run = LocalRun(job, RunOptions(runtime="podman"), out=open(os.devnull, "w"), err=open(os.devnull, "w"))
    run.containers = ["nightshift-mpijob-1-job-launcher"]
    closed: list[bool] = []

    def broken(settings: Any, names: Any) -> list[str]:
        raise RuntimeError("podman rm hung")

    monkeypatch.setattr(podman, "remove_containers", broken)
    monkeypatch.setattr(run.net, "close", lambda: closed.append(True) or [])
    left = run.close()
    assert closed == [True] and not run.tmp.exists()
    assert left == ["containers nightshift-mpijob-1-job-launcher (podman rm hung)"]


def test_a_pod_home_over_the_interpreter_is_fresh_with_the_interpreter_bound_into_it(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Issue 35 item 6: with the MPI Operator's default sshAuthMountPath (/root/.ssh) the pods got a fresh tmpfs on
    /root, hiding a pyenv interpreter the venv's python links to (the launcher exited 127). Sharing this machine's
    home instead ran root's ~/.bashrc in every ssh session (also with another sshAuthMountPath: sshd starts root's
    shell in root's home), whose `pyenv rehash` waited 60 s on a lock a killed session had left (CI: a rate test
    measured 0.1 MB/s, an elastic test timed out). The pod gets fresh homes with the interpreter's installation
    bound read-only at its own path."""
    import pwd
    import sys

    from nightshift.mpijob_local.runner import LocalRun

    root_home = pwd.getpwuid(0).pw_dir
    home = tmp_path / "root"
    base = home / ".pyenv" / "versions" / "3.11.7"
    (base / "bin").mkdir(parents=True)
    (base / "bin" / "python3.11").write_text("")
    venv = tmp_path / "project" / ".venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").symlink_to(base / "bin" / "python3.11")
    monkeypatch.setattr(sys, "prefix", str(venv))
    monkeypatch.setattr(sys, "base_prefix", str(base))
    monkeypatch.setattr(sys, "executable", str(venv / "bin" / "python"))
    job = parse_job(manifest(ssh_auth_mount_path=f"{home}/.ssh"), claims=CLAIMS, gpus_available=0)
    run = LocalRun(job, RunOptions(), out=open(os.devnull, "w"), err=open(os.devnull, "w"))
    run.python_bin = str(venv / "bin")
    try:
        assert run._homes() == (str(home), sorted([str(home), root_home]), [str(base)])
        inner = home / "venv"  # a venv inside the home too, linking into the pyenv: one mount each, outermost only
        (inner / "bin").mkdir(parents=True)
        run.python_bin = str(inner / "bin")
        monkeypatch.setattr(sys, "prefix", str(inner))
        assert run._homes() == (str(home), sorted([str(home), root_home]), [str(base), str(inner)])
        monkeypatch.setattr(sys, "base_prefix", str(venv))  # an interpreter outside the homes: nothing bound
        monkeypatch.setattr(sys, "prefix", str(venv))
        monkeypatch.setattr(sys, "executable", str(venv / "bin" / "python3.11-copy"))
        run.python_bin = str(venv / "bin")
        (venv / "bin" / "python3.11-copy").write_text("")
        assert run._homes()[2] == [p for p in [str(Path(__file__).resolve().parents[3])] if Path(p).is_relative_to(
            root_home)]
        monkeypatch.setattr(sys, "prefix", str(home))  # the installation is the home: kept as it is
        assert str(home) not in run._homes()[1]
        monkeypatch.setattr(sys, "prefix", str(venv))
        tmp = run.tmp
        monkeypatch.setattr(run, "tmp", home / "tmp" / "run")  # TMPDIR in the home: the pods' views live there
        assert str(home) not in run._homes()[1]
        monkeypatch.setattr(run, "tmp", tmp)
        link = tmp_path / "link-home"  # a symlinked home: the tmpfs goes over its target, the pyenv bound back
        link.symlink_to(home)
        run.job = parse_job(manifest(ssh_auth_mount_path=f"{link}/.ssh"), claims=CLAIMS, gpus_available=0)
        monkeypatch.setattr(sys, "base_prefix", str(base))
        assert run._homes()[1:] == (sorted([str(home), root_home]), [str(base)])
    finally:
        run.close()
