"""Checkpoint files from one rank's node directory to another's, over the process group.

Every rank walks the same list of :class:`~shardckpt.checkpoint.tiers.Transfer` in the same
order and takes part in its own: so the first transfer not yet done always has both of its ranks
at it, and the list cannot deadlock. One transfer: the sender offers the file's size, the receiver
answers whether it takes it (its size as recorded, room for it), then the bytes go in pieces of
:data:`PIECE` bytes; the receiver streams them into a temporary name through the checksumming
writer, compares size and CRC32C (per chunk and whole) with the manifest's entry, and only then
renames the file into place. A refused, damaged or unwritable transfer (a full disk) is
remembered, its remaining pieces are still taken (so the two ranks stay in step), the others go
on, and the receiver raises at the end (inside the caller's agreement, so every rank sees it).

A file can also go straight into the receiver's memory (:func:`receive_into`, a load from
peers, into shards on any device): the receiver then answers the offer with the spans it wants,
in file order (windows of whole chunks, one buffer of the read pipeline's ring each), the sender
sends span by span, and worker threads check every chunk's CRC32C and copy each target's bytes
out of the ring while the next window arrives (:mod:`.peer_pipe`); nothing is written to disk.

What a peer says is checked before it is used (:mod:`.peer_checks`): a path must stay inside the
step (a ``../step-N/...`` frozen reference is not a place to write), the spans a receiver asks
for must tile the file in pieces of at most :data:`PIECE` bytes, and the sender opens regular
files only; a stream cut in the middle leaves no staged file and no open descriptor. With a job
secret every message is authenticated (:mod:`.peer_channel`, :mod:`shardckpt.checkpoint.job_secret`).
"""

from __future__ import annotations

import logging
import os
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any
from collections.abc import Callable, Mapping, Sequence

from shardckpt.checkpoint.tiers import Transfer, is_full
from shardckpt.errors import InsufficientSpaceError, IntegrityError, ShardckptError
from shardckpt.format.manifest import FileEntry
from shardckpt.storage import IOConfig, Storage, open_regular
from shardckpt.checkpoint.job_secret import SECRET_VARIABLE
from shardckpt.training.peer_channel import Channel
from shardckpt.training.peer_checks import checked_count, checked_spans, outside_step
from shardckpt.training.peer_pipe import Pieces, stream_into

log = logging.getLogger(__name__)

#: Bytes per message at most: the sender's memory for one transfer is two pieces (the next one
#: is read while one is sent), the receiver's to disk one; into memory the receiver holds the
#: read pipeline's ring instead.
PIECE = 64 << 20

#: The receiver's answers to an offer: refused, the whole file in pieces, the spans it names.
REFUSE, WHOLE, SPANS = 0, 1, 2

def send_file(storage: Storage, entry: FileEntry, dst: int, group: Any) -> None:
    """Offer ``entry`` (in ``storage``) to ``dst``; send it if it is taken, in pieces of
    :data:`PIECE` bytes or in the spans the receiver names (checked before anything is
    allocated for them: :func:`~shardckpt.training.peer_checks.checked_spans`). Only a regular
    file is opened (a FIFO would block the sender)."""
    import torch

    try:
        f: Any = open_regular(storage.full(entry.path), storage.url_of(entry.path))
        size = os.fstat(f.fileno()).st_size
    except (OSError, ShardckptError) as e:
        log.warning("peer copy: cannot read %s: %s", storage.url_of(entry.path), e)
        f, size = None, -1
    url = storage.url_of(entry.path)
    try:
        ch = Channel(dst, group, sending=True)
        ch.open()
        ch.send(torch.tensor([size], dtype=torch.int64))
        answer = torch.zeros(1, dtype=torch.int64)
        _authentic(ch.recv(answer), dst, "answer", url)
        how = int(answer.item())
        if how == REFUSE:
            return
        if how == SPANS:
            count = torch.zeros(1, dtype=torch.int64)
            _authentic(ch.recv(count), dst, "request", url)
            n = checked_count(int(count.item()), size, dst, url)
            lengths = torch.zeros(n, dtype=torch.int64)
            if lengths.numel():
                _authentic(ch.recv(lengths), dst, "request", url)
            sizes = checked_spans(lengths.tolist(), size, PIECE, dst, url)
        else:
            sizes = [min(PIECE, size - x) for x in range(0, max(size, 0), PIECE)]
        _send_spans(f, sizes, ch)
    finally:
        if f is not None:
            f.close()


