"""`nightshift run-mpijob` for real: the MPIJob `nightshift plan` prints, trained across emulated hosts.

Each pod is a network, UTS and mount namespace on a bridge of the run; workers run sshd; ranks reach each
other over TCP. MLflow runs as a `--service` on the job's network (a server on 127.0.0.1 is not reachable
from the pods' namespaces, by design). The yardstick for every model is a single-host
`horovodrun -np N -H localhost:N --gloo` run of the same arguments, with `--threads` set to what each
emulated host's rank resolves (all cores: it is alone on its host), since the thread count changes the
reduction order of CPU kernels. Needs root, `ip`, `unshare` and `sshd`; skips, saying which, without them.
"""

from __future__ import annotations

import ast
import json
import os
import pwd
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest
import torch
import yaml

from tests.integration.horovod_helpers import processes_mentioning

pytestmark = pytest.mark.integration

BIN = Path(sys.executable).parent
NIGHTSHIFT = str(BIN / "nightshift")
TRACKING = "http://mlflow.nightshift.svc:5000"
CLAIM = "nightshift-workspace"
# 2 epochs of 79 steps (2 ranks x batch 8): the first checkpoint (step 100) comes mid-run.
CONF = {"backend": "kubernetes", "workers": 2, "epochs": 2, "batch_size": 8}
THREADS = os.cpu_count() or 1  # each emulated host runs one rank: it takes every core


def _missing() -> str | None:
    if sys.platform != "linux" or os.geteuid() != 0:
        return "needs root on Linux (network and mount namespaces)"
    for tool, package in (("ip", "iproute2"), ("unshare", "util-linux"), ("ssh", "openssh-client"),
                          ("ssh-keygen", "openssh-client"), ("tc", "iproute2")):
        if shutil.which(tool) is None:
            return f"`{tool}` not found (apt-get install -y {package})"
    if not os.access("/usr/sbin/sshd", os.X_OK):
        return "/usr/sbin/sshd not found (apt-get install -y openssh-server)"
    probe = subprocess.run(["unshare", "--net", "--mount", "--uts", "true"], capture_output=True, check=False)
    if probe.returncode != 0:
        return f"cannot create namespaces here: {probe.stderr.decode().strip()}"
    return None


MISSING = _missing()
if MISSING:
    pytestmark = [pytest.mark.integration, pytest.mark.skip(reason=MISSING)]


# ---------------------------------------------------------------------------------------------- helpers
@dataclass
class Site:
    """A NIGHTSHIFT_HOME shared by every pod (the claim's directory) and an MLflow store beside it."""

    home: Path
    mlflow: Path
    data: Path  # the demo data, written once by `nightshift demo-data`

    def env(self) -> dict[str, str]:
        env = {**os.environ, "NIGHTSHIFT_HOME": str(self.home), "MLFLOW_TRACKING_URI": TRACKING,
               "PATH": f"{BIN}:{os.environ.get('PATH', '/usr/bin:/bin')}"}
        env.pop("NIGHTSHIFT_CLUSTER_MLFLOW_URI", None)
        return env

    def plan(self, run_id: str, conf: dict[str, Any]) -> dict[str, Any]:
        """The MPIJob `nightshift plan` prints for this run, with its data staged where plan says."""
        done = subprocess.run([NIGHTSHIFT, "plan", "--run-id", run_id, "--conf", json.dumps(conf)],
                              capture_output=True, text=True, env=self.env(), timeout=120, check=False)
        assert done.returncode == 0, done.stderr
        (job,) = [o for o in yaml.safe_load_all(done.stdout) if o]
        assert trainer_arg(job, "--data") == str(self.workspace(run_id) / "data")
        shutil.copytree(self.data, self.workspace(run_id) / "data")
        return job

    def workspace(self, run_id: str) -> Path:
        return self.home / "workspaces" / "nightly_retrain" / run_id

    def write(self, job: dict[str, Any], name: str) -> Path:
        path = self.home.parent / f"{name}.yaml"
        path.write_text(yaml.safe_dump(job))
        return path

    def mlflow_service(self) -> list[str]:
        server = (f"{BIN / 'mlflow'} server --host 0.0.0.0 --port 5000 --workers 1 "
                  f"--allowed-hosts mlflow.nightshift.svc:5000 "
                  f"--backend-store-uri sqlite:///{self.mlflow / 'mlflow.db'} "
                  f"--artifacts-destination {self.mlflow / 'art'}")
        return ["--service", f"mlflow.nightshift.svc:5000={server}"]

    def run_mpijob(self, manifest: Path, *extra: str, timeout: float = 420) -> subprocess.Popen[str]:
        return subprocess.Popen([NIGHTSHIFT, "run-mpijob", str(manifest), "--volume", f"{CLAIM}={self.home}",
                                 "--timeout", str(timeout - 60), *extra],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=self.env())


