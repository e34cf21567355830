"""Synthetic checkpoints of a Llama-shaped layout, without torch and without a training job.

The layout is what the runtime produces for a Llama-shaped model with the policy "each decoder
layer, then the root": embedding tied to the output head, U blocks of attention and MLP weights,
RMSNorm weights whose numel is not a multiple of 16·S, one frozen parameter and one persistent
buffer; fp32 masters and AdamW moments (``exp_avg_sq`` >= 0) in two param groups (no weight decay
on norms). Values are a pure function of (seed, parameter, state kind, element index), so the
same seed gives the same tensors for every world size: consolidations of two synthetic checkpoints
of different N compare equal.
"""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from typing import Any
from collections.abc import Callable, Iterator, Mapping

import numpy as np

from shardckpt.format.signing import SigningKey
from shardckpt.checkpoint.attempt import Attempt, Steps
from shardckpt.checkpoint.job import Job
from shardckpt.checkpoint.reader import as_storage

from shardckpt.checkpoint.writer import CheckpointSpec, CheckpointWriter
from shardckpt.errors import ConfigError
from shardckpt.format.layout import Layout, Mesh, ParamInfo, build_layout
from shardckpt.format.manifest import (
    BufferSpec, Component, FileEntry, Manifest, OptimizerInfo, TensorSlot, default_states, shard_slots,
)
from shardckpt.format.records import ParamGroupRecord, PerRankState, RunExtras
from shardckpt.storage import crc32c

ADAMW_KINDS = ("exp_avg", "exp_avg_sq")
BLOCK = 1 << 16  # values are generated in blocks of this many elements
_KIND_ID = {"master": 1, "exp_avg": 2, "exp_avg_sq": 3, "momentum_buffer": 4}


