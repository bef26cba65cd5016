"""`nightshift run-mpijob` for elastic jobs, without root: the rule for an elastic launcher, discover_hosts.sh
as the MPI Operator renders it, its atomic rewrite, the listening check, and every refusal of `--chaos`."""

from __future__ import annotations

import os
import socket
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from nightshift.mpijob_local import files, network
from nightshift.mpijob_local.chaos import ChaosEvent, parse_chaos
from nightshift.mpijob_local.errors import ManifestNotSupported
from nightshift.mpijob_local.manifest import LocalJob, is_elastic_launcher, parse_job
from nightshift.mpijob_local.runner import RunOptions

ELASTIC = ["horovodrun", "--gloo", "-np", "3", "--min-np", "2", "--max-np", "3", "--slots-per-host", "1",
           "--host-discovery-script", "/etc/mpi/discover_hosts.sh", "--blacklist-cooldown-range", "2", "120",
           "python", "train.py"]


def manifest(name: str = "toy", workers: int = 3, launcher: list[str] | None = None) -> dict[str, Any]:
    worker = {"name": "worker", "image": "trainer", "command": ["/usr/sbin/sshd", "-De"]}
    return {"apiVersion": "kubeflow.org/v2beta1", "kind": "MPIJob", "metadata": {"name": name},
            "spec": {"slotsPerWorker": 1, "mpiReplicaSpecs": {
                "Launcher": {"replicas": 1, "template": {"spec": {"containers": [
                    {"name": "launcher", "image": "trainer", "command": launcher or ELASTIC}]}}},
                "Worker": {"replicas": workers, "template": {"spec": {"containers": [worker]}}}}}}


def job(workers: int = 3, launcher: list[str] | None = None) -> LocalJob:
    return parse_job(manifest(workers=workers, launcher=launcher), claims={}, gpus_available=0)


# ---------------------------------------------------------------------------------------------- elastic jobs
@pytest.mark.parametrize(("policy", "taken", "restarts_after"), [
    (None, "Never", {0: False, 1: False, -9: False}),
    ("OnFailure", "OnFailure", {0: False, 1: True, -9: True}),
    ("Always", "Always", {0: True, 1: True, -9: True}),
    ("ExitCode", "Never", {0: False, 1: False, -9: False}),  # the operator's pod gets Never; it decides itself
])
def test_the_worker_restart_policy_decides_whether_the_kubelet_restarts_a_worker_in_place(
        policy: str | None, taken: str, restarts_after: dict[int, bool]) -> None:
    from nightshift.mpijob_local.runner import LocalRun

    doc = manifest()
    if policy:
        doc["spec"]["mpiReplicaSpecs"]["Worker"]["restartPolicy"] = policy
    parsed = parse_job(doc, claims={}, gpus_available=0)
    assert parsed.worker_restart_policy == taken
    run = LocalRun(parsed, RunOptions(), out=open(os.devnull, "w"), err=open(os.devnull, "w"))
    try:
        assert {code: run.restarts_in_place(code) for code in restarts_after} == restarts_after
    finally:
        run.close()


def test_a_worker_restart_policy_run_mpijob_cannot_take_is_refused() -> None:
    doc = manifest()
    doc["spec"]["mpiReplicaSpecs"]["Worker"]["restartPolicy"] = "Sometimes"
    with pytest.raises(ManifestNotSupported, match=r"Worker.restartPolicy must be one of .*'OnFailure'.*'Sometimes'"):
        parse_job(doc, claims={}, gpus_available=0)


def test_the_kubelets_restart_back_off_doubles_to_five_minutes() -> None:
    from nightshift.mpijob_local.runner import LocalRun, RunningPod

    doc = manifest()
    doc["spec"]["mpiReplicaSpecs"]["Worker"]["restartPolicy"] = "OnFailure"
    run = LocalRun(parse_job(doc, claims={}, gpus_available=0), RunOptions(), out=open(os.devnull, "w"),
                   err=open(os.devnull, "w"))
    try:
        pod = RunningPod(name="toy-worker-1", role="worker", namespace="ns", slot=2, ip="10.0.0.2", dns_names=[])
        delays = []
        for restarts in range(7):
            pod.restarts = restarts
            run.schedule_restart(pod, now=1000.0)
            assert pod.restart_at is not None
            delays.append(pod.restart_at - 1000.0)
        assert delays == [10, 20, 40, 80, 160, 300, 300]
        assert run.is_running(pod)  # waiting for its restart, the pod is Running: listed
    finally:
        run.close()


