"""Offline resharding: turn a checkpoint of N ranks into one of M ranks (or another HSDP mesh).

Streams through the pure :func:`~shardckpt.format.layout.plan_reshard` plan: each target shard file is
written front to back, its bytes read from the source shards with checked ranged reads in pieces of
at most ``buffer_bytes``; memory is bounded by that buffer (plus a few cached boundary chunks), not
by the checkpoint. Target shards can be split over K worker processes. The target's manifest is
created last, so an interrupted or failed reshard leaves nothing a reader takes for whole.
Per-rank state (RNG) cannot follow a change of world size: it is dropped, and the manifest says so.
"""

from __future__ import annotations

import json
import logging
import multiprocessing as mp
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterator, Mapping, Sequence

from shardckpt.checkpoint.reader import CheckpointReader, as_storage

from shardckpt.checkpoint.writer import CheckpointSpec, CheckpointWriter
from shardckpt.storage.cached_reads import CachedRangeReader
from shardckpt.errors import ConfigError, IncompatibleLayoutError, ShardckptError, StorageError
from shardckpt.format.dtypes import itemsize
from shardckpt.format.layout import Copy, Mesh, ReshardPlan, plan_reshard
from shardckpt.tools.clean import remove_stale_saves
from shardckpt.tools.split import balance, shard_bytes
from shardckpt.format.manifest import (
    MANIFEST_NAME, MAX_MANIFEST_BYTES, Component, FileEntry, Manifest, TensorSlot, parse,
)
from shardckpt.storage import Storage
from shardckpt.storage.places import contains

log = logging.getLogger(__name__)

DEFAULT_BUFFER = 32 << 20
#: Smallest read batch: below it, batches re-read (and re-check) each source chunk many times.
MIN_BUFFER = 64 << 10


@dataclass(frozen=True)
class ReshardResult:
    manifest: Manifest
    source_world_size: int
    bytes_written: int
    bytes_read: int
    seconds: float


def target_spec(src: Manifest, mesh: Mesh) -> tuple[CheckpointSpec, dict[str, ReshardPlan]]:
    """The target's manifest-to-be and one plan per component. Pure."""
    components: dict[str, Component] = {}
    plans: dict[str, ReshardPlan] = {}
    for name, c in src.components.items():
        layout = c.layout.with_mesh(mesh)
        plans[name] = plan_reshard(c.layout, layout)
        components[name] = replace(c, layout=layout)
    per_rank = {"world_size": mesh.world_size,
                "dropped_from_world_size": src.mesh.world_size,
                "note": "per-rank state (RNG) cannot follow a change of world size; reshard dropped it"}
    spec = CheckpointSpec(mesh, components, src.optimizer, dict(src.extras), per_rank, src.chunk_size)
    return spec, plans


