"""Hugging Face weights into flat groups: matched names, planned ranged reads, import.

From a source opened with :func:`shardckpt.interop.hf.source.open_hf`, a target layout, a shard
rank and a match of names, :func:`plan_shard_reads` says which element range of which source
tensor lands at which offset of which flat group: exactly the rank's share, every byte of it
once. :func:`fetch` reads those ranges with at most ``buffer_bytes`` per request and a few
requests in flight, so memory stays about the caller's own shard plus the buffers.

:func:`import_hf` (the ``hf`` importer, whose plan is :func:`plan_hf`) writes a weights-only
shardckpt checkpoint (``master`` state only, fp32 for floating tensors) from such a folder, one
shard file at a time, streaming. The source's ``config.json`` is kept under ``extras["hf_config"]``.

Does not import torch.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, NamedTuple
from collections.abc import Callable, Iterator, Mapping, Sequence

import numpy as np

from shardckpt.checkpoint.job import Job
from shardckpt.checkpoint.pieces import cast_bytes
from shardckpt.checkpoint.reader import as_storage
from shardckpt.checkpoint.writer import CheckpointSpec
from shardckpt.errors import ConfigError, IncompatibleLayoutError, IntegrityError
from shardckpt.format.dtypes import FLOATS, itemsize
from shardckpt.format.layout import Layout, Mesh, ParamInfo, build_layout
from shardckpt.format.manifest import MANIFEST_NAME, Component, Manifest
from shardckpt.format.records import PerRankState, RunExtras
from shardckpt.interop.hf.config import DEFAULT_UNITS, HFConfig
from shardckpt.interop.hf.source import HFSource, HFTensor, open_hf
from shardckpt.interop.importer import ImportOptions, ImportPlan, get_importer, run_importer
from shardckpt.storage import DEFAULT_BATCH
from shardckpt.interop.importing import compile_units, unit_of
from shardckpt.storage import Storage

log = logging.getLogger(__name__)
#: The output head Hugging Face ties to the input embedding (``tie_word_embeddings``).
TIED_HEAD = ("lm_head.weight", "model.embed_tokens.weight")

NameMap = Mapping[str, str] | Callable[[str], "str | None"] | None


# ------------------------------------------------------------------------- matching (pure)


@dataclass(frozen=True)
class Match:
    """Target FQN -> source tensor, and every name that does not fit (all listed at once)."""

    sources: Mapping[str, HFTensor]
    missing: tuple[str, ...] = ()      # in the model, not in the file
    unexpected: tuple[str, ...] = ()   # in the file, not in the model
    mismatched: tuple[str, ...] = ()   # "<name> (<file>: [..] <dtype>; model: [..] <dtype>)"
    tied: tuple[tuple[str, HFTensor], ...] = ()  # (canonical FQN, the alias's own tensor)
    mismatched_names: tuple[str, ...] = ()  # the file's names of ``mismatched``, in its order

    def error(self, url: str, strict: bool = True) -> IncompatibleLayoutError | None:
        """One error listing every offender (mis-shaped always; missing/unexpected if strict)."""
        parts = []
        if strict and self.missing:
            parts.append(f"missing from the file: {', '.join(self.missing)}")
        if strict and self.unexpected:
            parts.append(f"not in the model: {', '.join(self.unexpected)}")
        if self.mismatched:
            parts.append(f"shape or dtype the model cannot take: {', '.join(self.mismatched)}")
        if not parts:
            return None
        return IncompatibleLayoutError(
            f"{url}: the weights do not fit the model; " + "; ".join(parts), self.missing,
            self.unexpected, self.mismatched_names)


def _mapper(name_map: NameMap) -> Callable[[str], str | None]:
    if name_map is None:
        return lambda n: n
    if callable(name_map):
        return name_map
    return lambda n: name_map.get(n, n)


def match_tensors(targets: Mapping[str, tuple[tuple[int, ...], str]], tensors: Mapping[str, HFTensor],
                  aliases: Mapping[str, str] | None = None, name_map: NameMap = None) -> Match:
    """Match source ``tensors`` to ``targets`` (FQN -> (shape, dtype the values go into)).

    ``name_map`` turns a file's name into the model's FQN (a dict, or a callable returning None to
    skip a tensor). A tied alias in the file (``lm_head.weight``) fills its canonical parameter
    when the canonical name is absent; when both are there, the canonical one is loaded and the
    alias is returned in ``tied`` (to be compared). Floating tensors go into floating targets
    (cast); other dtypes must be equal.
    """
    rename, aliases = _mapper(name_map), dict(aliases or {})
    sources: dict[str, HFTensor] = {}
    via_alias: dict[str, HFTensor] = {}
    unexpected: list[str] = []
    mismatched: list[str] = []
    mismatched_names: list[str] = []
    seen: dict[str, str] = {}
    bad: set[str] = set()
    for name, t in tensors.items():
        fqn = rename(name)
        if fqn is None:
            continue
        canon = aliases.get(fqn, fqn)
        if canon not in targets:
            unexpected.append(name)
            continue
        if fqn != canon:
            via_alias[canon] = t
            continue
        if canon in seen:
            raise ConfigError(f"the name map sends both {seen[canon]!r} and {name!r} to {canon!r}")
        seen[canon] = name
        sources[canon] = t
    tied = []
    for canon, t in via_alias.items():
        if canon in sources:
            tied.append((canon, t))
        else:
            sources[canon] = t
    for fqn, t in list(sources.items()):
        shape, dtype = targets[fqn]
        float_ok = t.dtype in FLOATS and dtype in FLOATS
        if tuple(t.shape) != tuple(shape) or not (float_ok or t.dtype == dtype):
            mismatched.append(f"{t.name} ({t.file}: {list(t.shape)} {t.dtype}; model: {list(shape)} "
                              f"{dtype})")
            mismatched_names.append(t.name)
            bad.add(fqn)
            del sources[fqn]
    for canon, t in tied:
        shape, _ = targets[canon]
        if tuple(t.shape) != tuple(shape):
            mismatched.append(f"{t.name} ({t.file}: {list(t.shape)} {t.dtype}; model: "
                              f"{list(shape)}, tied to {canon})")
            mismatched_names.append(t.name)
    missing = [f for f in targets if f not in sources and f not in bad]
    return Match(sources, tuple(missing), tuple(unexpected), tuple(mismatched),
                 tuple((c, t) for c, t in tied if c in sources), tuple(mismatched_names))


# ---------------------------------------------------------------------------- planning (pure)


class Read(NamedTuple):
    """Elements ``[start, stop)`` of source ``tensor`` go to element ``dst_offset`` of ``group``'s
    shard (in the shard's own dtype)."""

    group: str
    dst_offset: int
    tensor: HFTensor
    start: int
    stop: int

    @property
    def src_begin(self) -> int:
        return self.tensor.begin + self.start * itemsize(self.tensor.dtype)

    @property
    def src_end(self) -> int:
        return self.tensor.begin + self.stop * itemsize(self.tensor.dtype)


def plan_shard_reads(layout: Layout, shard_rank: int, sources: Mapping[str, HFTensor],
                     max_bytes: int = DEFAULT_BATCH) -> list[Read]:
    """The reads that fill ``shard_rank``'s shard of every flat group, in target order.

    Covers each element of the shard that belongs to a parameter in ``sources`` exactly once and
    nothing else (no padding, no other rank's elements); no read is larger than ``max_bytes``.
    """
    out: list[Read] = []
    for g in layout.groups:
        lo, hi = layout.shard_range(g, shard_rank)
        for p in layout.group_params(g):
            t = sources.get(p.fqn)
            a, b = max(lo, p.offset), min(hi, p.offset + p.numel)
            if t is None or a >= b:
                continue
            step = max(1, max_bytes // itemsize(t.dtype))
            for x in range(a, b, step):
                y = min(b, x + step)
                out.append(Read(g.name, x - lo, t, x - p.offset, y - p.offset))
    return out


def coalesce(reads: Sequence[Read], max_bytes: int) -> list[tuple[str, int, int, list[Read]]]:
    """Consecutive reads that follow each other in one file become one request of at most
    ``max_bytes``: (file, begin, end, reads). Order is kept."""
    spans: list[tuple[str, int, int, list[Read]]] = []
    for r in reads:
        if spans:
            f, a, b, rs = spans[-1]
            if f == r.tensor.file and b == r.src_begin and r.src_end - a <= max_bytes:
                spans[-1] = (f, a, r.src_end, rs + [r])
                continue
        spans.append((r.tensor.file, r.src_begin, r.src_end, [r]))
    return spans


# --------------------------------------------------------------------------- reading (effectful)


def fetch(source: HFSource, reads: Sequence[Read], buffer_bytes: int = DEFAULT_BATCH,
          workers: int = 4) -> Iterator[tuple[Read, memoryview]]:
    """Yield ``(read, raw bytes in the file's dtype)`` for every read, in the given order.

    Adjacent reads are merged into requests of at most ``buffer_bytes``; at most ``workers``
    requests are in flight, so memory is about ``workers x buffer_bytes``.
    """
    spans = coalesce(reads, buffer_bytes)
    storage = source.storage

    def get(span: tuple[str, int, int, list[Read]]) -> bytes:
        f, a, b, _ = span
        data = storage.read(f, a, b)
        if len(data) != b - a:
            raise IntegrityError(f"{storage.url_of(f)}: bytes [{a}, {b}) came back as {len(data)} "
                                 "bytes; the file is shorter than its header says")
        return data

    step = max(1, workers)
    with ThreadPoolExecutor(step) as pool:
        for i in range(0, len(spans), step):
            batch = spans[i:i + step]
            for span, data in zip(batch, pool.map(get, batch), strict=True):
                view, base = memoryview(data), span[1]
                for r in span[3]:
                    yield r, view[r.src_begin - base:r.src_end - base]


def as_bytes(values: Any) -> memoryview:
    """A flat byte view of bytes or a numpy array (what :func:`cast_bytes` returns)."""
    if isinstance(values, np.ndarray):
        return np.ascontiguousarray(values).reshape(-1).view(np.uint8).data
    return memoryview(values).cast("B")


# ------------------------------------------------------------------------------ offline import


def import_layout(source: HFSource, mesh: Mesh, units: Sequence[str] | None = None,
                  prefix: str = "model.") -> tuple[Layout, dict[str, str]]:
    """The layout of an imported checkpoint (parameters in file order, floats trained) and its
    tied aliases: ``lm_head.weight`` when the file leaves it out, or when ``config.json`` says
    ``tie_word_embeddings: true`` (then a stored head is not kept, as ``transformers`` ties it)."""
    pats = compile_units(units or DEFAULT_UNITS)
    tied_cfg = (source.config or {}).get("tie_word_embeddings") is True
    head, embed = TIED_HEAD
    aliases = {}
    names = list(source.tensors)
    if embed in source.tensors and (head not in source.tensors or tied_cfg):
        if head in source.tensors:
            names.remove(head)
        aliases[head] = embed
    order = {f: i for i, f in enumerate(source.files)}
    names.sort(key=lambda n: (order.get(source.tensors[n].file, 0), source.tensors[n].begin))
    infos = [ParamInfo(n, source.tensors[n].shape, source.tensors[n].dtype,
                       source.tensors[n].dtype in FLOATS, unit_of(n, pats)) for n in names]
    return build_layout(infos, mesh, prefix), aliases


def import_hf(src: str | Storage | HFSource, dst: str | Storage, ranks: int, replicate: int = 1,
              units: Sequence[str] | None = None, storage_options: Mapping[str, Any] | None = None,
              dst_storage_options: Mapping[str, Any] | None = None,
              buffer_bytes: int = DEFAULT_BATCH, workers: int = 4,
              job: Job | None = None) -> Manifest:
    """Write a weights-only checkpoint at ``dst`` for ``ranks`` ranks (``replicate`` x shards).

    Each flat group's ``master`` state holds the tensor values (floats widened to fp32; exact
    for bf16/fp16/fp32 sources); no optimizer state. Shard files are streamed one after another,
    memory about ``workers x buffer_bytes``; ``manifest.json`` is created last, so a failed run
    leaves no checkpoint. Refuses a ``dst`` that already holds one. In a ``torchrun`` job
    (``job``) each process writes its share of the shard files, reading only their ranges
    (:func:`shardckpt.interop.importing.write_import`). The ``hf`` importer
    (:mod:`shardckpt.interop.hf.importer`) with these options.
    """
    options = ImportOptions(src, dst, ranks, replicate, None if units is None else tuple(units),
                            buffer_bytes, storage_options, dst_storage_options, HFConfig(workers))
    return run_importer(get_importer("hf"), options, job)


def plan_hf(options: ImportOptions) -> ImportPlan:
    """The plan of :func:`import_hf`: the source opened (headers only), the destination checked,
    the layout and spec; shard ``s`` streams its ranges from the source."""
    assert isinstance(options.config, HFConfig) and options.ranks is not None
    src, workers, buffer_bytes = options.src, options.config.workers, options.buffer_bytes
    source = src if isinstance(src, HFSource) else open_hf(src, options.storage_options)
    out = as_storage(options.dst, options.dst_storage_options)
    if out.exists(MANIFEST_NAME):
        raise ConfigError(f"{out.url_of(MANIFEST_NAME)} exists; import into an empty location")
    mesh = Mesh.for_world(options.ranks, options.replicate)
    layout, aliases = import_layout(source, mesh, options.units)
    states = {g.name: (("master", g.master_dtype),) for g in layout.groups}
    config = None if source.config is None else dict(source.config)
    extras = RunExtras(step=0, source=source.url, hf_config=config).to_doc()
    spec = CheckpointSpec(mesh, {"model": Component("model", layout, states, aliases)},
                          extras=extras, per_rank_state=PerRankState(world_size=options.ranks).to_doc())
    return ImportPlan(options, out, spec, "import hf",
                      lambda s: _shard_producer(source, layout, s, buffer_bytes, workers),
                      None, source)


def _shard_producer(source: HFSource, layout: Layout, shard: int, buffer_bytes: int,
                    workers: int) -> Callable[[Any], Iterator[Any]]:
    sources = {p.fqn: source.tensors[p.fqn] for p in layout.params}

    def produce(slot: Any) -> Iterator[Any]:
        gname, _ = slot.name.rsplit(".", 1)
        g = layout.group(gname)
        k = itemsize(g.master_dtype)
        reads = [r for r in plan_shard_reads(layout, shard, sources, buffer_bytes)
                 if r.group == gname]
        pos = 0
        for r, raw in fetch(source, reads, buffer_bytes, workers):
            assert r.dst_offset == pos, "reads of a group cover its shard front to back"
            yield as_bytes(cast_bytes(raw, r.tensor.dtype, g.master_dtype))
            pos += r.stop - r.start
        pad = layout.shard_numel(g) - pos
        while pad > 0:  # padding (zero) in bounded pieces
            n = min(pad, max(1, buffer_bytes // k))
            yield bytes(n * k)
            pad -= n

    return produce
