"""Checkpoint files: atomic, self-verifying, newest-valid-first, pruned to the last K.

A checkpoint is one file, `ckpt-<step:010d>-<sha256 prefix>.pt`, holding a `torch.save` dict. The
name carries the hash of the bytes, so a truncated or bit-flipped file is detected before it is
unpickled; files are loaded with `weights_only=True`, so a checkpoint can never run code.
Writes go to a temporary file in the same directory, are fsynced, then renamed into place.
"""

from __future__ import annotations

import hashlib
import io
import logging
import re
import shutil
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from nightshift.errors import CheckpointCorrupt
from nightshift.fsutil import atomic_write_bytes

log = logging.getLogger(__name__)

FORMAT = "nightshift-checkpoint/1"
REQUIRED_KEYS = ("format", "step", "epoch", "resume_key", "model", "optimizer", "scheduler", "rng")
_NAME = re.compile(r"^ckpt-(?P<step>\d{10})-(?P<digest>[0-9a-f]{16})\.pt$")
_HASH_PREFIX = 16
SUPERSEDED = "superseded"  # checkpoints written for other training, set aside (CheckpointStore.set_aside)
KEEP_SET_ASIDE = 3


@dataclass(frozen=True, order=True)
class CheckpointFile:
    step: int
    path: Path

    @property
    def digest(self) -> str:
        match = _NAME.match(self.path.name)
        assert match is not None
        return match["digest"]


def serialize(state: dict[str, Any]) -> bytes:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getvalue()


class CheckpointStore:
    """The checkpoints of one training task in one directory."""

    def __init__(self, directory: str | Path, keep: int = 3) -> None:
        if keep < 1:
            raise ValueError(f"keep must be at least 1, got {keep}")
        self.directory = Path(directory)
        self.keep = keep

    def files(self) -> list[CheckpointFile]:
        """Checkpoint files by ascending step (names that do not match are ignored)."""
        if not self.directory.is_dir():
            return []
        found = []
        for path in self.directory.iterdir():
            match = _NAME.match(path.name)
            if match:
                found.append(CheckpointFile(int(match["step"]), path))
        return sorted(found)

    def write(self, state: dict[str, Any]) -> Path:
        """Write `state` (which must hold `step`) atomically, then prune to the newest `keep`."""
        return self.write_bytes(int(state["step"]), serialize(state))

    def write_bytes(self, step: int, payload: bytes) -> Path:
        self.directory.mkdir(parents=True, exist_ok=True)
        digest = hashlib.sha256(payload).hexdigest()[:_HASH_PREFIX]
        final = atomic_write_bytes(self.directory / f"ckpt-{step:010d}-{digest}.pt", payload)
        # A rewrite of the same step (a resumed run's final checkpoint) replaces the old file.
        for old in self.files():
            if old.step == step and old.path != final:
                old.path.unlink(missing_ok=True)
        self.prune()
        return final

    def prune(self) -> None:
        for old in self.files()[: -self.keep]:
            old.path.unlink(missing_ok=True)

    def set_aside(self, paths: list[Path] | None = None) -> Path:
        """Move `paths` (default: every checkpoint and half-written file of this directory) into
        `superseded/<UTC time>/` and return that directory, keeping the newest KEEP_SET_ASIDE such folders.
        Used for checkpoints written for other training: never resumed, but kept for a person to look at."""
        from datetime import UTC, datetime

        parent = self.directory / SUPERSEDED
        aside = parent / datetime.now(UTC).strftime("%Y%m%dT%H%M%S.%fZ")
        aside.mkdir(parents=True, exist_ok=False)
        if paths is None:
            paths = [p for p in self.directory.iterdir()
                     if _NAME.match(p.name) or (p.name.startswith(".ckpt-") and p.name.endswith(".tmp"))]
        for path in paths:
            path.rename(aside / path.name)
        for older in sorted(p for p in parent.iterdir() if p.is_dir())[:-KEEP_SET_ASIDE]:
            shutil.rmtree(older, ignore_errors=True)
        return aside

    def valid_newest_first(self) -> Iterator[tuple[CheckpointFile, dict[str, Any]]]:
        """Every checkpoint that loads, newest first, skipping (with a warning naming it) any that does not."""
        for checkpoint in reversed(self.files()):
            try:
                yield checkpoint, self.load(checkpoint)
            except CheckpointCorrupt as err:
                log.warning("skipping checkpoint: %s", err)

    def remove_temporaries(self) -> None:
        """Delete half-written files a killed writer left behind."""
        if self.directory.is_dir():
            for tmp in self.directory.glob(".ckpt-*.tmp"):
                tmp.unlink(missing_ok=True)

    def load(self, checkpoint: CheckpointFile) -> dict[str, Any]:
        """Read and verify one checkpoint; raise CheckpointCorrupt naming the file and the fault."""
        try:
            payload = checkpoint.path.read_bytes()
        except OSError as err:
            raise CheckpointCorrupt(f"{checkpoint.path}: cannot read ({err})") from err
        if hashlib.sha256(payload).hexdigest()[:_HASH_PREFIX] != checkpoint.digest:
            raise CheckpointCorrupt(
                f"{checkpoint.path}: content does not match the hash in its name (truncated or corrupted)"
            )
        try:
            state = torch.load(io.BytesIO(payload), map_location="cpu", weights_only=True)
        except Exception as err:  # torch raises several types for unreadable or unsafe pickles
            raise CheckpointCorrupt(f"{checkpoint.path}: not a loadable checkpoint ({err})") from err
        if not isinstance(state, dict) or state.get("format") != FORMAT:
            raise CheckpointCorrupt(f"{checkpoint.path}: not a Nightshift checkpoint (format {FORMAT})")
        missing = [key for key in REQUIRED_KEYS if key not in state]
        if missing:
            raise CheckpointCorrupt(f"{checkpoint.path}: lacks {', '.join(missing)}")
        return state

    def latest_valid(self) -> tuple[CheckpointFile, dict[str, Any]] | None:
        """The newest checkpoint that loads, skipping (with a warning naming it) any that do not."""
        return next(self.valid_newest_first(), None)


def snapshot(value: Any) -> Any:
    """A deep copy whose tensors are detached CPU clones, safe to serialize while training goes on."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: snapshot(v) for k, v in value.items()}
    if isinstance(value, list):
        return [snapshot(v) for v in value]
    if isinstance(value, tuple):
        return tuple(snapshot(v) for v in value)
    return value


class AsyncCheckpointWriter:
    """Writes checkpoints on a background thread, one at a time (the CheckFreq split: snapshot
    synchronously, persist asynchronously). `submit` waits for the previous write first, so at most
    one snapshot is in memory and checkpoints land in step order."""

    def __init__(self, store: CheckpointStore, on_written: Callable[[Path], None] | None = None) -> None:
        self.store = store
        self.on_written = on_written
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def submit(self, state: dict[str, Any]) -> None:
        self.wait()
        frozen = snapshot(state)
        self._thread = threading.Thread(target=self._write, args=(frozen,), name="checkpoint-writer")
        self._thread.start()

    def _write(self, state: dict[str, Any]) -> None:
        try:
            path = self.store.write(state)
            if self.on_written:
                self.on_written(path)
        except BaseException as err:  # re-raised on the training thread by wait()
            self._error = err

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error
