"""An MPIJob manifest (kubeflow.org/v2beta1) read as the pods the MPI Operator would create for it.

Pure: a manifest dict and what this machine offers (volumes for claims, GPUs) go in, a `LocalJob` comes
out, or `ManifestNotSupported` naming the field that cannot be honoured here. The pods, names, files
(`/etc/mpi/hostfile`, `discover_hosts.sh`) and env added here are those of the MPI Operator v0.6, which this
module was written against; `deploy/README.md` installs v0.8.2, whose worker listing for elastic jobs
(`getRunningWorkerPods`) the runner follows, and whose launcher env has not been compared line by line:
workers are `<job>-worker-<i>` behind the headless Service
`<job>-worker`, the launcher is `<job>-launcher`.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any

from nightshift.mpijob_local.errors import ManifestNotSupported

API_VERSION = "kubeflow.org/v2beta1"
KIND = "MPIJob"
GPU_RESOURCE = "nvidia.com/gpu"
CONFIG_MOUNT_PATH = "/etc/mpi"
HOSTFILE = f"{CONFIG_MOUNT_PATH}/hostfile"
DISCOVER_HOSTS = f"{CONFIG_MOUNT_PATH}/discover_hosts.sh"
DEFAULT_SSH_AUTH_MOUNT_PATH = "/root/.ssh"
# The operator's worker command when the template gives neither command nor args.
DEFAULT_WORKER_COMMAND = ("/usr/sbin/sshd", "-De")
IMPLEMENTATIONS = ("OpenMPI", "Intel", "MPICH")
RESTART_POLICIES = ("Always", "OnFailure", "Never", "ExitCode")
DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]*")
# Pod-spec fields that change nothing on one machine (scheduling, image pulls, accounting).
IGNORED_POD_FIELDS = frozenset({
    "nodeSelector", "tolerations", "affinity", "serviceAccountName", "priorityClassName", "imagePullSecrets",
    "schedulerName", "terminationGracePeriodSeconds", "securityContext", "restartPolicy", "dnsPolicy",
    "topologySpreadConstraints", "automountServiceAccountToken", "enableServiceLinks", "runtimeClassName",
    "volumes", "containers",
})
IGNORED_CONTAINER_FIELDS = frozenset({
    "name", "image", "imagePullPolicy", "resources", "terminationMessagePolicy", "terminationMessagePath",
    "securityContext", "ports", "readinessProbe", "livenessProbe", "startupProbe", "command", "args", "env",
    "workingDir", "volumeMounts",
})


@dataclass(frozen=True)
class Mount:
    """A directory (or file) of this machine seen at `target` in a pod. `source` None: a fresh emptyDir."""

    target: str
    source: str | None
    read_only: bool = False
    kind: str = "claim"  # claim (a PersistentVolumeClaim's directory) | emptyDir | hostPath


@dataclass(frozen=True)
class PodSpec:
    """One pod: its name (also its hostname), what it runs and sees."""

    name: str
    role: str  # "launcher" | "worker"
    index: int  # worker index; -1 for the launcher
    argv: tuple[str, ...]
    env: tuple[tuple[str, str], ...]
    working_dir: str | None
    mounts: tuple[Mount, ...]
    gpus: int = 0
    image: str = ""
    # What the template gives, apart: empty both means the image's ENTRYPOINT and CMD (container runtimes).
    command: tuple[str, ...] = ()
    args: tuple[str, ...] = ()
    # securityContext (the container's over the pod's); None: the image's user.
    run_as_user: int | None = None
    run_as_group: int | None = None
    fs_group: int | None = None


@dataclass(frozen=True)
class LocalJob:
    """The pods of one MPIJob and what the operator writes for them."""

    name: str
    namespace: str
    slots_per_worker: int
    implementation: str
    ssh_auth_mount_path: str
    launcher: PodSpec
    workers: tuple[PodSpec, ...]
    active_deadline_seconds: int | None = None
    # The worker pods' restartPolicy, as the operator sets it from mpiReplicaSpecs.Worker.restartPolicy (default
    # Never; ExitCode becomes Never on the pod, the operator deciding instead).
    worker_restart_policy: str = "Never"

    @property
    def pods(self) -> tuple[PodSpec, ...]:
        return (self.launcher, *self.workers)

    @property
    def workers_service(self) -> str:
        return f"{self.name}-worker"

    def fqdn(self, pod: PodSpec) -> str:
        """The name the hostfile uses: `<pod>.<job>-worker.<namespace>.svc` (pod hostname + subdomain)."""
        return f"{pod.name}.{self.workers_service}.{self.namespace}.svc"

    def dns_names(self, pod: PodSpec) -> list[str]:
        """Every name a pod answers to: the operator's FQDN, the pre-v0.5 `<pod>.<job>.<ns>.svc`, the short name."""
        return [self.fqdn(pod), f"{pod.name}.{self.name}.{self.namespace}.svc", pod.name]

    def hostfile(self) -> str:
        """`/etc/mpi/hostfile` as the operator writes it for this job's MPI implementation."""
        lines = []
        for worker in self.workers:
            host = self.fqdn(worker)
            if self.implementation == "OpenMPI":
                lines.append(f"{host} slots={self.slots_per_worker}\n")
            else:
                lines.append(f"{host}:{self.slots_per_worker}\n")
        return "".join(lines)

    def discover_hosts(self, running: Iterable[str] | None = None) -> str:
        """`/etc/mpi/discover_hosts.sh` as the operator writes it: one `echo <fqdn>` per worker pod that is
        running (`running`: pod names; None: every worker), sorted by pod name, no slots."""
        names = {w.name for w in self.workers} if running is None else set(running)
        workers = sorted((w for w in self.workers if w.name in names), key=lambda w: w.name)
        return "#!/bin/sh\n" + "".join(f"echo {self.fqdn(w)}\n" for w in workers)

    @property
    def elastic(self) -> bool:
        """Whether the launcher runs an elastic horovodrun (see `is_elastic_launcher`)."""
        return is_elastic_launcher(self.launcher.argv)


