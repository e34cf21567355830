"""Checkpoint files from one rank's node directory to another's, over the process group.

Every rank walks the same list of :class:`~shardckpt.checkpoint.tiers.Transfer` in the same
order and takes part in its own: so the first transfer not yet done always has both of its ranks
at it, and the list cannot deadlock. One transfer: the sender offers the file's size, the receiver
answers whether it takes it (its size as recorded, room for it), then the bytes go in pieces of
:data:`PIECE` bytes; the receiver streams them into a temporary name through the checksumming
writer, compares size and CRC32C (per chunk and whole) with the manifest's entry, and only then
renames the file into place. A refused or damaged transfer is remembered, the others go on, and
the receiver raises at the end (inside the caller's agreement, so every rank sees it).
"""

from __future__ import annotations

import logging
import uuid
from typing import Any
from collections.abc import Callable, Mapping, Sequence

from shardckpt.checkpoint.tiers import Transfer
from shardckpt.errors import InsufficientSpaceError, IntegrityError, ShardckptError
from shardckpt.format.manifest import FileEntry
from shardckpt.storage import Storage

log = logging.getLogger(__name__)

#: Bytes per message: memory for one transfer is one piece on each side.
PIECE = 64 << 20


def send_file(storage: Storage, entry: FileEntry, dst: int, group: Any) -> None:
    """Offer ``entry`` (in ``storage``) to ``dst``; send it in pieces if it is taken."""
    import torch
    import torch.distributed as dist

    path = storage.full(entry.path)
    try:
        f: Any = open(path, "rb")  # noqa: SIM115 - closed below
        size = storage.size(entry.path)
    except (OSError, ShardckptError) as e:
        log.warning("peer copy: cannot read %s: %s", storage.url_of(entry.path), e)
        f, size = None, -1
    try:
        dist.send(torch.tensor([size], dtype=torch.int64), dst, group=group)
        answer = torch.zeros(1, dtype=torch.int64)
        dist.recv(answer, dst, group=group)
        if f is None or not int(answer.item()):
            return
        buf = torch.empty(min(PIECE, max(size, 1)), dtype=torch.uint8)
        left = size
        while left > 0:
            n = min(left, buf.numel())
            view = buf[:n]
            got = f.readinto(view.numpy().data)
            if got != n:
                view.zero_()  # the receiver's checksum refuses it
            dist.send(view, dst, group=group)
            left -= n
    finally:
        if f is not None:
            f.close()


def receive_file(storage: Storage, entry: FileEntry, chunk_size: int, src: int, group: Any,
                 room: Callable[[int], None]) -> tuple[str, bool] | None:
    """Take ``entry`` from ``src`` into ``storage`` (under its path, renamed into place once
    whole and checked); ``room(nbytes)`` raises where there is none. Returns None, or a problem
    and whether it is a lack of room."""
    import torch
    import torch.distributed as dist

    offer = torch.zeros(1, dtype=torch.int64)
    dist.recv(offer, src, group=group)
    size = int(offer.item())
    problem: tuple[str, bool] | None = None
    if size != entry.size:
        problem = (f"rank {src} offers {storage.url_of(entry.path)} with {size} bytes, the "
                   f"manifest records {entry.size}", False)
    else:
        try:
            room(size)
        except InsufficientSpaceError as e:
            problem = (str(e), True)
    dist.send(torch.tensor([0 if problem else 1], dtype=torch.int64), src, group=group)
    if problem:
        return problem
    staged = storage.staging_name(entry.path, uuid.uuid4().hex[:12])
    buf = torch.empty(min(PIECE, max(size, 1)), dtype=torch.uint8)
    with storage.writer(staged, chunk_size) as w:
        left = size
        while left > 0:
            n = min(left, buf.numel())
            view = buf[:n]
            dist.recv(view, src, group=group)
            w.write(view.numpy())
            left -= n
        got_size, crc, chunks = w.close()
    if (got_size, crc, tuple(chunks)) != (entry.size, entry.crc32c, tuple(entry.chunk_crc32c)):
        storage.rm(staged)
        return (f"{storage.url_of(entry.path)}: the copy from rank {src} does not match its "
                "manifest entry (size or CRC32C); not kept", False)
    storage.install(staged, entry.path)
    return None


def run_transfers(plan: Sequence[Transfer], rank: int, storage: Storage,
                  entries: Mapping[str, FileEntry], chunk_size: int, group: Any,
                  room: Callable[[int], None] = lambda n: None) -> int:
    """Do this rank's part of ``plan`` (the same list, in the same order, on every rank), with
    ``storage`` this rank's node directory of the checkpoint. Raises
    :class:`~shardckpt.errors.IntegrityError` naming what this rank could not take (after every
    transfer has run). Returns the number of files received."""
    problems: list[tuple[str, bool]] = []
    received = 0
    for t in plan:
        if t.src == rank:
            send_file(storage, entries[t.path], t.dst, group)
        elif t.dst == rank:
            problem = receive_file(storage, entries[t.path], chunk_size, t.src, group, room)
            if problem is None:
                received += 1
            else:
                problems.append(problem)
    if problems:
        cls = InsufficientSpaceError if any(full for _, full in problems) else IntegrityError
        raise cls(f"peer copy: {len(problems)} file(s) not taken: "
                  + "; ".join(p for p, _ in problems[:3]))
    return received
