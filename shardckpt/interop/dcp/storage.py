"""shardckpt as the storage layer of ``torch.distributed.checkpoint`` (DCP).

DCP's planner decides what each rank writes and reads; :class:`ShardckptWriter` and
:class:`ShardckptReader` move the bytes. Every rank streams its items into one safetensors file
of its save attempt (``<save-id>/chunks-<rank>.safetensors``) with CRC32C per chunk; the
coordinator commits by creating ``manifest.json`` last, create-only, through
:meth:`shardckpt.checkpoint.writer.CheckpointWriter.commit` (every file checked, directories synced,
the attempt leased). The manifest is JSON: DCP's metadata is rebuilt from it on load, and the
values DCP's planner serializes itself (``WriteItemType.BYTE_IO``, ``torch.save`` bytes) are
stored as opaque checksummed blobs. Each rank reads only the byte ranges its load plan names,
CRC-checked::

    dcp.save(state_dict, storage_writer=ShardckptWriter("s3://bucket/run/step-100"))
    dcp.load(state_dict, storage_reader=ShardckptReader("s3://bucket/run/step-100"))

DCP's ``DefaultLoadPlanner`` decodes such a value by calling ``torch.load`` with
``weights_only=False``, which runs whatever code the pickle names. :class:`ShardckptReader`
therefore hands the planner only values that ``torch.load(weights_only=True)`` loads
(:mod:`shardckpt.interop.safe_unpickle`) and refuses any other with
:class:`~shardckpt.errors.UnsafePickleError`, unless it is built with ``allow_pickle=True`` for a
trusted checkpoint. :class:`WeightsOnlyLoadPlanner` is DCP's default load planner decoding values
with ``weights_only=True`` (what ``DcpCheckpointer`` loads with).
"""

from __future__ import annotations

import dataclasses
import io
import logging
import os
from dataclasses import dataclass
from typing import Any
from collections.abc import Mapping

