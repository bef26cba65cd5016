"""Run an MPIJob on this machine as the MPI Operator and the kubelets would, on emulated hosts.

Order of events, as on a cluster with `launcherCreationPolicy: WaitForWorkersReady`: the run's services
(`--service`), then the workers (sshd) start; once every one accepts TCP connections the launcher starts;
the job ends with the launcher, whose exit status is the job's. A worker whose main process dies is a
failed pod: its remaining processes are killed (the kubelet would tear the container down) and the job
fails, naming it.

Elastic jobs (the launcher runs `horovodrun ... --host-discovery-script ...`, see
`manifest.is_elastic_launcher`): as the MPI Operator does, `/etc/mpi/discover_hosts.sh` lists the worker pods
whose phase is Running, sorted by pod name, and is rewritten (atomically: a rename in the directory the launcher
mounts) whenever that set changes; each change is said on stderr. Running, as the kubelet has it: the pod's
container runs (whether or not its sshd listens yet, whatever its link), or it exited and the kubelet is to
restart it in place (the worker's restartPolicy OnFailure, or Always; after the kubelet's back-off, 10 s
doubling to 300 s). A worker whose container exits for good (restartPolicy Never) does not fail an elastic job:
it is dropped from the script and the launcher's exit decides (Horovod goes on with the hosts left while at
least `--min-np` slots remain; it blacklists, for its cool-down, a listed host it cannot start a process on).
`--chaos` (see `chaos.py`) kills, restores, and takes down or up the link of workers at set times from the
launcher's start; a kill is the container's exit on SIGKILL (restartPolicy decides what follows), a restore
starts the pod again in the same emulated host. With `--runtime podman` each
pod is a container of its image inside its emulated host (see `podman.py`); services stay processes of this
machine. There a chaos kill ends the pod's container (every process of its host dies), and a restore removes
the dead container and starts a new one of the pod (same name, host, files and mounts). Whatever happens
(success, failure, timeout, SIGINT/SIGTERM) every container, process, namespace, link and temporary file of the
run is removed before `run_mpijob` returns.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import pwd
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from types import FrameType
from typing import Any, TextIO

from nightshift.mpijob_local import files, network, podman
from nightshift.mpijob_local.chaos import ChaosEvent, parse_chaos
from nightshift.mpijob_local.errors import HostNotSuitable, ManifestNotSupported, MPIJobFailed, PodStartFailed
from nightshift.mpijob_local.manifest import CONFIG_MOUNT_PATH, DISCOVER_HOSTS, LocalJob, PodSpec, parse_job

POD_INIT = str(Path(__file__).with_name("pod_init.py"))
TEMP_PREFIX = "nightshift-mpijob-"
EXIT_TIMEOUT = 124
LOST_WORKER_GRACE_S = 15.0  # time the launcher gets to fail by itself once a worker pod died
DISCOVER_EVERY_S = 0.5  # how often an elastic job's running workers are looked at (Horovod reads every 1 s)
# The kubelet's back-off before it restarts a container in place (restartPolicy OnFailure/Always): 10 s, doubled
# at each restart, at most 300 s (kubernetes pkg/kubelet/kubelet.go: backOffPeriod, MaxContainerBackOff).
RESTART_BACKOFF_S = 10.0
RESTART_BACKOFF_MAX_S = 300.0
TAIL_LINES = 80
RUNTIMES = ("host", "podman")
_ERROR_LINE = re.compile(r"\b[\w.]*(Error|Exception|error)\b:? ")
_PROBE = """
import socket, sys, time
deadline = time.monotonic() + float(sys.argv[1])
pending = sys.argv[2:]
while True:
    left = []
    for target in pending:
        host, port = target.rsplit(":", 1)
        try:
            socket.create_connection((host, int(port)), timeout=1).close()
        except OSError:
            left.append(target)
    pending = left
    if not pending or time.monotonic() >= deadline:
        break
    time.sleep(0.2)