def is_elastic_launcher(argv: Sequence[str]) -> bool:
    """The rule for an elastic job: a word of the launcher's command (or of a shell command string in it, as
    in `sh -c "..."`) is `horovodrun` (any directory), and a later word is `--host-discovery-script` (or
    `--host-discovery-script=...`). Such a job's workers may come and go: a lost worker does not fail it."""
    words: list[str] = []
    for arg in argv:
        try:
            words += shlex.split(arg) if any(c.isspace() for c in arg) else [arg]
        except ValueError:  # unbalanced quotes: not a shell command string
            words.append(arg)
    starts = [i for i, word in enumerate(words) if PurePosixPath(word).name == "horovodrun"]
    return bool(starts) and any(word == "--host-discovery-script" or word.startswith("--host-discovery-script=")
                                for word in words[starts[0] + 1:])


def _get(obj: Mapping[str, Any], key: str, kind: type, where: str, default: Any = None) -> Any:
    value = obj.get(key, default)
    if value is not None and not isinstance(value, kind):
        raise ManifestNotSupported(f"{where}.{key} must be a {kind.__name__}, got {type(value).__name__}")
    return value


def _volumes(pod: Mapping[str, Any], where: str, claims: Mapping[str, str]) -> dict[str, tuple[str | None, str]]:
    """Volume name → (directory on this machine (None: an emptyDir, made per pod), kind of volume)."""
    out: dict[str, tuple[str | None, str]] = {}
    for volume in _get(pod, "volumes", list, where, []) or []:
        name = volume.get("name")
        if "persistentVolumeClaim" in volume:
            claim = volume["persistentVolumeClaim"].get("claimName")
            if claim not in claims:
                raise ManifestNotSupported(
                    f"{where}: volume {name!r} mounts PersistentVolumeClaim {claim!r}; give it a directory "
                    f"with --volume {claim}=DIR")
            out[name] = (claims[claim], "claim")
        elif "emptyDir" in volume:
            out[name] = (None, "emptyDir")
        elif "hostPath" in volume:
            out[name] = (str(volume["hostPath"].get("path")), "hostPath")
        else:
            kinds = sorted(k for k in volume if k != "name")
            raise ManifestNotSupported(
                f"{where}: volume {name!r} ({', '.join(kinds) or 'no source'}) cannot be provided on this "
                f"machine; only persistentVolumeClaim (with --volume), emptyDir and hostPath can")
    return out