SiteT = TypeVar("SiteT", bound=Site)


def launcher(job: dict[str, Any]) -> dict[str, Any]:
    return job["spec"]["mpiReplicaSpecs"]["Launcher"]["template"]["spec"]["containers"][0]


def trainer_arg(job: dict[str, Any], flag: str) -> str:
    command = launcher(job)["command"]
    return str(command[command.index(flag) + 1])


def without_mlflow_args(command: list[str]) -> list[str]:
    command = list(command)
    for flag in ("--mlflow-experiment", "--mlflow-run-name"):
        if flag in command:
            i = command.index(flag)
            del command[i:i + 2]
    return command


def without_mlflow(job: dict[str, Any]) -> dict[str, Any]:
    """The job minus rank 0's MLflow logging (fault tests: no tracking server needed, same weights)."""
    launcher(job)["command"] = without_mlflow_args(launcher(job)["command"])
    return job


def finish(proc: subprocess.Popen[str], timeout: float = 420) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"run-mpijob did not finish in {timeout}s:\n{err[-3000:]}")
    return proc.returncode, out, err


def weights(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, weights_only=True)


def assert_bitwise_equal(a: Path, b: Path) -> None:
    first, second = weights(a), weights(b)
    assert first.keys() == second.keys()
    for name in first:
        assert torch.equal(first[name], second[name]), f"parameter {name} differs"


def single_host_reference(job: dict[str, Any], out: Path) -> Path:
    """`horovodrun -np N -H localhost:N --gloo` with the job's trainer arguments and Horovod env; its model.pt."""
    command = launcher(job)["command"]
    np_ = command[command.index("-np") + 1]
    args = command[command.index("python"):]
    for flag, value in (("--out", out / "model"), ("--checkpoint-dir", out / "ckpt")):
        args[args.index(flag) + 1] = str(value)
    argv = [str(BIN / "horovodrun"), "-np", np_, "-H", f"localhost:{np_}", "--gloo",
            *without_mlflow_args(args), "--threads", str(THREADS)]
    horovod_env = {e["name"]: e["value"] for e in launcher(job)["env"] if e["name"].startswith("HOROVOD_")}
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600, check=False,
                          env={**os.environ, **horovod_env, "PATH": f"{BIN}:{os.environ['PATH']}"})
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return out / "model" / "model.pt"


def host_links() -> set[str]:
    """The host's links, less those of podman's own bridge network: another test beside this one (the serving image's,
    publishing a port) makes podman create its `podman0` bridge and a veth on it in the host's namespace."""
    done = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, check=True)
    links = set()
    for line in done.stdout.splitlines():
        name = line.split(":")[1].strip().split("@")[0]
        if re.fullmatch(r"podman\d+", name) or re.search(r" master podman\d+ ", line):
            continue
        links.add(name)
    return links


def namespace_pids(namespace: str) -> list[str]:
    done = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True, check=False)
    return done.stdout.split()


def assert_nothing_left(pid: int, links_before: set[str], *markers: str) -> None:
    """No namespace, link, process or temporary directory of the run-mpijob with this pid."""
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    assert f"nsmj{pid}-" not in namespaces, namespaces
    assert host_links() <= links_before, host_links() - links_before
    assert not list(Path(tempfile.gettempdir()).glob(f"nightshift-mpijob-{pid}-*"))
    deadline = time.monotonic() + 15
    while True:
        left = processes_mentioning(f"nightshift-mpijob-{pid}-", "/home/mpiuser/.sshd_config", *markers)
        ours = [line for line in left if not of_another_run(int(line.split(":")[0]), pid)]
        # A process of another run that is cleaning up beside this test (its namespace already deleted) is gone in
        # a moment; one of this run stays.
        if not ours or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert not ours, ours