print(" ".join(pending))
sys.exit(1 if pending else 0)
"""


@dataclass(frozen=True)
class Service:
    """A process of this machine put on the job's network under a DNS name (e.g. an MLflow server)."""

    host: str
    port: int
    argv: tuple[str, ...]

    def __post_init__(self) -> None:
        if not re.fullmatch(r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?", self.host) or len(self.host) > 63:
            raise ManifestNotSupported(f"--service host {self.host!r} must be a DNS name of at most 63 characters")
        if not 0 < self.port < 65536:
            raise ManifestNotSupported(f"--service {self.host}: port {self.port} is out of range")
        if not self.argv:
            raise ManifestNotSupported(f"--service {self.host}: no command")


@dataclass(frozen=True)
class RunOptions:
    """How to run a job here: directories for its claims, links, limits, services."""

    claims: Mapping[str, str] = field(default_factory=dict)
    link: network.LinkShape = field(default_factory=network.LinkShape)
    timeout_s: float | None = None
    services: tuple[Service, ...] = ()
    ready_timeout_s: float = 120.0
    runtime: str = "host"  # host: the pods' commands run from this machine's disk | podman: their images
    podman: podman.PodmanSettings = field(default_factory=podman.PodmanSettings)
    chaos: str | None = None  # --chaos: a script of worker failures (chaos.py), checked against the job
    # --chaos-after: the chaos script's clock starts at the first launcher line matching this pattern (the job
    # reached a state, say its first step), not at the launcher's start: failures follow the job, not the machine
    chaos_after: str | None = None
    # --pin-cpus: worker i's processes on the i-th core this process may use (modulo their count), the launcher and
    # services unpinned: each emulated host computes on a core of its own, as a cluster host on its own devices
    pin_cpus: bool = False

    def __post_init__(self) -> None:
        if self.runtime not in RUNTIMES:
            raise ManifestNotSupported(f"--runtime {self.runtime!r} must be one of {', '.join(RUNTIMES)}")
        if self.pin_cpus and self.runtime != "host":
            raise ManifestNotSupported("--pin-cpus pins the host runtime's pods; with --runtime podman give the "
                                       "containers' cpusets in containers.conf instead, or leave --pin-cpus out")
        if self.chaos_after is not None:
            if self.chaos is None:
                raise ManifestNotSupported("--chaos-after starts the clock of a --chaos script: give --chaos too")
            try:
                re.compile(self.chaos_after)
            except re.error as err:
                raise ManifestNotSupported(f"--chaos-after {self.chaos_after!r} is not a regular expression "
                                           f"({err}); give a pattern of a launcher log line, e.g. 'step 10'") from err


@dataclass
class RunningPod:
    name: str
    role: str  # launcher | worker | service
    namespace: str
    slot: int
    ip: str
    dns_names: list[str]
    proc: subprocess.Popen[bytes] | None = None
    pump: threading.Thread | None = None
    tail: deque[str] = field(default_factory=lambda: deque(maxlen=TAIL_LINES))
    ready_port: int | None = None
    container: bool = False  # a podman container (its exit status is podman run's)
    net_pid: int | None = None  # a process in the pod's network namespace (to read its listening sockets)
    restored_at: float | None = None  # when --chaos restored it (or the kubelet restarted it), until it runs again
    back_by: str = "restore"  # what brought it back: a --chaos "restore" or the kubelet's "restart"
    restarts: int = 0  # in-place restarts of its container (restartPolicy OnFailure/Always)
    restart_at: float | None = None  # when the emulated kubelet restarts its exited container in place


class _Stopped(Exception):
    """SIGINT or SIGTERM arrived: stop the job and clean up."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def count_gpus() -> int:
    return len(glob.glob("/dev/nvidia[0-9]*"))


def _exit_text(code: int, container: bool = False) -> str:
    """How a pod's process ended; a container's 128+N (podman run's status) is a kill by signal N."""
    if container and code > 128:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(code - 128).name}"
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-code).name}"
    return f"exit code {code}"


def _first_error(lines: Sequence[str]) -> str:
    """The line a person should read first: a rank's error, else horovodrun's, else the last line."""
    errors = [line for line in lines if _ERROR_LINE.search(line)]
    ranks = [line for line in errors if ">:" in line]  # horovodrun prefixes rank output with [i]<stderr>:
    if ranks or errors:
        return (ranks or errors)[0].strip()
    return next((line.strip() for line in reversed(lines) if line.strip()), "no output")


def _is_sshd(argv: Sequence[str]) -> bool:
    return bool(argv) and PurePosixPath(argv[0]).name == "sshd"


def _sshd_config_path(argv: Sequence[str]) -> str | None:
    for i, arg in enumerate(argv[:-1]):
        if arg == "-f":
            return argv[i + 1]
    return None


def preflight(job: LocalJob, options: RunOptions, pod_path: str) -> None:
    """Refuse, with one line saying what to do, what this machine cannot run."""
    if os.geteuid() != 0:
        raise HostNotSuitable("run-mpijob needs root (network namespaces, mounts): run it as root or with sudo")
    needed = {"ip": "iproute2", "unshare": "util-linux", "ssh-keygen": "openssh-client"}
    if options.link.shaped:
        needed["tc"] = "iproute2"
    for tool, package in needed.items():
        if shutil.which(tool) is None:
            raise HostNotSuitable(f"`{tool}` not found: install {package} (apt-get install -y {package})")
    if options.link.delay_ms and not network.netem_available():
        raise HostNotSuitable("--link-delay needs the kernel's netem qdisc (CONFIG_NET_SCH_NETEM), which this "
                              "kernel lacks; --link-rate (tbf) and --link-loss (nftables) work without it")
    if options.link.loss_pct and not network.netem_available() and not network.nft_available():
        raise HostNotSuitable("--link-loss needs the kernel's netem qdisc or nftables: this kernel has no netem; "
                              "install nftables (apt-get install -y nftables)")
    for claim, directory in options.claims.items():
        if not Path(directory).is_dir():
            raise ManifestNotSupported(f"--volume {claim}={directory}: {directory} is not a directory")
    if options.runtime == "podman":
        lacking = podman.missing(options.podman, [pod.image for pod in job.pods])
        if lacking:
            raise HostNotSuitable(f"--runtime podman: {'; '.join(lacking)}")
        return
    for pod in job.pods:
        program = pod.argv[0]
        found = program if "/" in program else shutil.which(program, path=pod_path)
        if not found or not os.access(found, os.X_OK):
            package = " (apt-get install -y openssh-server)" if _is_sshd(pod.argv) else ""
            raise HostNotSuitable(f"pod {pod.name}: `{program}` not found on this machine{package}")
    if any(_is_sshd(w.argv) for w in job.workers) and shutil.which("ssh") is None:
        raise HostNotSuitable("`ssh` not found: install openssh-client (apt-get install -y openssh-client)")