def _env(container: Mapping[str, Any], where: str) -> list[tuple[str, str]]:
    if container.get("envFrom"):
        raise ManifestNotSupported(f"{where}.envFrom (ConfigMaps/Secrets) cannot be provided on this machine")
    env = []
    for item in _get(container, "env", list, where, []) or []:
        name = item.get("name")
        if not isinstance(name, str) or not ENV_NAME.fullmatch(name):
            raise ManifestNotSupported(f"{where}.env: {name!r} is not a valid environment variable name")
        if "valueFrom" in item:
            raise ManifestNotSupported(f"{where}.env {name}: valueFrom cannot be resolved on this machine")
        value = item.get("value", "")
        env.append((name, value if isinstance(value, str) else str(value)))
    return env


def _gpus(container: Mapping[str, Any]) -> int:
    resources = container.get("resources") or {}
    asked = [int((resources.get(kind) or {}).get(GPU_RESOURCE, 0) or 0) for kind in ("limits", "requests")]
    return max(asked)


def _pod(template: Mapping[str, Any], *, where: str, name: str, role: str, index: int,
         claims: Mapping[str, str], operator_env: Sequence[tuple[str, str]]) -> PodSpec:
    spec = _get(template, "spec", dict, where) or {}
    where = f"{where}.spec"
    if spec.get("hostNetwork"):
        raise ManifestNotSupported(f"{where}.hostNetwork: pods on the host network cannot be emulated as hosts")
    for key in ("initContainers", "ephemeralContainers"):
        if spec.get(key):
            raise ManifestNotSupported(f"{where}.{key} are not run by run-mpijob; remove them to try the job here")
    unknown = sorted(set(spec) - IGNORED_POD_FIELDS)
    if unknown:
        raise ManifestNotSupported(f"{where}: field(s) {', '.join(unknown)} cannot be honoured on this machine")
    containers = _get(spec, "containers", list, where) or []
    if len(containers) != 1:
        raise ManifestNotSupported(f"{where}.containers: run-mpijob runs exactly one container per pod, "
                                   f"found {len(containers)}")
    container = containers[0]
    where = f"{where}.containers[0]"
    unknown = sorted(set(container) - IGNORED_CONTAINER_FIELDS - {"envFrom"})
    if unknown:
        raise ManifestNotSupported(f"{where}: field(s) {', '.join(unknown)} cannot be honoured on this machine")
    command = [str(a) for a in _get(container, "command", list, where, []) or []]
    args = [str(a) for a in _get(container, "args", list, where, []) or []]
    argv = command + args  # without a command, the trainer image's entrypoint just execs its args
    if not argv:
        if role != "worker":
            raise ManifestNotSupported(f"{where}: the launcher has neither command nor args")
        argv = list(DEFAULT_WORKER_COMMAND)
    volumes = _volumes(spec, where.rsplit(".containers", 1)[0], claims)
    mounts = []
    for mount in _get(container, "volumeMounts", list, where, []) or []:
        volume, target = mount.get("name"), str(mount.get("mountPath", ""))
        if volume not in volumes:
            raise ManifestNotSupported(f"{where}.volumeMounts: {volume!r} is not a volume of this pod")
        if not PurePosixPath(target).is_absolute():
            raise ManifestNotSupported(f"{where}.volumeMounts {volume}: mountPath {target!r} is not absolute")
        source, kind = volumes[volume]
        sub_path = mount.get("subPath")
        if sub_path:
            if PurePosixPath(sub_path).is_absolute() or ".." in PurePosixPath(sub_path).parts:
                raise ManifestNotSupported(f"{where}.volumeMounts {volume}: subPath {sub_path!r} leaves the volume")
            if source is None:
                raise ManifestNotSupported(f"{where}.volumeMounts {volume}: subPath of an emptyDir is not supported")
            source = str(PurePosixPath(source) / sub_path)
        mounts.append(Mount(target=target, source=source, read_only=bool(mount.get("readOnly", False)), kind=kind))
    working_dir = _get(container, "workingDir", str, where)
    if working_dir is not None and not PurePosixPath(working_dir).is_absolute():
        raise ManifestNotSupported(f"{where}.workingDir {working_dir!r} is not absolute")
    env = [*_env(container, where), *operator_env]
    pod_where = where.rsplit(".containers", 1)[0]
    pod_security = _get(spec, "securityContext", dict, pod_where) or {}
    container_security = _get(container, "securityContext", dict, where) or {}
    ids = {}
    for key in ("runAsUser", "runAsGroup"):  # the container's over the pod's; both must be valid
        pod_id, container_id = _id(pod_security, key, pod_where), _id(container_security, key, where)
        ids[key] = pod_id if container_id is None else container_id
    image = _get(container, "image", str, where) or ""
    return PodSpec(name=name, role=role, index=index, argv=tuple(argv), env=tuple(env),
                   working_dir=working_dir, mounts=tuple(mounts), gpus=_gpus(container), image=image,
                   command=tuple(command), args=tuple(args), run_as_user=ids["runAsUser"],
                   run_as_group=ids["runAsGroup"], fs_group=_id(pod_security, "fsGroup", pod_where))


