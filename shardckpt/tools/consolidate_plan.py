"""What a consolidation writes: which tensors go to which output file, in which dtype, read from
where, with each file's header built up front. Pure; :mod:`shardckpt.tools.consolidate` writes it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import Any
from collections.abc import Mapping, Sequence

from shardckpt.checkpoint.pieces import Source
from shardckpt.errors import ConfigError, ManifestError
from shardckpt.format.dtypes import DTYPES, FLOATS, itemsize, output_dtype
from shardckpt.format.layout import prod
from shardckpt.format.manifest import Manifest, TensorSlot
from shardckpt.format.records import param_groups, run_extras
from shardckpt.format.safetensors_header import build_header
from shardckpt.interop.hf.files import hf_config
from shardckpt.tools.model_prefix import model_prefix


DEFAULT_MAX_SHARD_SIZE = 5_000_000_000


def stored_as(stored: str, requested: str) -> str:
    """The dtype a tensor stored as ``stored`` is written in: floats in ``requested``, the others
    in their own."""
    return requested if stored in FLOATS else stored


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
    hf_config: Mapping[str, Any] | None = None    # config.json to write, if the manifest has one
    left_out_buffers: tuple[str, ...] = ()        # persistent buffers not written (keep_buffers)

    @property
    def output_bytes(self) -> int:
        """Bytes of the weight files to write (what must fit in DST beside the old ones)."""
        return sum(f.size for f in self.files + self.optimizer_files)

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
                       component: str = "model", optimizer: bool = False, source: str = "",
                       prefix: str | None = None, keep_buffers: bool = False) -> ConsolidationPlan:
    """Which tensors go to which output file, in which dtype, read from where. Pure.

    The component's persistent buffers are left out (named in ``left_out_buffers``) unless
    ``keep_buffers``: a buffer the training model kept and the Hugging Face class does not have
    is one ``transformers`` reports UNEXPECTED, and one it recomputes (rotary ``inv_freq``)
    needs no weights; models whose class keeps them (BatchNorm statistics) want them kept.

    A checkpoint of chunked tensors (no components) gives the tensors whose FQN starts with
    ``prefix``, named without it; None: the one the writer recorded, or the one its layout
    implies (:func:`~shardckpt.tools.model_prefix.model_prefix`: ``model.`` for
    ``get_state_dict``'s, ``state_dict.<attr>.`` for Lightning's)."""
    out = output_dtype(dtype)
    if max_shard_size < 1:
        raise ConfigError(f"max shard size {max_shard_size}: must be positive")
    if m.chunked is not None and not m.components:
        prefix = model_prefix(m, source) if prefix is None else prefix
        return _plan_chunked(m, out, max_shard_size, prefix, optimizer, source)
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
        tensors += [OutTensor(p.fqn, p.shape, stored_as(states["master"], out),
                              Source(states["master"], g.name, "master", p.offset, p.fqn)) for p in params]
        for kind, kdt in comp.states[g.name]:
            if kind != "master":
                opt += [OutTensor(f"{p.fqn}.{kind}", p.shape, stored_as(kdt, "float32"),
                                  Source(kdt, g.name, kind, p.offset, p.fqn)) for p in params]
    names = {t.name for t in tensors}
    clash = [b.fqn for b in comp.buffers if b.fqn in names]
    if clash:
        raise ManifestError(f"{source}: buffers named like parameters: {', '.join(clash)}")
    if keep_buffers:
        tensors += [OutTensor(b.fqn, b.shape, stored_as(b.dtype, out),
                              Source(b.dtype, None, "buffer", 0, b.fqn)) for b in comp.buffers]
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
                replace(pg, params=tuple(p for p in pg.params if p in own)).to_doc()
                for pg in param_groups(m.optimizer, source or 'the manifest')]}
    step = run_extras(m, source or 'the manifest').step
    if step is None:
        step = max((pg.step for pg in param_groups(m.optimizer, source or 'the manifest')), default=None)
    return ConsolidationPlan(source, m.save_id, step, component, out,
                             pack_files(tensors, max_shard_size, "model"), opt_files, meta,
                             dict(comp.aliases), hf_config(m, out, source),
                             () if keep_buffers else tuple(b.fqn for b in comp.buffers))


def _plan_chunked(m: Manifest, out: str, max_shard_size: int, prefix: str, optimizer: bool,
                  source: str) -> ConsolidationPlan:
    assert m.chunked is not None
    if optimizer:
        raise ConfigError(f"{source or 'the checkpoint'} holds chunked tensors; --optimizer is "
                          "only for checkpoints of flat groups")
    tensors = [OutTensor(fqn[len(prefix):], t.shape, stored_as(t.dtype, out),
                         Source(t.dtype, None, "chunked", 0, fqn))
               for fqn, t in m.chunked.tensors.items() if fqn.startswith(prefix) and fqn != prefix]
    if not tensors:
        some = ", ".join(list(m.chunked.tensors)[:3])
        raise ConfigError(f"{source or 'the checkpoint'}: no tensor name starts with {prefix!r} "
                          f"(it holds {some or 'none'}{', ...' if len(m.chunked.tensors) > 3 else ''}); "
                          "choose another --prefix")
    return ConsolidationPlan(source, m.save_id, run_extras(m, source or 'the manifest').step, prefix, out,
                             pack_files(tensors, max_shard_size, "model"),
                             hf_config=hf_config(m, out, source))
