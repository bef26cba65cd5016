"""`nightshift run-mpijob` without root: reading manifests, the operator's files, refusals, options."""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from nightshift.mpijob_local import files, network
from nightshift.mpijob_local.errors import ManifestNotSupported
from nightshift.mpijob_local.manifest import GPU_RESOURCE, parse_job
from nightshift.mpijob_local.runner import _first_error
from operators.mpijob_spec import MPIJobConfig, TaskIdentity, build_mpijob
from tests.conftest import REPO

IDENTITY = TaskIdentity("nightly_retrain", "train", "manual__t", 1)
SHARED_DIR = "/srv/nightshift"
COMMAND = ["python", "-m", "nightshift.train", "--data", f"{SHARED_DIR}/data", "--out", f"{SHARED_DIR}/out"]


def manifest(**overrides: Any) -> dict[str, Any]:
    """What the operator submits: the shared claim mounted at NIGHTSHIFT_HOME's path, env for MLflow."""
    config = {
        "image": "ghcr.io/nightshift/trainer:0.1.0", "command": COMMAND, "num_workers": 2,
        "env": {"MLFLOW_TRACKING_URI": "http://mlflow.nightshift.svc:5000", "NIGHTSHIFT_HOME": SHARED_DIR},
        "volumes": [{"name": "shared", "persistentVolumeClaim": {"claimName": "nightshift-workspace"}}],
        "volume_mounts": [{"name": "shared", "mountPath": SHARED_DIR}],
        **overrides,
    }
    return build_mpijob(MPIJobConfig(**config), IDENTITY)


CLAIMS = {"nightshift-workspace": "/tmp/home"}


def test_the_operators_job_becomes_a_launcher_and_its_workers() -> None:
    source = manifest()
    job = parse_job(source, claims=CLAIMS, gpus_available=0)
    name = source["metadata"]["name"]
    assert job.name == name and job.namespace == "default" and job.slots_per_worker == 1
    assert [p.name for p in job.pods] == [f"{name}-launcher", f"{name}-worker-0", f"{name}-worker-1"]
    launcher = dict(job.launcher.env)
    assert launcher["MLFLOW_TRACKING_URI"] == "http://mlflow.nightshift.svc:5000"
    assert launcher["K_MPI_JOB_ROLE"] == "launcher" and launcher["NVIDIA_VISIBLE_DEVICES"] == ""
    assert launcher["OMPI_MCA_orte_default_hostfile"] == "/etc/mpi/hostfile"
    assert dict(job.workers[1].env)["K_MPI_JOB_ROLE"] == "worker"
    assert job.launcher.argv[:6] == ("horovodrun", "--gloo", "-np", "2", "--hostfile", "/etc/mpi/hostfile")
    assert job.workers[0].argv == ("/usr/sbin/sshd", "-De", "-f", "/home/mpiuser/.sshd_config")
    for pod in job.pods:  # the claim's directory at the mountPath, in every pod
        assert [(m.source, m.target, m.read_only) for m in pod.mounts] == [("/tmp/home", SHARED_DIR, False)]
    assert job.ssh_auth_mount_path == "/home/mpiuser/.ssh"


def test_hostfile_is_the_operators_and_horovodrun_reads_it(tmp_path: Path) -> None:
    from horovod.runner.common.util.hosts import parse_host_files

    job = parse_job(manifest(num_workers=3), claims=CLAIMS, gpus_available=0)
    hostfile = tmp_path / "hostfile"
    hostfile.write_text(job.hostfile())
    name = job.name
    assert hostfile.read_text().splitlines() == [
        f"{name}-worker-{i}.{name}-worker.default.svc slots=1" for i in range(3)]
    assert parse_host_files(str(hostfile)) == ",".join(
        f"{name}-worker-{i}.{name}-worker.default.svc:1" for i in range(3))
    assert job.discover_hosts().splitlines()[0] == "#!/bin/sh"
    assert job.discover_hosts().splitlines()[1] == f"echo {name}-worker-0.{name}-worker.default.svc"
    # Every name a pod answers to: the operator's FQDN, the older <job> subdomain, the short name.
    assert job.dns_names(job.workers[1]) == [
        f"{name}-worker-1.{name}-worker.default.svc", f"{name}-worker-1.{name}.default.svc", f"{name}-worker-1"]


def test_hostfile_of_other_mpi_implementations_uses_host_colon_slots() -> None:
    source = manifest(num_workers=2, gpus_per_worker=4)
    source["spec"]["mpiImplementation"] = "Intel"
    job = parse_job(source, claims=CLAIMS, gpus_available=8)
    assert job.hostfile().splitlines()[0].endswith(".svc:4")
    assert [p.gpus for p in job.pods] == [0, 4, 4]


