"""Start a sharded run from Hugging Face weights: each rank reads only its own bytes.

Typical use, on every rank (``skip_weight_init`` is :func:`shardckpt.runtime.init.skip_weight_init`)::

    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig.from_hf_config(config))
    engine = ZeroEngine(model, policy=LLAMA_POLICY, process_mesh=pm, init_fn=skip_weight_init)
    load_hf(engine, "s3://bucket/Llama-3.2-1B")     # before the optimizer is built
    opt = ShardedAdamW(engine, ...)

The engine is taken as a :class:`HFLoadTarget` (the runtime's ``ZeroEngine`` is one), so this
module needs nothing from the runtime layer above it.

Every rank opens the index and the file headers (small), matches the file's names to the model's
FQNs, plans the element ranges of its own flat shards (:func:`shardckpt.interop.hf.import_.plan_shard_reads`) and
reads exactly those byte ranges, cast from the file's dtype to the masters' dtype as they arrive.
No rank holds a whole tensor it does not own, let alone the model: memory is the rank's shards plus
a few read buffers, whatever the stage, world size or HSDP mesh (replicas read the same ranges).
Errors are agreed: every rank raises the same one.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Protocol
from collections.abc import Mapping

import numpy as np
import torch

from shardckpt.checkpoint.collective import agree
from shardckpt.errors import IncompatibleLayoutError
from shardckpt.interop.hf.import_ import NameMap, as_bytes, fetch, match_tensors, plan_shard_reads
from shardckpt.interop.hf.source import HFSource, open_hf
from shardckpt.storage import DEFAULT_BATCH
from shardckpt.checkpoint.pieces import cast_bytes
from shardckpt.training.optim_info import fresh_optimizer_state
from shardckpt.training.save_load import Sharded

log = logging.getLogger(__name__)

__all__ = ["HFLoadResult", "HFLoadTarget", "load_hf"]


class _ShardRank(Protocol):
    @property
    def shard_rank(self) -> int: ...


class HFLoadTarget(Sharded, Protocol):
    """What :func:`load_hf` needs from a sharded model: what save/load need
    (:class:`~shardckpt.training.save_load.Sharded`), and the rank's place in its shard group
    (``process_mesh.shard_rank``), whose shards it reads."""

    @property
    def process_mesh(self) -> _ShardRank: ...


def _dtype_name(dtype: torch.dtype) -> str:
    """The layout name of a torch dtype (``torch.float32`` -> ``"float32"``)."""
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class HFLoadResult:
    """What :func:`load_hf` did: names that did not fit (non-strict), this rank's bytes, config."""

    missing: tuple[str, ...]
    unexpected: tuple[str, ...]
    mismatched: tuple[str, ...]
    bytes_read: int
    config: Mapping[str, Any] | None


def _write(target: torch.Tensor, offset: int, data: Any) -> None:
    """Copy the bytes ``data`` (already in ``target``'s dtype) to element ``offset`` of ``target``."""
    if hasattr(target, "write_bytes"):  # a master in its offload file
        target.write_bytes(offset * target.dtype.itemsize, as_bytes(data))
        return
    raw = np.frombuffer(as_bytes(data), dtype=np.uint8)
    k = target.element_size()
    if target.device.type == "cpu":
        target.detach().view(torch.uint8).numpy()[offset * k:offset * k + raw.size] = raw
    else:
        target.view(torch.uint8)[offset * k:offset * k + raw.size].copy_(
            torch.from_numpy(raw.copy()).to(target.device))


def _bytes_at(target: torch.Tensor, offset: int, nbytes: int) -> bytes:
    if hasattr(target, "read_bytes"):  # a master in its offload file
        return target.read_bytes(offset * target.dtype.itemsize, nbytes)
    k = target.element_size()
    return target.detach().view(torch.uint8)[offset * k:offset * k + nbytes].cpu().numpy().tobytes()