def _send_spans(f: Any, sizes: Sequence[int], ch: Channel) -> None:
    """Send the next ``sizes`` bytes of ``f`` (None: a file that cannot be read), span by span;
    the next span is read into a second buffer while this one is sent."""
    import torch

    bufs = [torch.empty(max([1, *sizes]), dtype=torch.uint8) for _ in range(min(2, len(sizes)))]

    def fill(k: int) -> Any:
        view = bufs[k % 2][:sizes[k]]
        got = f.readinto(view.numpy().data) if f is not None else 0
        if got != sizes[k]:
            view.zero_()  # the receiver's checksum refuses it
        return view

    with ThreadPoolExecutor(1, thread_name_prefix="shardckpt-peer-read") as pool:
        ahead = pool.submit(fill, 0) if sizes else None
        for k in range(len(sizes)):
            assert ahead is not None
            view = ahead.result()
            ahead = pool.submit(fill, k + 1) if k + 1 < len(sizes) else None
            ch.send(view)  # returns once sent: its buffer is the one read into next but one


def _authentic(ok: bool, peer: int, what: str, url: str) -> None:
    if not ok:
        raise IntegrityError(f"peer copy of {url}: the {what} of rank {peer} fails its "
                             f"authentication ({SECRET_VARIABLE} differs, or someone else "
                             "speaks for that rank); nothing more sent")


def _offer(storage: Storage, entry: FileEntry, ch: Channel,
           room: Callable[[int], None]) -> tuple[str, bool] | None:
    """Take the offer of ``entry`` on ``ch``: None where it can be taken, else the problem (and
    whether it is a lack of room), the offer then refused."""
    import torch

    src = ch.peer
    ch.open()
    offer = torch.zeros(1, dtype=torch.int64)
    authentic = ch.recv(offer)
    size = int(offer.item())
    problem: tuple[str, bool] | None = None
    outside = outside_step(entry.path)
    if not authentic:
        problem = (f"{storage.url_of(entry.path)}: the offer of rank {src} fails its "
                   f"authentication ({SECRET_VARIABLE}); not taken", False)
    elif outside:
        problem = (f"{storage.url_of('')}: rank {src} offers {entry.path!r}, {outside}; not "
                   "written", False)
    elif size != entry.size:
        problem = (f"rank {src} offers {storage.url_of(entry.path)} with {size} bytes, the "
                   f"manifest records {entry.size}", False)
    else:
        try:
            room(size)
        except InsufficientSpaceError as e:
            problem = (str(e), True)
    if problem:
        ch.send(torch.tensor([REFUSE], dtype=torch.int64))
    return problem