def test_a_gpu_request_is_refused_on_a_machine_without_enough_gpus() -> None:
    with pytest.raises(ManifestNotSupported, match=f"asks for 4 {GPU_RESOURCE}") as raised:
        parse_job(manifest(gpus_per_worker=2), claims=CLAIMS, gpus_available=0)
    assert "this machine has 0 GPU(s)" in str(raised.value) and "gpus_per_worker=0" in str(raised.value)
    with pytest.raises(ManifestNotSupported, match="has 3 GPU"):
        parse_job(manifest(gpus_per_worker=2), claims=CLAIMS, gpus_available=3)


def _pod(source: dict[str, Any], role: str = "Worker") -> dict[str, Any]:
    return source["spec"]["mpiReplicaSpecs"][role]["template"]["spec"]


@pytest.mark.parametrize(("edit", "message"), [
    (lambda m: m["spec"]["mpiReplicaSpecs"]["Worker"]["template"]["spec"]["volumes"][0]
     .update(persistentVolumeClaim={"claimName": "other"}), "--volume other=DIR"),
    (lambda m: _pod(m)["volumes"].append({"name": "cfg", "configMap": {"name": "x"}}), "configMap"),
    (lambda m: _pod(m)["containers"][0]["env"].append({"name": "POD", "valueFrom": {"fieldRef": {}}}),
     "valueFrom"),
    (lambda m: _pod(m).update(initContainers=[{"name": "init"}]), "initContainers"),
    (lambda m: _pod(m).update(hostNetwork=True), "hostNetwork"),
    (lambda m: _pod(m)["containers"].append(copy.deepcopy(_pod(m)["containers"][0])), "exactly one container"),
    (lambda m: _pod(m)["containers"][0]["volumeMounts"].append({"name": "nope", "mountPath": "/x"}),
     "'nope' is not a volume"),
    (lambda m: m["spec"].update(runLauncherAsWorker=True), "runLauncherAsWorker"),
    (lambda m: m.update(kind="PyTorchJob"), "not an MPIJob"),
])
def test_what_cannot_be_honoured_is_refused_naming_it(edit: Any, message: str) -> None:
    source = manifest()
    edit(source)
    with pytest.raises(ManifestNotSupported, match=re.escape(message)):
        parse_job(source, claims=CLAIMS, gpus_available=0)


def test_empty_dirs_host_paths_sub_paths_and_read_only_mounts() -> None:
    source = manifest()
    pod = _pod(source, "Launcher")
    pod["volumes"] += [{"name": "scratch", "emptyDir": {}}, {"name": "ds", "hostPath": {"path": "/data"}}]
    pod["containers"][0]["volumeMounts"] += [
        {"name": "scratch", "mountPath": "/scratch"},
        {"name": "ds", "mountPath": "/ds", "readOnly": True},
        {"name": "shared", "mountPath": "/ckpt", "subPath": "checkpoints"},
    ]
    pod["containers"][0]["workingDir"] = "/scratch"
    launcher = parse_job(source, claims=CLAIMS, gpus_available=0).launcher
    assert [(m.source, m.target, m.read_only) for m in launcher.mounts] == [
        ("/tmp/home", SHARED_DIR, False), (None, "/scratch", False), ("/data", "/ds", True),
        ("/tmp/home/checkpoints", "/ckpt", False)]
    assert launcher.working_dir == "/scratch"


def _options(path: Path) -> dict[str, str]:
    options = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#") and line.split()[0] != "Host":
            key, _, value = line.partition(" ")
            options[key] = value.strip()
    return options


def test_sshd_config_is_the_trainer_images_for_root() -> None:
    """Same options as images/trainer/sshd_config; only what running as root here needs differs."""
    image = _options(REPO / "images" / "trainer" / "sshd_config")
    ours = {line.split(" ", 1)[0]: line.split(" ", 1)[1]
            for line in files.sshd_config("/home/mpiuser/.ssh", "/venv/bin:/usr/bin").splitlines()
            if line and not line.startswith("#")}
    differs = {"PidFile": "none", "PermitRootLogin": "prohibit-password",
               "AuthorizedKeysFile": "/home/mpiuser/.ssh/authorized_keys"}
    for key, value in image.items():
        assert ours[key] == differs.get(key, value), key
    assert ours["HostKey"] == "/home/mpiuser/.ssh/id_rsa" and ours["Port"] == "22"
    assert ours["SetEnv"].startswith("PATH=/venv/bin:/usr/bin ")