import torch
from torch.futures import Future
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import (
    Metadata, StorageMeta,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType, LoadPlan, LoadPlanner, ReadItem, SavePlan, SavePlanner, WriteItem, WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult

from shardckpt.storage import commit as _commit
from shardckpt.checkpoint.reader import CheckpointReader
from shardckpt.checkpoint.attempt import Attempt, Steps
from shardckpt.checkpoint.job import Job
from shardckpt.checkpoint.writer import CheckpointSpec, CheckpointWriter
from shardckpt.format.chunked import (
    ChunkRecord, ChunkedTensor, blob_name, chunk_name,
)
from shardckpt.errors import ConfigError, ShardckptError
from shardckpt.format.dtypes import itemsize
from shardckpt.format.layout import Mesh, prod
from shardckpt.storage import DEFAULT_TTL_S
from shardckpt.format.manifest import DEFAULT_CHUNK_SIZE, FileEntry, TensorSlot
from shardckpt.format.records import RunExtras
from shardckpt.interop.dcp.metadata import chunked_section, dtype_name, section_metadata
from shardckpt.interop.dcp.read_items import locate, read_values
from shardckpt.interop.dcp.tensor_boxes import apply_boxes_pipelined
from shardckpt.interop.safe_unpickle import check_value
from shardckpt.storage import Storage

log = logging.getLogger(__name__)

__all__ = ["ShardckptWriter", "ShardckptReader", "WeightsOnlyLoadPlanner"]

#: Bytes one rank reads at a time while loading (its requests are batched up to this).
DEFAULT_READ_BATCH = 256 << 20


def _done(value: Any) -> Future[Any]:
    """A future that already holds ``value`` (the bytes moved before it is returned)."""
    fut: Future[Any] = Future()
    fut.set_result(value)
    return fut


@dataclass(frozen=True)
class _Attempt:
    """What the coordinator tells every rank in the global plan."""

    save_id: str
    rank: int


@dataclass(frozen=True)
class _Stored:
    """Where one write item went (travels back to the coordinator in a WriteResult)."""

    entry: FileEntry
    begin: int
    end: int


class ShardckptWriter(StorageWriter):
    """A DCP ``StorageWriter`` that writes a shardckpt checkpoint at ``url`` (any fsspec URL).

    ``extras``: JSON values recorded in the manifest (``step`` is shown by ``shardckpt inspect``
    and used by retention). The checkpoint is committed once, create-only: saving again to a
    URL that holds a committed checkpoint raises :class:`~shardckpt.errors.CommitConflictError`
    and leaves it as it was, unless ``replace_existing``: then the manifest there when the save
    began is replaced, only if it is still unchanged at commit (a resumed run saving a step again).
    """

    def __init__(self, url: str | os.PathLike, storage_options: Mapping[str, Any] | None = None, *,
                 chunk_size: int = DEFAULT_CHUNK_SIZE, extras: Mapping[str, Any] | None = None,
                 lease_ttl_s: float = DEFAULT_TTL_S, replace_existing: bool = False) -> None:
        super().__init__()
        self.replace_existing = replace_existing
        self.storage_options = dict(storage_options or {})
        # checked now: the keys shardckpt reads must have their types (docs/FORMAT.md 3.9)
        checked = RunExtras.from_doc(dict(extras or {}), "extras", f"ShardckptWriter of {url}").to_doc()
        self.chunk_size, self.extras, self.lease_ttl_s = chunk_size, checked, lease_ttl_s
        self.checkpoint_id = str(url)
        self.is_coordinator, self.rank = True, 0
        self._attempt: Attempt[CheckpointWriter] | None = None  # the coordinator's
        self._storage: Storage | None = None

    @property
    def storage(self) -> Storage:
        if self._storage is None:
            self._storage = Storage(self.checkpoint_id, self.storage_options)
        return self._storage

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id is not None and str(checkpoint_id) != self.checkpoint_id:
            self.checkpoint_id, self._storage = str(checkpoint_id), None
        self._release()  # a lease left by an attempt that failed on another rank

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("use_collectives") is False:
            raise ConfigError("ShardckptWriter commits one manifest for all ranks; call dcp.save "
                              "with use_collectives=True")
        self.is_coordinator = is_coordinator
        self.rank = int(kwargs.get("rank") or 0)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """Coordinator: open the attempt (:mod:`shardckpt.checkpoint.attempt`, its steps driven
        by DCP: open here, each rank's share in :meth:`write_data`, commit in :meth:`finish`):
        a new save id, its lease, and with ``replace_existing`` the manifest to replace."""
        self._release()
        storage = self.storage

        def replacing() -> bytes | None:
            return _commit.current_manifest(storage) if self.replace_existing else None

        attempt = Attempt(Job.single(), storage.url, Steps.named(f"dcp.save to {storage.url}"),
                          lambda save_id: CheckpointWriter(storage, CheckpointSpec(Mesh.for_world(1), {}),
                                                           save_id),
                          guard=replacing, lease_ttl_s=self.lease_ttl_s)
        save_id = attempt.open().save_id
        self._attempt = attempt
        return [dataclasses.replace(p, storage_data=_Attempt(save_id, i)) for i, p in enumerate(plans)]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        attempt = plan.storage_data
        if not isinstance(attempt, _Attempt):
            raise ShardckptError("ShardckptWriter.write_data: the plan did not come from "
                                 "ShardckptWriter.prepare_global_plan")
        try:
            results = self._write(attempt, plan.items, planner)
        except BaseException:
            self._release()  # finish() will not run; another rank's failure is met by reset()
            raise
        return _done(results)

    def _write(self, attempt: _Attempt, items: list[WriteItem], planner: SavePlanner) -> list[WriteResult]:
        if not items:
            return []
        slots, blobs = [], {}
        pos = 0
        for i, item in enumerate(items):
            if item.type == WriteItemType.BYTE_IO:
                data = planner.resolve_data(item)
                blobs[i] = data.getvalue() if isinstance(data, io.BytesIO) else bytes(data)
                slot = TensorSlot(blob_name(item.index.fqn), "uint8", (len(blobs[i]),), pos,
                                  pos + len(blobs[i]))
            else:
                td = item.tensor_data
                assert td is not None  # a tensor item carries its tensor data
                dtype = dtype_name(td.properties.dtype, item.index.fqn)
                sizes = tuple(td.chunk.sizes)
                n = prod(sizes) * itemsize(dtype)
                slot = TensorSlot(chunk_name(item.index.fqn, td.chunk.offsets), dtype, sizes, pos, pos + n)
            slots.append(slot)
            pos = slot.end
        index = {s.name: i for i, s in enumerate(slots)}

        def produce(slot: TensorSlot) -> Any:
            i = index[slot.name]
            if i in blobs:
                yield blobs.pop(i)
                return
            t = planner.resolve_data(items[i])
            assert isinstance(t, torch.Tensor)  # blobs (bytes items) were yielded above
            t = t.detach().to("cpu").contiguous().reshape(-1)
            if t.numel():
                yield t.view(torch.uint8).numpy()

        writer = CheckpointWriter(self.storage, CheckpointSpec(Mesh.for_world(1), {},
                                                               chunk_size=self.chunk_size),
                                  attempt.save_id)
        entry = writer.write_chunks(attempt.rank, slots, produce)
        return [WriteResult(index=item.index, size_in_bytes=s.end - s.begin,
                            storage_data=_Stored(entry, s.begin, s.end))
                for item, s in zip(items, slots, strict=True)]

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Coordinator: build the manifest from DCP's metadata and the results, then commit."""
        attempt, self._attempt = self._attempt, None
        if attempt is None:
            raise ShardckptError("ShardckptWriter.finish before prepare_global_plan")
        spec = CheckpointSpec(Mesh.for_world(max(1, len(results))), {}, extras=self.extras,
                              chunk_size=self.chunk_size, chunked=chunked_section(metadata, results))
        entries = {r.storage_data.entry.path: r.storage_data.entry for rs in results for r in rs}
        try:
            attempt.commit(lambda w, _: CheckpointWriter(self.storage, spec, w.save_id).commit(
                entries.values(), replacing=attempt.guarded), [])
        except BaseException as e:  # noqa: BLE001 - fail() discards the attempt and raises it
            attempt.fail(e)
        attempt.release()

    def _release(self) -> None:
        """Release the coordinator's lease (an attempt that will not commit here)."""
        attempt, self._attempt = self._attempt, None
        if attempt is not None:
            attempt.release()

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.checkpoint_id)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return isinstance(checkpoint_id, (str, os.PathLike))