def load_hf(engine: HFLoadTarget, source: str | HFSource, *, name_map: NameMap = None,
            strict: bool = True, storage_options: Mapping[str, Any] | None = None,
            buffer_bytes: int = DEFAULT_BATCH, workers: int = 4, group: Any = None) -> HFLoadResult:
    """Load Hugging Face safetensors weights into ``engine``'s master shards. Call on every rank.

    ``source``: a folder with ``model.safetensors`` or ``model.safetensors.index.json`` (or one
    ``.safetensors`` file), local or any fsspec URL. ``name_map`` turns a file's tensor names
    into the model's FQNs (a dict, or a callable returning None to skip a tensor). A tied head
    may be absent from the file or present and equal to the embedding (each rank compares its
    share). ``strict`` (default) refuses missing and unexpected names; mis-shaped tensors and
    dtypes the masters cannot take are always refused; all offenders in one error, raised on
    every rank. Non-strict, parameters the file lacks keep their values and the lists are
    returned. Values are cast to the masters' dtype (fp32; a frozen group's own dtype); an
    attached optimizer starts fresh (zero state, step 0). Persistent buffers found in the file
    are loaded too.
    """
    counter: dict[str, Any] = {"bytes": 0, "config": None}

    def work() -> dict[str, Any]:
        src = source if isinstance(source, HFSource) else open_hf(source, storage_options)
        counter["config"] = src.config
        layout, shards = engine.layout, engine.local_shards()
        masters = {g.name: shards[g.name]["master"] for g in layout.groups}
        targets = {p.fqn: (p.shape, _dtype_name(masters[p.group].dtype)) for p in layout.params}
        buffers = engine.buffers()
        targets.update({f: (tuple(b.shape), _dtype_name(b.dtype)) for f, b in buffers.items()})
        match = match_tensors(targets, src.tensors, engine.tied_aliases, name_map)
        err = match.error(src.url, strict)
        if err is not None:
            raise err
        shard = engine.process_mesh.shard_rank
        params = {f: t for f, t in match.sources.items() if layout.has_param(f)}
        reads = sorted(plan_shard_reads(layout, shard, params, buffer_bytes),
                       key=lambda r: (r.tensor.file, r.src_begin))
        for r, raw in fetch(src, reads, buffer_bytes, workers):
            target = masters[r.group]
            _write(target, r.dst_offset, cast_bytes(raw, r.tensor.dtype, _dtype_name(target.dtype)))
            counter["bytes"] += len(raw)
        for canon, alias in match.tied:
            _check_tied(src, engine, masters, canon, alias, buffer_bytes, workers, counter)
        loaded_buffers = {}
        for fqn, t in match.sources.items():
            if fqn in buffers:
                stored = src.storage.read(t.file, t.begin, t.end)
                counter["bytes"] += len(stored)
                b = torch.empty_like(buffers[fqn], device="cpu")
                _write(b.reshape(-1), 0, cast_bytes(stored, t.dtype, _dtype_name(b.dtype)))
                loaded_buffers[fqn] = b
        engine.load_buffers(loaded_buffers, strict=False)
        engine.refresh_params()
        fresh_optimizer_state(engine)
        return {"missing": list(match.missing), "unexpected": list(match.unexpected),
                "mismatched": list(match.mismatched)}

    out, _ = agree(work, f"load of Hugging Face weights from {_url(source)}", group)
    assert out is not None
    log.info("loaded %s: %d bytes read on this rank", _url(source), counter["bytes"])
    return HFLoadResult(tuple(out["missing"]), tuple(out["unexpected"]), tuple(out["mismatched"]),
                        int(counter["bytes"]), counter["config"])


def _url(source: str | HFSource) -> str:
    return source.url if isinstance(source, HFSource) else str(source)


def _check_tied(src: HFSource, engine: HFLoadTarget, masters: Mapping[str, torch.Tensor],
                canon: str, alias: Any, buffer_bytes: int, workers: int,
                counter: dict[str, Any]) -> None:
    """The file holds a tied alias as well: its share must equal what the canonical gave."""
    reads = plan_shard_reads(engine.layout, engine.process_mesh.shard_rank, {canon: alias},
                             buffer_bytes)
    for r, raw in fetch(src, reads, buffer_bytes, workers):
        target = masters[r.group]
        data = as_bytes(cast_bytes(raw, alias.dtype, _dtype_name(target.dtype)))
        counter["bytes"] += len(raw)
        if _bytes_at(target, r.dst_offset, len(data)) != bytes(data):
            raise IncompatibleLayoutError(
                f"{src.storage.url_of(alias.file)}: {alias.name} differs from {canon}, but the "
                f"model ties them; build the model untied, or skip {alias.name} with name_map")