def _id(security: Mapping[str, Any], key: str, where: str) -> int | None:
    value = security.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ManifestNotSupported(f"{where}.securityContext.{key} must be an integer >= 0, got {value!r}")
    return value


def _launcher_env(implementation: str, slots: int) -> list[tuple[str, str]]:
    """What the operator appends to the launcher's env (v0.6): role, MPI's hostfile settings, no GPUs."""
    env = [("K_MPI_JOB_ROLE", "launcher")]
    if implementation == "OpenMPI":
        env += [("OMPI_MCA_orte_keep_fqdn_hostnames", "true"), ("OMPI_MCA_orte_default_hostfile", HOSTFILE),
                ("OMPI_MCA_plm_rsh_args", "-o ConnectionAttempts=10"),
                ("OMPI_MCA_orte_set_default_slots", str(slots))]
    elif implementation == "Intel":
        env += [("I_MPI_HYDRA_HOST_FILE", HOSTFILE),
                ("I_MPI_HYDRA_BOOTSTRAP_EXEC_EXTRA_ARGS", "-o ConnectionAttempts=10"), ("I_MPI_PERHOST", str(slots))]
    else:
        env += [("HYDRA_HOST_FILE", HOSTFILE), ("HYDRA_LAUNCH_EXTRA_ARGS", "-o ConnectionAttempts=10")]
    return [*env, ("NVIDIA_VISIBLE_DEVICES", ""), ("NVIDIA_DRIVER_CAPABILITIES", "")]