def of_another_run(process: int, pid: int) -> bool:
    """The process is a pod's of another run-mpijob that is running beside this test (the hosts backend's or a
    podman runtime's under another test: its sshd has the same command line): it lives in that run's namespace
    (nsmj<PID>-...), or names that run's containers (`podman run`, conmon: nightshift-mpijob-<PID>-...)."""
    done = subprocess.run(["ip", "netns", "identify", str(process)], capture_output=True, text=True, check=False)
    owner = re.match(r"nsmj(\d+)-", done.stdout.strip())
    if owner is not None:
        return int(owner.group(1)) != pid
    try:
        cmdline = Path(f"/proc/{process}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return True  # gone meanwhile
    runs = {int(n) for n in re.findall(r"nightshift-mpijob-(\d+)-", cmdline)}
    return bool(runs) and pid not in runs


def wait_for(predicate: Any, timeout: float, what: str, proc: subprocess.Popen[str] | None = None) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if proc is not None and proc.poll() is not None:
            pytest.fail(f"run-mpijob ended before {what}: {proc.stderr.read() if proc.stderr else ''}")
        assert time.monotonic() < deadline, f"no {what} after {timeout}s"
        time.sleep(0.05)


# ---------------------------------------------------------------------------------------------- fixtures
def make_site(tmp_path_factory: pytest.TempPathFactory, name: str, kind: type[SiteT]) -> SiteT:
    """A claim directory, an MLflow store folder and the demo data, under a fresh temporary folder."""
    root = tmp_path_factory.mktemp(name)
    (root / "home").mkdir()
    (root / "mlflow").mkdir()
    data = root / "demo-data"
    done = subprocess.run([NIGHTSHIFT, "demo-data", str(data)], capture_output=True, text=True, timeout=120,
                          check=False)
    assert done.returncode == 0, done.stderr
    return kind(home=root / "home", mlflow=root / "mlflow", data=data)


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Site:
    return make_site(tmp_path_factory, "run-mpijob", Site)


@pytest.fixture(scope="module")
def links_before() -> set[str]:
    return host_links()


@pytest.fixture(scope="module")
def reference(site: Site) -> Path:
    """The single-host run every 2-host model must equal, bit for bit."""
    return single_host_reference(site.plan("reference", CONF), site.home.parent / "reference")


# ---------------------------------------------------------------------------------------------- tests
def test_plans_job_trains_across_two_hosts_bit_for_bit_and_logs_to_mlflow(
        site: Site, reference: Path, links_before: set[str]) -> None:
    job = site.plan("two-hosts", CONF)
    name = job["metadata"]["name"]
    started = time.monotonic()
    proc = site.run_mpijob(site.write(job, "two-hosts"), *site.mlflow_service())
    # While it runs, this machine's own namespace gets nothing: no link, no address, no route.
    wait_for(lambda: (site.workspace("two-hosts") / "model").exists() or proc.poll() is not None, 300,
             "training output", proc)
    assert host_links() <= links_before
    code, out, err = finish(proc)
    elapsed = time.monotonic() - started
    assert code == 0, err[-3000:] + out[-3000:]
    assert f"MPIJob {name} succeeded" in err

    model = site.workspace("two-hosts") / "model"
    summary = json.loads((model / "metrics.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 158
    assert f"{THREADS} torch threads" in out
    # Both ranks ran on their own host: each worker's sshd let the launcher in with the job's key.
    for i in range(2):
        assert f"[{name}-worker-{i}] Accepted publickey for root from 10.231.0.10" in out
    assert_bitwise_equal(model / "model.pt", reference)

    # The result came back through the tracking server on the job's network.
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{site.mlflow / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("nightly_retrain").experiment_id],
                                "tags.`nightshift.run_key` = 'nightly_retrain/two-hosts'")
    assert run.data.metrics["val_accuracy"] == pytest.approx(summary["val_accuracy"])
    assert json.loads((model / "mlflow_run.json").read_text())["run_id"] == run.info.run_id
    assert_nothing_left(proc.pid, links_before, str(site.workspace("two-hosts")))
    print(f"2 hosts: {elapsed:.1f}s end to end (MLflow service start included)")


def test_four_hosts_train_bit_for_bit_like_one_host(site: Site, links_before: set[str]) -> None:
    """Four ranks sum each gradient in an order that depends on where it lands in Horovod's fusion buffer,
    which depends on timing: two single-host runs already differ in the last bits. Without fusion
    (HOROVOD_FUSION_THRESHOLD=0, passed by horovodrun to every rank) the order is fixed, on any hosts."""
    conf = {**CONF, "workers": 4, "epochs": 1, "batch_size": 16}  # 20 steps: start-up dominates anyway
    job = without_mlflow(site.plan("four-hosts", conf))  # MLflow through the server: the 2-host test
    launcher(job)["env"].append({"name": "HOROVOD_FUSION_THRESHOLD", "value": "0"})
    ref = single_host_reference(job, site.home.parent / "reference-4")
    started = time.monotonic()
    proc = site.run_mpijob(site.write(job, "four-hosts"))
    code, out, err = finish(proc)
    assert code == 0, err[-3000:] + out[-3000:]
    summary = json.loads((site.workspace("four-hosts") / "model" / "metrics.json").read_text())
    assert summary["world_size"] == 4
    assert_bitwise_equal(site.workspace("four-hosts") / "model" / "model.pt", ref)
    assert_nothing_left(proc.pid, links_before, str(site.workspace("four-hosts")))
    print(f"4 hosts: {time.monotonic() - started:.1f}s end to end")


def test_a_killed_host_fails_the_job_naming_it_and_a_rerun_resumes_bit_for_bit(
        site: Site, reference: Path, links_before: set[str]) -> None:
    job = without_mlflow(site.plan("killed-host", CONF))
    name = job["metadata"]["name"]
    manifest = site.write(job, "killed-host")
    checkpoints = Path(trainer_arg(job, "--checkpoint-dir"))
    proc = site.run_mpijob(manifest)
    wait_for(lambda: checkpoints.exists() and any(checkpoints.glob("ckpt-*.pt")), 300, "checkpoint", proc)
    victims = subprocess.run(["ip", "netns", "pids", f"nsmj{proc.pid}-w1"], capture_output=True, text=True,
                             check=True).stdout.split()
    assert victims, "worker 1 runs nothing"
    for pid in victims:  # every process of the host: its sshd and its rank
        os.kill(int(pid), signal.SIGKILL)
    killed = time.monotonic()
    code, _, err = finish(proc)
    assert time.monotonic() - killed < 30
    assert code != 0
    assert f"lost host {name}-worker-1 (its processes are gone: killed by SIGKILL)" in err
    assert f"{name}-worker-0" not in err.splitlines()[-1]
    assert_nothing_left(proc.pid, links_before, str(site.workspace("killed-host")))

    again = site.run_mpijob(manifest)  # the operator's retry: the same job again
    code, out, err = finish(again)
    assert code == 0, err[-3000:]
    assert "resumed from checkpoint" in out and "at step 100/158" in out
    assert_bitwise_equal(site.workspace("killed-host") / "model" / "model.pt", reference)
    assert_nothing_left(again.pid, links_before, str(site.workspace("killed-host")))


def test_a_host_whose_link_goes_down_fails_the_job_within_the_gloo_timeout(
        site: Site, links_before: set[str]) -> None:
    job = without_mlflow(site.plan("link-down", CONF))
    name = job["metadata"]["name"]
    # horovodrun passes the launcher's env to every rank: 10 s for any Gloo operation to complete.
    launcher(job)["env"].append({"name": "HOROVOD_GLOO_TIMEOUT_SECONDS", "value": "10"})
    checkpoints = Path(trainer_arg(job, "--checkpoint-dir"))
    proc = site.run_mpijob(site.write(job, "link-down"))
    wait_for(lambda: checkpoints.exists() and any(checkpoints.glob("ckpt-*.pt")), 300, "checkpoint", proc)
    subprocess.run(["ip", "-n", f"nsmj{proc.pid}-sw", "link", "set", "v2", "down"], check=True)  # worker 1
    down = time.monotonic()
    code, _, err = finish(proc)
    took = time.monotonic() - down
    assert code != 0
    assert f"lost host {name}-worker-1 (its link is down (switch side))" in err
    assert took < 45, f"took {took:.0f}s after the link went down"
    assert_nothing_left(proc.pid, links_before, str(site.workspace("link-down")))


def _job(name: str, launcher_command: list[str], workers: int = 2) -> dict[str, Any]:
    """A small MPIJob of the trainer image's shape, for what needs no training."""
    worker = {"name": "worker", "image": "trainer", "command": ["/usr/sbin/sshd", "-De", "-f",
                                                                  "/home/mpiuser/.sshd_config"]}
    return {"apiVersion": "kubeflow.org/v2beta1", "kind": "MPIJob", "metadata": {"name": name},
            "spec": {"slotsPerWorker": 1, "sshAuthMountPath": "/home/mpiuser/.ssh", "mpiReplicaSpecs": {
                "Launcher": {"replicas": 1, "template": {"spec": {"containers": [
                    {"name": "launcher", "image": "trainer", "command": launcher_command}]}}},
                "Worker": {"replicas": workers, "template": {"spec": {"containers": [worker]}}}}}}


def test_pin_cpus_gives_each_worker_host_a_core_of_its_own(site: Site, links_before: set[str]) -> None:
    """Issue 35: --pin-cpus pins worker i's processes (sshd and every session it starts) to the i-th core; the
    launcher is not pinned."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("one core: nothing to pin apart")
    ask = "grep Cpus_allowed_list /proc/self/status"
    script = f"{ask} | sed 's/^/launcher /'; for w in 0 1; do ssh pinned-worker-$w \"{ask}\" | sed \"s/^/w$w /\"; done"
    job = _job("pinned", ["sh", "-c", f"pwd; {script}"])
    # Also: a workingDir that does not exist is created, as a container runtime does (here in the pod's fresh home)
    workdir = f"{pwd.getpwuid(0).pw_dir}/nightshift-test-workdir-{os.getpid()}"
    job["spec"]["mpiReplicaSpecs"]["Launcher"]["template"]["spec"]["containers"][0]["workingDir"] = workdir
    proc = site.run_mpijob(site.write(job, "pinned"), "--pin-cpus")
    code, out, err = finish(proc, timeout=120)
    assert code == 0, err
    assert f"[pinned-launcher] {workdir}\n" in out and not Path(workdir).exists()
    seen = dict(re.findall(r"\] (\w+) Cpus_allowed_list:\s+(\S+)", out))
    assert seen["w0"] == str(cores[0]) and seen["w1"] == str(cores[1]), out
    assert seen["launcher"] != seen["w0"], out  # every core this machine gives, not one
    assert f"--pin-cpus: pinned-worker-0 on core {cores[0]}, pinned-worker-1 on core {cores[1]}" in err
    assert_nothing_left(proc.pid, links_before)


def test_the_exit_status_is_the_launchers_and_a_failed_job_leaves_nothing(
        site: Site, links_before: set[str]) -> None:
    job = _job("fails", ["sh", "-c", "cat /etc/mpi/hostfile; echo 'ValueError: boom' >&2; exit 3"])
    proc = site.run_mpijob(site.write(job, "fails"))
    code, out, err = finish(proc, timeout=120)
    assert code == 3
    assert "[fails-launcher] fails-worker-1.fails-worker.default.svc slots=1" in out
    last = err.strip().splitlines()[-1]
    assert last.startswith("nightshift run-mpijob: MPIJob fails failed after ")
    assert last.endswith("s: launcher exit code 3; first error: ValueError: boom")
    assert_nothing_left(proc.pid, links_before)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_mid_job_stops_it_and_leaves_nothing(site: Site, links_before: set[str], signum: int) -> None:
    marker = f"600.{signum}7"  # `sleep 600.27`: a process only this test starts, over ssh on the workers
    job = _job("sleepy", ["horovodrun", "--gloo", "-np", "2", "--hostfile", "/etc/mpi/hostfile", "sleep", marker])
    proc = site.run_mpijob(site.write(job, f"sleepy-{signum}"))

    def ranks_running() -> bool:
        return all(processes_mentioning(f"sleep {marker}", pids=namespace_pids(f"nsmj{proc.pid}-w{i}"))
                   for i in (0, 1))

    wait_for(ranks_running, 120, "ranks on both workers", proc)
    proc.send_signal(signum)
    sent = time.monotonic()
    code, _, err = finish(proc, timeout=120)
    assert code == 128 + signum
    assert f"MPIJob sleepy stopped by {signal.Signals(signum).name}" in err
    assert time.monotonic() - sent < 30
    assert_nothing_left(proc.pid, links_before, f"sleep {marker}")



def test_a_job_past_its_timeout_is_stopped_and_leaves_nothing(site: Site, links_before: set[str]) -> None:
    job = _job("slow", ["horovodrun", "--gloo", "-np", "2", "--hostfile", "/etc/mpi/hostfile", "sleep", "600.31"])
    proc = site.run_mpijob(site.write(job, "slow"), "--timeout", "8")  # the last --timeout wins
    code, _, err = finish(proc, timeout=120)
    assert code == 124
    assert "MPIJob slow did not finish within 8s" in err.strip().splitlines()[-1]
    assert_nothing_left(proc.pid, links_before, "sleep 600.31")



def _netem() -> bool:
    if MISSING:
        return False
    from nightshift.mpijob_local.network import netem_available

    return netem_available()


NETEM = _netem()


def test_link_rate_limits_every_hosts_link(site: Site, links_before: set[str]) -> None:
    """--link-rate 100mbit: 8 MB from the launcher to a worker over ssh take at least 0.64 s.

    Also: an ssh session on a worker starts in a fresh home, not this machine's (root's ~/.bashrc here runs `pyenv
    init`, whose rehash waited 60 s on a lock file a killed session had left: this test once measured 0.1 MB/s)."""
    send = ("import subprocess, time; "
            "print('HOME', subprocess.run(['ssh', 'shaped-worker-0', 'ls -A ~'], capture_output=True, text=True, "
            "check=True).stdout.split()); t = time.perf_counter(); "
            "subprocess.run(['ssh', 'shaped-worker-0', 'cat > /dev/null'], input=bytes(8_000_000), check=True); "
            "print('MB/s', round(8 / (time.perf_counter() - t), 1))")
    job = _job("shaped", ["python", "-c", send], workers=1)
    proc = site.run_mpijob(site.write(job, "shaped"), "--link-rate", "100mbit")
    code, out, err = finish(proc, timeout=120)
    assert code == 0, err
    root_home = Path(pwd.getpwuid(0).pw_dir)
    bound = {".ssh"} | {p.relative_to(root_home).parts[0] for p in (
        Path(sys.prefix).resolve(), Path(sys.base_prefix).resolve(), Path(__file__).resolve().parents[2])
        if p.is_relative_to(root_home)}  # the Secret, and this machine's Python and checkout where they live
    listing = ast.literal_eval(out.split("HOME ")[1].splitlines()[0])
    assert set(listing) <= bound, (listing, bound)
    rate = float(out.split("MB/s ")[1].split()[0])
    assert 2 < rate <= 12.5, out  # 100 Mbit/s is 12.5 MB/s of frames; ssh's own overhead comes on top
    assert_nothing_left(proc.pid, links_before)


@pytest.mark.skipif(not NETEM, reason="this kernel has no netem qdisc (CONFIG_NET_SCH_NETEM)")
def test_link_delay_applies_on_the_way_into_every_host(site: Site, links_before: set[str]) -> None:
    """--link-delay 40: 40 ms into the worker, 40 ms back into the launcher; a TCP connect takes one RTT."""
    probe = ("import socket, time; t = time.perf_counter(); "
             "socket.create_connection(('delayed-worker-0', 22)).close(); "
             "print('connect ms', round((time.perf_counter() - t) * 1000))")
    job = _job("delayed", ["python", "-c", probe], workers=1)
    proc = site.run_mpijob(site.write(job, "delayed"), "--link-delay", "40")
    code, out, err = finish(proc, timeout=120)
    assert code == 0, err
    connect_ms = int(out.split("connect ms ")[1].split()[0])
    assert 80 <= connect_ms < 400, out
    assert_nothing_left(proc.pid, links_before)


@pytest.mark.skipif(NETEM, reason="this kernel has netem: --link-delay is tested for real")
def test_link_delay_is_refused_on_a_kernel_without_netem(site: Site, links_before: set[str]) -> None:
    proc = site.run_mpijob(site.write(_job("delayed", ["true"], workers=1), "delayed"), "--link-delay", "40")
    code, out, err = finish(proc, timeout=60)
    assert code == 2 and out == ""
    assert err.strip() == ("nightshift run-mpijob: --link-delay needs the kernel's netem qdisc "
                           "(CONFIG_NET_SCH_NETEM), which this kernel lacks; --link-rate (tbf) and --link-loss "
                           "(nftables) work without it")
    assert_nothing_left(proc.pid, links_before)


def _loss_available() -> bool:
    if MISSING:
        return False
    from nightshift.mpijob_local.network import nft_available

    return NETEM or nft_available()


lossy = pytest.mark.skipif(not _loss_available(), reason="--link-loss needs netem or nftables' nft "
                                                          "(apt-get install -y nftables)")

# In the launcher: a UDP receiver started on the worker over ssh counts what arrives of 2000 datagrams.
COUNT_DATAGRAMS = r"""
import shlex, socket, subprocess, sys, time
receiver = ("import socket, sys; s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.bind(('0.0.0.0', 9999)); "
            "s.settimeout(3); print('ready', flush=True); n = 0\n"
            "try:\n    while True: s.recv(64); n += 1\nexcept socket.timeout: print('got', n)")
proc = subprocess.Popen(["ssh", "lossy-worker-0", shlex.join([sys.executable, "-c", receiver])],
                        stdout=subprocess.PIPE, text=True)
assert proc.stdout.readline().strip() == "ready"
out = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
for i in range(2000):
    out.sendto(b"x" * 32, ("lossy-worker-0", 9999))
    if i % 50 == 49:
        time.sleep(0.005)  # no burst outruns the receiver's buffer: what is missing, the link dropped
print("received", proc.communicate(timeout=60)[0].split()[-1])
"""


@lossy
def test_link_loss_drops_that_share_of_the_packets_into_every_host(site: Site, links_before: set[str]) -> None:
    """--link-loss 20: about 400 of 2000 datagrams to a worker are lost (binomial sd 18; bounds at 11 sd)."""
    job = _job("lossy", ["python", "-c", COUNT_DATAGRAMS], workers=1)
    proc = site.run_mpijob(site.write(job, "lossy"), "--link-loss", "20")
    code, out, err = finish(proc, timeout=180)
    assert code == 0, err[-3000:]
    received = int(out.split("received ")[1].split()[0])
    assert 1400 <= received <= 1800, out
    assert_nothing_left(proc.pid, links_before)


@lossy
def test_training_over_a_lossy_link_completes_or_stops_at_its_timeout(site: Site, links_before: set[str]) -> None:
    """5% loss into every host: TCP retransmits under Gloo; the job ends by itself or at --timeout, never hangs."""
    job = without_mlflow(site.plan("lossy-train", {**CONF, "epochs": 1}))
    proc = site.run_mpijob(site.write(job, "lossy-train"), "--link-loss", "5", timeout=300)  # --timeout 240
    code, _, err = finish(proc, timeout=360)
    if code == 0:
        summary = json.loads((site.workspace("lossy-train") / "model" / "metrics.json").read_text())
        assert summary["world_size"] == 2
    else:
        assert code == 124, err[-3000:]
        assert "did not finish within 240s" in err.strip().splitlines()[-1]
    assert_nothing_left(proc.pid, links_before, str(site.workspace("lossy-train")))
    print(f"5% loss: exit {code}")
