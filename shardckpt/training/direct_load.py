"""Load a checkpoint whose files are on this machine (the local tier) straight into the engine's
shards: each needed span of a shard file is read with ``readinto`` into the shard's own memory
(no intermediate buffer, no second copy), and every chunk it touches is checked against its
CRC32C on the way (the bytes of a touched chunk that no shard wants go through one scratch
buffer). The file's safetensors header is checked against the manifest first, as every read
does (:meth:`~shardckpt.checkpoint.reader.CheckpointReader.check_file`).

:func:`load_direct` does what :func:`shardckpt.training.save_load.load` does for a checkpoint of
flat groups loaded with its optimizer state into shards of their own memory (any reshard
plan, any device: CPU shards by ``readinto``, device shards through the read pipeline,
:mod:`.direct_pipe`; :func:`direct_ready`); any other case (chunked tensors, weights only, state
in offload files, a weights-only checkpoint) goes through
:func:`~shardckpt.training.save_load.load` itself.

Shard files this machine lacks can come from peers in the same pass (``peers``, transfers every
rank walks alike): the sender streams the file from its node's directory, the receiver takes its
bytes straight into its shards through the read pipeline's ring
(:func:`~shardckpt.training.peer_copy.receive_into`: every chunk's CRC32C checked in worker
threads while the next bytes arrive), and nothing is written to the receiver's disk.
"""

from __future__ import annotations

import logging
from typing import Any
from collections.abc import Callable, Iterable, Mapping, Sequence

from shardckpt.checkpoint.collective import agree, rank_and_world
from shardckpt.checkpoint.reader import CheckpointReader
from shardckpt.checkpoint.tiers import Transfer
from shardckpt.checkpoint.set_aside import raise_damaged, raise_damaged_role
from shardckpt.errors import IntegrityError, ShardckptError
from shardckpt.format.manifest import FileEntry, Manifest
from shardckpt.format.reshard_plan import plan_reshard
from shardckpt.storage import local_path
from shardckpt.checkpoint.loss_flag import LossFlag
from shardckpt.training.direct_pipe import (
    header_target, loadable, piece, pipelined, read_local, target_view,
)
from shardckpt.training.optim_info import load_optimizer_info
from shardckpt.training.peer_copy import run_transfers
from shardckpt.training.save_load import LoadResult, Sharded, load

log = logging.getLogger(__name__)


def direct_kinds(model: Sharded) -> dict[str, list[str]] | None:
    """What :func:`direct_ready` asks of ``model``, as JSON (an agreement can carry it): the
    state kinds of each flat group it holds, where it has an optimizer and every shard takes
    bytes into its own memory; None where not."""
    shards = model.local_shards()
    if not (getattr(model, "optimizer", None) is not None
            and all(loadable(t) for kinds in shards.values() for t in kinds.values())
            and not any(hasattr(t, "write_bytes") for kinds in shards.values() for t in kinds.values())):
        return None
    groups = {gr.name for gr in model.layout.groups}
    return {g: sorted(kinds) for g, kinds in shards.items() if g in groups}


def direct_fits(kinds: Mapping[str, Iterable[str]] | None, m: Manifest) -> bool:
    """Whether a model of :func:`direct_kinds` ``kinds`` loads ``m`` directly: ``m`` holds
    optimizer state and every kind of every group. ``kinds`` may come from another rank's
    report: anything but a mapping of names to lists of names is a model that does not."""
    if not (isinstance(kinds, Mapping) and "model" in m.components and m.optimizer is not None
            and all(isinstance(g, str) and isinstance(k, list) and all(isinstance(x, str) for x in k)
                    for g, k in kinds.items())):
        return False
    src = m.components["model"]
    src_kinds = {g: {k for k, _ in held} for g, held in src.states.items()}
    return all(set(k) <= src_kinds.get(g, set()) for g, k in kinds.items())


def direct_ready(model: Sharded, m: Manifest) -> bool:
    """Whether :func:`load_direct` reads ``m`` straight into ``model``'s shards (flat groups
    with optimizer state into shards of their own memory on any device, every kind the model
    holds saved)."""
    return direct_fits(direct_kinds(model), m)


def load_direct(model: Sharded, url: str, strict: bool = True, peers: Sequence[Transfer] = (),
                flag_key: str | None = None, manifest: Manifest | None = None,
                then: Callable[[CheckpointReader], None] | None = None) -> LoadResult:
    """:func:`~shardckpt.training.save_load.load` of the local checkpoint ``url`` into ``model``
    on every rank, reading straight into its shards where it can (see the module docstring).
    ``peers``: shard files sent from one rank's ``url`` to another's memory on the way (the same
    list on every rank; only where :func:`direct_ready` holds on every rank); ``flag_key`` names
    the load for :class:`~shardckpt.checkpoint.loss_flag.LossFlag`, so that a rank lost during the
    transfers fails every survivor at once. ``manifest``: the one the ranks agreed on (this
    node's own copy is not read again). A shard file of this node that fails its checksums is
    moved aside and the load fails with :class:`DamagedCopyError` (the caller may load again
    with the copy from another node). ``then(reader)``: this rank's further reads (its per-rank
    state), inside the same agreement: a failure there fails every rank with the load, and no
    round of its own is spent."""
    rank, _ = rank_and_world()
    reader = CheckpointReader(url, {}, manifest=manifest)
    m = reader.manifest
    shards = model.local_shards()
    tensors = [t for kinds in shards.values() for t in kinds.values()]
    plain = direct_ready(model, m) and local_path(reader.storage.url) is not None
    if not plain:
        if peers:
            raise ShardckptError(f"{url}: shard files from peers need a direct load, and this "
                                 "engine's shards cannot take one")
        return load(model, reader, strict=strict)
    counter = {"bytes": 0}
    through = pipelined(tensors)
    views = {(g, k): target_view(t, through) for g, kinds in shards.items() for k, t in kinds.items()}

    def work() -> dict[str, Any]:
        src = m.components["model"]
        plan = plan_reshard(src.layout, model.layout, strict=strict)
        my_shard = model.layout.mesh.shard_rank(rank)
        by_file: dict[str, tuple[FileEntry, list[tuple[int, int, Any]]]] = {}
        mine = {t.path for t in peers if t.dst == rank}  # from peers: their headers checked below
        for c in plan.for_dst_shard(my_shard):
            for kind, tensor in shards[c.dst_group].items():
                entry, a, b = reader.state_range(c.src_shard, c.src_group, kind, c.src_offset,
                                                 c.src_offset + c.numel, check=False)
                k = tensor.element_size()
                by_file.setdefault(entry.path, (entry, []))[1].append(
                    (a, b, piece(views[(c.dst_group, kind)], c.dst_offset * k,
                                 (c.dst_offset + c.numel) * k)))
                counter["bytes"] += b - a
        if peers:
            entries = {f.path: f for f in m.files}
            heads = {p: header_target(entries[p].data_start, through) for p in mine}
            into = {p: [(0, entries[p].data_start, heads[p][1]),
                        *(by_file[p][1] if p in by_file else [])] for p in mine}
            run_transfers(peers, rank, reader.storage, entries, m.chunk_size, None, into=into)
            for p in sorted(mine):
                reader.check_header_bytes(entries[p], heads[p][0]())
        # this node's copies that fail a check: moved aside below, the rest read on
        damaged = read_local(reader, by_file, mine, through, tensors)
        if damaged:
            raise_damaged(damaged)
        if src.buffers:
            bufs = {}
            for spec in src.buffers:
                try:
                    slot, data = reader.read_buffer(spec.fqn)
                except IntegrityError as e:  # this node's copy: moved aside, then raised
                    raise_damaged_role(reader.files, m, "buffers", None, e)
                bufs[spec.fqn] = _tensor(slot.dtype, slot.shape, data)
            model.load_buffers(bufs)
        assert m.optimizer is not None
        load_optimizer_info(model, m.optimizer, strict)
        model.refresh_params()
        if then is not None:
            then(reader)
        return {"missing": list(plan.missing), "unexpected": list(plan.unexpected),
                "mismatched": list(plan.mismatched)}

    flag = LossFlag.for_group(None, flag_key) if peers and flag_key else None
    out, _ = agree(work, f"load of {url}", None, flag=flag)
    assert out is not None
    return LoadResult(tuple(out["missing"]), tuple(out["unexpected"]), tuple(out["mismatched"]),
                      m, counter["bytes"], reader)


def _tensor(dtype: str, shape: Sequence[int], data: memoryview) -> Any:
    import torch

    dt = getattr(torch, dtype)
    if not len(data):
        return torch.empty(tuple(shape), dtype=dt)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dt).reshape(tuple(shape))