def test_ssh_client_config_is_the_trainer_images() -> None:
    image = _options(REPO / "images" / "trainer" / "ssh_config")
    ours = {line.split()[0]: line.split(None, 1)[1] for line in files.ssh_config("/home/mpiuser/.ssh").splitlines()
            if line.strip() and not line.startswith("#") and not line.startswith("Host ")}
    for key, value in image.items():
        expected = "/home/mpiuser/.ssh/id_rsa" if key == "IdentityFile" else value
        assert ours[key] == expected, key
    assert ours["Port"] == "22"


def test_hosts_file_names_every_pod() -> None:
    text = files.hosts_file([("10.231.0.10", ["a-launcher"]),
                             ("10.231.0.11", ["a-worker-0.a-worker.d.svc", "a-worker-0"])])
    assert "127.0.0.1\tlocalhost" in text.splitlines()
    assert "10.231.0.11\ta-worker-0.a-worker.d.svc a-worker-0" in text.splitlines()


def test_link_options_are_checked() -> None:
    assert network.parse_rate("1gbit") == 10**9 and network.parse_rate("100mbit") == 10**8
    for bad in ("1gbps", "fast", "1 gbit"):
        with pytest.raises(ManifestNotSupported, match="--link-rate"):
            network.parse_rate(bad)
    with pytest.raises(ManifestNotSupported, match="--link-loss"):
        network.LinkShape(loss_pct=101)
    assert not network.LinkShape().shaped and network.LinkShape(delay_ms=5).shaped
    assert network.namespace_name(42, "worker", 3) == "nsmj42-w3" and network.host_veth(2) == "v2"
    assert network.address(0) == "10.231.0.10" and network.address(205) == "10.231.1.15"


def test_the_error_a_person_reads_first_is_a_ranks() -> None:
    lines = ["[0]<stderr>:ValueError: bad batch", "Traceback (most recent call last):",
             "RuntimeError: Horovod detected that one or more processes exited", "Exit code: 1"]
    assert _first_error(lines) == "[0]<stderr>:ValueError: bad batch"
    assert _first_error(lines[1:]) == "RuntimeError: Horovod detected that one or more processes exited"
    assert _first_error(["done", ""]) == "done"


def _write(tmp_path: Path, source: dict[str, Any]) -> Path:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(source))
    return path


def test_cli_refuses_a_gpu_job_here_on_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    from nightshift.cli import main
    from nightshift.mpijob_local import runner

    monkeypatch.setattr(runner, "count_gpus", lambda: 0)
    code = main(["run-mpijob", str(_write(tmp_path, manifest(gpus_per_worker=1))),
                 "--volume", f"nightshift-workspace={tmp_path}"])
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert f"asks for 2 {GPU_RESOURCE}" in err and "this machine has 0 GPU(s)" in err


def test_cli_refuses_a_claim_without_a_volume(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from nightshift.cli import main

    code = main(["run-mpijob", str(_write(tmp_path, manifest()))])
    err = capsys.readouterr().err
    assert code == 2 and "give it a directory with --volume nightshift-workspace=DIR" in err


def test_cli_refuses_without_root_or_sshd(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    from nightshift.cli import main
    from nightshift.mpijob_local import runner

    path = str(_write(tmp_path, manifest()))
    volume = f"nightshift-workspace={tmp_path}"
    monkeypatch.setattr(runner.os, "geteuid", lambda: 1000)
    assert main(["run-mpijob", path, "--volume", volume]) == 2
    assert "run-mpijob needs root" in capsys.readouterr().err
    monkeypatch.setattr(runner.os, "geteuid", lambda: 0)
    real_which = runner.shutil.which
    monkeypatch.setattr(runner.shutil, "which", lambda tool, path=None: None if tool == "ip" else real_which(tool))
    assert main(["run-mpijob", path, "--volume", volume]) == 2
    assert "`ip` not found: install iproute2" in capsys.readouterr().err
    monkeypatch.setattr(runner.shutil, "which", real_which)
    monkeypatch.setattr(runner.os, "access", lambda p, mode: not str(p).endswith("sshd"))
    assert main(["run-mpijob", path, "--volume", volume]) == 2
    assert "`/usr/sbin/sshd` not found on this machine (apt-get install -y openssh-server)" in capsys.readouterr().err


@pytest.mark.parametrize(("args", "message"), [
    (["--volume", "novalue"], "must look like CLAIM=DIR"),
    (["--service", "mlflow=server"], "must look like HOST:PORT=COMMAND"),
    (["--service", "Bad_Host:5000=server"], "must be a DNS name"),
])
def test_cli_options_are_checked(tmp_path: Path, args: list[str], message: str,
                                 capsys: pytest.CaptureFixture[str]) -> None:
    from nightshift.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["run-mpijob", str(_write(tmp_path, manifest())), *args])
    assert exit_.value.code == 2 and message in capsys.readouterr().err
