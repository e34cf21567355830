"""The files of ``offload_optimizer="nvme"``: creating them, raw reads and writes at offsets, and
:class:`OffloadedShard`, one state kind of one flat group in its file, as checkpoints see it
(streamed in bounded pieces, written in place). The store
(:class:`~shardckpt.runtime.offload.store.OffloadStore`) owns the files.

One file per flat group and state kind, ``<group>.<kind>.bin`` (raw little-endian elements) in
``<offload_dir>/shardckpt-offload-<run id>-rank<RRRRR>/``, the run id unique per run as the
checkpoint format's save ids are; preallocated at construction (:func:`create_files`), so a full
disk is one error then, naming the path and the bytes; removed by ``OffloadStore.close`` (and at
exit). Checkpoints read and write them in place through :class:`OffloadedShard`; an async
checkpoint copies them (and the master shards) into an :class:`OffloadSnapshot` in the run
directory, ``copy_file_range`` on the same disk instead of memory, and streams from that.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
from pathlib import Path
from typing import Any
from collections.abc import Iterator, Mapping, Sequence

import torch

from shardckpt.errors import ConfigError, ShardckptError

log = logging.getLogger(__name__)

#: Bytes per read or write call when streaming a file (checkpoints, zeroing).
IO_CHUNK = 16 << 20


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    raise AssertionError


def as_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of CPU tensor ``t`` (contiguous), as a writable view of its memory."""
    return t.view(torch.uint8).numpy().data.cast("B")


def pread_into(fd: int, buf: memoryview, offset: int, path: Path) -> None:
    """Fill ``buf`` from file ``fd`` at ``offset``; a file that ends first is an error naming
    ``path``."""
    done = 0
    while done < len(buf):
        n = os.preadv(fd, [buf[done:]], offset + done)
        if n <= 0:
            raise ShardckptError(f"offload file {path}: ended after {offset + done} bytes, "
                                 f"expected {offset + len(buf)}")
        done += n


def pwrite_from(fd: int, buf: memoryview, offset: int, path: Path) -> None:
    """Write all of ``buf`` to file ``fd`` at ``offset``; a failure is an error naming ``path``."""
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
    (:meth:`write_bytes`) without holding it whole. ``fd`` is the descriptor open on its file
    ``path`` (the store reads and writes whole files through it)."""

    def __init__(self, path: Path, fd: int, numel: int, dtype: torch.dtype) -> None:
        self.path, self.fd, self.dtype = path, fd, dtype
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
            pread_into(self.fd, as_bytes(t), lo, self.path)
            yield t.numpy()

    def read_into(self, out: torch.Tensor) -> None:
        """Copy the whole shard into ``out`` (same numel and dtype; any device)."""
        if out.device.type == "cpu" and out.is_contiguous():
            pread_into(self.fd, as_bytes(out.reshape(-1)), 0, self.path)
            return
        host = torch.empty(self.shape, dtype=self.dtype)
        pread_into(self.fd, as_bytes(host), 0, self.path)
        out.copy_(host)

    def write_bytes(self, offset: int, data: Any) -> None:
        """Write ``data`` (bytes-like) at byte ``offset``."""
        pwrite_from(self.fd, memoryview(data).cast("B"), offset, self.path)

    def read_bytes(self, offset: int, nbytes: int) -> bytes:
        """``nbytes`` bytes from byte ``offset``."""
        t = torch.empty(nbytes, dtype=torch.uint8)
        pread_into(self.fd, as_bytes(t), offset, self.path)
        return t.numpy().tobytes()

    def zero_(self) -> OffloadedShard:
        zeros = bytes(min(IO_CHUNK, self.nbytes))
        for lo in range(0, self.nbytes, IO_CHUNK):
            self.write_bytes(lo, zeros[:min(IO_CHUNK, self.nbytes - lo)])
        return self

    def __repr__(self) -> str:
        return f"OffloadedShard({self.path}, numel={self.numel()}, dtype={self.dtype})"


def create_files(base: Path, sizes: Mapping[str, int], kinds: Sequence[str], rank: int
                 ) -> tuple[Path, dict[tuple[str, str], OffloadedShard]]:
    """This rank's run directory under ``base`` and one preallocated fp32 file per group of
    ``sizes`` (name -> shard numel) and state kind of ``kinds``; one :class:`ConfigError`
    naming the directory and the bytes if the disk is short or a file cannot be made (nothing
    is left behind then)."""
    from shardckpt.checkpoint.writer import new_save_id

    need = sum(sizes.values()) * 4 * len(kinds)
    try:
        st = os.statvfs(base)
    except OSError as e:
        raise ConfigError(f"offload directory {base}: cannot stat it: {e.strerror or e}") from e
    free = st.f_bavail * st.f_frsize
    if free < need:
        raise ConfigError(
            f"offload directory {base}: the optimizer state of this rank needs {need} bytes "
            f"({_human(need)}) but only {free} bytes ({_human(free)}) are free")
    run_dir = base / f"shardckpt-offload-{new_save_id()}-rank{rank:05d}"
    files: dict[tuple[str, str], OffloadedShard] = {}
    try:
        run_dir.mkdir()
        for name, n in sizes.items():
            for kind in kinds:
                path = run_dir / f"{name}.{kind}.bin"
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
                files[name, kind] = OffloadedShard(path, fd, n, torch.float32)
                if n:  # reserve the blocks now: a full disk fails here, not mid-step
                    _reserve(fd, n * 4)
    except OSError as e:
        remove_files(run_dir, [s.fd for s in files.values()])
        raise ConfigError(
            f"offload directory {base}: creating the optimizer state files "
            f"({need} bytes, {_human(need)}) failed: {e.strerror or e}") from e
    log.info("optimizer state offloaded to %s: %d files, %s", run_dir, len(files), _human(need))
    return run_dir, files


def _reserve(fd: int, nbytes: int) -> None:
    """Allocate ``nbytes`` of disk for the file (a file system without ``fallocate`` gets a
    sized file; the write-back then reports a full disk with the path)."""
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as e:
        if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            raise
        os.ftruncate(fd, nbytes)


def remove_files(run_dir: Path | None, fds: list[int]) -> None:
    """Close ``fds`` and remove ``run_dir`` (where there is one), quietly: cleanup that must not
    fail."""
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
        view = as_bytes(buf)[:min(IO_CHUNK, nbytes - lo)]
        pread_into(src, view, lo, path)
        pwrite_from(dst, view, lo, path)


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
            _copy_range(t.fd, fd, t.nbytes, path)
            return copy
        flat = t.detach().reshape(-1)
        step = max(1, IO_CHUNK // flat.element_size())
        for lo in range(0, flat.numel(), step):  # a device shard: a piece at a time
            piece = flat[lo:lo + step].to("cpu").contiguous()
            pwrite_from(fd, as_bytes(piece), lo * flat.element_size(), path)
        return copy

    def remove(self) -> None:
        remove_files(self.directory, [f.fd for f in self._files])
        self._files = []
