"""The ``"nvme"`` store's windows: one group's master and state kinds read from their files
(:mod:`~shardckpt.runtime.offload.files`) into host tensors, stepped, and written back.

:func:`file_windows` yields them in order, reading one group ahead and writing each back in the
background once the caller moves on, on the store's worker thread: at most three groups' windows
are in memory at once (the one being stepped, the one read ahead, the one written back).
"""

from __future__ import annotations

from concurrent.futures import Executor, Future
from typing import Any
from collections.abc import Generator, Mapping, Sequence

import torch

from shardckpt.runtime.offload.files import OffloadedShard, as_bytes, pread_into, pwrite_from

__all__ = ["file_windows", "read_window", "write_window"]

Files = Mapping[tuple[str, str], OffloadedShard]


def read_window(files: Files, name: str, numel: int, kinds: Sequence[str],
                pin: bool = False) -> dict[str, torch.Tensor]:
    """Group ``name``'s ``kinds`` (``"master"`` first), fresh host tensors read from its files."""
    out = {}
    for kind in kinds:
        t = torch.empty(numel, dtype=torch.float32, pin_memory=pin)
        f = files[name, kind]
        pread_into(f.fd, as_bytes(t), 0, f.path)
        out[kind] = t
    return out


def write_window(files: Files, name: str, window: Mapping[str, torch.Tensor]) -> None:
    """Write ``window`` (:func:`read_window`'s, updated) back into group ``name``'s files."""
    for kind, t in window.items():
        f = files[name, kind]
        pwrite_from(f.fd, as_bytes(t), 0, f.path)


def file_windows(pool: Executor, files: Files, sizes: Mapping[str, int], names: Sequence[str],
                 kinds: Sequence[str], pin: bool = False
                 ) -> Generator[tuple[str, dict[str, torch.Tensor]], None, None]:
    """Each group of ``names`` with its window, in order (module docstring). Every write has
    landed when the iteration ends or the iterator is closed."""
    reads: dict[int, Future[dict[str, torch.Tensor]]] = {}
    writes: list[Future[None]] = []
    if names:
        reads[0] = pool.submit(read_window, files, names[0], sizes[names[0]], kinds, pin)
    try:
        for i, name in enumerate(names):
            window = reads.pop(i).result()
            if i + 1 < len(names):  # read-ahead; queued behind the previous write-back
                nxt = names[i + 1]
                reads[i + 1] = pool.submit(read_window, files, nxt, sizes[nxt], kinds, pin)
            yield name, window
            writes = [w for w in writes if not w.done() or w.result()]
            writes.append(pool.submit(write_window, files, name, window))
            del window
    finally:
        pending: list[Future[Any]] = [*reads.values(), *writes]
        for f in pending:
            f.result()
