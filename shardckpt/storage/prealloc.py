"""Files allocated before they are written: :func:`fill` (the pages allocated and touched) and
:func:`preallocated` (a file made so), for :class:`~shardckpt.storage.spare.Spare`."""

from __future__ import annotations

import os
from collections.abc import Callable

from shardckpt.storage.retry import map_error

#: The piece of zeros a spare is written with.
PIECE = 8 << 20


def fill(fd: int, nbytes: int) -> None:
    """Allocate ``nbytes`` of the open file ``fd`` and write zeros over them: a page only
    allocated is still touched for the first time by the write that takes it over, which on a
    virtual machine costs as much as a new page. No room: ``OSError`` before anything is written."""
    if not nbytes:
        return
    os.posix_fallocate(fd, 0, nbytes)
    zeros = memoryview(bytes(min(nbytes, PIECE)))
    for pos in range(0, nbytes, len(zeros)):
        os.pwrite(fd, zeros[:nbytes - pos], pos)


def preallocated(open_fd: Callable[[str, str], int], path: str, url: str, nbytes: int) -> None:
    """``path`` opened by ``open_fd`` (created or truncated, as its backend creates files) and
    filled (:func:`fill`) with ``nbytes``; the error mapped where the file system has no room
    (the caller removes the file)."""
    fd = open_fd(path, url)
    try:
        fill(fd, nbytes)
    except OSError as e:
        raise map_error(e, "preallocate", url) from e
    finally:
        os.close(fd)
