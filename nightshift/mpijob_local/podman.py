"""`run-mpijob --runtime podman`: each pod a container of its template's image, inside its emulated host.

The emulated host stays the runner's (network namespace on the run's bridge, names in /etc/hosts); what runs
in it is `podman run --network ns:/run/netns/<pod's namespace>` of the pod's image, as the MPI Operator's
pod would be run by a kubelet:

- argv: the template's `command` replaces the image's ENTRYPOINT (and drops its CMD), `args` replace CMD;
  neither: the image's ENTRYPOINT and CMD;
- env: the image's ENV, then the template's env and the operator's, given through `--env-file` (a 0600
  file of the run's temporary directory: values never appear on a command line);
- user: `securityContext.runAsUser`/`runAsGroup` (the container's over the pod's), else the image's USER;
  `fsGroup` becomes a supplementary group;
- files: the operator's SSH Secret at `sshAuthMountPath` (a copy owned by the pod's user, 0700/0600, since
  sshd and ssh refuse keys with another owner or a wider mode), `/etc/mpi/hostfile` and
  `discover_hosts.sh` (launcher), the run's hosts file as `/etc/hosts`, the pod's name as its hostname;
- volumes: a claim (`--volume CLAIM=DIR`) is this machine's directory, seen in the pod through an
  *idmapped mount* that makes the directory's owner the pod's user: a non-root pod writes there as it
  would to a claim Kubernetes had given to its user (fsGroup), while on this machine every file it writes
  belongs to the directory's owner and nothing is chowned. Podman's own `:idmap` volume option needs an
  OCI runtime with idmapped mounts (runc >= 1.2, crun) and a user namespace for the container; the
  runc 1.1 that works here has neither, so run-mpijob makes the mount itself (open_tree, mount_setattr,
  move_mount; Linux >= 5.12 and a filesystem that supports it) and hands it to podman as a bind mount,
  which keeps the mapping. emptyDirs are directories of the run owned by the pod's user; hostPaths are
  bound as they are (Kubernetes changes nothing about them either).

Containers are named `nightshift-mpijob-<owner pid>-<pod>`: a run removes its own (`podman rm -f`) whatever
ends it, and the next run removes those of a run that was killed before it could.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import re
import shutil
import subprocess
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from nightshift.mpijob_local.errors import HostNotSuitable, ManifestNotSupported
from nightshift.mpijob_local.manifest import CONFIG_MOUNT_PATH, PodSpec

CONTAINER_PREFIX = "nightshift-mpijob-"
OWNER_LABEL = "nightshift.mpijob.owner"
_CONTAINER_NAME = re.compile(rf"^{CONTAINER_PREFIX}(\d+)-")
REPO_CONTAINERS_CONF = Path(__file__).resolve().parents[2] / "images" / "podman" / "containers.conf"
STOP_GRACE_S = 3


@dataclass(frozen=True)
class PodmanSettings:
    """How podman is run here: the containers.conf it reads (CONTAINERS_CONF) and the OCI runtime."""

    containers_conf: str | None = None
    oci_runtime: str | None = None

    @classmethod
    def from_environment(cls, containers_conf: str | None = None, oci_runtime: str | None = None,
                         environ: Mapping[str, str] | None = None) -> PodmanSettings:
        """Given values first, then NIGHTSHIFT_CONTAINERS_CONF / CONTAINERS_CONF / the repository's
        images/podman/containers.conf, and NIGHTSHIFT_OCI_RUNTIME."""
        env = os.environ if environ is None else environ
        conf = containers_conf or env.get("NIGHTSHIFT_CONTAINERS_CONF") or env.get("CONTAINERS_CONF")
        if not conf and REPO_CONTAINERS_CONF.is_file():
            conf = str(REPO_CONTAINERS_CONF)
        return cls(containers_conf=conf or None, oci_runtime=oci_runtime or env.get("NIGHTSHIFT_OCI_RUNTIME") or None)

    def command(self, *args: str) -> list[str]:
        return ["podman", *(["--runtime", self.oci_runtime] if self.oci_runtime else []), *args]

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        if self.containers_conf:
            env["CONTAINERS_CONF"] = self.containers_conf
        return env


def run_podman(settings: PodmanSettings, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """One podman command; a podman that hangs (past `timeout`) or cannot start is a failed command (exit 124 or
    127, its reason in stderr), never an exception that would cut a clean-up short."""
    argv = settings.command(*args)
    try:
        return subprocess.run(argv, capture_output=True, text=True, check=False, timeout=timeout,
                              env=settings.env(), stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return subprocess.CompletedProcess(argv, 124, "", f"podman {args[0]} did not answer within {timeout:.0f}s")
    except OSError as err:
        return subprocess.CompletedProcess(argv, 127, "", f"podman {args[0]} could not start: {err.strerror}")


# ---------------------------------------------------------------------------------------------- images
@dataclass(frozen=True)
class ImageConfig:
    """What `podman image inspect` says a container of the image runs, and as whom."""

    name: str
    entrypoint: tuple[str, ...] = ()
    cmd: tuple[str, ...] = ()
    user: str = ""
    working_dir: str = ""
    exposed_ports: tuple[int, ...] = ()
    passwd: str = ""  # the image's /etc/passwd, to find a named user's UID and primary group

    @classmethod
    def from_inspect(cls, name: str, inspect: Mapping[str, object], passwd: str = "") -> ImageConfig:
        config = inspect.get("Config") or {}
        assert isinstance(config, Mapping)
        ports = []
        for port in config.get("ExposedPorts") or {}:
            number, _, proto = str(port).partition("/")
            if number.isdigit() and proto in ("", "tcp"):
                ports.append(int(number))
        return cls(name=name, entrypoint=tuple(config.get("Entrypoint") or ()), cmd=tuple(config.get("Cmd") or ()),
                   user=str(config.get("User") or ""), working_dir=str(config.get("WorkingDir") or ""),
                   exposed_ports=tuple(sorted(ports)), passwd=passwd)


def inspect_image(settings: PodmanSettings, image: str) -> ImageConfig:
    """The image's config, from podman's local storage (nothing is pulled), with its /etc/passwd."""
    done = run_podman(settings, "image", "inspect", "--format", "json", image)
    if done.returncode != 0:
        raise HostNotSuitable(f"image {image} is not in podman's local storage (`podman image exists {image}` "
                              f"is false): build it first (make images) or load it with `podman load`")
    (inspected,) = json.loads(done.stdout)
    passwd = ""
    mounted = run_podman(settings, "image", "mount", image)
    if mounted.returncode == 0:
        try:
            with contextlib.suppress(OSError):
                passwd = (Path(mounted.stdout.strip()) / "etc" / "passwd").read_text(errors="replace")
        finally:
            run_podman(settings, "image", "unmount", image)
    return ImageConfig.from_inspect(image, inspected, passwd)


def pod_argv(spec: PodSpec, image: ImageConfig) -> tuple[list[str] | None, list[str], list[str]]:
    """(`--entrypoint` to give, or None to keep the image's; the args after the image; what the pod runs)."""
    if spec.command:
        return list(spec.command), list(spec.args), [*spec.command, *spec.args]
    args = list(spec.args) if spec.args else list(image.cmd)
    return None, list(spec.args), [*image.entrypoint, *args]


def runs_sshd(argv: Sequence[str]) -> bool:
    return any(PurePosixPath(a).name == "sshd" for a in argv)


def ready_port(spec: PodSpec, image: ImageConfig) -> int | None:
    """The port a worker running sshd is ready on: the image's one exposed port, else 22."""
    if spec.role != "worker" or not runs_sshd(pod_argv(spec, image)[2]):
        return None
    return image.exposed_ports[0] if len(image.exposed_ports) == 1 else 22


# ---------------------------------------------------------------------------------------------- users
@dataclass(frozen=True)
class PodUser:
    uid: int
    gid: int
    user_arg: str  # what `podman run --user` gets
    groups: tuple[int, ...] = ()  # supplementary (fsGroup)


def _passwd_entry(passwd: str, user: str) -> tuple[int, int] | None:
    for line in passwd.splitlines():
        parts = line.split(":")
        if len(parts) >= 4 and parts[2].isdigit() and parts[3].isdigit() and user in (parts[0], parts[2]):
            return int(parts[2]), int(parts[3])
    return None


def pod_user(spec: PodSpec, image: ImageConfig) -> PodUser:
    """Who the pod's process is: runAsUser/runAsGroup, else the image's USER (a name or UID[:GID]); a UID's
    primary group comes from the image's /etc/passwd (0 when it has none, as with Kubernetes)."""
    image_user, _, image_group = image.user.partition(":")
    groups = (spec.fs_group,) if spec.fs_group is not None else ()
    if spec.run_as_user is not None:
        uid = spec.run_as_user
        entry = _passwd_entry(image.passwd, str(uid))
    else:
        entry = _passwd_entry(image.passwd, image_user or "0")
        if image_user and not image_user.isdigit() and entry is None:
            raise ManifestNotSupported(f"pod {spec.name}: image {image.name} runs as user {image_user!r}, which "
                                       f"its /etc/passwd lacks; set securityContext.runAsUser")
        uid = entry[0] if entry else int(image_user or 0)
    if spec.run_as_group is not None:
        gid = spec.run_as_group
    elif spec.run_as_user is None and image_group:
        group_entry = image_group if image_group.isdigit() else None
        if group_entry is None:
            raise ManifestNotSupported(f"pod {spec.name}: image {image.name} names group {image_group!r}; set "
                                       f"securityContext.runAsGroup to its GID")
        gid = int(group_entry)
    else:
        gid = entry[1] if entry else 0
    return PodUser(uid=uid, gid=gid, user_arg=f"{uid}:{gid}", groups=groups)


# ---------------------------------------------------------------------------------------------- env
def env_file_text(env: Mapping[str, str], pod: str) -> str:
    """`--env-file` lines (KEY=VALUE, taken literally by podman); a value podman cannot carry is refused."""
    lines = []
    for key, value in env.items():
        if "\n" in value or "\r" in value or "\0" in value:
            raise ManifestNotSupported(f"pod {pod}: env {key} holds a line break, which --runtime podman cannot "
                                       f"pass (--env-file is one line per variable); use --runtime host")
        lines.append(f"{key}={value}\n")
    return "".join(lines)


# ---------------------------------------------------------------------------------------------- run argv
@dataclass(frozen=True)
class Volume:
    source: str
    target: str
    read_only: bool = False

    def arg(self) -> str:
        for path in (self.source, self.target):
            if ":" in path or "," in path:
                raise ManifestNotSupported(f"mount {self.source} -> {self.target}: a path with ':' or ',' "
                                           f"cannot be given to podman --volume")
        return f"{self.source}:{self.target}:{'ro' if self.read_only else 'rw'}"


@dataclass(frozen=True)
class ContainerPlan:
    """Everything `podman run` gets for one pod (what goes on its command line; env goes in a file)."""

    name: str
    owner: int
    namespace: str
    hostname: str
    image: str
    user: PodUser
    env_file: str
    volumes: tuple[Volume, ...]
    entrypoint: list[str] | None
    args: list[str]
    working_dir: str | None = None
    labels: Mapping[str, str] = field(default_factory=dict)

    def argv(self, settings: PodmanSettings) -> list[str]:
        argv = settings.command(
            "run", "--rm", "--pull", "never", "--name", self.name, "--label", f"{OWNER_LABEL}={self.owner}",
            "--network", f"ns:/run/netns/{self.namespace}", "--hostname", self.hostname, "--no-hosts",
            "--user", self.user.user_arg, "--env-file", self.env_file, "--stop-timeout", str(STOP_GRACE_S))
        for key, value in sorted(self.labels.items()):
            argv += ["--label", f"{key}={value}"]
        for group in self.user.groups:
            argv += ["--group-add", str(group)]
        for volume in self.volumes:
            argv += ["--volume", volume.arg()]
        if self.working_dir:
            argv += ["--workdir", self.working_dir]
        if self.entrypoint is not None:
            argv += ["--entrypoint", json.dumps(self.entrypoint)]
        return [*argv, self.image, *self.args]


def container_name(owner: int, pod: str) -> str:
    return f"{CONTAINER_PREFIX}{owner}-{pod}"


def secret_copy(secret: Path, directory: Path, user: PodUser) -> Path:
    """The SSH Secret as the pod's user may use it: a directory 0700 and files 0600, all owned by it (made
    afresh: the copy of a container `--chaos` restores replaces the dead one's)."""
    if directory.exists():
        shutil.rmtree(directory)
    directory.mkdir(mode=0o700)
    for item in sorted(secret.iterdir()):
        target = directory / item.name
        shutil.copyfile(item, target)
        target.chmod(0o600)
        os.chown(target, user.uid, user.gid)
    os.chown(directory, user.uid, user.gid)
    return directory


def plan_container(spec: PodSpec, image: ImageConfig, *, owner: int, namespace: str, pod_dir: Path,
                   hosts: Path, secret: Path, ssh_auth_mount_path: str, mpi_config: Path,
                   env: Mapping[str, str], claim_view: Mapping[str, str]) -> ContainerPlan:
    """The container of `spec`: its files are written into `pod_dir` (made here, 0700).

    A pod that `--chaos` restores gets its plan again, in the `pod_dir` of its dead container: the env file
    and the Secret's copy are written afresh, its emptyDirs are kept as they were (as the host runtime keeps
    them). `claim_view` maps a claim mount's source to the directory to bind instead (its idmapped view)."""
    if spec.gpus:
        raise ManifestNotSupported(f"pod {spec.name} asks for {spec.gpus} GPU(s): --runtime podman runs CPU "
                                   f"pods only here; use --runtime host or render it with gpus_per_worker=0")
    user = pod_user(spec, image)
    pod_dir.mkdir(mode=0o700, exist_ok=True)
    env_file = pod_dir / "env"
    env_file.unlink(missing_ok=True)
    fd = os.open(env_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(env_file_text(env, spec.name))
    volumes = [Volume(str(hosts), "/etc/hosts", read_only=True),
               Volume(str(secret_copy(secret, pod_dir / "ssh", user)), ssh_auth_mount_path, read_only=True)]
    if spec.role == "launcher":
        volumes.append(Volume(str(mpi_config), CONFIG_MOUNT_PATH, read_only=True))
    for k, mount in enumerate(spec.mounts):
        if mount.source is None:  # emptyDir: a fresh directory of this pod, its user's
            source = pod_dir / f"empty-{k}"
            if not source.is_dir():  # a restored pod finds its emptyDir as it was
                source.mkdir(mode=0o755)
                os.chown(source, user.uid, user.gid)
            volumes.append(Volume(str(source), mount.target, mount.read_only))
        else:
            volumes.append(Volume(claim_view.get(mount.source, mount.source), mount.target, mount.read_only))
    entrypoint, args = pod_argv(spec, image)[:2]
    return ContainerPlan(name=container_name(owner, spec.name), owner=owner, namespace=namespace,
                         hostname=spec.name, image=spec.image, user=user, env_file=str(env_file),
                         volumes=tuple(volumes), entrypoint=entrypoint, args=args, working_dir=spec.working_dir)


# ---------------------------------------------------------------------------------------------- idmapped mounts
_SYS_OPEN_TREE, _SYS_MOVE_MOUNT, _SYS_MOUNT_SETATTR = 428, 429, 442  # the same numbers on x86_64 and arm64
_OPEN_TREE_CLONE, _OPEN_TREE_CLOEXEC, _AT_RECURSIVE, _AT_EMPTY_PATH = 1, 0o2000000, 0x8000, 0x1000
_MOVE_MOUNT_F_EMPTY_PATH = 4
_MOUNT_ATTR_IDMAP = 0x00100000
_MNT_DETACH = 2
_AT_FDCWD = -100


class _MountAttr(ctypes.Structure):
    _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64), ("propagation", ctypes.c_uint64),
                ("userns_fd", ctypes.c_uint64)]


