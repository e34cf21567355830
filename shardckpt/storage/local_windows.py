"""Checked reads of local files straight into the caller's memory, on several threads.

Every file is cut into windows of whole checksum chunks (:data:`WINDOW_BYTES`, rounded to whole
chunks); the windows of all files go to one pool of threads, each window read with
:func:`~shardckpt.storage.local.read_local_into` (``preadv`` into the targets, every chunk it
touches checked against its CRC32C; the bytes of a touched chunk that no target wants go through a
scratch buffer). Reads and CRC32Cs release the GIL, so one process's load is not one core's copy
and checksum in series, and there is no buffer between the disk and the destination. Every chunk
lies in one window, so each is read and checked once.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from shardckpt.format.manifest import FileEntry
from shardckpt.storage.local import read_local_into

#: Bytes of a file that one thread reads and checks at a time (rounded to whole chunks).
WINDOW_BYTES = 16 << 20

Piece = tuple[int, int, memoryview]           # absolute byte range of the file, its target
LocalPieces = tuple[str, str, FileEntry, Sequence[Piece]]   # path, URL for errors, entry, pieces


def cut(pieces: Sequence[Piece], chunk_size: int) -> list[list[Piece]]:
    """``pieces`` cut at the edges of windows of whole chunks: the pieces of each window touched,
    in file order. Pure."""
    step = max(1, WINDOW_BYTES // chunk_size) * chunk_size
    out: dict[int, list[Piece]] = {}
    for a, b, view in pieces:
        at = a
        while at < b:
            end = min(b, (at // step + 1) * step)
            out.setdefault(at // step, []).append((at, end, view[at - a:end - a]))
            at = end
    return [out[w] for w in sorted(out)]


def read_windows(files: Sequence[LocalPieces], chunk_size: int, threads: int) -> None:
    """Fill every piece of ``files`` from its local file, the windows of all files read and
    checked by up to ``threads`` threads at once. The first failure (an
    :class:`~shardckpt.errors.IntegrityError` naming the file and the chunk, or a storage error)
    is raised once the windows already started end; those not started are cancelled."""
    work = [(path, url, entry, w) for path, url, entry, pieces in files
            for w in cut(pieces, chunk_size)]
    if len(work) < 2 or threads < 2:
        for path, url, entry, w in work:
            read_local_into(path, url, entry, chunk_size, w)
        return
    pool = ThreadPoolExecutor(min(threads, len(work)), thread_name_prefix="shardckpt-read")
    try:
        for done in [pool.submit(read_local_into, path, url, entry, chunk_size, w)
                     for path, url, entry, w in work]:
            done.result()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
