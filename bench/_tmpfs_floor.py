"""Helper for ``bench/recovery.py``: the least work the node-local tier's save and resumes can do
on this machine, measured in the same launch (every rank at once, between barriers, as the tier
itself runs):

* ``write``: each rank writes its state's bytes (as many as its shard file holds) into a file on
  the tier's tmpfs whose pages are allocated already (as a spare's are), in 8 MiB ``pwrite``
  calls, taking each piece's CRC32C: what a local save must do at the least;
* ``read``: each rank reads its newest local shard file into memory it holds already, in 8 MiB
  ``preadv`` calls, taking each piece's CRC32C: what a resume from the local tier must do;
* ``peer``: each rank of node 0 reads its own file as ``read`` does (its own resume) and, at the
  same time in a second thread, reads its node's copy of the file of the same local rank of node 1
  and sends it there over the process group (one ``send``/``recv`` of the whole), which CRC32Cs
  it: what a resume from peers, node 1 having lost its copy, must do at the least (node 0 holds
  its own state in memory, not node 1's: the bytes it sends must be read).

Each is the slowest rank's time, median of ``reps``. The tier's own figures over these are how
far it is from the machine's limit, whatever the durable tier's speed.
"""

from __future__ import annotations

import os
import time
from typing import Any

PIECE = 8 << 20


def _crc(view: memoryview) -> None:
    from shardckpt.format.integrity import crc32c

    crc32c(view)


def _timed(fn: Any) -> float:
    import torch.distributed as dist

    dist.barrier()
    t = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - t


def _write(path: str, data: memoryview) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        for pos in range(0, len(data), PIECE):
            piece = data[pos:pos + PIECE]
            os.pwrite(fd, piece, pos)
            _crc(piece)
    finally:
        os.close(fd)


def _read(path: str, into: memoryview) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        for pos in range(0, len(into), PIECE):
            piece = into[pos:pos + PIECE]
            os.preadv(fd, [piece], pos)
            _crc(piece)
    finally:
        os.close(fd)


def floors(shard_file: str, scratch_dir: str, rank: int, ranks_per_node: int,
           reps: int, peer_file: str | None = None) -> dict[str, list[float]]:
    """Seconds of each floor per rep, this rank's view (the caller takes the slowest rank's);
    ``peer_file``: on node 0, its copy of the file it would send to node 1."""
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np
    import torch
    import torch.distributed as dist

    n = os.path.getsize(shard_file)
    src = np.empty(n, np.uint8)
    _read(shard_file, memoryview(src))  # the bytes themselves, and every page of src touched
    scratch = os.path.join(scratch_dir, f".floor-rank-{rank:05d}")
    with open(scratch, "wb") as f:
        f.write(bytes(n))  # allocated and touched, as a spare is
    out: dict[str, list[float]] = {"write": [], "read": [], "peer": []}
    buf = torch.empty(n, dtype=torch.uint8)
    node, local = divmod(rank, ranks_per_node)
    sizes: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(sizes, n)
    got = torch.empty(sizes[local] if node == 1 else 0, dtype=torch.uint8)
    send = torch.empty(os.path.getsize(peer_file) if node == 0 and peer_file else 0, dtype=torch.uint8)
    pool = ThreadPoolExecutor(1)
    try:
        for _ in range(reps):
            out["write"].append(_timed(lambda: _write(scratch, memoryview(src))))
            out["read"].append(_timed(lambda: _read(shard_file, memoryview(buf.numpy()))))

            def peer() -> None:
                if node == 0:
                    own = pool.submit(_read, shard_file, memoryview(buf.numpy()))
                    if peer_file:
                        _read(peer_file, memoryview(send.numpy()))
                    dist.send(send if peer_file else buf, dst=ranks_per_node + local)
                    own.result()
                elif node == 1:
                    dist.recv(got, src=local)
                    _crc(memoryview(got.numpy()))
            out["peer"].append(_timed(peer))
    finally:
        pool.shutdown()
        os.unlink(scratch)
    return out
