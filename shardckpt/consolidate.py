"""Consolidate a sharded checkpoint into Hugging Face safetensors, streaming with bounded memory.

Output in ``DST`` (component ``model`` by default):

* ``model-0000i-of-0000K.safetensors``: parameters by FQN in their original shapes, then persistent
  buffers; each file at most ``max_shard_size`` bytes, header included (a single larger tensor gets
  a file of its own). Always with an index, even for K = 1: ``transformers`` loads either form,
  and one commit rule serves both.
* ``model.safetensors.index.json`` (``metadata.total_size`` = tensor bytes, ``weight_map``):
  **written last, it commits DST**; a failed or killed run leaves no index.
* ``--optimizer``: ``optimizer-0000i-of-0000K.safetensors`` with ``"<fqn>.<kind>"`` in fp32, and
  ``optimizer.safetensors.index.json`` whose metadata adds the optimizer name and param groups
  (``params``, ``hparams``, ``step``).
* ``shardckpt_consolidated.json``: provenance (source, save id, step, dtype, omitted aliases).

Invariants:

* Values come from the ``master`` state (fp32; frozen groups: their own dtype). Floating tensors,
  buffers included, are cast to the requested dtype, as ``model.to(dtype).save_pretrained()``
  does; integer and bool tensors keep theirs. bf16 is round-to-nearest-even on the float32 bit
  pattern, bit-identical to torch's CPU cast, NaN included (``0xFFFF``); float64 goes through
  float32 first, as torch does.
* Tied parameters are written once, under the canonical FQN; aliases (``lm_head.weight``) are not
  written, as ``save_pretrained`` does, and are listed in the provenance file.
* The output depends only on the tensors, not on the world size, mesh or unit policy.
* Memory is about ``buffer_bytes`` (plus up to two checksum chunks per range being read), never a
  tensor: a file's header is written first (shapes are known from the manifest), then tensors
  are streamed in pieces read with checked ranged reads.

Does not import torch.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from shardckpt.checkpoint import CheckpointReader, as_storage
from shardckpt.errors import ConfigError, ManifestError, ShardckptError
from shardckpt.layout import DTYPES, itemsize, prod
from shardckpt.manifest import DEFAULT_CHUNK_SIZE, Manifest, TensorSlot
# Casts and piece reads live in shardckpt.pieces (shared with diff); re-exported for old imports.
from shardckpt.pieces import (  # noqa: F401
    DEFAULT_BUFFER, Piece, PieceReader, Source, byte_ranges, cast_bytes, decode, f32_to_bf16_bits,
)
from shardckpt.stheader import build_header
from shardckpt.storage import Storage

log = logging.getLogger(__name__)

DEFAULT_MAX_SHARD_SIZE = 5_000_000_000
MODEL_INDEX = "model.safetensors.index.json"
OPTIMIZER_INDEX = "optimizer.safetensors.index.json"
PROVENANCE = "shardckpt_consolidated.json"
DTYPE_ALIASES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "half": "float16",
                 "float16": "float16", "fp32": "float32", "float": "float32", "float32": "float32"}
FLOATS = ("float64", "float32", "bfloat16", "float16", "float8_e4m3fn", "float8_e5m2")
_OUTPUT_NAME = re.compile(r"^(model|optimizer)(-\d{5}-of-\d{5})?\.safetensors"
                          r"(\.index\.json|\.partial-[0-9a-f]+)?$|^shardckpt_consolidated\.json$")


# ----------------------------------------------------------------------------- dtype choice (pure)


def output_dtype(stored: str, requested: str) -> str:
    return requested if stored in FLOATS else stored


def canonical_dtype(name: str) -> str:
    try:
        return DTYPE_ALIASES[name.lower()]
    except KeyError:
        raise ConfigError(f"unknown dtype {name!r}; use bf16, fp16 or fp32") from None


# ------------------------------------------------------------------------------------ plan (pure)


@dataclass(frozen=True, slots=True)
class OutTensor:
    name: str
    shape: tuple[int, ...]
    dtype: str
    source: Source

    @property
    def numel(self) -> int:
        return prod(self.shape)


@dataclass(frozen=True)
class OutFile:
    """One output file: its header (already built) and tensors in data order."""

    name: str
    header: bytes
    tensors: tuple[OutTensor, ...]
    data_bytes: int

    @property
    def size(self) -> int:
        return len(self.header) + self.data_bytes


@dataclass(frozen=True)
class ConsolidationPlan:
    source: str
    save_id: str
    step: int | None
    component: str
    dtype: str
    files: tuple[OutFile, ...]
    optimizer_files: tuple[OutFile, ...] = ()
    optimizer_meta: Mapping[str, Any] = field(default_factory=dict)
    omitted_aliases: Mapping[str, str] = field(default_factory=dict)

    @property
    def source_bytes(self) -> int:
        """Bytes of tensors read from the source (what progress counts)."""
        return sum(t.numel * itemsize(t.source.dtype)
                   for f in self.files + self.optimizer_files for t in f.tensors)


_META = {"format": "pt"}  # transformers refuses safetensors files without format "pt"


def _entry_chars(name: str, dtype: str, shape: tuple[int, ...], begin: int, end: int) -> int:
    doc = {name: {"dtype": DTYPES[dtype][1], "shape": list(shape), "data_offsets": [begin, end]}}
    return len(json.dumps(doc, separators=(",", ":"))) - 2


def pack_files(tensors: Sequence[OutTensor], max_shard_size: int, prefix: str) -> tuple[OutFile, ...]:
    """Greedy in order: a tensor starts a new file when it would push the current one (header
    included, exactly) past ``max_shard_size``; a tensor too large for any file gets its own."""
    groups: list[list[OutTensor]] = []
    cur: list[OutTensor] = []
    meta = len(json.dumps({"__metadata__": _META}, separators=(",", ":")))  # with the braces
    data = chars = 0
    for t in tensors:
        nbytes = t.numel * itemsize(t.dtype)
        c = _entry_chars(t.name, t.dtype, t.shape, data, data + nbytes)
        hdr = meta + chars + c + len(cur) + 1  # the JSON: entries joined by commas
        if cur and 8 + hdr + (-hdr % 8) + data + nbytes > max_shard_size:
            groups.append(cur)
            cur, data, chars = [], 0, 0
            c = _entry_chars(t.name, t.dtype, t.shape, 0, nbytes)
        cur.append(t)
        data += nbytes
        chars += c
    if cur or not groups:
        groups.append(cur)
    out = []
    for i, ts in enumerate(groups):
        slots, pos = [], 0
        for t in ts:
            n = t.numel * itemsize(t.dtype)
            slots.append(TensorSlot(t.name, t.dtype, t.shape, pos, pos + n))
            pos += n
        name = f"{prefix}-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        out.append(OutFile(name, build_header(slots, _META), tuple(ts), pos))
    return tuple(out)


def plan_consolidation(m: Manifest, dtype: str = "bfloat16", max_shard_size: int = DEFAULT_MAX_SHARD_SIZE,
                       component: str = "model", optimizer: bool = False, source: str = "") -> ConsolidationPlan:
    """Which tensors go to which output file, in which dtype, read from where. Pure."""
    out = canonical_dtype(dtype)
    if max_shard_size < 1:
        raise ConfigError(f"max shard size {max_shard_size}: must be positive")
    comp = m.components.get(component)
    if comp is None:
        raise ConfigError(f"{source or 'the checkpoint'} has no component {component!r}; it has "
                          f"{', '.join(sorted(m.components)) or 'none'}")
    tensors: list[OutTensor] = []
    opt: list[OutTensor] = []
    for g in comp.layout.groups:
        states = dict(comp.states[g.name])
        if "master" not in states:
            raise ManifestError(f"{source}: group {g.name!r} has no master state to consolidate")
        params = comp.layout.group_params(g)
        tensors += [OutTensor(p.fqn, p.shape, output_dtype(states["master"], out),
                              Source(states["master"], g.name, "master", p.offset, p.fqn)) for p in params]
        for kind, kdt in comp.states[g.name]:
            if kind != "master":
                opt += [OutTensor(f"{p.fqn}.{kind}", p.shape, output_dtype(kdt, "float32"),
                                  Source(kdt, g.name, kind, p.offset, p.fqn)) for p in params]
    names = {t.name for t in tensors}
    clash = [b.fqn for b in comp.buffers if b.fqn in names]
    if clash:
        raise ManifestError(f"{source}: buffers named like parameters: {', '.join(clash)}")
    tensors += [OutTensor(b.fqn, b.shape, output_dtype(b.dtype, out), Source(b.dtype, None, "buffer", 0, b.fqn))
                for b in comp.buffers]
    opt_files: tuple[OutFile, ...] = ()
    meta: dict[str, Any] = {}
    if optimizer:
        if not opt:
            raise ConfigError(f"{source or 'the checkpoint'}: component {component!r} holds no "
                              "optimizer state; drop --optimizer")
        opt_files = pack_files(opt, max_shard_size, "optimizer")
        if m.optimizer is not None:
            own = {p.fqn for p in comp.layout.params}
            meta = {"optimizer": m.optimizer.name, "param_groups": [
                {**pg, "params": [p for p in pg["params"] if p in own]} for pg in m.optimizer.param_groups]}
    step = m.extras.get("step")
    if not isinstance(step, int) and m.optimizer is not None:
        step = max((pg.get("step", 0) for pg in m.optimizer.param_groups), default=None)
    return ConsolidationPlan(source, m.save_id, step if isinstance(step, int) else None, component, out,
                             pack_files(tensors, max_shard_size, "model"), opt_files, meta,
                             dict(comp.aliases))


# --------------------------------------------------------------------------------- write (effectful)


@dataclass(frozen=True)
class ConsolidateResult:
    url: str
    source: str
    save_id: str
    step: int | None
    dtype: str
    component: str
    files: tuple[tuple[str, int], ...]            # (name, bytes)
    optimizer_files: tuple[tuple[str, int], ...]
    tensors: int
    total_size: int                               # tensor bytes of the model set (index total_size)
    omitted_aliases: Mapping[str, str]
    bytes_read: int
    bytes_written: int
    seconds: float


def _index(files: Sequence[OutFile], extra: Mapping[str, Any] | None = None) -> bytes:
    meta = {"total_size": sum(f.data_bytes for f in files), **(extra or {})}
    wmap = {t.name: f.name for f in files for t in f.tensors}
    return json.dumps({"metadata": meta, "weight_map": wmap}, indent=2).encode()


def _write_file(storage: Storage, rel: str, f: OutFile, engine: PieceReader,
                progress: Callable[[int], None] | None) -> int:
    items = [(t.numel, (t.source,)) for t in f.tensors]
    with storage.writer(rel, DEFAULT_CHUNK_SIZE) as w:
        w.write(f.header)
        pieces = engine.pieces(items)
        try:
            for p in pieces:
                t = f.tensors[p.index]
                w.write(cast_bytes(p.data[0], t.source.dtype, t.dtype))
                if progress:
                    progress(len(p.data[0]))
        finally:
            pieces.close()  # type: ignore[attr-defined]
        size, _, _ = w.close()
    if size != f.size:
        raise ShardckptError(f"{storage.url_of(rel)}: wrote {size} bytes, planned {f.size}")
    return size


def write_consolidation(reader: CheckpointReader, plan: ConsolidationPlan, dst: "str | Storage",
                        overwrite: bool = False, storage_options: Mapping[str, Any] | None = None,
                        buffer_bytes: int = DEFAULT_BUFFER,
                        progress: Callable[[int], None] | None = None) -> ConsolidateResult:
    """Write ``plan`` to ``dst``; the model index is created last and commits DST.

    Refuses a DST holding anything unless ``overwrite``; with it, the old indexes are removed
    first (DST is uncommitted from then on), our old outputs not rewritten are removed after the
    commit, and other files (``config.json``, tokenizer files) are kept. Local files are written
    under ``<name>.partial-<id>`` and renamed once all are complete; on object stores each upload
    becomes visible only when complete. On failure, every file this run wrote is removed.
    """
    t0 = time.perf_counter()
    storage = as_storage(dst, storage_options)
    if storage.url.rstrip("/") == reader.url.rstrip("/"):
        raise ConfigError(f"{storage.url}: the destination is the source; choose another directory")
    existing = storage.ls("")
    if existing and not overwrite:
        raise ConfigError(f"{storage.url} already exists and holds {len(existing)} entries "
                          f"({', '.join(existing[:3])}{', ...' if len(existing) > 3 else ''}); "
                          "pass --overwrite to replace its consolidated files")
    uncommit = (MODEL_INDEX, OPTIMIZER_INDEX, PROVENANCE, "model.safetensors", "optimizer.safetensors")
    for name in uncommit:  # before any new byte: a stale index or single file must not be loaded
        if name in existing:
            storage.rm(name)
    engine = PieceReader([reader], buffer_bytes)
    token = uuid.uuid4().hex[:8]
    files = plan.files + plan.optimizer_files
    staged = [f"{f.name}.partial-{token}" if storage.is_local else f.name for f in files]
    done: list[str] = []
    written = 0
    try:
        for f, rel in zip(files, staged):
            done.append(rel)
            written += _write_file(storage, rel, f, engine, progress)
        if storage.is_local:
            for f, rel in zip(files, staged):
                storage.call("rename", rel, lambda a=rel, b=f.name: os.replace(storage.full(a), storage.full(b)))
                done[done.index(rel)] = f.name
    except BaseException:
        for rel in done:
            try:
                storage.rm(rel)
            except ShardckptError:
                log.warning("could not remove partial %s", storage.url_of(rel))
        raise
    provenance = {"source": plan.source or reader.url, "save_id": plan.save_id, "step": plan.step,
                  "component": plan.component, "dtype": plan.dtype,
                  "files": [f.name for f in plan.files],
                  "optimizer_files": [f.name for f in plan.optimizer_files],
                  "omitted_aliases": dict(plan.omitted_aliases)}
    storage.put(PROVENANCE, json.dumps(provenance, indent=2).encode())
    if plan.optimizer_files:
        storage.put(OPTIMIZER_INDEX, _index(plan.optimizer_files, plan.optimizer_meta))
    storage.put(MODEL_INDEX, _index(plan.files))
    new = {f.name for f in files}
    for name in existing:
        if _OUTPUT_NAME.match(name) and name not in new and name not in uncommit:
            storage.rm(name)
    secs = time.perf_counter() - t0
    log.info("consolidated %s -> %s: %d files, %d bytes in %.2f s", reader.url, storage.url,
             len(files), written, secs)
    return ConsolidateResult(storage.url, plan.source or reader.url, plan.save_id, plan.step, plan.dtype,
                             plan.component, tuple((f.name, f.size) for f in plan.files),
                             tuple((f.name, f.size) for f in plan.optimizer_files),
                             sum(len(f.tensors) for f in plan.files), sum(f.data_bytes for f in plan.files),
                             dict(plan.omitted_aliases), engine.bytes_read, written, secs)


def consolidate(src: "str | CheckpointReader", dst: "str | Storage", dtype: str = "bfloat16",
                max_shard_size: int = DEFAULT_MAX_SHARD_SIZE, component: str = "model",
                optimizer: bool = False, storage_options: Mapping[str, Any] | None = None,
                buffer_bytes: int = DEFAULT_BUFFER, progress: Callable[[int], None] | None = None,
                overwrite: bool = False) -> ConsolidateResult:
    """Consolidate checkpoint ``src`` into Hugging Face safetensors at ``dst`` (see the module doc)."""
    reader = src if isinstance(src, CheckpointReader) else CheckpointReader(src, storage_options)
    plan = plan_consolidation(reader.manifest, dtype, max_shard_size, component, optimizer, reader.url)
    return write_consolidation(reader, plan, dst, overwrite, storage_options, buffer_bytes, progress)