def _shard_producers(reader: CheckpointReader, ranged: CachedRangeReader, plans: Mapping[str, ReshardPlan],
                     shards: Sequence[int], slots: Sequence[TensorSlot], buffer_bytes: int,
                     prefetch: ThreadPoolExecutor, on_bytes: Callable[[int], None] | None,
                     read_workers: int = 4,
                     ) -> Callable[[int], Callable[[TensorSlot], Iterator[Any]]]:
    """``for_shard(t)`` is the slot producer of shard ``t``; write the shards in ``shards`` order.

    The pieces of every slot of each shard are planned up front and cut into batches of at most
    ``buffer_bytes`` that run across slot boundaries (small slots share a batch, so adjacent
    ranges of one source file coalesce into one read). The next batch is read on the ``prefetch``
    thread while the current one is written, so at most two batches are held at once; within a
    batch, source files are read concurrently (``read_workers``). The read-ahead runs across
    shards: the first batch of the next shard is read while the last one of this shard is written.

    A local source is not copied: each range is a view of the mapped source file, its chunks
    CRC-checked once (:meth:`~shardckpt.storage.cached_reads.CachedRangeReader.map_many`), written straight
    from the page cache; a batch's mappings go when the batch has been written.
    """
    def plan_shard(shard: int) -> list[list[tuple[int, Any]]]:
        by_group: dict[str, list[Copy]] = {}
        for plan in plans.values():
            for c in plan.for_dst_shard(shard):
                by_group.setdefault(c.dst_group, []).append(c)

        # Each batch: (slot index, piece) pairs; a piece is an int (that many zero bytes) or a read.
        batches: list[list[tuple[int, Any]]] = [[]]
        batch_bytes = 0
        for si, slot in enumerate(slots):
            group, kind = slot.name.rsplit(".", 1)
            n = itemsize(slot.dtype)
            max_elems = max(1, buffer_bytes // n)
            pos = 0

            def add(piece: Any, nbytes: int) -> None:
                nonlocal batch_bytes
                if batch_bytes + nbytes > buffer_bytes and batches[-1]:
                    batches.append([])
                    batch_bytes = 0
                batches[-1].append((si, piece))
                batch_bytes += nbytes

            for c in by_group.get(group, ()):
                if c.dst_offset > pos:
                    add((c.dst_offset - pos) * n, 0)
                for x in range(0, c.numel, max_elems):
                    take = min(c.numel - x, max_elems)
                    add(reader.state_range(c.src_shard, c.src_group, kind,
                                           c.src_offset + x, c.src_offset + x + take), take * n)
                pos = c.dst_offset + c.numel
            if pos < slot.shape[0]:
                add((slot.shape[0] - pos) * n, 0)
        return batches

    # Every batch of every shard, in the order they are written: (shard, batch).
    batches = [(t, b) for t in shards for b in plan_shard(t) if b]

    zeros = bytes(max((p for _, b in batches for _, p in b if isinstance(p, int)), default=0))

    def fetch(batch: list[tuple[int, Any]], k: int) -> list[tuple[int, Any]]:
        reads = [p for _, p in batch if not isinstance(p, int)]
        if ranged.storage.can_map:
            data = iter(ranged.map_many(reads))
        else:
            data = iter(ranged.read_many(reads, workers=read_workers))
        zview = memoryview(zeros)
        return [(si, zview[:p] if isinstance(p, int) else next(data)) for si, p in batch]

    index = {s.name: i for i, s in enumerate(slots)}
    state: dict[str, Any] = {"next": 0, "pending": None, "pending_shard": None, "current": [], "pos": 0}

    def submit() -> None:
        k = state["next"]
        if state["pending"] is None and k < len(batches):
            state["pending"] = prefetch.submit(fetch, batches[k][1], k)
            state["pending_shard"] = batches[k][0]
            state["next"] = k + 1

    def advance(shard: int) -> bool:
        """Make the shard's next batch current (starting the read of the one after, maybe of the
        next shard); False at the end of the shard's batches."""
        submit()
        if state["pending"] is None or state["pending_shard"] != shard:
            return False
        state["current"], state["pos"] = state["pending"].result(), 0
        state["pending"] = None
        submit()
        return True

    def for_shard(shard: int) -> Callable[[TensorSlot], Iterator[Any]]:
        def produce(slot: TensorSlot) -> Iterator[Any]:
            si = index[slot.name]
            while True:
                if state["pos"] == len(state["current"]) and not advance(shard):
                    return
                owner, piece = state["current"][state["pos"]]
                if owner != si:  # the next slot's bytes: leave them for its call
                    return
                state["pos"] += 1
                if on_bytes:
                    on_bytes(len(piece))
                yield piece

        return produce

    return for_shard


def _write_shards(src_url: str, src_options: Mapping[str, Any] | None, dst_url: str,
                  dst_options: Mapping[str, Any] | None, mesh: Mesh, save_id: str,
                  shards: Sequence[int], buffer_bytes: int,
                  on_bytes: Callable[[int], None] | None = None) -> tuple[list[FileEntry], int]:
    reader = CheckpointReader(src_url, src_options)
    spec, plans = target_spec(reader.manifest, mesh)
    writer = CheckpointWriter(as_storage(dst_url, dst_options), spec, save_id)
    ranged = CachedRangeReader(reader.storage, reader.manifest.chunk_size)
    entries = []
    with ThreadPoolExecutor(1) as prefetch:
        for_shard = _shard_producers(reader, ranged, plans, shards, writer.slots, buffer_bytes,
                                     prefetch, on_bytes)
        for t in shards:
            entries.append(writer.write_shard(t, for_shard(t)))
    return entries, ranged.bytes_read


def entry_json(e: FileEntry) -> dict[str, Any]:
    """A written file's entry as JSON, to send to the process that commits."""
    return {"path": e.path, "role": e.role, "size": e.size, "header_size": e.header_size,
            "crc32c": e.crc32c, "chunks": list(e.chunk_crc32c), "index": e.index}


def entry_from_json(e: Mapping[str, Any]) -> FileEntry:
    return FileEntry(e["path"], e["role"], e["size"], e["header_size"], e["crc32c"],
                     tuple(e["chunks"]), e["index"])


def _worker(args: dict[str, Any], conn: Any) -> None:
    """Entry point of a worker process: write some target shards, send their entries as JSON."""
    try:
        entries, nread = _write_shards(args["src"], args["src_options"], args["dst"], args["dst_options"],
                                       Mesh(tuple((a, s) for a, s in args["mesh"])), args["save_id"],
                                       args["shards"], args["buffer_bytes"])
        conn.send(json.dumps({"ok": True, "read": nread, "entries": [entry_json(e) for e in entries]}))
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which raises
        conn.send(json.dumps({"ok": False, "error": f"{type(e).__name__}: {e}"}))
    finally:
        conn.close()


def _prepare_dst(dst: Storage, src: Storage, overwrite: bool) -> bytes | None:
    """Refuse a DST that is, holds or lies in SRC, and an existing DST unless ``overwrite``;
    return the bytes of DST's manifest that the new one is to replace (None: create)."""
    here, there = dst.location(), src.location()
    if here == there:
        raise ConfigError(f"{dst.url}: the destination is the source ({src.url}); choose another "
                          "directory")
    if contains(there, here):
        raise ConfigError(f"{dst.url} lies inside the source {src.url}; choose a directory outside it")
    if overwrite and contains(here, there):
        raise ConfigError(f"the source {src.url} lies inside the destination {dst.url}, which "
                          "--overwrite would replace; choose another destination")
    existing = dst.ls("")
    if not existing:
        return None
    if not overwrite:
        raise ConfigError(f"{dst.url} already exists and is not empty; pass --overwrite to replace it "
                          "(the current checkpoint there stays until the new one commits)")
    if MANIFEST_NAME in existing:  # replaced as it is, readable or not (a damaged one too)
        return dst.read_limited(MANIFEST_NAME, MAX_MANIFEST_BYTES)
    return None


def _check_work(m: Manifest, mesh: Mesh, to: int, buffer_bytes: int) -> None:
    """Refuse work that cannot make progress: a shard degree beyond the data (every shard of
    every group mostly padding), or read batches so small that each checksum chunk of the source
    is read and checked over and over."""
    if buffer_bytes < MIN_BUFFER:
        raise ConfigError(f"--buffer {buffer_bytes} bytes: below the minimum of {MIN_BUFFER} bytes "
                          f"({MIN_BUFFER >> 10} KiB)")
    if m.chunked is not None:  # reshard would drop them: it rewrites flat groups only
        raise ConfigError("the checkpoint holds chunked tensors (saved through torch.distributed."
                          "checkpoint); they load on any world size as they are, with "
                          "ShardckptReader; reshard applies to flat groups only")
    groups = [g for c in m.components.values() for g in c.layout.groups]
    if not groups:
        return
    largest = max(groups, key=lambda g: g.numel)
    limit = max(1, -(-largest.numel // 16))
    if mesh.shard_degree > limit:
        raise ConfigError(
            f"--to {to}: a shard degree of {mesh.shard_degree} leaves shard ranks without data: the "
            f"largest flat group ({largest.name}, {largest.numel} elements) fills at most {limit} "
            f"shards of 16 elements; choose --to <= {limit * mesh.replicate_degree}")


def reshard(src: str, dst: str, to: int, from_: int | None = None, replicate: int = 1,
            workers: int = 1, overwrite: bool = False,
            storage_options: Mapping[str, Any] | None = None,
            dst_storage_options: Mapping[str, Any] | None = None,
            buffer_bytes: int = DEFAULT_BUFFER,
            progress: Callable[[int], None] | None = None) -> ReshardResult:
    """Reshard ``src`` to a world of ``to`` ranks (mesh ``replicate`` x ``to/replicate``) at ``dst``.

    ``from_`` is a guard: it must equal the source's world size. With ``overwrite``, an existing
    checkpoint at ``dst`` is replaced only once the new one is complete. Under ``torchrun``,
    :func:`shardckpt.tools.distributed.reshard_job` splits the same work over the job's processes.
    """
    t0 = time.perf_counter()
    if workers < 1:
        raise ConfigError(f"--workers {workers}: must be >= 1")
    reader, mesh = open_source(src, to, from_, replicate, storage_options, buffer_bytes)
    m = reader.manifest
    dst_opts = dst_storage_options if dst_storage_options is not None else storage_options
    dst_storage, replacing, writer = open_destination(reader, mesh, dst, dst_opts, overwrite)
    try:
        with writer.lease():  # released before the attempt's directory is removed on failure
            entries, nread = _write_all(reader, writer, src, storage_options, dst, dst_opts,
                                        workers, buffer_bytes, progress)
            manifest = writer.commit(entries, replacing)
    except BaseException as e:
        discard_attempt(writer, dst, e)
        raise
    if overwrite:
        _remove_replaced(dst_storage, replacing, manifest.save_id)
    written = sum(e.size for e in entries)
    return ReshardResult(manifest, m.mesh.world_size, written, nread, time.perf_counter() - t0)


def open_source(src: str, to: int, from_: int | None, replicate: int,
                storage_options: Mapping[str, Any] | None,
                buffer_bytes: int) -> tuple[CheckpointReader, Mesh]:
    """Check the options and open the source: its reader and the target mesh."""
    if to is None or to < 1:
        raise ConfigError(f"--to {to}: the target world size must be >= 1")
    if replicate < 1 or to % replicate:
        raise ConfigError(f"--to {to} is not divisible by --replicate {replicate}")
    reader = CheckpointReader(src, storage_options)
    m = reader.manifest
    if from_ is not None and from_ != m.mesh.world_size:
        raise IncompatibleLayoutError(
            f"{reader.storage.url_of(MANIFEST_NAME)}: --from {from_} does not match the checkpoint's "
            f"world size {m.mesh.world_size} (mesh {m.mesh.describe()})")
    mesh = Mesh.for_world(to, replicate)
    _check_work(m, mesh, to, buffer_bytes)
    return reader, mesh


def open_destination(reader: CheckpointReader, mesh: Mesh, dst: str,
                     dst_options: Mapping[str, Any] | None, overwrite: bool,
                     ) -> tuple[Storage, bytes | None, CheckpointWriter]:
    """Guard the destination and make the writer of a new attempt there: the destination's
    storage, the manifest bytes the new one is to replace (None: create), the writer."""
    dst_storage = as_storage(dst, dst_options)
    replacing = _prepare_dst(dst_storage, reader.storage, overwrite)
    spec, _ = target_spec(reader.manifest, mesh)
    writer = CheckpointWriter(dst_storage, spec)
    dst_storage.ensure_free_space("", writer.data_bytes(), "reshard")
    return dst_storage, replacing, writer


def discard_attempt(writer: CheckpointWriter, dst: str, error: BaseException) -> None:
    """After a failure (the lease released): remove the attempt's directory; where that fails,
    the error says how to remove it."""
    if not writer.discard() and isinstance(error, ShardckptError):
        error.args = (f"{error.args[0] if error.args else type(error).__name__}; `shardckpt clean "
                      f"{dst}` removes the unfinished {writer.save_id}/",)


def _write_all(reader: CheckpointReader, writer: CheckpointWriter, src: str,
               src_options: Mapping[str, Any] | None, dst: str, dst_options: Mapping[str, Any] | None,
               workers: int, buffer_bytes: int,
               progress: Callable[[int], None] | None) -> tuple[list[FileEntry], int]:
    """Write every target shard (in this process or over ``workers`` processes), then buffers."""
    mesh = writer.spec.mesh
    S = mesh.shard_degree
    k = min(workers, S)
    if k <= 1:
        entries, nread = _write_shards(src, src_options, dst, dst_options, mesh,
                                       writer.save_id, list(range(S)), buffer_bytes, progress)
    else:
        _, plans = target_spec(reader.manifest, mesh)
        parts = balance([r + w for r, w in shard_bytes(writer.spec, plans)], k)
        entries, nread = _run_workers(src, src_options, dst, dst_options, mesh, writer.save_id,
                                      parts, buffer_bytes)
    if reader.manifest.buffers_file() is not None:
        b = writer.write_buffers(lambda slot: iter([reader.read_buffer(slot.name)[1]]))
        if b is not None:
            entries.append(b)
    return entries, nread


def _remove_replaced(dst: Storage, replaced: bytes | None, keep: str) -> None:
    """After an ``--overwrite`` commit: remove the files of the manifest it replaced (where that
    could be read) and every save directory no writer holds a lease on, except the new one."""
    old = None
    if replaced is not None:
        try:
            old = parse(replaced, dst.url_of(MANIFEST_NAME))
        except ShardckptError:
            old = None  # a damaged manifest: its save directory goes with the others below
    try:
        for f in old.files if old is not None else ():
            if f.path.split("/", 1)[0] != keep:
                dst.rm(f.path)
        removed = remove_stale_saves(dst, keep)
    except ShardckptError as e:
        log.warning("%s: committed, but could not remove what it replaced (%s); `shardckpt clean "
                    "%s` removes it", dst.url, e, dst.url)
        return
    if removed:
        log.info("%s: removed %d earlier save directories: %s", dst.url, len(removed), ", ".join(removed))


def _run_workers(src: str, src_options: Mapping[str, Any] | None, dst: str,
                 dst_options: Mapping[str, Any] | None, mesh: Mesh, save_id: str,
                 parts: Sequence[Sequence[int]], buffer_bytes: int) -> tuple[list[FileEntry], int]:
    """Write the target shards of ``parts[w]`` in spawned process ``w``; fail if any fails."""
    ctx = mp.get_context("spawn")
    procs = []
    for w, shards in enumerate(parts):
        parent, child = ctx.Pipe(duplex=False)
        args = {"src": src, "src_options": dict(src_options or {}), "dst": dst,
                "dst_options": dict(dst_options or {}), "mesh": [list(a) for a in mesh.axes],
                "save_id": save_id, "shards": list(shards), "buffer_bytes": buffer_bytes}
        p = ctx.Process(target=_worker, args=(args, child), daemon=True)
        p.start()
        child.close()
        procs.append((p, parent))
    entries: list[FileEntry] = []
    errors: list[str] = []
    nread = 0
    for w, (p, conn) in enumerate(procs):
        try:
            msg = json.loads(conn.recv())
        except EOFError:
            p.join(5)
            errors.append(f"worker {w} died (exit code {p.exitcode})")
            continue
        p.join(30)
        if not msg["ok"]:
            errors.append(f"worker {w}: {msg['error']}")
            continue
        nread += msg["read"]
        entries += [entry_from_json(e) for e in msg["entries"]]
    if errors:
        for p, _ in procs:
            if p.is_alive():
                p.kill()
                p.join(30)
        raise StorageError("reshard failed; nothing was committed: " + "; ".join(errors))
    return entries, nread