def _syscall(number: int, *args: object) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    result = int(libc.syscall(number, *args))
    if result < 0:
        errno = ctypes.get_errno()
        raise OSError(errno, os.strerror(errno))
    return result


def _userns_fd(uid_map: str, gid_map: str) -> int:
    """A user namespace with these maps (held by a short-lived process), as an open file descriptor."""
    holder = subprocess.Popen(["unshare", "--user", "--", "sh", "-c", "read _"], stdin=subprocess.PIPE,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        assert holder.stdin is not None
        own = os.readlink("/proc/self/ns/user")
        for _ in range(2000):  # until unshare has entered its namespace (it execs sh once it has)
            with contextlib.suppress(OSError):
                if os.readlink(f"/proc/{holder.pid}/ns/user") != own:
                    break
            if holder.poll() is not None:
                raise HostNotSuitable("`unshare --user` failed: this machine cannot make user namespaces")
            os.sched_yield()
        Path(f"/proc/{holder.pid}/uid_map").write_text(uid_map)
        Path(f"/proc/{holder.pid}/gid_map").write_text(gid_map)
        return os.open(f"/proc/{holder.pid}/ns/user", os.O_RDONLY | os.O_CLOEXEC)
    finally:
        if holder.stdin is not None:
            holder.stdin.close()
        holder.wait(timeout=30)


def idmap_maps(source_uid: int, source_gid: int, user: PodUser) -> tuple[str, str]:
    """/proc/PID/uid_map and gid_map lines of an idmapped mount on which the owner (uid, gid) of the
    source shows as the pod's user: a file stored as `source_uid` is the pod's `uid`, and back."""
    return f"{source_uid} {user.uid} 1\n", f"{source_gid} {user.gid} 1\n"


def idmapped_bind(source: str, target: Path, user: PodUser) -> None:
    """Mount `source` at `target` (made here) so that its owner is `user` there; nothing on disk changes."""
    info = os.stat(source)
    if 0 in (info.st_uid, info.st_gid):
        # Mapped to the pod's user, root's files would be the pod's to write: a setuid file it made there would
        # be setuid root on this machine.
        raise HostNotSuitable(
            f"the claim directory {source} is owned by root (uid {info.st_uid}, gid {info.st_gid}): a pod writing "
            f"it as user {user.uid} would write as root on this machine; give the claim a directory owned by a "
            f"non-root user (e.g. chown {user.uid}:{user.gid} {source}, the pod's user)")
    uid_map, gid_map = idmap_maps(info.st_uid, info.st_gid, user)
    target.mkdir(mode=0o755)
    userns = _userns_fd(uid_map, gid_map)
    tree = -1
    try:
        tree = _syscall(_SYS_OPEN_TREE, _AT_FDCWD, os.fsencode(source),
                        _OPEN_TREE_CLONE | _OPEN_TREE_CLOEXEC | _AT_RECURSIVE)
        attr = _MountAttr(_MOUNT_ATTR_IDMAP, 0, 0, userns)
        _syscall(_SYS_MOUNT_SETATTR, tree, b"", _AT_EMPTY_PATH | _AT_RECURSIVE, ctypes.byref(attr),
                 ctypes.sizeof(attr))
        _syscall(_SYS_MOVE_MOUNT, tree, b"", _AT_FDCWD, os.fsencode(str(target)), _MOVE_MOUNT_F_EMPTY_PATH)
    except OSError as err:
        raise HostNotSuitable(
            f"cannot make an idmapped mount of {source} (so that pod user {user.uid} may write it): "
            f"{err.strerror}; it needs Linux >= 5.12 and a filesystem with idmapped mounts (ext4, xfs, btrfs, "
            f"tmpfs >= 6.3); or give the claim a directory owned by UID {user.uid}") from None
    finally:
        for fd in (tree, userns):
            if fd >= 0:
                os.close(fd)


def mounts_under(directory: Path) -> list[str]:
    """Mount points at or below `directory`, deepest first."""
    points = []
    root = str(directory.resolve())
    with open("/proc/self/mountinfo", encoding="utf-8") as info:
        for line in info:
            raw = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), line.split()[4])
            if raw == root or raw.startswith(root + "/"):
                points.append(raw)
    return sorted(points, key=lambda p: -len(PurePosixPath(p).parts))


def unmount_all(directory: Path) -> list[str]:
    """Detach every mount below `directory`; those that stay (never expected)."""
    libc = ctypes.CDLL(None, use_errno=True)
    for point in mounts_under(directory):
        libc.umount2(os.fsencode(point), _MNT_DETACH)
    return mounts_under(directory)


def remove_tree(directory: Path) -> list[str]:
    """rm -r of a run's directory that never descends into a mount (a claim's view): what was left."""
    left = unmount_all(directory)
    if left:
        return [f"{directory} (still mounted: {', '.join(left)})"]
    shutil.rmtree(directory, ignore_errors=True)
    return [str(directory)] if directory.exists() else []


# ---------------------------------------------------------------------------------------------- preflight, clean-up
def missing(settings: PodmanSettings, images: Sequence[str]) -> list[str]:
    """What `--runtime podman` lacks here, each naming what to do (empty: nothing)."""
    if shutil.which("podman") is None:
        return ["`podman` not found: install it (apt-get install -y podman runc) or use --runtime host"]
    lacking = []
    if settings.oci_runtime and shutil.which(settings.oci_runtime) is None and not Path(settings.oci_runtime).is_file():
        lacking.append(f"OCI runtime `{settings.oci_runtime}` not found (apt-get install -y {settings.oci_runtime})")
    if settings.containers_conf and not Path(settings.containers_conf).is_file():
        lacking.append(f"containers.conf {settings.containers_conf} does not exist (--containers-conf, "
                       f"NIGHTSHIFT_CONTAINERS_CONF)")
    if lacking:
        return lacking
    for image in dict.fromkeys(images):
        if not image:
            lacking.append("a pod template names no image: --runtime podman runs each pod's image")
            continue
        done = run_podman(settings, "image", "exists", image)
        if done.returncode != 0:
            lacking.append(f"image {image} is not in podman's local storage: build it (make images) or "
                           f"`podman load` it; --runtime podman pulls nothing")
    return lacking


def list_containers(settings: PodmanSettings, timeout: float = 120) -> list[str] | None:
    """The names of run-mpijob's containers here; None when podman could not list them."""
    done = run_podman(settings, "ps", "-a", "--filter", f"name=^{CONTAINER_PREFIX}", "--format", "{{.Names}}",
                      timeout=timeout)
    return [line.strip() for line in done.stdout.splitlines() if line.strip()] if done.returncode == 0 else None


def remove_containers(settings: PodmanSettings, names: Sequence[str]) -> list[str]:
    """`podman rm -f` (SIGTERM, SIGKILL after STOP_GRACE_S); those that are still there."""
    if not names:
        return []
    done = run_podman(settings, "rm", "-f", "--ignore", "--time", str(STOP_GRACE_S), *names, timeout=60)
    listed = list_containers(settings, timeout=30)
    if listed is None:  # cannot tell: none is known to be gone unless rm said so
        return [] if done.returncode == 0 else list(names)
    present = set(listed)
    return [name for name in names if name in present]


def remove_stale_containers(settings: PodmanSettings, alive: Callable[[int], bool]) -> list[str]:
    """Containers of runs whose run-mpijob (the pid in their name) is gone."""
    if shutil.which("podman") is None:
        return []
    stale = []
    for name in list_containers(settings) or []:
        match = _CONTAINER_NAME.match(name)
        if match and not alive(int(match.group(1))):
            stale.append(name)
    left = set(remove_containers(settings, stale))
    return [name for name in stale if name not in left]
