"""The season script and its data: what lands each night, and the golden table the oracle scores champions on.

The world is the digits images (scikit-learn's, as `nightshift demo-data` writes them) seen through a state that
changes over the season: a brightness (gradual drift dims the images 10% a night, from then on) and a horizontal
shift (a sudden shift moves every image one pixel right, from then on). Each night's rows are fresh noisy draws of
the pool's images in the current state (N(0, 0.6) per pixel, clipped to the contract's 0..16), split 70/15/15 by
label with the product's own split (nightshift.data.demo.split_frame). 400 images never reach the pipeline: the
golden table, drawn once, seen through each night's state (clean labels always), is what the oracle scores every
champion and challenger on.

A night's data lands in a directory of its own under the landing folder; the pipeline's declared data
(NIGHTSHIFT_HOME/demo-data/digits) is a symbolic link switched to it atomically (os.replace), so a run reads one
night whole (the gate resolves the link once and stages the resolved directory).
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

SPLITS = ("train", "validation", "test")
GOLDEN_ROWS = 400
NOISE = 0.6
SIDE = 8
PIXELS = SIDE * SIDE
LOST_CLASS = 7
LABEL_NOISE = 0.4
DRIFT_STEP = 0.9  # each drift night: the images this much as bright as the night before

EVENTS = {
    "steady": "a fresh sample of the current distribution",
    "unchanged": "the same bytes as the last valid night",
    "drift": "gradual drift: images 10% dimmer than the night before, from then on",
    "shift": "sudden shift: every image one pixel further right, from then on",
    "bad_data": "schema break (label float64) and NaNs in pixel_12 (5% of rows)",
    "lost_class": f"class {LOST_CLASS} missing from every split",
    "heavy_tail": "pixel_0 heavy-tailed (2 x Pareto(1.5)): ~4% of rows beyond the 0..16 contract",
    "label_noise": f"{LABEL_NOISE:.0%} of the labels replaced by random ones",
}
# Events whose data breaks the dataset's documented contract (DESIGN.md: label int64 0-9 with every class,
# pixel_0..pixel_63 float32 in 0..16): such data must never be staged, whatever the suite says.
INVALID = frozenset({"bad_data", "lost_class", "heavy_tail"})
# Events that change the world from that night on (the others are one night's accident on top of it).
LASTING = frozenset({"drift", "shift"})

FAULTS = {
    "worker_killed": "a Horovod rank SIGKILLed mid-training (after its first checkpoint when there is one)",
    "scheduler_killed": "the scheduler and everything under it SIGKILLed mid-training, restarted 5 s later",
    "postgres_restarted": "the metadata database's PostgreSQL restarted mid-training",
    "model_server_killed": "the model server SIGKILLed as the night starts",
    "dvc_remote_unwritable": "the DVC remote read-only for the whole night (a read-only bind mount)",
}


@dataclass(frozen=True)
class Night:
    event: str
    fault: str | None = None

    def __post_init__(self) -> None:
        if self.event not in EVENTS:
            raise ValueError(f"unknown data event {self.event!r}; one of {', '.join(EVENTS)}")
        if self.fault is not None and self.fault not in FAULTS:
            raise ValueError(f"unknown fault {self.fault!r}; one of {', '.join(FAULTS)}")

    @property
    def valid(self) -> bool:
        return self.event not in INVALID


# The default season, ordered so that any prefix of 3 or more nights mixes training, refusal and skipping: the
# short seasons run while the machine is shared are its first nights.
SEASON = (
    Night("steady"),
    Night("bad_data"),
    Night("unchanged"),
    Night("steady", "worker_killed"),
    Night("drift", "scheduler_killed"),
    Night("unchanged", "model_server_killed"),
    Night("shift"),
    Night("steady", "postgres_restarted"),
    Night("lost_class"),
    Night("steady", "dvc_remote_unwritable"),
    Night("heavy_tail"),
    Night("label_noise"),
    Night("drift"),
    Night("steady"),
    Night("unchanged"),
    Night("steady", "worker_killed"),
    Night("bad_data"),
    Night("drift"),
    Night("steady", "scheduler_killed"),
    Night("unchanged"),
    Night("label_noise"),
    Night("shift"),
    Night("steady", "postgres_restarted"),
    Night("steady", "model_server_killed"),
    Night("lost_class"),
    Night("drift"),
    Night("unchanged"),
    Night("heavy_tail"),
    Night("steady", "dvc_remote_unwritable"),
    Night("steady"),
)


def season(nights: int) -> list[Night]:
    """The first `nights` of the default season; beyond 30, nights 14-30 again."""
    if nights < 1:
        raise ValueError(f"--nights must be at least 1, got {nights}")
    out = list(SEASON[:nights])
    while len(out) < nights:
        out.append(SEASON[13 + (len(out) - len(SEASON)) % (len(SEASON) - 13)])
    return out


@dataclass(frozen=True)
class World:
    """The distribution on a night: how bright the images are and how far right they have moved."""

    brightness: float = 1.0
    shift: int = 0

    def after(self, event: str) -> World:
        if event == "drift":
            return replace(self, brightness=round(self.brightness * DRIFT_STEP, 6))
        if event == "shift":
            return replace(self, shift=self.shift + 1)
        return self

    def describe(self) -> str:
        return f"brightness {self.brightness:.2f}, shift {self.shift}px"


def _digits() -> tuple[np.ndarray, np.ndarray]:
    from sklearn.datasets import load_digits

    bunch = load_digits()
    return bunch.data.astype(np.float32), bunch.target.astype(np.int64)


def _golden_split(labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Indices of the pool (what nights draw from) and of the golden images (never in a night's data)."""
    from sklearn.model_selection import train_test_split

    index = np.arange(len(labels))
    pool, golden = train_test_split(index, test_size=GOLDEN_ROWS, random_state=2026, stratify=labels)
    return np.sort(pool), np.sort(golden)


def render(pixels: np.ndarray, world: World) -> np.ndarray:
    """`pixels` (n x 64, 0..16) seen in `world`: shifted right (zeros enter on the left), dimmed, clipped, float32."""
    images = pixels.reshape(-1, SIDE, SIDE)
    if world.shift:
        moved = np.zeros_like(images)
        moved[:, :, world.shift:] = images[:, :, : SIDE - world.shift]
        images = moved
    return np.clip(images.reshape(-1, PIXELS) * world.brightness, 0.0, 16.0).astype(np.float32)


def _frame(pixels: np.ndarray, labels: np.ndarray) -> pd.DataFrame:
    frame = pd.DataFrame(pixels, columns=[f"pixel_{i}" for i in range(PIXELS)])
    frame.insert(0, "label", labels.astype(np.int64))
    return frame


def golden_table(world: World) -> pd.DataFrame:
    """The oracle's held-out table in `world`: the 400 golden images with a fixed noise draw, true labels."""
    pixels, labels = _digits()
    _, golden = _golden_split(labels)
    noise = np.random.default_rng(999).normal(0.0, NOISE, size=(len(golden), PIXELS)).astype(np.float32)
    return _frame(render(pixels[golden] + noise, world), labels[golden])


def draw(rng: np.random.Generator, labels: np.ndarray, rows: int) -> np.ndarray:
    """Which images a night holds: `rows` draws, with replacement, from the pool (never a golden image)."""
    pool, _ = _golden_split(labels)
    return rng.choice(pool, size=rows, replace=True)


def night_splits(number: int, night: Night, world: World, rows: int) -> dict[str, pd.DataFrame]:
    """Night `number`'s splits for a data event other than `unchanged`, in `world` (the state after the event)."""
    from nightshift.data.demo import split_frame

    pixels, labels = _digits()
    rng = np.random.default_rng(1000 + number)
    drawn = draw(rng, labels, rows)
    noise = rng.normal(0.0, NOISE, size=(rows, PIXELS)).astype(np.float32)
    frame = _frame(render(pixels[drawn] + noise, world), labels[drawn])
    parts = {name: part.reset_index(drop=True) for name, part in split_frame(frame, seed=number).items()}
    for name, part in parts.items():
        if night.event == "label_noise":
            flip = rng.random(len(part)) < LABEL_NOISE
            part.loc[flip, "label"] = rng.integers(0, 10, size=int(flip.sum()))
        elif night.event == "lost_class":
            parts[name] = part = part[part["label"] != LOST_CLASS].reset_index(drop=True)
        elif night.event == "heavy_tail":
            part["pixel_0"] = (2.0 * rng.pareto(1.5, size=len(part))).astype(np.float32)
        elif night.event == "bad_data":
            part["label"] = part["label"].astype(np.float64)
            part.loc[rng.random(len(part)) < 0.05, "pixel_12"] = np.nan
    return parts


def write_splits(parts: dict[str, pd.DataFrame], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=False)
    for name in SPLITS:
        parts[name].to_parquet(out / f"{name}.parquet", index=False)


def copy_splits(source: Path, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=False)
    for name in SPLITS:
        shutil.copyfile(source / f"{name}.parquet", out / f"{name}.parquet")


def link(target: Path, link_path: Path) -> None:
    """Point `link_path` at `target` atomically (a new link renamed over the old one)."""
    link_path.parent.mkdir(parents=True, exist_ok=True)
    if link_path.exists() and not link_path.is_symlink():
        raise RuntimeError(f"{link_path} is a real directory, not the season's link: use a fresh NIGHTSHIFT_HOME")
    temporary = link_path.with_name(f".{link_path.name}.next")
    temporary.unlink(missing_ok=True)
    os.symlink(target, temporary)
    os.replace(temporary, link_path)


def split_digests(folder: Path) -> dict[str, str]:
    """md5 of each split file: DVC's object names, and how the oracle tells one night's bytes from another's."""
    import hashlib

    return {name: hashlib.md5((folder / f"{name}.parquet").read_bytes()).hexdigest() for name in SPLITS}


@dataclass
class Landing:
    """Writes each night's data under `root` and links the pipeline's declared data to it."""

    root: Path
    declared: Path  # NIGHTSHIFT_HOME/demo-data/digits
    rows: int
    world: World = field(default_factory=World)
    last_valid: Path | None = None
    written: dict[int, dict[str, Any]] = field(default_factory=dict)

    def write(self, number: int, night: Night) -> dict[str, Any]:
        """Write night `number` (1-based) and say what it is; the world moves on for a lasting event."""
        out = self.root / f"night-{number:02d}-{night.event}"
        world = self.world.after(night.event)
        if night.event == "unchanged":
            if self.last_valid is None:
                raise ValueError("an unchanged night needs a valid night before it")
            copy_splits(self.last_valid, out)
        else:
            write_splits(night_splits(number, night, world, self.rows), out)
        self.world = world
        if night.valid:
            self.last_valid = out
        info = {"night": number, "event": night.event, "fault": night.fault, "folder": str(out),
                "world": world, "valid": night.valid, "digests": split_digests(out)}
        self.written[number] = info
        return info

    def switch(self, number: int) -> None:
        link(Path(self.written[number]["folder"]), self.declared)