@pytest.mark.parametrize(("argv", "elastic"), [
    (ELASTIC, True),
    (["/opt/venv/bin/horovodrun", "--host-discovery-script=/etc/mpi/discover_hosts.sh", "python", "t.py"], True),
    (["sh", "-c", "cd /work && horovodrun -np 2 --host-discovery-script /etc/mpi/discover_hosts.sh python t.py"],
     True),
    (["horovodrun", "--gloo", "-np", "2", "--hostfile", "/etc/mpi/hostfile", "python", "t.py"], False),
    (["python", "t.py", "--host-discovery-script", "x"], False),  # no horovodrun
    (["sh", "-c", "echo --host-discovery-script; horovodrun -np 2 -H a:1 python t.py"], False),  # before it
])
def test_a_job_is_elastic_when_its_launcher_runs_horovodrun_with_a_discovery_script(
        argv: list[str], elastic: bool) -> None:
    assert is_elastic_launcher(argv) is elastic
    assert job(launcher=argv).elastic is elastic


def test_discover_hosts_lists_the_running_workers_sorted_by_pod_name_as_horovod_reads_them(tmp_path: Path) -> None:
    from horovod.runner.elastic.discovery import HostDiscoveryScript

    twelve = job(workers=12)
    everyone = twelve.discover_hosts()
    lines = everyone.splitlines()
    assert lines[0] == "#!/bin/sh" and len(lines) == 13
    # Sorted by pod name, as the operator sorts them: worker-10 and worker-11 come before worker-2.
    assert [line.split()[1].split(".")[0] for line in lines[1:4]] == ["toy-worker-0", "toy-worker-1", "toy-worker-10"]
    some = twelve.discover_hosts(["toy-worker-2", "toy-worker-10", "toy-worker-0"])
    assert some == ("#!/bin/sh\necho toy-worker-0.toy-worker.default.svc\necho toy-worker-10.toy-worker.default.svc\n"
                    "echo toy-worker-2.toy-worker.default.svc\n")
    assert twelve.discover_hosts([]) == "#!/bin/sh\n"
    # Horovod runs it and gives each host --slots-per-host slots (the operator's script has none).
    script = tmp_path / "discover_hosts.sh"
    files.write_text(script, some, 0o555)
    found = HostDiscoveryScript(str(script), slots=2).find_available_hosts_and_slots()
    assert found == {f"toy-worker-{i}.toy-worker.default.svc": 2 for i in (0, 2, 10)}


def test_discover_hosts_is_replaced_by_a_rename_that_a_running_reader_never_sees_half_of(tmp_path: Path) -> None:
    script = tmp_path / "discover_hosts.sh"
    files.write_text(script, "#!/bin/sh\necho a\n", 0o555)
    before = script.stat().st_ino
    with script.open() as reader:  # a discovery run that opened the old file reads it whole
        files.replace_text(script, "#!/bin/sh\necho b\n", 0o555)
        assert reader.read() == "#!/bin/sh\necho a\n"
    assert script.read_text() == "#!/bin/sh\necho b\n" and script.stat().st_ino != before
    assert script.stat().st_mode & 0o777 == 0o555
    assert [p.name for p in tmp_path.iterdir()] == ["discover_hosts.sh"]  # no temporary file left
    assert subprocess.run([str(script)], capture_output=True, text=True, check=True).stdout == "b\n"


def test_listening_reads_the_sockets_of_a_processs_network_namespace() -> None:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    port = server.getsockname()[1]
    assert not network.listening(os.getpid(), port)  # bound, not listening
    server.listen()
    assert network.listening(os.getpid(), port)
    server.close()
    assert not network.listening(os.getpid(), port)
    assert not network.listening(2**22 + 7, 22)  # no such process