class ShardckptReader(StorageReader):
    """A DCP ``StorageReader`` for a committed shardckpt checkpoint.

    Each rank reads only the byte ranges its load plan names (the smallest span of each stored
    chunk that holds the requested box), in batches of at most ``read_batch_bytes``, with every
    CRC32C chunk it touches checked. A box into a CPU tensor from a local disk is read straight
    into the tensor's memory; one into a tensor on a device (into every tensor with
    ``pipeline=True``) goes through the read pipeline: a bounded ring of host buffers, checks in
    worker threads, copies overlapped with the next reads. ``pipeline=False``: every box is read
    in batches and copied (:mod:`shardckpt.interop.dcp.tensor_boxes`). A checkpoint of flat
    groups (``ZeroEngine``) is presented as the state dict ``get_state_dict(model, optimizer)``
    gives, under ``{model_key: ..., optim_key: ...}``
    (:class:`shardckpt.interop.dcp.flat_view.FlatView`).

    Values that are not tensors (``torch.save`` bytes, which DCP's default load planner decodes
    by calling ``torch.load`` with ``weights_only=False``) are handed to the planner only if
    ``torch.load(weights_only=True)`` loads them: plain Python values, tensors, and the classes
    allowed with ``torch.serialization.add_safe_globals``. Any other is refused, before this
    rank hands the planner any value or tensor, with
    :class:`~shardckpt.errors.UnsafePickleError` naming the key, the file and the refused global.
    ``allow_pickle=True`` hands every value over unchecked: only for a checkpoint whose every
    writer you trust, since loading it then runs whatever code its values name.
    """

    def __init__(self, url: str | os.PathLike, storage_options: Mapping[str, Any] | None = None, *,
                 workers: int = 8, read_batch_bytes: int = DEFAULT_READ_BATCH,
                 model_key: str = "model", optim_key: str = "optim",
                 allow_pickle: bool = False, trust: Any = None,  # trust: CheckpointReader's
                 pipeline: bool | None = None) -> None:
        super().__init__()
        self.checkpoint_id = str(url)
        self.storage_options = dict(storage_options or {})
        self.workers, self.read_batch_bytes = workers, read_batch_bytes
        self.model_key, self.optim_key = model_key, optim_key
        self.allow_pickle, self.trust, self.pipeline = bool(allow_pickle), trust, pipeline
        if self.allow_pickle:
            log.info("%s: values are handed to DCP's planner unchecked (allow_pickle=True)",
                     self.checkpoint_id)
        self._reader: CheckpointReader | None = None
        self._flat: Any = None
        self._chunks: dict[tuple[str, tuple[int, ...]], tuple[ChunkedTensor, ChunkRecord]] = {}

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id is not None:
            self.checkpoint_id = str(checkpoint_id)
        self._reader, self._flat = None, None

    def _open(self) -> CheckpointReader:
        if self._reader is None:
            r = CheckpointReader(self.checkpoint_id, self.storage_options, trust=self.trust)
            if r.manifest.chunked is None:
                from shardckpt.interop.dcp.flat_view import FlatView

                self._flat = FlatView(r, self.model_key, self.optim_key)
            else:
                self._chunks = {(t.fqn, c.offsets): (t, c)
                                for t in r.manifest.chunked.tensors.values() for c in t.chunks}
            self._reader = r
        return self._reader

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        r = self._open()
        if self._flat is not None:
            return self._flat.metadata(self.checkpoint_id, r.manifest.save_id)
        section = r.manifest.chunked
        assert section is not None
        return section_metadata(section, self.checkpoint_id, r.manifest.save_id)

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any,
                              **kwargs: Any) -> None:
        self._open()

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        r = self._open()
        if self._flat is not None:
            self._read_flat(plan, planner)
            return _done(None)
        values = [item for item in plan.items if item.type == LoadItemType.BYTE_IO]
        for item, data in read_values(r, self._chunks, values, self.read_batch_bytes, self.workers,
                                      self._check):  # all checked before any is handed over
            planner.load_bytes(item, io.BytesIO(data))
        batch: list[tuple[ReadItem, tuple[FileEntry, int, int], Any]] = []
        size = 0
        for item in plan.items:
            if item.type == LoadItemType.BYTE_IO:
                continue
            entry, a, b, src = locate(r, self._chunks, item)
            batch.append((item, (entry, a, b), src))
            size += b - a
            if size >= self.read_batch_bytes:
                apply_boxes_pipelined(r, batch, planner, self.workers, self.pipeline)
                batch, size = [], 0
        apply_boxes_pipelined(r, batch, planner, self.workers, self.pipeline)
        return _done(None)

    def _check(self, data: bytes, key: str, file: str) -> None:
        if not self.allow_pickle:
            check_value(data, key, file, self.checkpoint_id)

    def _read_flat(self, plan: LoadPlan, planner: LoadPlanner) -> None:
        values = []
        for item in plan.items:
            if item.type == LoadItemType.BYTE_IO:
                data = self._flat.value(item.storage_index.fqn).getvalue()
                self._check(data, item.storage_index.fqn, "manifest.json")
                values.append((item, data))
        for item, data in values:
            planner.load_bytes(item, io.BytesIO(data))
        for item in plan.items:
            fqn = item.storage_index.fqn
            if item.type == LoadItemType.BYTE_IO:
                continue
            target = planner.resolve_tensor(item)
            target.copy_(self._flat.box(fqn, item.storage_offsets, item.lengths))
            planner.commit_tensor(item, target)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return isinstance(checkpoint_id, (str, os.PathLike))


class WeightsOnlyLoadPlanner(DefaultLoadPlanner):
    """DCP's ``DefaultLoadPlanner``, decoding values with ``torch.load(weights_only=True)``
    instead of ``weights_only=False``: a value that names anything outside torch's allow-list
    (and the classes allowed with ``torch.serialization.add_safe_globals``) fails to load
    instead of running. Pass it as ``dcp.load(..., planner=WeightsOnlyLoadPlanner())``; it
    works with any storage reader."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        from torch.distributed.checkpoint._traverse import set_element

        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj
