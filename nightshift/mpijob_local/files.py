"""The files the MPI Operator and the trainer image give pods, written into a run's temporary directory.

- the SSH Secret (`id_rsa`, `id_rsa.pub`, `authorized_keys`: a fresh ECDSA P-521 key in PEM, as the
  operator generates) mounted at the job's `sshAuthMountPath`;
- `/etc/mpi/hostfile` and `/etc/mpi/discover_hosts.sh` (the operator's ConfigMap, launcher only; the
  launcher mounts their directory, so a `discover_hosts.sh` replaced by a rename (`replace_text`) is what it
  reads next, as a ConfigMap update reaches a pod);
- the sshd and ssh client configurations of `images/trainer` (`sshd_config`, `ssh_config`), adapted to
  pods that run as root here: `PermitRootLogin prohibit-password` where the image says `no` (it runs
  sshd as `mpiuser`), the Secret's absolute paths, no PID file;
- the hosts file every pod sees as `/etc/hosts`: each pod's DNS names and the run's services.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path

from nightshift.mpijob_local.errors import HostNotSuitable

SSH_PORT = 22


def write_ssh_secret(directory: Path) -> Path:
    """The operator's SSH Secret as files in `directory` (created); returns it."""
    directory.mkdir(mode=0o700)
    key = directory / "id_rsa"
    done = subprocess.run(["ssh-keygen", "-q", "-t", "ecdsa", "-b", "521", "-m", "PEM", "-N", "", "-C", "",
                           "-f", str(key)], capture_output=True, text=True, check=False, timeout=60)
    if done.returncode != 0:
        raise HostNotSuitable(f"ssh-keygen could not make the job's key pair: {done.stderr.strip()}")
    public = (directory / "id_rsa.pub").read_text()
    (directory / "authorized_keys").write_text(public)
    key.chmod(0o600)
    (directory / "id_rsa.pub").chmod(0o644)
    (directory / "authorized_keys").chmod(0o644)
    return directory


def sshd_config(ssh_auth_mount_path: str, env_path: str) -> str:
    """`images/trainer/sshd_config` for a worker that runs sshd as root."""
    return "\n".join([
        "# images/trainer/sshd_config, as nightshift run-mpijob runs it (pods run as root on this machine)",
        f"Port {SSH_PORT}",
        "PidFile none",
        f"HostKey {ssh_auth_mount_path}/id_rsa",
        f"AuthorizedKeysFile {ssh_auth_mount_path}/authorized_keys",
        "PubkeyAuthentication yes",
        "PasswordAuthentication no",
        "KbdInteractiveAuthentication no",
        "PermitRootLogin prohibit-password",
        "UsePAM no",
        "StrictModes no",
        "PrintMotd no",
        "AllowTcpForwarding no",
        "X11Forwarding no",
        f"SetEnv PATH={env_path} PYTHONUNBUFFERED=1",
        "",
    ])


def ssh_config(ssh_auth_mount_path: str) -> str:
    """`images/trainer/ssh_config` (with the Port line the image appends) for the launcher's ssh client."""
    return "\n".join([
        "# images/trainer/ssh_config, as nightshift run-mpijob runs it",
        "Host *",
        "    StrictHostKeyChecking no",
        "    UserKnownHostsFile /dev/null",
        "    LogLevel ERROR",
        f"    IdentityFile {ssh_auth_mount_path}/id_rsa",
        "    ConnectionAttempts 10",
        f"    Port {SSH_PORT}",
        "",
    ])


def hosts_file(entries: Sequence[tuple[str, Sequence[str]]]) -> str:
    """/etc/hosts: loopback, then one line per address with every name it answers to."""
    lines = ["127.0.0.1\tlocalhost", "::1\tlocalhost ip6-localhost ip6-loopback"]
    lines += [f"{ip}\t{' '.join(names)}" for ip, names in entries]
    return "\n".join(lines) + "\n"


def write_mpi_config(directory: Path, hostfile: str, discover_hosts: str) -> Path:
    """The operator's ConfigMap for the launcher: hostfile 0444, discover_hosts.sh 0555."""
    directory.mkdir()
    (directory / "hostfile").write_text(hostfile)
    (directory / "discover_hosts.sh").write_text(discover_hosts)
    (directory / "hostfile").chmod(0o444)
    (directory / "discover_hosts.sh").chmod(0o555)
    return directory


def replace_text(path: Path, text: str, mode: int) -> None:
    """Replace `path` at once: a temporary file beside it, then a rename, so a reader sees the old content or
    the new, never half of it. (Seen through a mount of its directory; a file-level bind mount would keep
    showing the old inode.)"""
    temporary = path.with_name(f".{path.name}.new")
    temporary.write_text(text)
    os.chmod(temporary, mode)
    os.replace(temporary, path)


def write_text(path: Path, text: str, mode: int = 0o644) -> Path:
    path.write_text(text)
    os.chmod(path, mode)
    return path


def image_env(python_bin: str, home: str, hostname: str) -> dict[str, str]:
    """What the trainer image's ENV gives every container, with this machine's Python first on PATH.

    OMP_WAIT_POLICY=PASSIVE is the emulator's, not the image's: emulated hosts share this machine's cores, and
    torch's OpenMP threads spinning in one host's ranks would take them from the others'. A pod's env overrides it.
    """
    return {
        "PATH": f"{python_bin}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        "HOME": home,
        "HOSTNAME": hostname,
        "LANG": "C.UTF-8",
        "PYTHONUNBUFFERED": "1",
        "PYTHONDONTWRITEBYTECODE": "1",
        "OMP_WAIT_POLICY": "PASSIVE",
    }


def merged_env(base: Mapping[str, str], pairs: Sequence[tuple[str, str]]) -> dict[str, str]:
    """Container env over the image env; a later duplicate wins, as in a pod."""
    env = dict(base)
    env.update(pairs)
    return env
