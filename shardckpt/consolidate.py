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
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping, NamedTuple, Sequence

import numpy as np

from shardckpt.checkpoint import CheckpointReader, as_storage
from shardckpt.chunkcache import CachedRangeReader
from shardckpt.errors import ConfigError, ManifestError, ShardckptError
from shardckpt.layout import DTYPES, itemsize, prod
from shardckpt.manifest import DEFAULT_CHUNK_SIZE, FileEntry, Manifest, TensorSlot
from shardckpt.stheader import build_header
from shardckpt.storage import Storage

log = logging.getLogger(__name__)

DEFAULT_BUFFER = 64 << 20
DEFAULT_MAX_SHARD_SIZE = 5_000_000_000
MODEL_INDEX = "model.safetensors.index.json"
OPTIMIZER_INDEX = "optimizer.safetensors.index.json"
PROVENANCE = "shardckpt_consolidated.json"
DTYPE_ALIASES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "half": "float16",
                 "float16": "float16", "fp32": "float32", "float": "float32", "float32": "float32"}
FLOATS = ("float64", "float32", "bfloat16", "float16", "float8_e4m3fn", "float8_e5m2")
_OUTPUT_NAME = re.compile(r"^(model|optimizer)(-\d{5}-of-\d{5})?\.safetensors"
                          r"(\.index\.json|\.partial-[0-9a-f]+)?$|^shardckpt_consolidated\.json$")


# ----------------------------------------------------------------------------- dtype casts (pure)