def parse_job(manifest: Mapping[str, Any], *, claims: Mapping[str, str], gpus_available: int) -> LocalJob:
    """The pods `manifest` would get from the MPI Operator, or `ManifestNotSupported` naming what cannot be."""
    if manifest.get("apiVersion") != API_VERSION or manifest.get("kind") != KIND:
        raise ManifestNotSupported(
            f"not an MPIJob of {API_VERSION}: apiVersion {manifest.get('apiVersion')!r}, kind {manifest.get('kind')!r}")
    metadata = manifest.get("metadata") or {}
    name = metadata.get("name")
    if not isinstance(name, str) or not DNS_LABEL.fullmatch(name) or len(name) > 48:
        raise ManifestNotSupported(f"metadata.name {name!r} must be a DNS label of at most 48 characters")
    namespace = metadata.get("namespace") or "default"
    if not DNS_LABEL.fullmatch(str(namespace)):
        raise ManifestNotSupported(f"metadata.namespace {namespace!r} is not a DNS label")
    spec = manifest.get("spec") or {}
    where = f"MPIJob {name}: spec"
    implementation = spec.get("mpiImplementation", "OpenMPI")
    if implementation not in IMPLEMENTATIONS:
        raise ManifestNotSupported(f"{where}.mpiImplementation {implementation!r} is not one of {IMPLEMENTATIONS}")
    if spec.get("runLauncherAsWorker"):
        raise ManifestNotSupported(f"{where}.runLauncherAsWorker is not supported by run-mpijob")
    slots = spec.get("slotsPerWorker", 1)
    if isinstance(slots, bool) or not isinstance(slots, int) or slots < 1:
        raise ManifestNotSupported(f"{where}.slotsPerWorker must be an integer >= 1, got {slots!r}")
    ssh_path = spec.get("sshAuthMountPath", DEFAULT_SSH_AUTH_MOUNT_PATH)
    if not isinstance(ssh_path, str) or not PurePosixPath(ssh_path).is_absolute():
        raise ManifestNotSupported(f"{where}.sshAuthMountPath {ssh_path!r} is not an absolute path")
    replicas = spec.get("mpiReplicaSpecs") or {}
    unknown = sorted(set(replicas) - {"Launcher", "Worker"})
    if unknown or "Launcher" not in replicas or "Worker" not in replicas:
        raise ManifestNotSupported(f"{where}.mpiReplicaSpecs needs Launcher and Worker (and nothing else), "
                                   f"got {sorted(replicas)}")
    if replicas["Launcher"].get("replicas", 1) != 1:
        raise ManifestNotSupported(f"{where}.mpiReplicaSpecs.Launcher.replicas must be 1")
    count = replicas["Worker"].get("replicas", 1)
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ManifestNotSupported(f"{where}.mpiReplicaSpecs.Worker.replicas must be an integer >= 1, got {count!r}")
    restart_policy = replicas["Worker"].get("restartPolicy", "Never")
    if restart_policy not in RESTART_POLICIES:
        raise ManifestNotSupported(f"{where}.mpiReplicaSpecs.Worker.restartPolicy must be one of {RESTART_POLICIES}, "
                                   f"got {restart_policy!r}")
    run_policy = spec.get("runPolicy") or {}
    deadline = run_policy.get("activeDeadlineSeconds")

    launcher = _pod(replicas["Launcher"].get("template") or {}, where=f"{where}.mpiReplicaSpecs.Launcher.template",
                    name=f"{name}-launcher", role="launcher", index=-1, claims=claims,
                    operator_env=_launcher_env(implementation, slots))
    workers = tuple(
        _pod(replicas["Worker"].get("template") or {}, where=f"{where}.mpiReplicaSpecs.Worker.template",
             name=f"{name}-worker-{i}", role="worker", index=i, claims=claims,
             operator_env=[("K_MPI_JOB_ROLE", "worker")])
        for i in range(count))
    wanted = sum(pod.gpus for pod in (launcher, *workers))
    if wanted > gpus_available:
        per_pod = ", ".join(f"{p.name}: {p.gpus}" for p in (launcher, *workers) if p.gpus)
        raise ManifestNotSupported(
            f"MPIJob {name} asks for {wanted} {GPU_RESOURCE} ({per_pod}) but this machine has "
            f"{gpus_available} GPU(s); render it with gpus_per_worker=0 to try it on the CPU")
    return LocalJob(name=name, namespace=str(namespace), slots_per_worker=slots, implementation=implementation,
                    ssh_auth_mount_path=ssh_path, launcher=launcher, workers=workers,
                    active_deadline_seconds=deadline if isinstance(deadline, int) and deadline > 0 else None,
                    worker_restart_policy="Never" if restart_policy == "ExitCode" else restart_policy)