def remove_stale_runs(podman_settings: podman.PodmanSettings | None = None) -> list[str]:
    """Namespaces and temporary directories of runs whose run-mpijob died without cleaning up; with
    `podman_settings` (a `--runtime podman` run) their containers too. A host-runtime run never calls podman."""
    removed = []
    if podman_settings is not None:
        removed += [f"container {n}" for n in podman.remove_stale_containers(podman_settings, network.pid_alive)]
    removed += network.remove_stale_namespaces()
    for path in glob.glob(os.path.join(tempfile.gettempdir(), f"{TEMP_PREFIX}*-*")):
        match = re.match(rf"{TEMP_PREFIX}(\d+)-", os.path.basename(path))
        if match and not network.pid_alive(int(match.group(1))):
            podman.remove_tree(Path(path))  # never into a claim's idmapped view: unmounted first
            removed.append(path)
    return removed


class LocalRun:
    """One run of a job: its temporary directory, network, pods; `close()` removes all of them."""

    def __init__(self, job: LocalJob, options: RunOptions, *, out: TextIO, err: TextIO,
                 chaos: Sequence[ChaosEvent] = ()) -> None:
        self.job, self.options, self.out, self.err = job, options, out, err
        self.chaos = deque(chaos)  # events still to come
        self.chaos_after = re.compile(options.chaos_after) if options.chaos_after is not None else None
        self.chaos_clock: float | None = None  # when the chaos script's clock started (--chaos-after: its line)
        self.listed: set[str] = {w.name for w in job.workers}  # the workers discover_hosts.sh lists
        self.gone: set[str] = set()  # workers whose death was handled (elastic: until restored)
        self.links_down: set[str] = set()  # workers whose link --chaos took down
        self.owner = os.getpid()
        self.tmp = Path(tempfile.mkdtemp(prefix=f"{TEMP_PREFIX}{self.owner}-"))
        self.net = network.Network(self.owner)
        self.pods: list[RunningPod] = []
        self.containers: list[str] = []  # names of the containers this run started (--runtime podman)
        self.images: dict[str, podman.ImageConfig] = {}
        self.claim_views: dict[tuple[str, int, int], str] = {}
        self.stop_signal: int | None = None
        self._write_lock = threading.Lock()
        self.python_bin = str(Path(sys.executable).parent)
        self.pod_path = files.image_env(self.python_bin, "/", "")["PATH"]

    # ------------------------------------------------------------------ set-up
    def say(self, message: str) -> None:
        with self._write_lock:
            self.err.write(f"run-mpijob: {message}\n")
            self.err.flush()

    def check_stop(self) -> None:
        if self.stop_signal is not None:
            raise _Stopped(self.stop_signal)

    def plan(self) -> None:
        """Namespaces, addresses and names for every pod and service."""
        entries: list[tuple[str, str, str, list[str]]] = [
            ("launcher", self.job.launcher.name, network.namespace_name(self.owner, "launcher"),
             self.job.dns_names(self.job.launcher))]
        for worker in self.job.workers:
            entries.append(("worker", worker.name, network.namespace_name(self.owner, "worker", worker.index),
                            self.job.dns_names(worker)))
        for i, service in enumerate(self.options.services):
            names = [service.host] + ([service.host.split(".")[0]] if "." in service.host else [])
            entries.append(("service", service.host, network.namespace_name(self.owner, "service", i), names))
        for slot, (role, name, namespace, names) in enumerate(entries):
            self.pods.append(RunningPod(name=name, role=role, namespace=namespace, slot=slot,
                                        ip=network.address(slot), dns_names=names))

    def create_network(self) -> None:
        self.net.create_switch()
        for pod in self.pods:
            self.check_stop()
            self.net.add_host(pod.namespace, pod.slot)
            if self.options.link.shaped:
                self.net.shape(pod.namespace, pod.slot, self.options.link)
            self.say(f"pod {pod.name}: {pod.ip} on {network.host_veth(pod.slot)} (netns {pod.namespace})")

    def write_files(self) -> None:
        job = self.job
        self.secret = files.write_ssh_secret(self.tmp / "ssh")
        self.mpi_config = files.write_mpi_config(self.tmp / "mpi", job.hostfile(), job.discover_hosts())
        self.hosts = files.write_text(self.tmp / "hosts", files.hosts_file([(p.ip, p.dns_names) for p in self.pods]))
        self.ssh_config = files.write_text(self.tmp / "ssh_config", files.ssh_config(job.ssh_auth_mount_path))
        self.sshd_config = files.write_text(self.tmp / "sshd_config",
                                            files.sshd_config(job.ssh_auth_mount_path, self.pod_path), 0o600)
        (self.tmp / "pods").mkdir()

    def _homes(self) -> tuple[str, list[str], list[str]]:
        """The image user's home (where its Secret is mounted); the homes the pod gets fresh (that one and root's,
        whose shell start-up files an ssh session runs); and the directories of this machine's Python inside them,
        which the pod sees read-only at the same paths.

        A pod never shares this machine's homes: an image brings its own, and the start-up files here (root's
        ~/.bashrc running `pyenv init`, whose rehash takes a lock file that a killed ssh session leaves behind, and
        every later session waits 60 s on) must not run in its ssh sessions. But a venv's bin/python is a link,
        often into a pyenv under root's home, which the MPI Operator's default sshAuthMountPath, /root/.ssh, makes
        the pods' home too: that installation (and a venv or this project's checkout inside a home) is bound over
        the fresh home, where the image would have it.
        """
        home = str(PurePosixPath(self.job.ssh_auth_mount_path).parent)
        where = {Path(sys.prefix).resolve(), Path(sys.base_prefix).resolve(),
                 Path(sys.executable).resolve().parent.parent, Path(self.python_bin).resolve().parent,
                 Path(__file__).resolve().parents[2]}  # and this project's code (an editable install)
        # A home is mounted over where it resolves to (a symlinked home: its target), and one holding this run's
        # own directory (TMPDIR under it) stays this machine's: the pods' scratch and views live in that directory.
        homes = {str(Path(h).resolve()) for h in (home, pwd.getpwuid(0).pw_dir)}
        fresh = sorted(h for h in homes
                       if h != "/" and Path(h) not in where and not self.tmp.resolve().is_relative_to(h))
        inside = sorted(p for p in where if any(p.is_relative_to(h) for h in fresh))
        outermost = [p for p in inside if not any(p != o and p.is_relative_to(o) for o in inside)]
        return home, fresh, [str(p) for p in outermost]

    def pod_spec(self, running: RunningPod, spec: PodSpec | None, service: Service | None) -> dict[str, Any]:
        directory = self.tmp / "pods" / running.name
        (directory / "scratch").mkdir(parents=True, exist_ok=True)  # exists for a pod --chaos restores
        hostname = files.write_text(directory / "hostname", f"{running.name}\n")
        mounts: list[dict[str, Any]] = [
            {"source": str(self.hosts), "target": "/etc/hosts", "read_only": True},
            {"source": str(hostname), "target": "/etc/hostname", "read_only": True},
        ]
        base = {"hostname": running.name, "scratch": str(directory / "scratch"), "mounts": mounts}
        if service is not None:
            env = {**os.environ, "HOSTNAME": running.name}
            return {**base, "tmpfs": [], "cwd": os.getcwd(), "env": env, "argv": list(service.argv)}
        assert spec is not None
        home, fresh_homes, interpreter = self._homes()
        mounts += [{"source": path, "target": path, "read_only": True} for path in interpreter]
        secret_targets = {self.job.ssh_auth_mount_path, os.path.join(pwd.getpwuid(0).pw_dir, ".ssh")}
        mounts += [{"source": str(self.secret), "target": t, "read_only": True} for t in sorted(secret_targets)]
        mounts.append({"source": str(self.ssh_config), "target": "/etc/ssh/ssh_config", "read_only": True})
        if spec.role == "launcher":
            mounts.append({"source": str(self.mpi_config), "target": CONFIG_MOUNT_PATH, "read_only": True})
        if _is_sshd(spec.argv):
            targets = {"/etc/ssh/sshd_config", _sshd_config_path(spec.argv) or "/etc/ssh/sshd_config"}
            mounts += [{"source": str(self.sshd_config), "target": t, "read_only": True} for t in sorted(targets)]
            mounts.append({"source": None, "target": "/run/sshd", "dir": True})
            running.ready_port = files.SSH_PORT
        for k, mount in enumerate(spec.mounts):
            source = mount.source
            if source is None:  # emptyDir: a directory of this pod only
                source = str(directory / f"empty-{k}")
                Path(source).mkdir(exist_ok=True)  # a restored pod finds its emptyDir as it was
            mounts.append({"source": source, "target": mount.target, "read_only": mount.read_only})
        env = files.merged_env(files.image_env(self.python_bin, home, running.name), spec.env)
        if spec.gpus:
            first = sum(p.gpus for p in self.job.pods[: self.job.pods.index(spec)])
            devices = ",".join(str(i) for i in range(first, first + spec.gpus))
            env.update({"CUDA_VISIBLE_DEVICES": devices, "NVIDIA_VISIBLE_DEVICES": devices})
        return {**base, "tmpfs": fresh_homes, "cwd": spec.working_dir or home, "env": env,
                "argv": list(spec.argv)}

    def image(self, spec: PodSpec) -> podman.ImageConfig:
        if spec.image not in self.images:
            self.images[spec.image] = podman.inspect_image(self.options.podman, spec.image)
        return self.images[spec.image]

    def claim_view(self, spec: PodSpec, user: podman.PodUser) -> dict[str, str]:
        """For each claim the pod writes: an idmapped view of its directory where the pod's user owns it."""
        views = {}
        for mount in spec.mounts:
            if mount.kind != "claim" or mount.source is None:
                continue
            info = os.stat(mount.source)
            if (info.st_uid, info.st_gid) == (user.uid, user.gid):
                continue  # already the pod user's
            key = (mount.source, user.uid, user.gid)
            if key not in self.claim_views:
                target = self.tmp / "claims" / str(len(self.claim_views))
                target.parent.mkdir(exist_ok=True)
                podman.idmapped_bind(mount.source, target, user)
                self.claim_views[key] = str(target)
            views[mount.source] = self.claim_views[key]
        return views

    def start_container(self, running: RunningPod, spec: PodSpec) -> None:
        """The pod as a container of its image, in its emulated host's network namespace."""
        image = self.image(spec)
        env = files.merged_env({"OMP_WAIT_POLICY": "PASSIVE"}, spec.env)
        user = podman.pod_user(spec, image)
        plan = podman.plan_container(
            spec, image, owner=self.owner, namespace=running.namespace, pod_dir=self.tmp / "pods" / running.name,
            hosts=self.hosts, secret=self.secret, ssh_auth_mount_path=self.job.ssh_auth_mount_path,
            mpi_config=self.mpi_config, env=env, claim_view=self.claim_view(spec, user))
        running.ready_port = podman.ready_port(spec, image)
        running.net_pid = None  # found in its namespace once the container runs (see is_running)
        if plan.name not in self.containers:  # a restored pod's container has the dead one's name
            self.containers.append(plan.name)
        running.proc = subprocess.Popen(plan.argv(self.options.podman), stdin=subprocess.DEVNULL,
                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
                                        env=self.options.podman.env())
        running.container = True
        running.pump = threading.Thread(target=self._pump, args=(running,), daemon=True,
                                        name=f"log-{running.name}")
        running.pump.start()

    def start_pod(self, running: RunningPod, spec: PodSpec | None = None, service: Service | None = None) -> None:
        self.check_stop()
        if spec is not None and self.options.runtime == "podman":
            self.start_container(running, spec)
            return
        spec_file = self.tmp / "pods" / f"{running.name}.json"
        spec_file.write_text(json.dumps(self.pod_spec(running, spec, service)))
        spec_file.chmod(0o600)
        argv = ["ip", "netns", "exec", running.namespace, "unshare", "--uts", "--mount", "--propagation",
                "private", "--", sys.executable, "-I", POD_INIT, str(spec_file)]
        core = self.core_of(running)
        if core is not None:  # inherited by every process the pod starts (sshd, its sessions, the ranks)
            argv = ["taskset", "--cpu-list", str(core), *argv]
        running.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, start_new_session=True)
        running.net_pid = running.proc.pid  # `ip netns exec`, `unshare` and pod_init exec the pod's command
        running.pump = threading.Thread(target=self._pump, args=(running,), daemon=True,
                                        name=f"log-{running.name}")
        running.pump.start()

    def core_of(self, running: RunningPod) -> int | None:
        """The core a worker pod is pinned to with --pin-cpus, else None."""
        if not self.options.pin_cpus or running.role != "worker":
            return None
        cores = sorted(os.sched_getaffinity(0))
        index = next(w.index for w in self.job.workers if w.name == running.name)
        return cores[index % len(cores)]

    def _pump(self, running: RunningPod) -> None:
        assert running.proc is not None and running.proc.stdout is not None
        writable = True
        for raw in iter(running.proc.stdout.readline, b""):
            line = raw.decode("utf-8", errors="replace").rstrip("\n")
            running.tail.append(line)
            if (running.role == "launcher" and self.chaos_after is not None and self.chaos_clock is None
                    and self.chaos_after.search(line)):
                self.chaos_clock = time.monotonic()
                self.say(f"chaos: the launcher printed a line matching --chaos-after {self.chaos_after.pattern!r}; "
                         f"the chaos script's clock starts")
            if not writable:
                continue  # keep draining: a pod must never block on a full pipe
            with self._write_lock:
                try:
                    self.out.write(f"[{running.name}] {line}\n")
                    self.out.flush()
                except (OSError, ValueError):  # our stdout went away (a closed pipe)
                    writable = False

    def probe(self, targets: Sequence[tuple[str, int]], wait_s: float) -> subprocess.Popen[str]:
        """TCP connects from inside the launcher's namespace (the view the launcher will have)."""
        argv = ["ip", "netns", "exec", self.pods[0].namespace, sys.executable, "-I", "-c", _PROBE, str(wait_s),
                *(f"{ip}:{port}" for ip, port in targets)]
        return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)

    def wait_ready(self, pods: Sequence[RunningPod], limit_s: float) -> None:
        waiting = [p for p in pods if p.ready_port]
        if not waiting:
            return
        probe = self.probe([(p.ip, p.ready_port or 0) for p in waiting], limit_s)
        try:
            while probe.poll() is None:
                self.check_stop()
                for pod in pods:
                    if pod.proc is not None and pod.proc.poll() is not None:
                        last = next((line for line in reversed(pod.tail) if line.strip()), "no output")
                        raise PodStartFailed(f"pod {pod.name} exited before it was ready "
                                             f"({_exit_text(pod.proc.returncode, pod.container)}): {last}")
                time.sleep(0.1)
        finally:
            if probe.poll() is None:
                probe.kill()
            stdout, _ = probe.communicate()
        if probe.returncode != 0:
            late = set(stdout.split())
            names = [f"{p.name} (port {p.ready_port})" for p in waiting if f"{p.ip}:{p.ready_port}" in late]
            raise PodStartFailed(f"not ready after {limit_s:.0f}s: {', '.join(names)}")

    # ------------------------------------------------------------------ the job
    def run(self) -> int:
        started = time.monotonic()
        limits = [t for t in (self.options.timeout_s, self.job.active_deadline_seconds) if t]
        deadline = started + min(limits) if limits else None
        self.plan()
        self.write_files()
        self.create_network()
        if self.options.pin_cpus:
            self.say("--pin-cpus: " + ", ".join(f"{p.name} on core {self.core_of(p)}" for p in self.pods
                                                if p.role == "worker"))
        by_name = {p.name: p for p in self.pods}
        services = [p for p in self.pods if p.role == "service"]
        for running, service in zip(services, self.options.services, strict=True):
            self.start_pod(running, service=service)
            running.ready_port = service.port
        for spec in self.job.workers:
            self.start_pod(by_name[spec.name], spec=spec)
        ready_s = self.options.ready_timeout_s
        if deadline is not None:
            ready_s = min(ready_s, max(deadline - time.monotonic(), 1.0))
        self.wait_ready([p for p in self.pods if p.role != "launcher"], ready_s)
        self.say(f"{len(self.job.workers)} worker(s) ready in {time.monotonic() - started:.1f}s; "
                 f"starting the launcher")
        launcher = by_name[self.job.launcher.name]
        workers = [by_name[w.name] for w in self.job.workers]
        if self.job.elastic:
            self.say(f"elastic job: {DISCOVER_HOSTS} lists the running workers; a lost worker does not fail it")
            self.refresh_discover_hosts(workers)
        self.start_pod(launcher, spec=self.job.launcher)
        assert launcher.proc is not None
        launched = time.monotonic()
        if self.chaos_after is None:
            self.chaos_clock = launched
        lost_at: float | None = None
        timed_out = False
        next_look = launched
        while launcher.proc.poll() is None:
            self.check_stop()
            now = time.monotonic()
            clock = self.chaos_clock
            while self.chaos and clock is not None and now - clock >= self.chaos[0].at_s:
                event = self.chaos.popleft()
                self.apply_chaos(event, by_name[event.pod], now - clock, workers)
            for worker in workers:
                if worker.proc is None or worker.proc.poll() is None or worker.name in self.gone:
                    continue
                self.gone.add(worker.name)
                how = _exit_text(worker.proc.returncode, worker.container)
                if self.job.elastic and self.restarts_in_place(worker.proc.returncode):
                    network.kill_namespaces([worker.namespace], grace_s=0)
                    self.say(f"worker {worker.name} stopped ({how}): {self.schedule_restart(worker, now)}")
                    self.refresh_discover_hosts(workers)
                elif self.job.elastic:
                    self.say(f"worker {worker.name} stopped ({how}): elastic job, its pod failed (restartPolicy "
                             f"{self.job.worker_restart_policy}): it is dropped from discover_hosts.sh and the "
                             f"launcher's exit decides")
                    network.kill_namespaces([worker.namespace], grace_s=0)
                    self.refresh_discover_hosts(workers)
                elif lost_at is None:
                    lost_at = now
                    self.say(f"worker {worker.name} stopped ({how}): the job fails")
                    network.kill_namespaces([worker.namespace], grace_s=0)
            for worker in workers:
                if worker.restart_at is not None and now >= worker.restart_at:
                    self.restart_in_place(worker)
            if self.job.elastic and now >= next_look:
                next_look = now + DISCOVER_EVERY_S
                self.refresh_discover_hosts(workers)
                self.say_running_again(workers)
            if lost_at is not None and now - lost_at > LOST_WORKER_GRACE_S:
                network.kill_namespaces([launcher.namespace], grace_s=10)
            elif deadline is not None and now > deadline:
                timed_out = True
                network.kill_namespaces([launcher.namespace], grace_s=10)
            time.sleep(0.1)
        code = launcher.proc.returncode
        elapsed = time.monotonic() - started
        if self.chaos:
            started_at = ("its clock never started (no launcher line matched --chaos-after)"
                          if self.chaos_clock is None else f"at {time.monotonic() - self.chaos_clock:.1f}s")
            self.say(f"chaos: {len(self.chaos)} event(s) not run, the launcher ended first {started_at}: "
                     f"{'; '.join(e.text for e in self.chaos)}")
        if timed_out:
            raise MPIJobFailed(f"MPIJob {self.job.name} did not finish within {min(limits):.0f}s "
                               f"(--timeout / activeDeadlineSeconds); its pods were stopped", EXIT_TIMEOUT)
        if code == 0 and lost_at is None:
            self.say(f"MPIJob {self.job.name} succeeded in {elapsed:.1f}s")
            return 0
        lost = self.lost_workers(workers)
        what = f"lost {'; '.join(lost)}" if lost else f"first error: {_first_error(launcher.tail)[-300:]}"
        raise MPIJobFailed(f"MPIJob {self.job.name} failed after {elapsed:.1f}s: launcher "
                           f"{_exit_text(code, launcher.container)}; {what}", code if code > 0 else 1)

    # ------------------------------------------------------------------ elastic jobs and --chaos
    def is_running(self, worker: RunningPod) -> bool:
        """Pod phase Running, the MPI Operator's rule for discover_hosts.sh (kubeflow/mpi-operator,
        pkg/controller/mpi_job_controller.go, getRunningWorkerPods: `pod.Status.Phase == corev1.PodRunning`): its
        container runs, or has exited and the kubelet is to restart it in place (the pod stays Running). Not
        whether its sshd listens yet, nor its link: Horovod finds those out by itself, and blacklists the host."""
        if worker.restart_at is not None:
            return True
        if worker.name in self.gone:  # its death was handled (a podman run client may outlive its container)
            return False
        return worker.proc is not None and worker.proc.poll() is None

    def accepts_connections(self, worker: RunningPod) -> bool:
        """Its main process is alive and, for an sshd worker, its port listens in its emulated host."""
        if worker.proc is None or worker.proc.poll() is not None:
            return False
        if not worker.ready_port:
            return True
        if worker.net_pid is None or not network.pid_alive(worker.net_pid):
            pids = network.namespace_pids(worker.namespace)
            worker.net_pid = pids[0] if pids else None
        return worker.net_pid is not None and network.listening(worker.net_pid, worker.ready_port,
                                                                 f"/run/netns/{worker.namespace}")

    def say_running_again(self, workers: Sequence[RunningPod]) -> None:
        for worker in workers:
            if worker.restored_at is not None and self.accepts_connections(worker):
                self.say(f"worker {worker.name} runs again, {time.monotonic() - worker.restored_at:.1f}s after "
                         f"its {worker.back_by}")
                worker.restored_at = None

    def restarts_in_place(self, code: int) -> bool:
        """Whether the kubelet restarts an exited worker container in its pod (restartPolicy)."""
        policy = self.job.worker_restart_policy
        return policy == "Always" or (policy == "OnFailure" and code != 0)

    def schedule_restart(self, worker: RunningPod, now: float) -> str:
        delay = min(RESTART_BACKOFF_S * 2 ** worker.restarts, RESTART_BACKOFF_MAX_S)
        worker.restart_at = now + delay
        return (f"restartPolicy {self.job.worker_restart_policy}: the kubelet restarts its container in place in "
                f"{delay:.0f}s (restart {worker.restarts + 1}); its pod stays Running, listed in discover_hosts.sh")

    def start_again(self, worker: RunningPod, back_by: str) -> str | None:
        """Start a dead worker's pod again in its host (a --chaos restore, or the kubelet's in-place restart):
        its dead container removed first; what could not be removed, else None once it is started."""
        left = self.remove_dead_container(worker) if worker.container else None
        if left:
            return left
        if worker.pump is not None:
            worker.pump.join(timeout=5)
        spec = next(w for w in self.job.workers if w.name == worker.name)
        worker.tail.clear()
        self.start_pod(worker, spec=spec)
        worker.restored_at = time.monotonic()
        worker.restart_at = None
        worker.back_by = back_by
        self.gone.discard(worker.name)
        return None

    def restart_in_place(self, worker: RunningPod) -> None:
        left = self.start_again(worker, "restart")
        if left:
            worker.restart_at = time.monotonic() + RESTART_BACKOFF_S
            self.say(f"worker {worker.name} not restarted: {left}; trying again in {RESTART_BACKOFF_S:.0f}s")
            return
        worker.restarts += 1
        self.say(f"worker {worker.name}: the kubelet restarted its container in place (restart {worker.restarts})")

    def refresh_discover_hosts(self, workers: Sequence[RunningPod], event: str | None = None) -> None:
        """Rewrite discover_hosts.sh when the set of running workers changed, and say so (after `event`, on
        its line, when one caused it)."""
        running = {w.name for w in workers if self.is_running(w)}
        if running == self.listed:
            if event:
                self.say(f"{event}; discover_hosts.sh lists {len(running)} worker(s), unchanged")
            return
        added, dropped = sorted(running - self.listed), sorted(self.listed - running)
        self.listed = running
        files.replace_text(self.mpi_config / "discover_hosts.sh", self.job.discover_hosts(running), 0o555)
        change = [f"+{n}" for n in added] + [f"-{n}" for n in dropped]
        self.say(f"{event + '; ' if event else ''}discover_hosts.sh lists {len(running)} worker(s) "
                 f"({', '.join(change)}): {', '.join(sorted(running)) or 'none'}")

    def apply_chaos(self, event: ChaosEvent, worker: RunningPod, at_s: float, workers: Sequence[RunningPod]) -> None:
        what = f"chaos at {at_s:.1f}s ({event.text})"
        if event.action == "kill":
            pids = network.namespace_pids(worker.namespace)
            network.kill_namespaces([worker.namespace], grace_s=0)  # returns once none is left
            said = f"{what}: killed {worker.name} ({len(pids)} process(es), SIGKILL)"
            if worker.container:
                # Its container has exited; `podman run --rm` removing it takes seconds more (under load): not
                # waited for here, the job goes on (a restore waits for it, see remove_dead_container).
                said += f"; its container {podman.container_name(self.owner, worker.name)} exited"
            elif worker.proc is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    worker.proc.wait(timeout=10)
            if self.job.elastic:
                self.gone.add(worker.name)  # said here, not as a worker that stopped by itself
                if self.restarts_in_place(-signal.SIGKILL):
                    said += f"; {self.schedule_restart(worker, time.monotonic())}"
        elif event.action == "restore":
            if worker.restart_at is None and worker.proc is not None and worker.proc.poll() is None:
                self.say(f"{what}: not restored: it runs (the kubelet restarted it in place)")
                return
            left = self.start_again(worker, "restore")
            if left:
                self.say(f"{what}: not restored: {left}")
                return
            new = f" as a new container {podman.container_name(self.owner, worker.name)}" if worker.container else ""
            said = (f"{what}: restored {worker.name}{new} in its host {worker.namespace} ({worker.ip}), listed "
                    f"again as its pod runs")
        else:
            up = event.action == "up"
            self.net.set_link(worker.slot, up)
            (self.links_down.discard if up else self.links_down.add)(worker.name)
            said = f"{what}: link of {worker.name} ({network.host_veth(worker.slot)} in {self.net.switch}) is " \
                   f"{event.action}"
        if self.job.elastic:
            self.refresh_discover_hosts(workers, said)
        else:  # a killed worker fails the job, naming it, as any lost worker does
            self.say(said)

    def remove_dead_container(self, worker: RunningPod) -> str | None:
        """Before a restore: the pod's dead container gone (`podman run --rm` removes it as it ends; a `podman
        run` still there is stopped), so that its name is free; what could not be removed, else None."""
        name = podman.container_name(self.owner, worker.name)
        network.kill_namespaces([worker.namespace], grace_s=0)  # processes a restore must not find in its host
        if worker.proc is not None and worker.proc.poll() is None:
            try:
                worker.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                worker.proc.kill()
                worker.proc.wait()
        if podman.remove_containers(self.options.podman, [name]):
            return f"its dead container {name} is still there (podman rm -f {name} failed)"
        return None

    def lost_workers(self, workers: Sequence[RunningPod]) -> list[str]:
        """Workers that died, whose link is down, or that the launcher's namespace cannot reach."""
        probe = self.probe([(w.ip, w.ready_port) for w in workers if w.ready_port], 2.0)
        unreachable = set(probe.communicate(timeout=30)[0].split())
        lost = []
        for worker in workers:
            why = []
            if worker.proc is not None and worker.proc.poll() is not None:
                why.append(f"its processes are gone: {_exit_text(worker.proc.returncode, worker.container)}")
            state = self.net.link_state(worker.namespace, worker.slot)
            if state != "up":
                why.append(f"its link is {state}")
            elif not why and f"{worker.ip}:{worker.ready_port}" in unreachable:
                why.append("unreachable from the launcher")
            if why:
                lost.append(f"host {worker.name} ({', '.join(why)})")
        return lost

    # ------------------------------------------------------------------ clean-up
    def close(self) -> list[str]:
        """Remove the containers, stop every process, delete namespaces (and their links), unmount the claims'
        views, remove the temporary directory."""
        left: list[str] = []
        # Each step whatever the one before did: a podman that fails or hangs must not keep the namespaces, the
        # claims' views or the temporary directory here.
        try:
            left += [f"container {name}" for name in podman.remove_containers(self.options.podman, self.containers)]
        except Exception as err:
            left.append(f"containers {', '.join(self.containers)} ({err})")
        try:
            left += self.net.close()
        except Exception as err:
            left.append(f"network ({err})")
        for pod in self.pods:
            if pod.proc is not None:
                try:
                    pod.proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    pod.proc.kill()
                    pod.proc.wait()
                    left.append(f"pod {pod.name}: pid {pod.proc.pid} needed SIGKILL")
            if pod.pump is not None:
                pod.pump.join(timeout=5)
        left += podman.remove_tree(self.tmp)
        return left


