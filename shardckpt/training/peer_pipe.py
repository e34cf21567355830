"""A file from a peer straight into memory through the read pipeline's ring
(:mod:`shardckpt.checkpoint.tensor_reads`): the receiving end of
:func:`~shardckpt.training.peer_copy.receive_into` once the offer is taken.

The receiver asks for the whole file in windows of whole chunks, one ring buffer each (each
window sent as spans of at most ``cap`` bytes, the sender's message limit). This thread receives
window after window into free buffers of the ring (``SHARDCKPT_IO_BUFFERS`` of
``SHARDCKPT_IO_BUFFER_SIZE``, pinned where a destination is on CUDA); worker threads
(``SHARDCKPT_IO_THREADS``) check every chunk's CRC32C and copy each piece's part into its
destination (``copy_`` on CPU, ``non_blocking`` on a side stream on CUDA), while the next window
arrives. A buffer is refilled only once its copy is done, so the host memory of a transfer is the
ring whatever the file's size, and no host copy of the destinations is made.

A chunk that fails its check, or a message that fails its authentication, is a problem returned
to the caller (the rest of the file is still received, then dropped, so both ranks stay in step);
a worker that dies is raised once the rest is received; a receive that fails (the peer gone)
stops the workers and is raised. Nothing waits forever on a dead thread.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from shardckpt.checkpoint.job_secret import SECRET_VARIABLE
from shardckpt.checkpoint.tensor_reads import Copier, host_ring, pinnable
from shardckpt.errors import IntegrityError
from shardckpt.format.manifest import FileEntry
from shardckpt.storage import IOConfig, Slot, check_chunks, windows
from shardckpt.training.peer_channel import Channel

#: (start, end, target): file bytes [start, end) go to ``target``, a writable memoryview of
#: ``end - start`` bytes or ``(uint8 tensor, byte offset)`` (its own memory, any device)
Pieces = Sequence[tuple[int, int, Any]]


def span_lengths(plan: Sequence[tuple[int, int, Any]], cap: int) -> list[int]:
    """The lengths of the spans asked for: each window ``[w0, w1)`` of ``plan`` cut into spans of
    at most ``cap`` bytes. Together they tile the file. Pure."""
    return [min(cap, w1 - x) for w0, w1, _ in plan for x in range(w0, w1, cap)]


class _Outcome:
    """The first problem (a chunk, a tag) and the first failure (a dying worker) of a stream."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.problem: str | None = None
        self.failure: BaseException | None = None
        self.cancelled = False

    def note(self, problem: str | None = None, failure: BaseException | None = None) -> None:
        with self.lock:
            self.problem = self.problem or problem
            self.failure = self.failure or failure

    @property
    def stopped(self) -> bool:
        return self.cancelled or self.problem is not None or self.failure is not None


def stream_into(ch: Channel, entry: FileEntry, chunk_size: int, url: str, pieces: Pieces, cap: int,
                config: IOConfig | None = None) -> str | None:
    """Ask ``ch``'s peer for ``entry``'s bytes (the offer already taken, ``SPANS`` answered) and
    hand each piece's part to its target (see the module docstring); returns None, or the
    problem (the targets then hold bytes that must not be used)."""
    import torch

    cfg = config or IOConfig.from_env()
    cs, size = chunk_size, entry.size
    ring = host_ring(cfg, cfg.slot_bytes(cs), pinnable([t[0] for _, _, t in pieces
                                                         if isinstance(t, tuple)]))
    plan = windows(size, cs, [(0, size, None), *pieces], ring.nbytes // cs)
    lengths = span_lengths(plan, cap)
    ch.send(torch.tensor([len(lengths)], dtype=torch.int64))
    if lengths:
        ch.send(torch.tensor(lengths, dtype=torch.int64))
    copier, out = Copier(), _Outcome()
    where = f"{url} (from rank {ch.peer})"

    def put(target: Any, at: int, slot: Slot, lo: int, hi: int) -> None:
        if isinstance(target, memoryview):
            target[at:at + hi - lo] = slot.view[lo:hi]
        else:
            copier.put(target, at, slot, lo, hi)

    def work(w0: int, w1: int, parts: list[tuple[Any, int, int, int]], slot: Slot) -> None:
        try:
            if out.stopped:
                return
            check_chunks(entry, cs, where, w0, slot.view[:w1 - w0])
            for target, at, lo, hi in parts:
                if target is not None:
                    put(target, at, slot, lo, hi)
        except IntegrityError as e:  # the rest is still received, then dropped
            out.note(problem=str(e))
        except BaseException as e:  # noqa: BLE001 - raised once the stream is over
            out.note(failure=e)
        finally:
            ring.release(slot)

    never = threading.Event()
    pool = ThreadPoolExecutor(max(1, cfg.threads), thread_name_prefix="shardckpt-peer-check")
    try:
        for w0, w1, parts in plan:
            slot = ring.acquire(never)  # every worker gives its buffer back, whatever happens
            authentic = True
            for x in range(w0, w1, cap):
                authentic &= ch.recv(slot.handle[x - w0:min(w1, x + cap) - w0])
            if not authentic:
                out.note(problem=f"{url}: a piece from rank {ch.peer} fails its authentication "
                                 f"({SECRET_VARIABLE})")
            if out.stopped:
                ring.release(slot)
                continue
            pool.submit(work, w0, w1, parts, slot)
    except BaseException:
        out.cancelled = True  # a receive that failed: the workers stop at their next window
        raise
    finally:
        pool.shutdown(wait=True)
        try:
            ring.drain()
        finally:
            copier.finish()
    if out.failure is not None:
        raise out.failure
    return out.problem
