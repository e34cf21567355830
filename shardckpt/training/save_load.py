"""Save from a running job and load into a job of any world size, mesh or unit policy.

A sharded model (the runtime's engine) offers the small protocol :class:`Sharded`. Save: every
shard is written once, straight from the owning rank's memory (with HSDP the writers are spread
across replicas), buffers once by rank 0; one exchange of file entries and rank 0 creates the
manifest. Load: each rank plans its own part from the checkpoint's layout to its own and reads only
the byte ranges it needs, checked chunk by chunk, into its live shards; then the compute parameters
are re-derived. Every rank raises the same error if any rank fails.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from typing import Any, Protocol
from collections.abc import Mapping

from shardckpt.checkpoint.trust import SigningKey, Trust
from shardckpt.checkpoint.reader import CheckpointReader, as_storage, read_manifest
from shardckpt.checkpoint.attempt import Attempt, Steps
from shardckpt.checkpoint.job import Job
from shardckpt.checkpoint.writer import CheckpointSpec, CheckpointWriter
from shardckpt.checkpoint.collective import agree, rank_and_world
from shardckpt.checkpoint.replica_check import ReplicaCheck
from shardckpt.errors import IncompatibleLayoutError, ManifestError
from shardckpt.format.layout import Layout
from shardckpt.format.reshard_plan import plan_reshard
from shardckpt.format.manifest import (
    MANIFEST_NAME, BufferSpec, Component, FileEntry, Manifest, TensorSlot,
)
from shardckpt.format.records import PerRankState
from shardckpt.training.device_load import fill_shards
from shardckpt.storage import Storage
from shardckpt.training.device_save import ShardBytes, device_events
from shardckpt.training.frozen_reuse import write_frozen
from shardckpt.training.optim_info import fresh_optimizer_state, load_optimizer_info, optimizer_info

log = logging.getLogger(__name__)


class Sharded(Protocol):
    """What save/load need from a sharded model (the runtime's ``ZeroEngine`` implements it)."""

    layout: Layout
    tied_aliases: Mapping[str, str]
    optimizer: Any  # None, or a sharded optimizer with optimizer_metadata()/load_optimizer_metadata()

    def local_shards(self) -> dict[str, dict[str, Any]]: ...        # group -> kind -> 1-D tensor
    def refresh_params(self) -> None: ...
    def buffers(self) -> dict[str, Any]: ...                          # fqn -> tensor
    def load_buffers(self, buffers: Mapping[str, Any], strict: bool = True) -> None: ...


def _bytes_of(t: Any) -> Any:
    """A CPU uint8 numpy view of a tensor's bytes (zero-copy for contiguous CPU tensors)."""
    import torch

    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    return t.contiguous().reshape(-1).view(torch.uint8).numpy()


def _dtype_name(t: Any) -> str:
    return str(t.dtype).removeprefix("torch.")


def checkpoint_spec(model: Sharded, extras: Mapping[str, Any] | None = None,
                    aliases: Mapping[str, str] | None = None, chunk_size: int | None = None) -> CheckpointSpec:
    """The manifest-to-be of ``model`` (the same on every rank)."""
    layout = model.layout
    shards = model.local_shards()
    states = {g.name: tuple((k, _dtype_name(t)) for k, t in shards[g.name].items()) for g in layout.groups}
    buffers = tuple(BufferSpec(f, tuple(t.shape), _dtype_name(t)) for f, t in model.buffers().items())
    comp = Component("model", layout, states, dict(aliases or getattr(model, "tied_aliases", {}) or {}),
                     buffers)
    optim = optimizer_info(model)
    per_rank = PerRankState(world_size=layout.mesh.world_size).to_doc()
    spec = CheckpointSpec(layout.mesh, {"model": comp}, optim, dict(extras or {}), per_rank,
                          frozen=True)  # frozen groups in frozen files, which a later save may reference
    if chunk_size:
        spec.chunk_size = chunk_size
    return spec


@dataclass
class SaveJob:
    """One save attempt: :meth:`stage` copies the shards aside, :meth:`run` writes and commits.

    :func:`begin_save` (local, no collective) opens the destination, snapshots what is small and
    decides what this rank writes. ``stage`` copies the live shards into the staging buffers (if
    any); after it the model may change. ``run`` is an
    :class:`~shardckpt.checkpoint.attempt.Attempt` over ``group``: rank 0 picks the save id and
    the previous checkpoint, each rank writes its files (:meth:`write_files`, through the
    attempt's writer), rank 0 commits. Collective on ``group``, so it may run in a background
    thread as long as nobody else uses ``group`` meanwhile. The node tier writes a job's files
    through a writer of its own instead (:meth:`write_files` takes the writer).
    """

    storage: Storage                         # the checkpoint's location, opened once
    spec: CheckpointSpec
    rank: int
    shard: int | None                       # shard rank this rank writes, if any
    shards: Mapping[str, Mapping[str, Any]]  # group -> kind -> 1-D tensor (live, then staged)
    buffers: Mapping[str, Any]               # fqn -> tensor (rank 0 only)
    rank_state: Mapping[str, Any]            # name -> tensor, written to rank-XXXXX.safetensors
    staging: dict[str, dict[str, Any]] | None = None
    group: Any = None
    snapshot: Any = None                    # offload files: copies on their disk (``take``)
    failure: BaseException | None = None    # of stage(); raised by run() on every rank
    previous: str | None = None             # rank 0's: the run's previous committed checkpoint
    replicas: ReplicaCheck | None = None    # HSDP: replicas compare chunk CRCs before the commit
    ready: Mapping[Any, Any] | None = None  # CUDA shards: an event per device, at begin_save

    @property
    def url(self) -> str:
        return self.storage.url

    def stage(self) -> None:
        """Copy the live shards aside (into the staging buffers; where they hold ``None``, into
        ``snapshot``); afterwards training may go on. A failure is raised by :meth:`run`,
        inside its collective agreement, so that every rank sees it."""
        if self.replicas is not None:  # a replica that writes nothing: its CRCs, before they change
            self.replicas.take()
        if self.staging is None or self.shard is None:
            return
        try:
            staged: dict[str, dict[str, Any]] = {}
            for g, kinds in self.shards.items():
                staged[g] = dict(self.staging[g])
                for k, t in kinds.items():
                    if staged[g][k] is None:
                        staged[g][k] = self.snapshot.take(g, k, t)
                    elif hasattr(t, "read_into"):  # state in an offload file
                        t.read_into(staged[g][k])
                    else:
                        staged[g][k].copy_(t)
            self.shards = staged
        except BaseException as e:  # noqa: BLE001 - raised in run()
            self.failure = e

    def release(self) -> None:
        """Remove the snapshot, if any: the save finished or failed."""
        if self.snapshot is not None:
            self.snapshot.remove()
            self.snapshot = None

    def write_files(self, writer: CheckpointWriter) -> list[dict[str, Any]]:
        """Write this rank's files through ``writer`` (opened for this save); their entries."""
        w, entries = writer, []
        if self.failure is not None:
            raise self.failure
        if self.shard is not None:
            produce = ShardBytes(self.shards, ready=self.ready)  # in parallel on a local disk
            entries.append(w.write_shard(self.shard, produce))
            if w.frozen_slots:
                entries.append(write_frozen(w, self.shard, produce, self.previous))
        if self.rank == 0 and w.buffer_slots:
            bufs = self.buffers
            b = w.write_buffers(lambda slot: iter([_bytes_of(bufs[slot.name])]))
            if b is not None:
                entries.append(b)
        if self.rank_state:
            slots, pos = [], 0
            for name, t in self.rank_state.items():
                n = t.numel() * t.element_size()
                slots.append(TensorSlot(name, _dtype_name(t), tuple(t.shape), pos, pos + n))
                pos += n
            state = self.rank_state
            entries.append(w.write_rank_state(self.rank, slots,
                                              lambda slot: iter([_bytes_of(state[slot.name])])))
        return [e.to_doc() for e in entries]

    def run(self) -> Manifest:
        """The attempt: agree on the save id (and, for frozen files, the previous checkpoint:
        rank 0's), write this rank's files, exchange entries, commit on rank 0. A failed
        attempt's files stay (resume passes over an uncommitted step; ``clean`` removes them)."""
        def previous() -> str | None:
            return self.previous

        def entries(reports: list[Any]) -> list[FileEntry]:
            return [FileEntry.from_doc(d) for rep in reports for d in rep]

        def replicas_agree(writer: CheckpointWriter, reports: list[Any]) -> None:
            if self.replicas is not None:  # HSDP: ReplicaMismatchError on every rank, no commit
                self.replicas.compare(writer.save_id, entries(reports), self.url, self.group)

        attempt = Attempt(Job.of_group(self.group), self.url,
                          Steps(f"plan of the save to {self.url}", f"save to {self.url}",
                                f"commit of {self.url}"),
                          lambda save_id: CheckpointWriter(self.storage, self.spec, save_id),
                          guard=previous, tell_guard=True, discard=False,
                          after_loss=self.commit_status,
                          check_written=replicas_agree)

        def write(writer: CheckpointWriter) -> list[dict[str, Any]]:
            self.previous = attempt.guarded or None
            if self.replicas is not None:  # a replica that writes nothing: its CRCs, meanwhile
                self.replicas.take(writer.save_id)
            return self.write_files(writer)

        m = attempt.run(write, lambda w, reports: w.commit(entries(reports)))
        assert attempt.writer is not None
        return m or attempt.writer.manifest(entries(attempt.reports))

    def commit_status(self, committing: bool, writer: CheckpointWriter | None) -> str:
        """What a failed exchange left behind, as found in storage now (for error messages)."""
        storage = self.storage
        where = storage.url_of(MANIFEST_NAME)
        if not storage.exists(MANIFEST_NAME):
            if committing and self.rank:
                return (f"not committed when rank {self.rank} looked: {where} did not exist yet; "
                        "rank 0 may still create it, and then resume picks it")
            return f"nothing was committed: {where} does not exist"
        ours = writer is not None and read_manifest(storage).save_id == writer.save_id
        if not ours:
            return f"not committed by this save: {where} belongs to another save attempt"
        return (f"the checkpoint committed anyway: {where} exists, and resume picks it (the "
                "newest committed checkpoint that checks out)")


def begin_save(model: Sharded, url: str, extras: Mapping[str, Any] | None = None,
               storage_options: Mapping[str, Any] | None = None, chunk_size: int | None = None,
               group: Any = None, rank_state: Mapping[str, Any] | None = None,
               staging: dict[str, dict[str, Any]] | None = None, snapshot: Any = None,
               previous: str | None = None, signing_key: SigningKey | None = None,
               check_replicas: bool = True) -> SaveJob:
    """Snapshot what is small (buffers, rank state, metadata) and plan this rank's writes. Local.

    With ``staging`` (tensors shaped like ``local_shards()``, allocated once by the caller),
    :meth:`SaveJob.stage` copies the shards into it, so training may change the live state while
    the files are written; without it, the files are written from the live tensors. Kinds staged
    as ``None`` go into ``snapshot`` instead (nvme offload: ``take(group, kind, shard)`` copies
    on the offload disk; :meth:`SaveJob.release` calls its ``remove()``).

    ``previous``: the URL of the run's previous committed checkpoint, a sibling of ``url`` (rank
    0's is used on every rank). A frozen file whose bytes did not change since it is not written
    again: the manifest references that checkpoint's file (docs/FORMAT.md section 15).
    ``check_replicas`` (HSDP): replicas compare chunk CRCs before the commit (:mod:`.replica_check`).
    """
    rank, _ = rank_and_world(group)
    mesh = model.layout.mesh
    shard, replica = mesh.shard_rank(rank), mesh.replicate_rank(rank)
    spec = replace(checkpoint_spec(model, extras, chunk_size=chunk_size), signing_key=signing_key)
    if rank_state:
        spec.per_rank_state = PerRankState(world_size=mesh.world_size, files=True).to_doc()
    writes = replica == shard % mesh.replicate_degree
    shards = model.local_shards() if writes else {}
    buffers = {f: t.detach().clone() for f, t in model.buffers().items()} if rank == 0 else {}
    state = {k: v.detach().clone() for k, v in (rank_state or {}).items()}
    check = ReplicaCheck.of(spec, rank, writes, lambda: ShardBytes(model.local_shards()), check_replicas)
    return SaveJob(as_storage(url, storage_options), spec, rank, shard if writes else None, shards,
                   buffers, state, staging, group, snapshot=snapshot, previous=previous, replicas=check,
                   ready=device_events(shards))


def save(model: Sharded, url: str, extras: Mapping[str, Any] | None = None,
         storage_options: Mapping[str, Any] | None = None, chunk_size: int | None = None,
         group: Any = None, rank_state: Mapping[str, Any] | None = None) -> Manifest:
    """Save ``model`` to ``url`` from every rank; returns the committed manifest on every rank.

    Called on every rank. Each shard is written once (HSDP: shard s by replica ``s % R``),
    buffers by rank 0, ``rank_state`` (e.g. RNG states) by each rank; the manifest is created
    by rank 0 after every file is durable.
    """
    job = begin_save(model, url, extras, storage_options, chunk_size, group, rank_state)
    return job.run()


def read_rank_state(reader: CheckpointReader, rank: int) -> dict[str, Any] | None:
    """Tensors of ``rank-XXXXX.safetensors`` (None if the checkpoint has none for ``rank``)."""
    import torch

    from shardckpt.format.safetensors_header import parse_header

    entry = next((f for f in reader.manifest.files if f.role == "rank" and f.index == rank), None)
    if entry is None:
        return None
    reader.check_file(entry)  # trusted: its signed digest
    data = reader.storage.read_checked(entry, reader.manifest.chunk_size, 0, entry.size)
    tensors, _ = parse_header(bytes(data[8:entry.data_start]), entry.size, reader.storage.url_of(entry.path))
    out = {}
    for name, slot in tensors.items():
        raw = bytearray(data[entry.data_start + slot.begin:entry.data_start + slot.end])
        t = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
        out[name] = t.view(getattr(torch, slot.dtype)).reshape(slot.shape)
    return out


@dataclass(frozen=True)
class LoadResult:
    missing: tuple[str, ...]
    unexpected: tuple[str, ...]
    mismatched: tuple[str, ...]
    manifest: Manifest
    bytes_read: int
    #: The reader the load read through (this rank's; for chunked tensors too), for what the
    #: caller reads next (per-rank state) without opening the checkpoint again.
    reader: CheckpointReader | None = field(default=None, compare=False, repr=False)


def load(model: Sharded, url: str | CheckpointReader, strict: bool = True,
         weights_only: bool = False, storage_options: Mapping[str, Any] | None = None,
         group: Any = None, trust: Trust | None = None) -> LoadResult:
    """Load ``url`` (or an open reader of it) into ``model`` on every rank, whatever world size,
    mesh or unit policy wrote it; each rank opens it once.

    ``strict`` (default) refuses missing, unexpected or reshaped parameters, listing all of them
    in one error; otherwise what matches is loaded and the lists are returned. ``weights_only``
    loads the masters and buffers and leaves optimizer state and step alone. A checkpoint of
    chunked tensors (FSDP2 saved it through DCP) is loaded by
    :func:`shardckpt.training.chunked_load.load_chunked` through the same reader (the lists are
    then empty). ``trust``: public keys that must have signed it (:class:`CheckpointReader`'s).
    """
    rank, _ = rank_and_world(group)
    counter: dict[str, Any] = {"bytes": 0}

    def work() -> dict[str, Any]:
        reader = counter["reader"] = (url if isinstance(url, CheckpointReader)
                                      else CheckpointReader(url, storage_options, trust=trust))
        m = counter["manifest"] = reader.manifest
        if "model" not in m.components and m.chunked is not None:
            return {"chunked": True}  # saved through DCP: load_chunked, below, on every rank
        if "model" not in m.components:
            raise ManifestError(f"{reader.url}: no 'model' component (found {sorted(m.components)})")
        src = m.components["model"]
        plan = plan_reshard(src.layout, model.layout, strict=strict)
        my_shard = model.layout.mesh.shard_rank(rank)
        shards = model.local_shards()
        src_kinds = {g: {k for k, _ in kinds} for g, kinds in src.states.items()}
        # a checkpoint that holds weights alone (`shardckpt import hf`, consolidated starts): the
        # optimizer starts fresh instead of the load being refused
        fresh = (not weights_only and m.optimizer is None
                 and all(ks <= {"master"} for ks in src_kinds.values()))
        skip_optim = weights_only or fresh
        requests, targets = [], []
        missing_kinds: set[str] = set()
        for c in plan.for_dst_shard(my_shard):
            for kind, tensor in shards[c.dst_group].items():
                if skip_optim and kind != "master":
                    continue
                if kind not in src_kinds[c.src_group]:
                    missing_kinds.add(kind)
                    continue
                requests.append(reader.state_range(c.src_shard, c.src_group, kind,
                                                   c.src_offset, c.src_offset + c.numel))
                targets.append((tensor, c.dst_offset, c.numel))
        if missing_kinds:
            raise IncompatibleLayoutError(
                f"{reader.url}: the checkpoint has no {', '.join(sorted(missing_kinds))} state; "
                "load with weights_only=True to take the weights alone")
        # pipelined into the shards' own memory, whatever their device
        counter["bytes"] += fill_shards(reader, requests, targets)
        if m.components["model"].buffers:
            bufs = {}
            for b in src.buffers:
                slot, data = reader.read_buffer(b.fqn)
                bufs[b.fqn] = (slot, bytes(data))
            model.load_buffers(_to_tensors(bufs))
        if not weights_only and m.optimizer is not None:
            load_optimizer_info(model, m.optimizer, strict)
        if fresh and getattr(model, "optimizer", None) is not None:
            fresh_optimizer_state(model)
            if rank == 0:
                log.warning("%s holds weights only (no optimizer state): the optimizer starts "
                            "fresh, moments zero and step 0", reader.url)
        model.refresh_params()
        return {"missing": list(plan.missing), "unexpected": list(plan.unexpected),
                "mismatched": list(plan.mismatched), "save_id": m.save_id}

    where = url.url if isinstance(url, CheckpointReader) else url
    out, _ = agree(work, f"load of {where}", group)
    assert out is not None
    if out.get("chunked"):
        from shardckpt.training.chunked_load import load_chunked

        m = load_chunked(model, counter["reader"], storage_options, strict=strict,
                         weights_only=weights_only, group=group)
        return LoadResult((), (), (), m, 0, counter["reader"])
    return LoadResult(tuple(out["missing"]), tuple(out["unexpected"]), tuple(out["mismatched"]),
                      counter["manifest"], counter["bytes"], counter["reader"])


def _to_tensors(bufs: Mapping[str, tuple[TensorSlot, bytes]]) -> dict[str, Any]:
    import torch

    out = {}
    for fqn, (slot, data) in bufs.items():
        dt = getattr(torch, slot.dtype)
        t = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dt).reshape(slot.shape) if data \
            else torch.empty(slot.shape, dtype=dt)
        out[fqn] = t
    return out