@contextlib.contextmanager
def _stop_on_signals(run: LocalRun) -> Iterator[None]:
    """SIGINT/SIGTERM set a flag the run checks; the previous handlers come back afterwards."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: FrameType | None) -> None:
        run.stop_signal = signum

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def run_mpijob(manifest: Mapping[str, Any], options: RunOptions, *, out: TextIO | None = None,
               err: TextIO | None = None) -> int:
    """Run `manifest` on emulated hosts; 0 on success, else raises `MPIJobFailed` (exit code inside)."""
    out = out or sys.stdout
    err = err or sys.stderr
    job = parse_job(manifest, claims=options.claims, gpus_available=count_gpus())
    chaos = parse_chaos(options.chaos, job) if options.chaos is not None else ()
    pod_path = files.image_env(str(Path(sys.executable).parent), "/", "")["PATH"]
    preflight(job, options, pod_path)
    for name in remove_stale_runs(options.podman if options.runtime == "podman" else None):
        err.write(f"run-mpijob: removed {name}, left by a run that did not clean up\n")
    run = LocalRun(job, options, out=out, err=err, chaos=chaos)
    with _stop_on_signals(run):
        try:
            return run.run()
        except _Stopped as stopped:
            raise MPIJobFailed(f"MPIJob {job.name} stopped by {stopped}; its pods were removed",
                               128 + stopped.signum) from None
        finally:
            left = run.close()
            if left:
                err.write(f"run-mpijob: could not remove: {'; '.join(left)}\n")