def receive_file(storage: Storage, entry: FileEntry, chunk_size: int, src: int, group: Any,
                 room: Callable[[int], None]) -> tuple[str, bool] | None:
    """Take ``entry`` from ``src`` into ``storage`` (under its path, renamed into place once
    whole and checked); ``room(nbytes)`` raises where there is none. Returns None, or a problem
    and whether it is a lack of room."""
    import torch

    ch = Channel(src, group, sending=False)
    problem = _offer(storage, entry, ch, room)
    if problem:
        return problem
    ch.send(torch.tensor([WHOLE], dtype=torch.int64))
    size = entry.size
    staged = storage.staging_name(entry.path, uuid.uuid4().hex[:12])
    w = storage.writer(staged, chunk_size)
    try:
        failed = _take(w, size, ch)
    except BaseException:  # a cut stream: nothing staged stays, no descriptor stays open
        w.abort()
        raise
    if failed is None:
        try:
            got = w.close()
        except (OSError, ShardckptError) as e:
            failed = e
    if failed is not None:
        return (f"{storage.url_of(entry.path)}: the copy from rank {src} could not be written "
                f"({failed}); not kept", is_full(failed))
    if (got[0], got[1], tuple(got[2])) != (entry.size, entry.crc32c, tuple(entry.chunk_crc32c)):
        storage.rm(staged)
        return (f"{storage.url_of(entry.path)}: the copy from rank {src} does not match its "
                "manifest entry (size or CRC32C); not kept", False)
    try:
        storage.install(staged, entry.path)
    except BaseException:
        storage.rm(staged)
        raise
    return None


def _take(w: Any, size: int, ch: Channel) -> BaseException | None:
    """Receive ``size`` bytes on ``ch`` into the writer ``w``; the error that stopped the
    writing (the rest still received, then dropped; ``w`` then aborted), or None."""
    import torch

    buf = torch.empty(min(PIECE, max(size, 1)), dtype=torch.uint8)
    failed: BaseException | None = None
    for x in range(0, size, PIECE):
        view = buf[:min(PIECE, size - x)]
        authentic = ch.recv(view)
        if failed is None and not authentic:
            failed = IntegrityError(f"a piece from rank {ch.peer} fails its authentication "
                                    f"({SECRET_VARIABLE})")
            w.abort()
        if failed is None:
            try:
                w.write(view.numpy())
            except (OSError, ShardckptError) as e:  # the rest is still taken, then dropped
                failed = e
                w.abort()
    return failed


def receive_into(storage: Storage, entry: FileEntry, chunk_size: int, src: int, group: Any,
                 pieces: Pieces, config: IOConfig | None = None) -> tuple[str, bool] | None:
    """Take ``entry`` from ``src`` straight into memory: each target of ``pieces`` ((start, end,
    target), byte ranges of the file; a target is a memoryview or ``(uint8 tensor, byte
    offset)`` on any device) gets its bytes through the read pipeline's ring, every chunk of the
    file checked against its CRC32C in worker threads while the next bytes arrive
    (:func:`~shardckpt.training.peer_pipe.stream_into`); nothing is written (``storage`` names
    the file in messages). Returns None, or the problem (the targets then hold bytes that must
    not be used)."""
    import torch

    ch = Channel(src, group, sending=False)
    problem = _offer(storage, entry, ch, lambda n: None)
    if problem:
        return problem
    ch.send(torch.tensor([SPANS], dtype=torch.int64))
    bad = stream_into(ch, entry, chunk_size, storage.url_of(entry.path), pieces, PIECE, config)
    return None if bad is None else (bad, False)


def run_transfers(plan: Sequence[Transfer], rank: int, storage: Storage,
                  entries: Mapping[str, FileEntry], chunk_size: int, group: Any,
                  room: Callable[[int], None] = lambda n: None,
                  into: Mapping[str, Pieces] | None = None) -> int:
    """Do this rank's part of ``plan`` (the same list, in the same order, on every rank), with
    ``storage`` this rank's node directory of the checkpoint; a file this rank receives whose
    path ``into`` names goes straight into those pieces (:func:`receive_into`), not to disk.
    Raises :class:`~shardckpt.errors.IntegrityError` naming what this rank could not take (after
    every transfer has run). Returns the number of files received."""
    problems: list[tuple[str, bool]] = []
    received = 0
    for t in plan:
        if t.src == rank:
            send_file(storage, entries[t.path], t.dst, group)
        elif t.dst == rank:
            if into is not None and t.path in into:
                problem = receive_into(storage, entries[t.path], chunk_size, t.src, group, into[t.path])
            else:
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
