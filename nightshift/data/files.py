"""Open a data file only when it is a regular file, without ever blocking on or reading anything else.

A name checked with `is_file()` can be swapped for a FIFO (an open() that blocks until a writer comes), a
device (`/dev/zero` never ends) or a link elsewhere before it is opened. `open_regular` opens with
O_NONBLOCK (a FIFO opens at once instead of blocking) and judges what it opened with `fstat`, so what is
read is the file that was judged.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Iterator
from pathlib import Path

from nightshift.errors import DataError

CHUNK = 1 << 20
KINDS = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
         (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a directory"), (stat.S_ISLNK, "a symbolic link"))


def kind(mode: int) -> str:
    """What a file of `mode` is, in words ("a FIFO", "a character device"...)."""
    return next((name for test, name in KINDS if test(mode)), "not a regular file")


def not_regular(path: Path, mode: int) -> DataError:
    return DataError(f"{path} is not a regular file ({kind(mode)}); nothing was read from it: replace it with "
                     f"the Parquet file itself and run again")


def open_regular(path: str | Path, *, follow: bool = True, expect: os.stat_result | None = None) -> int:
    """A read-only descriptor of the regular file `path`; DataError (one line, naming it) for anything else.

    `follow=False`: `path` itself must not be a symbolic link (O_NOFOLLOW). `expect`: the stat taken when
    `path` was checked; the file opened must be that very file (inode and device), not one swapped in since.
    """
    path = Path(path)
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow else os.O_NOFOLLOW)
    try:
        fd = os.open(path, flags)
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise DataError(f"{path} is a symbolic link (or a link loop) where a regular file was checked; "
                            f"nothing was read from it: replace it with the Parquet file itself and run again") \
                from err
        raise DataError(f"{path} cannot be opened: {err.strerror or err}; make it a readable Parquet file and "
                        f"run again") from err
    try:
        found = os.fstat(fd)
        if not stat.S_ISREG(found.st_mode):
            raise not_regular(path, found.st_mode)
        if expect is not None and (found.st_ino, found.st_dev) != (expect.st_ino, expect.st_dev):
            raise DataError(f"{path} was replaced by another file while it was being opened; nothing was read "
                            f"from it: stage it again once whatever writes it has finished")
    except BaseException:
        os.close(fd)
        raise
    return fd


def chunks(fd: int, size: int = CHUNK) -> Iterator[bytes]:
    """The bytes of open file `fd` from its start, `size` at a time (pread: the descriptor's offset is unused)."""
    offset = 0
    while chunk := os.pread(fd, size, offset):
        offset += len(chunk)
        yield chunk


def read_regular(path: str | Path) -> bytes:
    """All bytes of the regular file `path` (links followed), read through one descriptor."""
    with open(open_regular(path), "rb") as handle:
        return handle.read()
