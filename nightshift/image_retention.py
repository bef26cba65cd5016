"""Retention of podman images: what `make images` leaves behind when it builds a tag again.

`scripts/images.py` builds its tags (`localhost/nightshift/trainer:cpu`, `.../serving:<version>`,
`.../airflow:<version>`, the local bases `localhost/python:3.11-slim-bookworm` and
`localhost/nightshift/airflow-base:*`) with podman's layer cache. Each build that changes anything moves the tag to
a new image; the image it leaves holds no name any more, but podman keeps it, and its layers, for good.
`run-mpijob --runtime podman` builds nothing: its containers run with `--rm` under names of their own (the next
run removes those a killed run left), and a container it left running holds its image.

What goes (`plan`, pure, from `podman images --all --format json`): an image that

- once carried a name of a Nightshift build (its name history, podman's `History`, says so),
- carries no name now (the tag moved to a newer build, or it was untagged),
- is used by no container, running or stopped (`Containers`: podman counts every container of its storage,
  buildah's build containers among them),
- is the parent of no other image (the image a restamp built on, or a layer another image is built from),
- and is not read-only (an additional image store's).

Everything else stays, and the unnamed images that never carried a name stay too: they are the layer cache of
build stages (the trainer's Horovod compile, minutes), which the next build reuses, not superseded builds;
`podman image prune` would take them. Removal is `podman rmi <id>` without --force: podman refuses an image a
container took meanwhile (exit 2, kept), removes the image's own layers and the parent images that only it held,
and never a layer another image uses. It runs under the image build's machine lock (the lock file scripts/images.py
holds while it builds: LOCK_FILE): while a build runs, nothing is collected and the result says so.

Standard library only: scripts/images.py imports it (with its own podman command) to collect after a build.
"""

from __future__ import annotations

import fcntl
import json
import subprocess
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nightshift.errors import NightshiftError

# The lock scripts/images.py holds for a whole build (its LOCK_FILE: the two must stay the same file).
LOCK_FILE = Path(tempfile.gettempdir()) / "nightshift-images.lock"
# Names of the builds scripts/images.py makes: a repository under localhost/nightshift/, and the local Python base.
OWNED_PREFIXES = ("localhost/nightshift/",)
OWNED_NAMES = ("localhost/python:3.11-slim-bookworm",)
RMI_IN_USE = 2  # podman rmi: "one of the specified images has child images or is being used by a container"
RMI_UNKNOWN = 1  # podman rmi: "one of the specified images did not exist"

Runner = Callable[[Sequence[str]], "subprocess.CompletedProcess[str]"]


class ImageGcFailed(NightshiftError):
    """podman could not list or remove the images (its output says why)."""


@dataclass(frozen=True)
class ImageDecision:
    image_id: str
    names: tuple[str, ...]
    history: tuple[str, ...]
    size: int
    remove: bool
    reason: str

    def to_dict(self) -> dict[str, object]:
        return {"kind": "image", "what": self.image_id[:12], "id": self.image_id, "names": list(self.names),
                "was": list(self.history), "size": self.size, "action": "remove" if self.remove else "keep",
                "reason": self.reason}


def owned(name: str) -> bool:
    """Whether `name` is one scripts/images.py builds."""
    return name.startswith(OWNED_PREFIXES) or name in OWNED_NAMES


def _strings(value: Any) -> tuple[str, ...]:
    return tuple(str(v) for v in value) if isinstance(value, list) else ()


def plan(listing: Sequence[Mapping[str, Any]]) -> list[ImageDecision]:
    """A decision for each image that carries, or once carried, a Nightshift build's name, from the entries of
    `podman images --all --format json` (an image with several names is listed once per name: taken once). Images
    that never carried such a name are none of this collection's business and are left out."""
    images: dict[str, Mapping[str, Any]] = {}
    for entry in listing:
        image_id = str(entry.get("Id") or "")
        if not image_id:
            raise ImageGcFailed(f"an entry of `podman images --format json` has no Id ({dict(entry)!r:.200}): "
                                f"nothing was removed")
        images.setdefault(image_id, entry)
    children: dict[str, int] = {}
    for entry in images.values():
        parent = str(entry.get("ParentId") or "")
        if parent:
            children[parent] = children.get(parent, 0) + 1
    decisions = []
    for image_id, entry in images.items():
        names, history = _strings(entry.get("Names")), _strings(entry.get("History"))
        ours = [n for n in (*names, *history) if owned(n)]
        if not ours:
            continue
        size = int(entry.get("Size") or 0)
        containers = int(entry.get("Containers") or 0)

        def decided(remove: bool, reason: str, image_id: str = image_id, names: tuple[str, ...] = names,
                    history: tuple[str, ...] = history, size: int = size) -> ImageDecision:
            return ImageDecision(image_id, names, history, size, remove, reason)

        if names:
            decisions.append(decided(False, f"tagged {', '.join(names)}: the current build"))
        elif containers:
            decisions.append(decided(False, f"a superseded build of {ours[0]}, used by {containers} container(s) "
                                            f"(running or stopped): kept while a container holds it"))
        elif children.get(image_id):
            decisions.append(decided(False, f"a superseded build of {ours[0]}, parent of {children[image_id]} "
                                            f"image(s) (a restamp or a build on it): goes with them"))
        elif entry.get("ReadOnly"):
            decisions.append(decided(False, f"a superseded build of {ours[0]} in a read-only image store"))
        else:
            decisions.append(decided(True, f"a superseded build of {ours[0]}: no name, no container, no child "
                                           f"image (the tag moved to a newer build)"))
    return decisions


@contextmanager
def build_lock(wait: bool = False) -> Iterator[bool]:
    """Hold the image build's machine lock; yields False (holding nothing) when a build holds it and not `wait`."""
    with LOCK_FILE.open("a+") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def listing(run: Runner) -> list[dict[str, Any]]:
    """`podman images --all --format json`, parsed; ImageGcFailed when podman fails or answers something else."""
    done = run(["images", "--all", "--format", "json"])
    if done.returncode != 0:
        raise ImageGcFailed(f"`podman images` failed (exit {done.returncode}): {str(done.stderr).strip()[-500:]}; "
                            f"nothing was removed")
    try:
        parsed = json.loads(done.stdout or "[]")
    except json.JSONDecodeError as err:
        raise ImageGcFailed(f"`podman images --format json` printed no JSON ({err}): nothing was removed") from err
    if not isinstance(parsed, list) or not all(isinstance(e, dict) for e in parsed):
        raise ImageGcFailed("`podman images --format json` printed no list of images: nothing was removed")
    return parsed


def collect(run: Runner, *, dry_run: bool) -> dict[str, Any]:
    """Plan from podman's listing and, unless `dry_run`, `podman rmi` each image the plan lets go (the caller holds
    the build lock). {"remove": [...], "keep": [...], "removed_bytes"}: an image a container took since the
    listing is kept, saying so; any other failure of podman is ImageGcFailed naming the image."""
    decisions = plan(listing(run))
    removed, kept = [], [d for d in decisions if not d.remove]
    for decision in (d for d in decisions if d.remove):
        if dry_run:
            removed.append(decision)
            continue
        done = run(["rmi", decision.image_id])
        if done.returncode in (0, RMI_UNKNOWN):
            removed.append(decision)
        elif done.returncode == RMI_IN_USE:
            kept.append(ImageDecision(decision.image_id, decision.names, decision.history, decision.size, False,
                                      f"podman refused to remove it (a container or an image took it since the "
                                      f"listing): {str(done.stderr).strip()[-300:]}"))
        else:
            raise ImageGcFailed(f"`podman rmi {decision.image_id[:12]}` failed (exit {done.returncode}): "
                                f"{str(done.stderr).strip()[-500:]}; run `nightshift gc --images` again")
    return {"dry_run": dry_run, "remove": [d.to_dict() for d in removed], "keep": [d.to_dict() for d in kept],
            "removed_bytes": 0 if dry_run else sum(d.size for d in removed),
            "note": "sizes are each image's whole size: layers it shares with a kept image stay"}


def collect_images(*, dry_run: bool = False, run: Runner | None = None) -> dict[str, Any]:
    """`nightshift gc --images`: under the build lock (skipped, saying so, while a build holds it), collect with
    podman as `run-mpijob --runtime podman` runs it (its containers.conf and OCI runtime)."""
    with build_lock() as held:
        if not held:
            return {"dry_run": dry_run, "remove": [], "keep": [], "removed_bytes": 0,
                    "skipped": f"an image build holds {LOCK_FILE} (`make images` at work): nothing was looked at; "
                               f"run `nightshift gc --images` again when it is done"}
        return collect(run or _podman(), dry_run=dry_run)


def _podman() -> Runner:
    from nightshift.mpijob_local.podman import PodmanSettings, run_podman

    settings = PodmanSettings.from_environment()

    def run(args: Sequence[str]) -> subprocess.CompletedProcess[str]:
        return run_podman(settings, *args, timeout=600)

    return run