def test_a_process_not_yet_in_the_pods_network_namespace_is_not_taken_for_the_pod() -> None:
    """Review finding: a restored pod's first process is `ip netns exec` until it enters the namespace; read
    before that, /proc/PID/net/tcp is this machine's, where a machine's own sshd may listen on 22."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    port = server.getsockname()[1]
    other = subprocess.Popen(["unshare", "--net", "sleep", "30"])
    try:
        deadline = 50
        while deadline and network.same_network_namespace(other.pid, "/proc/self/ns/net"):
            deadline -= 1  # unshare has not made its namespace yet
            subprocess.run(["sleep", "0.05"], check=True)
        assert network.listening(os.getpid(), port, "/proc/self/ns/net")
        assert not network.listening(os.getpid(), port, f"/proc/{other.pid}/ns/net")
        assert not network.listening(os.getpid(), port, "/run/netns/no-such-namespace")
    finally:
        other.kill()
        other.wait()
        server.close()


# ---------------------------------------------------------------------------------------------- --chaos
def test_a_chaos_script_becomes_events_on_full_pod_names() -> None:
    events = parse_chaos("kill worker-1 at 30s; restore toy-worker-1 at 60; down worker-2 at 61.5s;"
                         "up worker-2 at 61.5s;", job())
    assert events == (
        ChaosEvent("kill", "toy-worker-1", 30.0, "kill worker-1 at 30s"),
        ChaosEvent("restore", "toy-worker-1", 60.0, "restore toy-worker-1 at 60"),
        ChaosEvent("down", "toy-worker-2", 61.5, "down worker-2 at 61.5s"),
        ChaosEvent("up", "toy-worker-2", 61.5, "up worker-2 at 61.5s"))
    # A pod killed and restored may be killed again.
    again = parse_chaos("kill worker-0 at 0s; restore worker-0 at 5s; kill worker-0 at 9s", job())
    assert [e.action for e in again] == ["kill", "restore", "kill"]


def test_restore_and_up_are_refused_for_a_job_that_is_not_elastic() -> None:
    """Review finding: a restore in a job that fails anyway hid which worker was lost from the job's error."""
    plain = job(launcher=["horovodrun", "--gloo", "-np", "3", "--hostfile", "/etc/mpi/hostfile", "python", "t.py"])
    assert [e.action for e in parse_chaos("kill worker-1 at 3s; down worker-2 at 4s", plain)] == ["kill", "down"]
    for script in ("kill worker-1 at 3s; restore worker-1 at 9s", "down worker-1 at 3s; up worker-1 at 9s"):
        with pytest.raises(ManifestNotSupported, match=r"only fits an elastic job .* drop the '(restore|up)' events"):
            parse_chaos(script, plain)