def llama_dims(params: int, units: int) -> tuple[int, int, int]:
    """(hidden d, intermediate ff, vocab V) so that the layout holds about ``params`` elements.

    d is 8 more than a multiple of 16, so norm weights never fill whole 16-element quanta.
    """
    if params < 1 or units < 0:
        raise ConfigError(f"need params >= 1 and units >= 0; got params={params}, units={units}")
    d = math.sqrt(params / (32 + 12 * units))
    d = max(8, int(d) // 16 * 16 + 8)
    ff = max(8, (8 * d // 3 + 7) // 8 * 8)
    return d, ff, 32 * d


def llama_params(params: int, units: int) -> tuple[list[ParamInfo], list[BufferSpec], dict[str, str]]:
    """Parameter infos (unit policy: each layer, then the root), buffers and tied aliases."""
    d, ff, vocab = llama_dims(params, units)
    out: list[ParamInfo] = []
    for i in range(units):
        u = f"model.layers.{i}"
        for name, shape in (
            ("input_layernorm.weight", (d,)),
            ("self_attn.q_proj.weight", (d, d)), ("self_attn.k_proj.weight", (d, d)),
            ("self_attn.v_proj.weight", (d, d)), ("self_attn.o_proj.weight", (d, d)),
            ("post_attention_layernorm.weight", (d,)),
            ("mlp.gate_proj.weight", (ff, d)), ("mlp.up_proj.weight", (ff, d)),
            ("mlp.down_proj.weight", (d, ff)),
        ):
            out.append(ParamInfo(f"{u}.{name}", shape, "float32", True, u))
    out.append(ParamInfo("model.embed_tokens.weight", (vocab, d), "float32", True, ""))
    out.append(ParamInfo("model.norm.weight", (d,), "float32", True, ""))
    out.append(ParamInfo("model.frozen_scale", (d,), "float32", False, ""))
    buffers = [BufferSpec("model.rotary_emb.inv_freq", (max(1, d // 16),), "float32")]
    return out, buffers, {"lm_head.weight": "model.embed_tokens.weight"}


def _fqn_key(fqn: str) -> int:
    return crc32c(fqn.encode())


def values(seed: int, fqn: str, kind: str, start: int, end: int) -> np.ndarray:
    """Elements ``[start, end)`` (flattened) of a parameter's state, as float32."""
    if end <= start:
        return np.zeros(0, np.float32)
    key = _fqn_key(fqn)
    is_norm = fqn.endswith("norm.weight")
    parts = []
    for b in range(start // BLOCK, (end - 1) // BLOCK + 1):
        rng = np.random.default_rng([seed, _KIND_ID.get(kind, 9), key, b])
        x = rng.standard_normal(BLOCK, dtype=np.float32)
        lo, hi = max(start, b * BLOCK) - b * BLOCK, min(end, (b + 1) * BLOCK) - b * BLOCK
        parts.append(x[lo:hi])
    v = np.concatenate(parts) if len(parts) > 1 else parts[0]
    if kind == "master":
        return (1.0 + 0.01 * v).astype(np.float32) if is_norm else (0.02 * v).astype(np.float32)
    if kind == "exp_avg_sq":
        return (1e-6 * v * v).astype(np.float32)
    return (1e-3 * v).astype(np.float32)


def shard_producer(layout: Layout, seed: int, shard: int) -> Callable[[TensorSlot], Iterator[Any]]:
    """Bytes of every ``<group>.<kind>`` slot of one shard, generated piece by piece."""

    def produce(slot: TensorSlot) -> Iterator[Any]:
        gname, kind = slot.name.rsplit(".", 1)
        pieces, padding = layout.shard_pieces(gname, shard)
        for p, a, b in pieces:
            for x in range(a, b, BLOCK * 16):
                yield values(seed, p.fqn, kind, x, min(b, x + BLOCK * 16))
        if padding:
            yield bytes(padding * 4)

    return produce


def synth_spec(params: int, ranks: int, replicate: int = 1, units: int = 2, step: int = 100,
               seed: int = 0) -> CheckpointSpec:
    """The manifest-to-be of a synthetic checkpoint (layout, states, optimizer, extras)."""
    mesh = Mesh.for_world(ranks, replicate)
    infos, buffers, aliases = llama_params(params, units)
    layout = build_layout(infos, mesh, prefix="model.")
    states = {g.name: default_states(g, ADAMW_KINDS) for g in layout.groups}
    comp = Component("model", layout, states, aliases, tuple(buffers))
    trained = [i for i in infos if i.requires_grad]
    decay = [i.fqn for i in trained if len(i.shape) >= 2]
    no_decay = [i.fqn for i in trained if len(i.shape) < 2]
    base = {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8, "amsgrad": False}
    optim = OptimizerInfo("adamw", (
        ParamGroupRecord(tuple(decay), {**base, "weight_decay": 0.1}, step).to_doc(),
        ParamGroupRecord(tuple(no_decay), {**base, "weight_decay": 0.0}, step).to_doc(),
    ))
    extras = RunExtras(step=step, samples_seen=step * 8 * ranks // replicate,
                       other={"user": {"synthetic": True, "seed": seed}})
    return CheckpointSpec(mesh, {"model": comp}, optim, extras.to_doc(),
                          PerRankState(world_size=ranks).to_doc())


def synth_bytes(params: int, ranks: int, replicate: int = 1, units: int = 2) -> int:
    """Bytes of shard data :func:`synthesize` writes for these arguments: what its ``progress``
    counts in all."""
    spec = synth_spec(params, ranks, replicate, units)
    slots = shard_slots(spec.components, spec.mesh)
    return (slots[-1].end if slots else 0) * spec.mesh.shard_degree


def synthesize(dst: str, params: int, ranks: int, replicate: int = 1, units: int = 2,
               seed: int = 0, step: int = 100, storage_options: Mapping[str, Any] | None = None,
               workers: int = 2, chunk_size: int | None = None,
               progress: Callable[[int], None] | None = None, digests: bool | str = False,
               signing_key: SigningKey | None = None) -> Manifest:
    """Write a committed synthetic checkpoint to ``dst`` (an fsspec URL) and return its manifest
    (``digests``, ``signing_key``: as :class:`~shardckpt.checkpoint.writer.CheckpointSpec`'s)."""
    spec = synth_spec(params, ranks, replicate, units, step, seed)
    spec.digests, spec.signing_key = digests, signing_key
    if chunk_size:
        spec.chunk_size = chunk_size
    storage = as_storage(dst, storage_options)
    layout = spec.components["model"].layout
    buffers = spec.components["model"].buffers

    def one(writer: CheckpointWriter, shard: int) -> Any:
        produce = shard_producer(layout, seed, shard)
        if progress is None:
            return writer.write_shard(shard, produce)

        def counted(slot: TensorSlot) -> Iterator[Any]:
            for piece in produce(slot):
                yield piece
                progress(memoryview(piece).nbytes)
        return writer.write_shard(shard, counted)

    def buffer_values(slot: TensorSlot) -> Iterator[Any]:
        n = math.prod(slot.shape)
        yield (1.0 / (10000.0 ** (np.arange(n, dtype=np.float32) / max(1, n)))).astype(np.float32)

    def write(writer: CheckpointWriter) -> list[FileEntry]:
        with ThreadPoolExecutor(max(1, workers)) as pool:
            entries = list(pool.map(lambda s: one(writer, s), range(spec.mesh.shard_degree)))
        b = writer.write_buffers(buffer_values) if buffers else None
        return entries + ([b] if b else [])

    # one process; the destination is not guarded (synth writes where it is told, as before)
    attempt = Attempt(Job.single(), storage.url, Steps.named("synth"),
                      lambda save_id: CheckpointWriter(storage, spec, save_id),
                      room=lambda w: storage.ensure_free_space("", w.data_bytes(), "synth"))
    m = attempt.run(write, lambda w, reports: w.commit(reports[0]))
    assert m is not None
    return m
