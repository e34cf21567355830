"""The files of ``offload_optimizer="nvme"``: raw reads and writes at offsets, and
:class:`OffloadedShard`, one state kind of one flat group in its file, as checkpoints see it
(streamed in bounded pieces, written in place). :mod:`shardckpt.runtime.offload` owns the files.
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path
from typing import Any, Iterator

import torch

from shardckpt.errors import ShardckptError

#: Bytes per read or write call when streaming a file (checkpoints, zeroing).
IO_CHUNK = 16 << 20


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    raise AssertionError


def _as_bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.view(torch.uint8).numpy()).cast("B")


def _pread_into(fd: int, buf: memoryview, offset: int, path: Path) -> None:
    done = 0
    while done < len(buf):
        n = os.preadv(fd, [buf[done:]], offset + done)
        if n <= 0:
            raise ShardckptError(f"offload file {path}: ended after {offset + done} bytes, "
                                 f"expected {offset + len(buf)}")
        done += n


def _pwrite_from(fd: int, buf: memoryview, offset: int, path: Path) -> None:
    done = 0
    try:
        while done < len(buf):
            done += os.pwrite(fd, buf[done:], offset + done)
    except OSError as e:
        raise ShardckptError(f"offload file {path}: writing {len(buf)} bytes at {offset} "
                             f"failed: {e.strerror or e}") from e


class OffloadedShard:
    """One state kind of one flat group, living in its offload file: what ``local_shards()``
    gives for it. Checkpoints stream from it (:meth:`iter_bytes`) and into it
    (:meth:`write_bytes`) without holding it whole."""

    def __init__(self, path: Path, fd: int, numel: int, dtype: torch.dtype) -> None:
        self.path, self._fd, self.dtype = path, fd, dtype
        self.shape = torch.Size([numel])
        self.nbytes = numel * dtype.itemsize

    def numel(self) -> int:
        return self.shape[0]

    def iter_bytes(self, chunk: int | None = None) -> Iterator[Any]:
        """The file's bytes in order, ``chunk`` (default :data:`IO_CHUNK`) at a time (uint8
        numpy arrays): never the whole shard in memory at once."""
        chunk = chunk or IO_CHUNK
        for lo in range(0, self.nbytes, chunk):
            t = torch.empty(min(chunk, self.nbytes - lo), dtype=torch.uint8)
            _pread_into(self._fd, _as_bytes(t), lo, self.path)
            yield t.numpy()

    def read_into(self, out: torch.Tensor) -> None:
        """Copy the whole shard into ``out`` (same numel and dtype; any device)."""
        if out.device.type == "cpu" and out.is_contiguous():
            _pread_into(self._fd, _as_bytes(out.reshape(-1)), 0, self.path)
            return
        host = torch.empty(self.shape, dtype=self.dtype)
        _pread_into(self._fd, _as_bytes(host), 0, self.path)
        out.copy_(host)

    def write_bytes(self, offset: int, data: Any) -> None:
        """Write ``data`` (bytes-like) at byte ``offset``."""
        _pwrite_from(self._fd, memoryview(data).cast("B"), offset, self.path)

    def read_bytes(self, offset: int, nbytes: int) -> bytes:
        """``nbytes`` bytes from byte ``offset``."""
        t = torch.empty(nbytes, dtype=torch.uint8)
        _pread_into(self._fd, _as_bytes(t), offset, self.path)
        return t.numpy().tobytes()

    def zero_(self) -> "OffloadedShard":
        zeros = bytes(min(IO_CHUNK, self.nbytes))
        for lo in range(0, self.nbytes, IO_CHUNK):
            self.write_bytes(lo, zeros[:min(IO_CHUNK, self.nbytes - lo)])
        return self

    def __repr__(self) -> str:
        return f"OffloadedShard({self.path}, numel={self.numel()}, dtype={self.dtype})"


def _reserve(fd: int, nbytes: int) -> None:
    """Allocate ``nbytes`` of disk for the file (a file system without ``fallocate`` gets a
    sized file; the write-back then reports a full disk with the path)."""
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as e:
        if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            raise
        os.ftruncate(fd, nbytes)


def _remove(run_dir: Path | None, fds: list[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass
    if run_dir is not None:
        shutil.rmtree(run_dir, ignore_errors=True)


def _copy_range(src: int, dst: int, nbytes: int, path: Path) -> None:
    """Copy ``nbytes`` from the start of file ``src`` to file ``dst`` inside the kernel
    (``copy_file_range``: a reflink where the file system shares blocks); where the call is
    missing or refused, through a buffer of :data:`IO_CHUNK` bytes."""
    done = 0
    try:
        while done < nbytes:
            n = os.copy_file_range(src, dst, nbytes - done, done, done)
            if n <= 0:
                break
            done += n
    except (AttributeError, OSError) as e:
        if isinstance(e, OSError) and e.errno not in (errno.EXDEV, errno.ENOSYS, errno.EINVAL,
                                                      errno.EOPNOTSUPP, errno.EPERM):
            raise ShardckptError(f"offload snapshot {path}: copying {nbytes} bytes failed: "
                                 f"{e.strerror or e}") from e
    buf = torch.empty(min(IO_CHUNK, max(nbytes - done, 0)), dtype=torch.uint8)
    for lo in range(done, nbytes, IO_CHUNK):
        view = _as_bytes(buf)[:min(IO_CHUNK, nbytes - lo)]
        _pread_into(src, view, lo, path)
        _pwrite_from(dst, view, lo, path)


class OffloadSnapshot:
    """Copies of this rank's offload files, and of the master shards beside them, in a
    directory on the same disk (``<run dir>/snapshot-<id>/``): what an async checkpoint
    streams from while training changes the live files. RAM used: at most one buffer of
    :data:`IO_CHUNK` bytes (none where ``copy_file_range`` works). :meth:`remove` deletes it."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._files: list[OffloadedShard] = []
        directory.mkdir()

    def take(self, group: str, kind: str, t: Any) -> OffloadedShard:
        """Copy ``t`` (an :class:`OffloadedShard`, or a 1-D tensor on any device) into the
        snapshot; the copy, streamed like the original."""
        path = self.directory / f"{group}.{kind}.bin"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        copy = OffloadedShard(path, fd, t.numel(), t.dtype)
        self._files.append(copy)
        if isinstance(t, OffloadedShard):
            _copy_range(t._fd, fd, t.nbytes, path)
            return copy
        flat = t.detach().reshape(-1)
        step = max(1, IO_CHUNK // flat.element_size())
        for lo in range(0, flat.numel(), step):  # a device shard: a piece at a time
            piece = flat[lo:lo + step].to("cpu").contiguous()
            _pwrite_from(fd, _as_bytes(piece), lo * flat.element_size(), path)
        return copy

    def remove(self) -> None:
        _remove(self.directory, [f._fd for f in self._files])
        self._files = []