def f32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns (uint16) of float32 ``x``: round to nearest, ties to even.

    Adds ``0x7FFF + lsb`` to the uint32 pattern and keeps the high half; infinities stay
    infinities, overflow rounds to infinity, subnormals round like normals. Every NaN becomes
    ``0xFFFF``, what torch's CPU cast gives.
    """
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    t = u >> np.uint32(16)
    t &= np.uint32(1)
    t += np.uint32(0x7FFF)
    t += u  # wraps only for NaNs with the sign bit set; those are replaced below
    t >>= np.uint32(16)
    out = t.astype(np.uint16)
    nan = (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    if nan.any():
        out[nan] = np.uint16(0xFFFF)
    return out


def _fp8_table(dtype: str) -> np.ndarray:
    """The 256 float32 values of an fp8 format (e4m3fn: no infinities; e5m2: IEEE-like)."""
    exp_bits, man_bits, bias = (4, 3, 7) if dtype == "float8_e4m3fn" else (5, 2, 15)
    code = np.arange(256)
    e, m = (code >> man_bits) & ((1 << exp_bits) - 1), code & ((1 << man_bits) - 1)
    frac = m / (1 << man_bits)
    val = np.where(e == 0, np.ldexp(frac, 1 - bias), np.ldexp(1 + frac, e - bias))
    if dtype == "float8_e5m2":
        val = np.where(e == 31, np.where(m == 0, np.inf, np.nan), val)
    else:
        val = np.where((e == 15) & (m == 7), np.nan, val)
    return np.where(code & 0x80, -val, val).astype(np.float32)


_NUMPY = {"float64": "<f8", "float32": "<f4", "float16": "<f2", "int64": "<i8", "int32": "<i4",
          "int16": "<i2", "int8": "i1", "uint8": "u1", "bool": "u1"}


def decode(raw: Any, dtype: str) -> np.ndarray:
    """Little-endian bytes of ``dtype`` as a numpy array (bf16 and fp8 widened to float32)."""
    if dtype == "bfloat16":
        return (np.frombuffer(raw, "<u2").astype(np.uint32) << np.uint32(16)).view(np.float32)
    if dtype.startswith("float8"):
        return _fp8_table(dtype)[np.frombuffer(raw, np.uint8)]
    return np.frombuffer(raw, _NUMPY[dtype])


def cast_bytes(raw: Any, src: str, dst: str) -> Any:
    """Bytes of ``raw`` (``src``) cast to ``dst``; identity when they are equal."""
    if src == dst:
        return raw
    x = decode(raw, src)
    if dst == "bfloat16":
        return f32_to_bf16_bits(x.astype(np.float32, copy=False))
    if x.dtype == np.float64 and dst != "float64":
        x = x.astype(np.float32)  # double -> float -> half, as torch does
    with np.errstate(over="ignore"):  # out of range -> inf, as torch casts
        return x.astype(_NUMPY[dst])


def output_dtype(stored: str, requested: str) -> str:
    return requested if stored in FLOATS else stored


def canonical_dtype(name: str) -> str:
    try:
        return DTYPE_ALIASES[name.lower()]
    except KeyError:
        raise ConfigError(f"unknown dtype {name!r}; use bf16, fp16 or fp32") from None


# ------------------------------------------------------------------------- piece reads (effectful)


@dataclass(frozen=True, slots=True)
class Source:
    """Where a tensor's elements lie: state ``kind`` of flat ``group`` from element ``offset``,
    or (``group`` None) the buffer ``fqn``."""

    dtype: str
    group: str | None
    kind: str
    offset: int
    fqn: str


def byte_ranges(reader: CheckpointReader, src: Source, start: int, end: int) -> list[tuple[FileEntry, int, int]]:
    """Absolute byte ranges (one per shard file touched) of elements ``[start, end)`` of ``src``."""
    if src.group is None:
        entry = reader.manifest.buffers_file()
        slot = reader.buffer_slots.get(src.fqn)
        if entry is None or slot is None:
            raise ManifestError(f"{reader.url}: no buffer {src.fqn!r}")
        n, base = itemsize(src.dtype), entry.data_start + slot.begin
        return [(entry, base + start * n, base + end * n)]
    s = reader.slot(src.group, src.kind).shape[0]
    x, stop = src.offset + start, src.offset + end
    out = []
    while x < stop:
        shard = x // s
        hi = min(stop, (shard + 1) * s)
        out.append(reader.state_range(shard, src.group, src.kind, x - shard * s, hi - shard * s))
        x = hi
    return out


class Piece(NamedTuple):
    index: int               # which item
    start: int               # element range [start, end) inside the item's tensor
    end: int
    data: tuple[bytes, ...]  # one per reader


class PieceReader:
    """Reads aligned pieces of tensors from one or more checkpoints, in batches.

    ``pieces(items)`` yields, for item ``i = (numel, sources)`` with one source per reader, the
    pieces ``[a, b)`` that tile ``[0, numel)`` in order, with the same boundaries on every reader.
    A batch holds at most ``buffer_bytes / 4`` source bytes; one batch is read ahead while the
    caller consumes the previous one, and boundary chunks shared by consecutive ranges are cached
    (at most ``buffer_bytes / 4``), so memory is about ``buffer_bytes`` whatever the tensor sizes.
    """

    def __init__(self, readers: Sequence[CheckpointReader], buffer_bytes: int = DEFAULT_BUFFER,
                 workers: int = 4) -> None:
        if buffer_bytes < 1:
            raise ConfigError(f"buffer of {buffer_bytes} bytes; it must be positive")
        self.readers = list(readers)
        self.batch_bytes = max(1, buffer_bytes // 4)
        self.cached = [CachedRangeReader(r.storage, r.manifest.chunk_size,
                                         capacity=max(2, self.batch_bytes // r.manifest.chunk_size))
                       for r in self.readers]
        self.workers = workers

    @property
    def bytes_read(self) -> int:
        return sum(c.bytes_read for c in self.cached)

    def _batches(self, items: Sequence[tuple[int, Sequence[Source]]]) -> Iterator[list[tuple[int, int, int]]]:
        batch: list[tuple[int, int, int]] = []
        size = 0
        for i, (numel, sources) in enumerate(items):
            per_elem = sum(itemsize(s.dtype) for s in sources)
            step = max(1, self.batch_bytes // per_elem)
            for a in range(0, numel, step):
                b = min(numel, a + step)
                batch.append((i, a, b))
                size += (b - a) * per_elem
                if size >= self.batch_bytes:
                    yield batch
                    batch, size = [], 0
        if batch:
            yield batch

    def _read(self, items: Sequence[tuple[int, Sequence[Source]]], batch: list[tuple[int, int, int]]) -> list[Piece]:
        sides = []
        for side, (reader, cached) in enumerate(zip(self.readers, self.cached)):
            requests, owner = [], []
            for k, (i, a, b) in enumerate(batch):
                for r in byte_ranges(reader, items[i][1][side], a, b):
                    requests.append(r)
                    owner.append(k)
            parts: list[list[bytes]] = [[] for _ in batch]
            for k, data in zip(owner, cached.read_many(requests, self.workers)):
                parts[k].append(data)
            sides.append([p[0] if len(p) == 1 else b"".join(p) for p in parts])
        return [Piece(i, a, b, tuple(s[k] for s in sides)) for k, (i, a, b) in enumerate(batch)]

    def pieces(self, items: Sequence[tuple[int, Sequence[Source]]]) -> Iterator[Piece]:
        with ThreadPoolExecutor(1) as pool:
            pending = None
            for batch in self._batches(items):
                job = pool.submit(self._read, items, batch)
                if pending is not None:
                    yield from pending.result()
                pending = job
            if pending is not None:
                yield from pending.result()


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
