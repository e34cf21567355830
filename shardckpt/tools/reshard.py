"""Offline resharding: turn a checkpoint of N ranks into one of M ranks (or another HSDP mesh).

Streams through the pure :func:`~shardckpt.format.reshard_plan.plan_reshard` plan: each target shard file is
written front to back, its bytes read from the source shards with checked ranged reads in pieces of
at most ``buffer_bytes``; memory is bounded by that buffer (plus a few cached boundary chunks), not
by the checkpoint. Target shards can be split over K worker processes. The target's manifest is
created last, so an interrupted or failed reshard leaves nothing a reader takes for whole.
Per-rank state (RNG) cannot follow a change of world size: it is dropped, and the manifest says so.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterator, Mapping, Sequence

from shardckpt.checkpoint.reader import CheckpointReader, as_storage
from shardckpt.checkpoint.writer import CheckpointSpec, CheckpointWriter
from shardckpt.errors import (
    ConfigError, IncompatibleLayoutError, LinkRefusedError, ShardckptError, StorageError,
)
from shardckpt.format.dtypes import itemsize
from shardckpt.format.layout import Mesh
from shardckpt.format.reshard_plan import Copy, ReshardPlan, plan_reshard
from shardckpt.tools.clean import SAVE_ID, remove_stale_saves
from shardckpt.tools.split import balance, shard_bytes
from shardckpt.format.manifest import (
    MANIFEST_NAME, MAX_MANIFEST_BYTES, Component, FileEntry, Manifest, TensorSlot,
)
from shardckpt.format.manifest_parse import parse
from shardckpt.storage import DEFAULT_BATCH, RangeReader, Storage, read_ahead
from shardckpt.storage.places import contains

log = logging.getLogger(__name__)

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


def _plan_batches(reader: CheckpointReader, plans: Mapping[str, ReshardPlan], shard: int,
                  slots: Sequence[TensorSlot], buffer_bytes: int) -> list[list[tuple[int, Any]]]:
    """The pieces of every slot of target ``shard``, in file order, cut into batches of at most
    ``buffer_bytes`` that run across slot boundaries (small slots share a batch, so adjacent
    ranges of one source file coalesce into one read). Each batch holds (slot index, piece)
    pairs; a piece is an int (that many zero bytes) or a source range to read."""
    by_group: dict[str, list[Copy]] = {}
    for plan in plans.values():
        for c in plan.for_dst_shard(shard):
            by_group.setdefault(c.dst_group, []).append(c)
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


class _ShardStream:
    """The bytes of target shards ``shards``, slot by slot: :meth:`for_shard` gives the slot
    producer of a shard; the shards are written in ``shards`` order.

    The batches of every shard (:func:`_plan_batches`) are read through one
    :func:`~shardckpt.storage.read_ahead` loop: the next batch is read while the current one is
    written, so at most two batches are held at once; within a batch, source files are read
    concurrently (``read_workers``). The read-ahead runs across shards: the first batch of the
    next shard is read while the last one of this shard is written. Where the storage maps files
    (local), a range is not copied: it is a view of the mapped source file, its chunks
    CRC-checked once, written straight from the page cache; a batch's mappings go when the batch
    has been written.
    """

    def __init__(self, reader: CheckpointReader, ranges: RangeReader, plans: Mapping[str, ReshardPlan],
                 shards: Sequence[int], slots: Sequence[TensorSlot], buffer_bytes: int,
                 on_bytes: Callable[[int], None] | None, read_workers: int = 4) -> None:
        self.ranges, self.on_bytes, self.read_workers = ranges, on_bytes, read_workers
        self.batches = [(t, b) for t in shards
                        for b in _plan_batches(reader, plans, t, slots, buffer_bytes) if b]
        self.zeros = bytes(max((p for _, b in self.batches for _, p in b if isinstance(p, int)),
                               default=0))
        self.index = {s.name: i for i, s in enumerate(slots)}
        self.stream = read_ahead(self.batches, self._fetch)
        self.taken = 0  # batches taken from the stream
        self.current: list[tuple[int, Any]] = []
        self.pos = 0

    def _fetch(self, item: tuple[int, list[tuple[int, Any]]]) -> list[tuple[int, Any]]:
        _, batch = item
        data = iter(self.ranges.fetch([p for _, p in batch if not isinstance(p, int)], self.read_workers))
        zview = memoryview(self.zeros)
        return [(si, zview[:p] if isinstance(p, int) else next(data)) for si, p in batch]

    def _advance(self, shard: int) -> bool:
        """Make the shard's next batch current (the read of the one after, maybe of the next
        shard, starts); False at the end of the shard's batches."""
        if self.taken == len(self.batches) or self.batches[self.taken][0] != shard:
            return False
        self.current, self.pos = [], 0  # written: let it go before the next is waited for
        _, self.current = next(self.stream)
        self.taken += 1
        return True

    def for_shard(self, shard: int) -> Callable[[TensorSlot], Iterator[Any]]:
        def produce(slot: TensorSlot) -> Iterator[Any]:
            si = self.index[slot.name]
            while True:
                if self.pos == len(self.current) and not self._advance(shard):
                    return
                owner, piece = self.current[self.pos]
                if owner != si:  # the next slot's bytes: leave them for its call
                    return
                self.pos += 1
                if self.on_bytes:
                    self.on_bytes(len(piece))
                yield piece

        return produce

    def close(self) -> None:
        self.stream.close()  # type: ignore[attr-defined]


