"""Optimizer state and step off the accelerator: in host memory (``"cpu"``) or in files (``"nvme"``).

ZeRO-Offload (Ren et al., 2021) and ZeRO-Infinity (Rajbhandari et al., 2021) for the sharded
element-wise optimizers of :mod:`shardckpt.runtime.optim`. Per trained flat group the offload
store holds an fp32 master and every per-element state kind (``exp_avg``, ...); the step runs
on the host, group by group:

1. the reduced gradient shard is copied to a host buffer (pinned on CUDA, reused);
2. the group's master and state are at hand: in place (``"cpu"``), or read from their files,
   the next group's read already in flight on a background thread (``"nvme"``);
3. the optimizer's update runs on them, op for op as in the resident step, so every element
   gets the same bits;
4. the updated master is copied to the device shard the all-gathers read (``group.master``);
   with ``"nvme"`` the master and state are written back on the background thread while the
   next group computes.

Resident host memory for ``"nvme"`` is the gradient buffer plus at most three groups' master and
state (the one computing, the one being read ahead, the one being written back), whatever the
model size. The device shard stays authoritative for the weights between steps: whatever writes
it (a checkpoint load, ``summon_full_params(writeback=True)``) marks the group changed
(:meth:`FlatParamGroup.refresh`), and the next step copies it into the store first.

Files: one per flat group and state kind, ``<group>.<kind>.bin`` (raw little-endian elements)
in ``<offload_dir>/shardckpt-offload-<run id>-rank<RRRRR>/``, the run id unique per run as the
checkpoint format's save ids are; preallocated at construction, so a full disk is one error
then, naming the path and the bytes; removed by :meth:`OffloadStore.close` (and at exit).
Checkpoints read and write them in place through :class:`OffloadedShard`.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch

from shardckpt.errors import ConfigError, ShardckptError

log = logging.getLogger(__name__)

MODES = ("cpu", "nvme")

#: Bytes per read or write call when streaming a file (checkpoints, zeroing).
IO_CHUNK = 16 << 20

#: The update of one flat group: (master, grad, state kinds, the group's work items).
UpdateFn = Callable[[torch.Tensor, torch.Tensor, dict[str, torch.Tensor], Any], None]


@dataclass(frozen=True)
class OffloadConfig:
    """Where the optimizer state lives: ``mode`` ``"cpu"`` or ``"nvme"`` (with ``directory``)."""

    mode: str
    directory: Path | None = None

    def describe(self) -> str:
        return f"optimizer offload {self.mode}" + (f" to {self.directory}" if self.directory else "")


def check_offload(mode: str | None, directory: str | os.PathLike[str] | None
                  ) -> OffloadConfig | None:
    """The validated offload settings (``None``: resident); one :class:`ConfigError` naming
    the field otherwise. For ``"nvme"`` the directory is created if missing and must be
    writable."""
    if mode is None:
        if directory is not None:
            raise ConfigError(f"offload_dir={str(directory)!r} is set but offload_optimizer is "
                              "None; pass offload_optimizer='nvme' to use it")
        return None
    if mode not in MODES:
        raise ConfigError(f"offload_optimizer is {mode!r}; use None, 'cpu' or 'nvme'")
    if mode == "cpu":
        if directory is not None:
            raise ConfigError("offload_dir is only for offload_optimizer='nvme'")
        return OffloadConfig("cpu")
    if directory is None:
        raise ConfigError("offload_optimizer='nvme' needs offload_dir, a directory on local disk")
    path = Path(directory)
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".shardckpt-probe-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise ConfigError(f"offload directory {path} is not writable: "
                          f"{e.strerror or e} ({type(e).__name__})") from e
    return OffloadConfig("nvme", path)


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

    def zero_(self) -> "OffloadedShard":
        zeros = bytes(min(IO_CHUNK, self.nbytes))
        for lo in range(0, self.nbytes, IO_CHUNK):
            self.write_bytes(lo, zeros[:min(IO_CHUNK, self.nbytes - lo)])
        return self

    def __repr__(self) -> str:
        return f"OffloadedShard({self.path}, numel={self.numel()}, dtype={self.dtype})"


class OffloadStore:
    """The masters and optimizer state of this rank's trained flat groups, off the device.

    ``sizes``: group name -> shard numel; ``kinds``: the optimizer's per-element state kinds.
    """

    def __init__(self, config: OffloadConfig, sizes: Mapping[str, int], kinds: Sequence[str],
                 device: torch.device, rank: int = 0) -> None:
        self.config = config
        self.kinds = tuple(kinds)
        self.sizes = dict(sizes)
        self.pin = device.type == "cuda"
        self._grad: torch.Tensor | None = None
        self._host: dict[str, dict[str, torch.Tensor]] = {}
        self._files: dict[tuple[str, str], OffloadedShard] = {}
        self._pool: ThreadPoolExecutor | None = None
        self.run_dir: Path | None = None
        self._failed: str | None = None  # a step failed half-way: the state is inconsistent
        if config.mode == "cpu":
            self._host = {name: {k: torch.zeros(n, dtype=torch.float32, pin_memory=self.pin)
                                 for k in ("master", *self.kinds)}
                          for name, n in self.sizes.items()}
        else:
            self._create_files(rank)
        self._finalizer = weakref.finalize(self, _remove, self.run_dir,
                                           [s._fd for s in self._files.values()])

    @property
    def state_bytes(self) -> int:
        """Bytes of masters and state this store holds (host memory or disk)."""
        return sum(self.sizes.values()) * 4 * (1 + len(self.kinds))

    def _create_files(self, rank: int) -> None:
        from shardckpt.checkpoint.writer import new_save_id

        assert self.config.directory is not None
        base = self.config.directory
        need = self.state_bytes
        try:
            st = os.statvfs(base)
        except OSError as e:
            raise ConfigError(f"offload directory {base}: cannot stat it: {e.strerror or e}") from e
        free = st.f_bavail * st.f_frsize
        if free < need:
            raise ConfigError(
                f"offload directory {base}: the optimizer state of this rank needs {need} bytes "
                f"({_human(need)}) but only {free} bytes ({_human(free)}) are free")
        self.run_dir = base / f"shardckpt-offload-{new_save_id()}-rank{rank:05d}"
        try:
            self.run_dir.mkdir()
            for name, n in self.sizes.items():
                for kind in ("master", *self.kinds):
                    path = self.run_dir / f"{name}.{kind}.bin"
                    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
                    self._files[name, kind] = OffloadedShard(path, fd, n, torch.float32)
                    if n:  # reserve the blocks now: a full disk fails here, not mid-step
                        _reserve(fd, n * 4)
        except OSError as e:
            _remove(self.run_dir, [s._fd for s in self._files.values()])
            raise ConfigError(
                f"offload directory {base}: creating the optimizer state files "
                f"({need} bytes, {_human(need)}) failed: {e.strerror or e}") from e
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="shardckpt-offload")
        log.info("optimizer state offloaded to %s: %d files, %s", self.run_dir,
                 len(self._files), _human(need))

    # ----------------------------------------------------------------- checkpoint access

    def local_state(self, name: str) -> dict[str, Any]:
        """State kind -> the live host tensor (``"cpu"``) or :class:`OffloadedShard`."""
        self._check_usable()
        if name not in self.sizes:
            return {}
        if self._host:
            return {k: self._host[name][k] for k in self.kinds}
        return {k: self._files[name, k] for k in self.kinds}

    def pull_master(self, name: str, master: torch.Tensor) -> None:
        """Copy the device master of ``name`` into the store (it changed outside a step)."""
        if self._host:
            self._host[name]["master"].copy_(master)
            return
        host = master.detach().to("cpu", copy=True)
        self._files[name, "master"].write_bytes(0, _as_bytes(host))

    # ---------------------------------------------------------------------------- step

    def host_grad(self, grad: torch.Tensor) -> torch.Tensor:
        """``grad`` copied into the reused host buffer (pinned on CUDA)."""
        n = grad.numel()
        if self._grad is None or self._grad.numel() < n:
            self._grad = torch.empty(n, dtype=torch.float32, pin_memory=self.pin)
        out = self._grad[:n]
        out.copy_(grad)
        return out

    def _read(self, name: str) -> dict[str, torch.Tensor]:
        out = {}
        for kind in ("master", *self.kinds):
            t = torch.empty(self.sizes[name], dtype=torch.float32, pin_memory=self.pin)
            f = self._files[name, kind]
            _pread_into(f._fd, _as_bytes(t), 0, f.path)
            out[kind] = t
        return out

    def _write(self, name: str, window: dict[str, torch.Tensor]) -> None:
        for kind, t in window.items():
            f = self._files[name, kind]
            _pwrite_from(f._fd, _as_bytes(t), 0, f.path)

    def windows(self, names: Sequence[str]) -> Iterator[tuple[str, dict[str, torch.Tensor]]]:
        """Each group's master and state kinds, in order; with ``"nvme"`` read one group ahead
        and written back (in the background) once the caller moves on. Every write has landed
        when the iteration ends."""
        if self._host:
            for name in names:
                yield name, self._host[name]
            return
        assert self._pool is not None
        pool = self._pool
        reads: dict[int, Future[dict[str, torch.Tensor]]] = {}
        writes: list[Future[None]] = []
        if names:
            reads[0] = pool.submit(self._read, names[0])
        try:
            for i, name in enumerate(names):
                window = reads.pop(i).result()
                if i + 1 < len(names):  # read-ahead; queued behind the previous write-back
                    reads[i + 1] = pool.submit(self._read, names[i + 1])
                yield name, window
                writes = [w for w in writes if not w.done() or w.result()]
                writes.append(pool.submit(self._write, name, window))
                del window
        finally:
            for f in [*reads.values(), *writes]:
                f.result()

    def step(self, work: Mapping[str, Any], masters: Mapping[str, torch.Tensor],
             grads: Mapping[str, torch.Tensor], update: UpdateFn) -> None:
        """Run ``update`` on every group of ``work`` on the host and copy each updated master
        to its device shard in ``masters``. If it fails half-way, some groups are updated and
        others not: the store then refuses every later step and checkpoint access, so that no
        checkpoint is taken from that state."""
        self._check_usable()
        try:
            for name, window in self.windows(list(work)):
                grad = self.host_grad(grads[name])
                update(window["master"], grad, {k: window[k] for k in self.kinds}, work[name])
                masters[name].copy_(window["master"])
        except BaseException as e:
            self._failed = f"{type(e).__name__}: {e}"
            raise

    def _check_usable(self) -> None:
        if self._failed is not None:
            where = self.run_dir or "host memory"
            raise ShardckptError(
                f"the offloaded optimizer state in {where} is inconsistent: an optimizer step "
                f"failed half-way ({self._failed}); rebuild the engine and resume from the last "
                "checkpoint")

    def close(self) -> None:
        """Release the host state, or close and remove the files."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        self._host = {}
        self._grad = None
        self._finalizer()


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
