"""Save and load on S3: ``R`` processes, one per rank, each writing or reading its own shard.

Run by ``bench/s3.py`` (credentials and endpoint from the AWS environment variables):

    python bench/s3_save_load.py SIDE OP SRC DST RANKS

* ``shardckpt save``: each process holds its rank's shard of checkpoint SRC in memory (read
  before the clock starts) and streams it to DST through :class:`CheckpointWriter` (checksums
  as the bytes go by); the parent commits the manifest once every file is written: a save's
  storage path, without the training engine.
* ``shardckpt load``: each process opens DST's manifest and reads its shard's state with
  checked ranged reads (:meth:`CheckpointReader.read_ranges`, 8 requests in flight).
* ``s3fs save`` / ``s3fs load``: the peer, plain s3fs: each process uploads the same bytes as one
  object (``fs.open(wb)``, 8 MiB blocks) or reads its object whole (``fs.cat_file``), unchecked.

The clock runs from a barrier every process passes with its data ready to the end of the last
process (and of the commit); prints ``{"seconds": ..., "bytes": ...}``.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import queue
import sys
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
BLOCK = 8 << 20


def options() -> dict[str, Any]:
    return {"key": os.environ["AWS_ACCESS_KEY_ID"], "secret": os.environ["AWS_SECRET_ACCESS_KEY"],
            "client_kwargs": {"endpoint_url": os.environ["AWS_ENDPOINT_URL"]}}


def _shard_data(src: str, rank: int) -> dict[str, bytes]:
    """Rank ``rank``'s shard of ``src``, slot by slot (and the buffers on rank 0)."""
    from shardckpt.checkpoint.reader import CheckpointReader

    reader = CheckpointReader(src, options())
    names = list(reader.slots)
    parts = reader.read_ranges([reader.state_range(rank, *n.rsplit(".", 1), 0,
                                                   reader.slots[n].shape[0]) for n in names])
    data = {n: bytes(p) for n, p in zip(names, parts, strict=False)}
    if rank == 0:
        data.update({f"buffer:{k}": bytes(reader.read_buffer(k)[1]) for k in reader.buffer_slots})
    return data


def _rank(side: str, op: str, src: str, dst: str, rank: int, barrier: Any, out: Any) -> None:
    import s3fs

    from shardckpt.checkpoint.reader import CheckpointReader, as_storage
    from shardckpt.checkpoint.writer import CheckpointSpec, CheckpointWriter

    fs = s3fs.S3FileSystem(skip_instance_cache=True, **options())
    data = _shard_data(src, rank) if op == "save" else {}
    barrier.wait()
    t0 = time.time()
    report: dict[str, Any] = {"t0": t0}
    if side == "s3fs" and op == "save":
        with fs.open(f"{dst.removeprefix('s3://')}/rank-{rank:05d}.bin", "wb", block_size=BLOCK) as w:
            for piece in data.values():
                w.write(piece)
        report["bytes"] = sum(map(len, data.values()))
    elif side == "s3fs":
        report["bytes"] = len(fs.cat_file(f"{dst.removeprefix('s3://')}/rank-{rank:05d}.bin"))
    elif op == "save":
        m = CheckpointReader(src, options()).manifest
        spec = CheckpointSpec(m.mesh, m.components, m.optimizer, m.extras, m.per_rank_state,
                              m.chunk_size)
        writer = CheckpointWriter(as_storage(dst, options()), spec, os.environ["BENCH_SAVE_ID"])
        entries = [writer.write_shard(rank, lambda slot: [data[slot.name]])]
        if rank == 0:
            b = writer.write_buffers(lambda slot: [data[f"buffer:{slot.name}"]])
            entries += [b] if b is not None else []
        report["entries"] = [e.to_doc() for e in entries]
        report["bytes"] = sum(e.size for e in entries)
    else:
        reader = CheckpointReader(dst, options())
        names = list(reader.slots)
        parts = reader.read_ranges([reader.state_range(rank, *n.rsplit(".", 1), 0,
                                                       reader.slots[n].shape[0]) for n in names])
        report["bytes"] = sum(len(p) for p in parts)
    report["t1"] = time.time()
    out.put((rank, report))


def _collect(procs: list[Any], out: Any) -> dict[int, dict[str, Any]]:
    """Every rank's report; a rank process that ends without one (an error, a kill) ends the
    job at once instead of leaving it waiting for a report that never comes."""
    reports: dict[int, dict[str, Any]] = {}
    while len(reports) < len(procs):
        try:
            rank, report = out.get(timeout=5)
        except queue.Empty:
            dead = [(r, p.exitcode) for r, p in enumerate(procs)
                    if p.exitcode is not None and (p.exitcode != 0 or r not in reports)]
            if dead and out.empty():
                raise SystemExit(f"rank process {dead[0][0]} ended without a report "
                                 f"(exit code {dead[0][1]})") from None
            continue
        reports[rank] = report
    return reports


def main(side: str, op: str, src: str, dst: str, ranks: int) -> None:
    from shardckpt.checkpoint.reader import CheckpointReader, as_storage
    from shardckpt.checkpoint.writer import CheckpointSpec, CheckpointWriter, new_save_id
    from shardckpt.format.manifest import FileEntry

    os.environ["BENCH_SAVE_ID"] = new_save_id()
    writer = None
    if side == "shardckpt" and op == "save":  # the committing writer, ready before the clock
        m = CheckpointReader(src, options()).manifest
        spec = CheckpointSpec(m.mesh, m.components, m.optimizer, m.extras, m.per_rank_state,
                              m.chunk_size)
        writer = CheckpointWriter(as_storage(dst, options()), spec, os.environ["BENCH_SAVE_ID"])
    ctx = mp.get_context("spawn")
    barrier, out = ctx.Barrier(ranks), ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(side, op, src, dst, r, barrier, out))
             for r in range(ranks)]
    for p in procs:
        p.start()
    reports = _collect(procs, out)
    for p in procs:
        p.join(timeout=600)
        if p.exitcode != 0:
            raise SystemExit(f"rank process failed ({p.exitcode})")
    end = max(r["t1"] for r in reports.values())
    if writer is not None:  # the commit, once every file is written
        writer.commit([FileEntry.from_doc(d) for r in reports.values() for d in r["entries"]])
        end = time.time()
    print(json.dumps({"seconds": round(end - min(r["t0"] for r in reports.values()), 4),
                      "bytes": sum(r["bytes"] for r in reports.values())}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]))