def _write_shards(src_url: str, src_options: Mapping[str, Any] | None, dst_url: str,
                  dst_options: Mapping[str, Any] | None, mesh: Mesh, save_id: str,
                  shards: Sequence[int], buffer_bytes: int,
                  on_bytes: Callable[[int], None] | None = None) -> tuple[list[FileEntry], int]:
    reader = CheckpointReader(src_url, src_options)
    spec, plans = target_spec(reader.manifest, mesh)
    writer = CheckpointWriter(as_storage(dst_url, dst_options), spec, save_id)
    ranges = RangeReader(reader.storage, reader.manifest.chunk_size)
    stream = _ShardStream(reader, ranges, plans, shards, writer.slots, buffer_bytes, on_bytes)
    try:
        entries = [writer.write_shard(t, stream.for_shard(t)) for t in shards]
    finally:
        stream.close()
    return entries, ranges.bytes_read


def _worker(args: dict[str, Any], conn: Any) -> None:
    """Entry point of a worker process: write some target shards, send their entries as JSON."""
    try:
        entries, nread = _write_shards(args["src"], args["src_options"], args["dst"], args["dst_options"],
                                       Mesh(tuple((a, s) for a, s in args["mesh"])), args["save_id"],
                                       args["shards"], args["buffer_bytes"])
        conn.send(json.dumps({"ok": True, "read": nread, "entries": [e.to_doc() for e in entries]}))
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
    replacing = None
    if MANIFEST_NAME in existing:  # replaced as it is, readable or not (a damaged one too)
        replacing = dst.read_limited(MANIFEST_NAME, MAX_MANIFEST_BYTES)
    _refuse_links(dst, existing, replacing)
    return replacing


def _replaced_files(dst: Storage, replaced: bytes | None) -> list[str]:
    """The files of the manifest ``replaced`` (its bytes), or none where it cannot be read."""
    if replaced is None:
        return []
    try:
        return [f.path for f in parse(replaced, dst.url_of(MANIFEST_NAME)).files]
    except ShardckptError:
        return []  # a damaged manifest: its save directory goes with the other stale ones


def _refuse_links(dst: Storage, existing: Sequence[str], replacing: bytes | None) -> None:
    """Before anything is written: refuse an ``--overwrite`` whose removals after the commit (the
    replaced checkpoint's files, earlier save directories) would meet a symbolic link in DST. A
    link is never followed (its target may be anything) nor removed (someone put it there)."""
    doomed = _replaced_files(dst, replacing) + [n for n in existing if SAVE_ID.fullmatch(n)]
    for rel in doomed:
        link = dst.first_link(rel)
        if link is not None:
            raise LinkRefusedError(
                f"{dst.url}: --overwrite would remove {dst.url_of(rel)}, but {link[0]} is a symbolic "
                f"link to {link[1]}; shardckpt never deletes through a link or removes one. Nothing "
                "was written: remove the link, or choose another destination", dst.url_of(rel),
                link[0], link[1])


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
            buffer_bytes: int = DEFAULT_BATCH,
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
    could be read) and every save directory no writer holds a lease on, except the new one.
    Removals stay inside DST (:meth:`~shardckpt.storage.Storage.remove_inside`): a symbolic link
    that appeared since :func:`_prepare_dst` checked is left alone and logged."""
    try:
        for path in _replaced_files(dst, replaced):
            if path.split("/", 1)[0] == keep:
                continue
            try:
                dst.remove_inside(path)
            except LinkRefusedError as e:
                log.warning("%s", e)
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
    import multiprocessing as mp  # only with --workers

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
        entries += [FileEntry.from_doc(e) for e in msg["entries"]]
    if errors:
        for p, _ in procs:
            if p.is_alive():
                p.kill()
                p.join(30)
        raise StorageError("reshard failed; nothing was committed: " + "; ".join(errors))
    return entries, nread