@pytest.mark.parametrize(("script", "message"), [
    ("", "--chaos is empty; give events like 'kill worker-1 at 30s; restore worker-1 at 60s'"),
    (" ; ", "--chaos event 1 '' must look like 'ACTION POD at SECONDS' with ACTION one of kill, restore, down, up"),
    ("kill worker-1 30s", "--chaos event 1 'kill worker-1 30s' must look like 'ACTION POD at SECONDS'"),
    ("kill worker-1 at 30s;; restore worker-1 at 40s", "--chaos event 2 '' must look like"),
    ("stop worker-1 at 30s", "--chaos event 1 'stop worker-1 at 30s': unknown action 'stop'; valid actions: kill, "
                             "restore, down, up"),
    ("kill worker-3 at 30s", "--chaos event 1 'kill worker-3 at 30s': no worker pod 'worker-3' in MPIJob toy; "
                             "valid pods: worker-0..worker-2 or toy-worker-0..toy-worker-2"),
    ("kill other-worker-0 at 30s", "no worker pod 'other-worker-0' in MPIJob toy; valid pods: worker-0..worker-2"),
    ("kill launcher at 30s", "'kill launcher at 30s': the launcher cannot be a chaos target (its exit is the job's); "
                             "valid pods: worker-0..worker-2"),
    ("kill toy-launcher at 30s", "the launcher cannot be a chaos target"),
    ("kill worker-1 at -5s", "--chaos event 1 'kill worker-1 at -5s': time '-5s' must be seconds from the "
                             "launcher's start, >= 0, like 30s or 2.5s"),
    ("kill worker-1 at soon", "time 'soon' must be seconds from the launcher's start"),
    ("kill worker-1 at 30m", "time '30m' must be seconds"),
    ("kill worker-1 at 30s; restore worker-1 at 20s", "--chaos event 2 'restore worker-1 at 20s': at 20s comes "
                                                      "before the event above it (30s); list the events in time order"),
    ("restore worker-1 at 30s", "--chaos event 1 'restore worker-1 at 30s': toy-worker-1 is not killed at that "
                                "point; 'restore' needs an earlier 'kill worker-1'"),
    ("kill worker-0 at 1s; restore worker-1 at 2s", "toy-worker-1 is not killed at that point"),
    ("kill worker-1 at 1s; restore worker-1 at 2s; restore worker-1 at 3s", "--chaos event 3"),
    ("up worker-2 at 30s", "toy-worker-2 is not down at that point; 'up' needs an earlier 'down worker-2'"),
    ("kill worker-1 at 1s; kill toy-worker-1 at 2s", "--chaos event 2 'kill toy-worker-1 at 2s': toy-worker-1 is "
                                                     "already killed; 'restore toy-worker-1' it first"),
    ("down worker-1 at 1s; down worker-1 at 2s", "toy-worker-1 is already down; 'up worker-1' it first"),
])
def test_a_bad_chaos_script_is_refused_naming_the_bad_part(script: str, message: str) -> None:
    with pytest.raises(ManifestNotSupported) as refused:
        parse_chaos(script, job())
    assert message in str(refused.value)
    assert "\n" not in str(refused.value)


def test_a_one_worker_job_names_its_only_pod() -> None:
    with pytest.raises(ManifestNotSupported, match=r"valid pods: worker-0 or toy-worker-0$"):
        parse_chaos("kill worker-1 at 1s", job(workers=1))


def test_chaos_is_taken_with_the_podman_runtime_and_checked_before_anything_starts(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    from nightshift.cli import main
    from nightshift.mpijob_local import runner

    seen: list[RunOptions] = []

    def stop_at_preflight(job: LocalJob, options: RunOptions, pod_path: str) -> None:
        seen.append(options)
        raise ManifestNotSupported("stopped at preflight by the test")

    monkeypatch.setattr(runner, "preflight", stop_at_preflight)
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(manifest()))
    script = "kill worker-1 at 10s; restore worker-1 at 16s"
    assert main(["run-mpijob", str(path), "--runtime", "podman", "--chaos", script]) == 2
    assert "stopped at preflight by the test" in capsys.readouterr().err
    assert [(o.runtime, o.chaos) for o in seen] == [("podman", script)]
    assert main(["run-mpijob", str(path), "--runtime", "podman", "--chaos", "restore worker-1 at 1s"]) == 2
    assert "'restore' needs an earlier 'kill worker-1'" in capsys.readouterr().err
    assert len(seen) == 1  # a bad script never reaches preflight


@pytest.mark.parametrize(("args", "message"), [
    (["--chaos", "kill worker-7 at 10s"], "no worker pod 'worker-7' in MPIJob toy; valid pods: worker-0..worker-2"),
    (["--chaos-after", "step 10"], "--chaos-after starts the clock of a --chaos script: give --chaos too"),
    (["--chaos", "kill worker-1 at 5s", "--chaos-after", "step (10"],
     "--chaos-after 'step (10' is not a regular expression"),
])
def test_cli_refuses_a_bad_chaos_script_or_clock_before_anything_starts(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, args: list[str],
        message: str) -> None:
    from nightshift.cli import main
    from nightshift.mpijob_local import runner

    def no_run(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a run started")

    monkeypatch.setattr(runner, "preflight", no_run)
    monkeypatch.setattr(runner, "LocalRun", no_run)
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(manifest()))
    assert main(["run-mpijob", str(path), *args]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1 and message in err, err


def test_pin_cpus_is_for_the_host_runtime() -> None:
    with pytest.raises(ManifestNotSupported, match="--pin-cpus pins the host runtime's pods"):
        RunOptions(runtime="podman", pin_cpus=True)
