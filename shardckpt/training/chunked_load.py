"""Load into ``ZeroEngine`` a checkpoint of chunked tensors, without a conversion step.

FSDP2 saved it through :class:`shardckpt.interop.dcp.storage.ShardckptWriter`, or
``shardckpt import dcp`` kept DCP's chunks; each rank reads only the elements of its own shard of
every flat group from the chunks that hold them (:mod:`shardckpt.interop.dcp.to_flat` says which
tensor is what).
"""

from __future__ import annotations

from typing import Any
from collections.abc import Mapping

from shardckpt.checkpoint.chunked_read import iter_elements
from shardckpt.checkpoint.collective import agree, rank_and_world
from shardckpt.checkpoint.reader import CheckpointReader
from shardckpt.errors import IntegrityError
from shardckpt.format.manifest import Manifest
from shardckpt.interop.dcp.model_state import as_tensor, read_model
from shardckpt.interop.dcp.to_flat import flat_producer
from shardckpt.storage import DEFAULT_BATCH
from shardckpt.training.optim_info import load_optimizer_info


class _Slot:
    """What a producer is asked for: one ``<group>.<kind>`` state."""

    def __init__(self, name: str) -> None:
        self.name = name


def load_chunked(model: Any, url: str | CheckpointReader,
                 storage_options: Mapping[str, Any] | None = None, *,
                 model_key: str = "model", optim_key: str | None = None, strict: bool = True,
                 weights_only: bool = False, buffer_bytes: int = DEFAULT_BATCH,
                 group: Any = None) -> Manifest:
    """Load a checkpoint of chunked tensors (FSDP2 saved it through
    :class:`shardckpt.interop.dcp.storage.ShardckptWriter`, or ``import dcp`` kept DCP's chunks) into
    ``ZeroEngine`` ``model`` at any world size, without a conversion step: each rank reads the
    elements of its own shard of every flat group (masters, Adam moments; the model's frozen
    parameters from the tensors of their names) from the chunks that hold them, then buffers and
    the optimizer's hyper-parameters and step (``weights_only``: masters and buffers alone).
    ``url`` may be this rank's reader of the checkpoint, already open (its manifest read):
    ``shardckpt.training.save_load.load`` passes the one it opened, so that a rank opens the
    checkpoint once. Collective."""
    import torch

    rank, _ = rank_and_world(group)
    lay = model.layout
    my_shard = lay.mesh.shard_rank(rank)
    opened: list[CheckpointReader] = []

    def work() -> str:
        reader = url if isinstance(url, CheckpointReader) else CheckpointReader(url, storage_options)
        opened.append(reader)
        frozen = [p.fqn for g in lay.groups if not g.requires_grad for p in lay.group_params(g)]
        src = read_model(reader, model_key, optim_key, frozen_names=frozen)
        found = {g.name: (src.params if g.requires_grad else {**src.params, **src.frozen})
                 for g in lay.groups}
        missing = sorted(p.fqn for p in lay.params if p.fqn not in found[p.group])
        if missing and strict:
            raise IntegrityError(f"{reader.url}: no weights (with Adam state, for a trained one) "
                                 f"for {len(missing)} parameters of the model: {missing[:10]}")
        produce = flat_producer(reader, src, lay, my_shard, buffer_bytes)
        with torch.no_grad():
            for gname, kinds in model.local_shards().items():
                if any(p.fqn not in found[gname] for p in lay.group_params(gname)):
                    continue
                for kind, tensor in kinds.items():
                    if weights_only and kind != "master":
                        continue
                    if kind != "master" and kind not in src.kinds:
                        raise IntegrityError(f"{reader.url}: holds {', '.join(src.kinds)}; the "
                                             f"optimizer keeps {kind!r}")
                    if hasattr(tensor, "write_bytes"):  # state in an offload file
                        at = 0
                        for x in produce(_Slot(f"{gname}.{kind}")):
                            tensor.write_bytes(at, x)
                            at += memoryview(x).nbytes
                        continue
                    flat, pos = tensor.view(-1), 0
                    dtype = str(flat.dtype).removeprefix("torch.")
                    for x in produce(_Slot(f"{gname}.{kind}")):
                        piece = as_tensor(memoryview(x).cast("B"), dtype)
                        flat[pos:pos + piece.numel()].copy_(piece)
                        pos += piece.numel()
        bufs = {}
        for f, t in src.buffers.items():
            raw = bytearray(b"".join(iter_elements(reader, t, 0, t.numel, 1 << 24)))
            dtype = getattr(torch, t.dtype)
            bufs[f] = (torch.frombuffer(raw, dtype=torch.uint8).view(dtype).reshape(t.shape)
                       if raw else torch.empty(t.shape, dtype=dtype))
        if bufs:
            model.load_buffers(bufs)
        if not weights_only:
            load_optimizer_info(model, src.optimizer, strict)
        model.refresh_params()
        return reader.manifest.save_id

    agree(work, f"load of {url.url if isinstance(url, CheckpointReader) else url}", group)
    return opened[0].manifest  # every rank opened it, or agree raised
