"""Atomic file writes: a reader sees the old file or the new one, never half of either."""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
from pathlib import Path
from typing import Any


def atomic_write_bytes(path: str | Path, payload: bytes, *, overwrite: bool = True) -> Path:
    """Write `payload` to a temporary file beside `path`, fsync it, rename it over `path`, fsync the folder.

    The temporary file is named `.<name>.<random>.tmp` and removed if anything fails. With `overwrite=False`
    the file is linked into place instead of renamed, so an existing `path` is never replaced (FileExistsError),
    even one created a moment before.
    """
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(payload)
            handle.flush()
            os.fsync(handle.fileno())
        if overwrite:
            os.replace(tmp, path)
        else:
            os.link(tmp, path)
            os.unlink(tmp)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)
    return path


def atomic_write_json(path: str | Path, payload: Any, *, overwrite: bool = True) -> Path:
    """`atomic_write_bytes` of `payload` as indented, key-sorted JSON with a final newline."""
    return atomic_write_bytes(path, (json.dumps(payload, indent=2, sort_keys=True) + "\n").encode(),
                              overwrite=overwrite)


_SAFE = re.compile(r"[A-Za-z0-9_.=@+-]{1,120}")


def safe_name(text: str) -> str:
    """`text` as one path component, injectively: a name of safe characters (not `.` or `..`, at most 120)
    is kept as it is; any other gets its unsafe characters replaced by `_` and `~` plus a hash of the whole
    text appended. `~` is never kept, so a kept name never equals a hashed one, and two texts that differ
    only in what was replaced (run ids `a:b` and `a_b`, `.` and `_`) never share a directory."""
    if _SAFE.fullmatch(text) and text not in (".", ".."):
        return text
    cleaned = re.sub(r"[^A-Za-z0-9_.=@+-]", "_", text)[:80].strip(".") or "_"
    return f"{cleaned}~{hashlib.sha256(text.encode()).hexdigest()[:16]}"
