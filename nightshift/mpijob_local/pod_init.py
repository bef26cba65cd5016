"""Inside a pod's fresh UTS and mount namespaces: set the hostname, mount what the pod sees, exec its command.

Run by run-mpijob as `python -I pod_init.py SPEC.json` under `ip netns exec NS unshare --uts --mount
--propagation private`; standard library only, so it starts fast and needs nothing installed. SPEC holds
`hostname`, `scratch` (a directory this pod mounts a private tmpfs on), `tmpfs` (paths that get a fresh
tmpfs: the pod's homes; a mount whose source lies under one sees it as it was), `mounts` (`source`,
`target`, `dir`, `read_only`: bind mounts; a `source` of null only makes sure `target` exists), `cwd`, `env` and `argv`.

A mount target this machine lacks (`/etc/mpi`, `/home/mpiuser/.ssh`, `/run/sshd`) is created in an
overlay of its nearest existing parent directory whose upper layer is the pod's tmpfs: the pod sees the
directory, this machine's filesystem is not written. Every mount vanishes with the pod's last process.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import socket
import sys
from pathlib import Path

MS_RDONLY = 1
MS_REMOUNT = 32
MS_BIND = 4096
MS_REC = 16384

_libc = ctypes.CDLL(None, use_errno=True)


class PodSetupError(Exception):
    """A mount or the exec of the pod's command failed; the message names the path."""


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    rc = _libc.mount(source.encode() if source else None, target.encode(), fstype.encode() if fstype else None,
                     flags, data.encode() if data else None)
    if rc != 0:
        err = ctypes.get_errno()
        raise PodSetupError(f"mount {source or fstype} on {target}: {os.strerror(err)}")


def _mount_points() -> list[str]:
    points = []
    with open("/proc/self/mountinfo", encoding="utf-8") as info:
        for line in info:
            raw = line.split()[4]
            points.append(re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), raw))
    return points


class PodFilesystem:
    """The pod's view: overlays that add missing mount points, then tmpfs and bind mounts."""

    def __init__(self, scratch: Path) -> None:
        self.scratch = scratch
        self.overlays: list[Path] = []
        self.private: list[Path] = []  # this pod's own tmpfs mounts (its fresh homes): written directly
        _mount("tmpfs", str(scratch), "tmpfs", 0, "mode=0755")

    def _overlay(self, lower: Path) -> None:
        if lower == Path("/") or self.scratch.is_relative_to(lower):
            raise PodSetupError(f"cannot add a mount point under {lower}: create the missing directory on "
                                f"this machine first")
        k = len(self.overlays)
        below = [Path(p) for p in _mount_points() if Path(p) != lower and Path(p).is_relative_to(lower)]
        stage = self.scratch / f"stage{k}"
        if below:  # an overlay hides the mounts below its lower dir: keep a view and bind them back after
            stage.mkdir()
            _mount(str(lower), str(stage), None, MS_BIND | MS_REC)
        upper, work = self.scratch / f"upper{k}", self.scratch / f"work{k}"
        upper.mkdir()
        work.mkdir()
        _mount("overlay", str(lower), "overlay", 0, f"lowerdir={lower},upperdir={upper},workdir={work}")
        for point in sorted(below, key=lambda p: len(p.parts)):
            if not any(point != other and point.is_relative_to(other) for other in below):
                _mount(str(stage / point.relative_to(lower)), str(point), None, MS_BIND | MS_REC)
        self.overlays.append(lower)

    def ensure(self, target: Path, is_dir: bool) -> None:
        """Make `target` exist in this pod's view without writing this machine's filesystem."""
        if target.exists():
            return
        parent = target.parent
        while not parent.exists():
            parent = parent.parent
        if not any(parent.is_relative_to(o) for o in [*self.overlays, *self.private]):
            self._overlay(parent)
        if is_dir:
            target.mkdir(parents=True, exist_ok=True)
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.touch()

    def keep(self, source: Path) -> Path:
        """A view of `source` in this pod's scratch, for a mount whose source a fresh tmpfs is about to hide."""
        if not source.exists():
            raise PodSetupError(f"volume source {source} does not exist on this machine")
        view = self.scratch / f"keep{len(list(self.scratch.glob('keep*')))}"
        if source.is_dir():
            view.mkdir()
        else:
            view.touch()
        _mount(str(source), str(view), None, MS_BIND | MS_REC)
        return view

    def tmpfs(self, target: Path) -> None:
        self.ensure(target, is_dir=True)
        _mount("tmpfs", str(target), "tmpfs", 0, "mode=0755")
        self.private.append(target)

    def bind(self, source: Path, target: Path, read_only: bool) -> None:
        if not source.exists():
            raise PodSetupError(f"volume source {source} does not exist on this machine")
        self.ensure(target, is_dir=source.is_dir())
        _mount(str(source), str(target), None, MS_BIND | MS_REC)
        if read_only:
            _mount(None, str(target), None, MS_REMOUNT | MS_BIND | MS_RDONLY)


def set_up(spec: dict) -> None:
    socket.sethostname(spec["hostname"])
    pod = PodFilesystem(Path(spec["scratch"]))
    fresh = [Path(target) for target in spec.get("tmpfs", [])]
    mounts = []
    for mount in spec.get("mounts", []):  # a source inside a fresh home (this machine's Python): seen from before it
        if mount.get("source") is not None and any(Path(mount["source"]).is_relative_to(t) for t in fresh):
            mount = {**mount, "source": str(pod.keep(Path(mount["source"])))}
        mounts.append(mount)
    for target in fresh:
        pod.tmpfs(target)
    # Parents before children, so a volume inside another lands on top of it.
    for mount in sorted(mounts, key=lambda m: len(Path(m["target"]).parts)):
        target = Path(mount["target"])
        if mount.get("source") is None:
            pod.ensure(target, is_dir=bool(mount.get("dir", True)))
        else:
            pod.bind(Path(mount["source"]), target, bool(mount.get("read_only")))
    pod.ensure(Path(spec["cwd"]), is_dir=True)  # as a container runtime creates a missing workingDir
    os.chdir(spec["cwd"])


def main(argv: list[str]) -> int:
    spec = json.loads(Path(argv[1]).read_text())
    try:
        set_up(spec)
    except (PodSetupError, OSError) as err:
        print(f"pod {spec.get('hostname')}: {err}", file=sys.stderr, flush=True)
        return 126
    args = spec["argv"]
    try:
        os.execvpe(args[0], args, spec["env"])
    except OSError as err:
        print(f"pod {spec.get('hostname')}: cannot run {args[0]}: {err.strerror}", file=sys.stderr, flush=True)
        return 127
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main(sys.argv))
