"""The manifest: the versioned JSON that describes one checkpoint, and its strict codec.

``docs/FORMAT.md`` is the specification; this module is its reference implementation. Parsing
validates every field before anything is trusted: types, bounds, that the parameters of each flat
group tile it exactly, that every file name is a plain relative path, and that every shard file's
recorded size equals the size its tensors imply. Duplicate JSON keys are refused. The
manifest's own checksum, text encoding and string bounds are in :mod:`shardckpt.format.integrity`.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping, Sequence

from shardckpt.format.chunked import FEATURE as CHUNKED_FEATURE, ChunkedSection, file_layout, parse_section, section_doc
from shardckpt.errors import ManifestError
from shardckpt.format.dtypes import DTYPES, itemsize
from shardckpt.format.layout import SHARD_ALIGN, SHARD_AXIS, FlatGroup, Layout, Mesh, ParamSpec, prod
from shardckpt.format.integrity import (
    CHECKSUM_FIELD, MAX_NAME, MAX_SHORT, ChunkCrcs, check_free_text, check_surrogates,
    checksum_problem, decode_text, seal,
)

FORMAT_NAME = "shardckpt"
#: 1.1 adds the manifest's own checksum (``manifest_crc32c``); see docs/FORMAT.md section 9.
VERSION = (1, 1)
#: 1.2 adds chunked tensors and blobs (the ``chunked`` section, docs/FORMAT.md section 13); a
#: manifest with that section is written as 1.2 and lists ``chunked_tensors`` in ``requires``.
#: Manifests without it are still written as :data:`VERSION`, byte for byte as before.
CHUNKED_VERSION = (1, 2)
#: Features a manifest may list in ``requires``; a reader refuses any other (it would misread).
KNOWN_FEATURES = (CHUNKED_FEATURE,)
#: Major versions this shardckpt reads. 0.x shard files hold their tensors group by group; from
#: 1.0 they are kind by kind (every group's master weights first), see :func:`shard_slots`.
READABLE_MAJORS = (0, 1)
MANIFEST_NAME = "manifest.json"
#: A manifest larger than this is refused before it is read (a 70B, 1024-rank manifest is ~10 MB).
MAX_MANIFEST_BYTES = 512 << 20
#: Largest size, offset or element count accepted anywhere (2**53: exact in JSON doubles too).
MAX_INT = 1 << 53
DEFAULT_CHUNK_SIZE = 1 << 20
ROLES = ("shard", "buffers", "rank", "chunks")
_SAFE_NAME = re.compile(r"^[A-Za-z0-9_.\-]+$")
_LOWER_HEX = re.compile(r"[0-9a-f]*")
_SHARD_NAME = re.compile(r"shard-(\d{1,9})-of-(\d{1,9})\.safetensors")
#: Offenders listed by name in one error; the rest are counted.
MAX_LISTED = 10


@dataclass(frozen=True, slots=True)
class FileEntry:
    """One file of the checkpoint, relative to the checkpoint directory, with its checksums."""

    path: str
    role: str                 # "shard" | "buffers" | "rank"
    size: int
    header_size: int          # safetensors JSON header length (the u64 at byte 0)
    crc32c: int
    chunk_crc32c: Sequence[int]  # held as ChunkCrcs, whatever sequence of ints is given
    index: int | None = None  # shard rank for "shard", global rank for "rank"

    def __post_init__(self) -> None:
        if not isinstance(self.chunk_crc32c, ChunkCrcs):
            object.__setattr__(self, "chunk_crc32c", ChunkCrcs(self.chunk_crc32c))

    @property
    def data_start(self) -> int:
        return 8 + self.header_size


@dataclass(frozen=True, slots=True)
class BufferSpec:
    fqn: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def nbytes(self) -> int:
        return prod(self.shape) * itemsize(self.dtype)


@dataclass(frozen=True)
class Component:
    """A named part of a checkpoint: a layout, the state kinds per group, aliases and buffers."""

    name: str
    layout: Layout
    states: Mapping[str, tuple[tuple[str, str], ...]]  # group -> ((kind, dtype), ...)
    aliases: Mapping[str, str] = field(default_factory=dict)  # alias fqn -> canonical fqn
    buffers: tuple[BufferSpec, ...] = ()


@dataclass(frozen=True)
class OptimizerInfo:
    name: str
    param_groups: tuple[Mapping[str, Any], ...]  # each: {"params": [fqn], "hparams": {...}, "step": int}


@dataclass(frozen=True)
class Manifest:
    version: tuple[int, int]
    save_id: str
    created_at: str
    mesh: Mesh
    chunk_size: int
    components: Mapping[str, Component]
    optimizer: OptimizerInfo | None
    extras: Mapping[str, Any]
    per_rank_state: Mapping[str, Any]
    files: tuple[FileEntry, ...]
    chunked: ChunkedSection | None = None  # format 1.2: DCP-style chunked tensors and blobs

    def file(self, path: str) -> FileEntry:
        for f in self.files:
            if f.path == path:
                return f
        raise KeyError(path)

    def shard_file(self, shard: int) -> FileEntry:
        for f in self.files:
            if f.role == "shard" and f.index == shard:
                return f
        raise KeyError(f"shard {shard}")

    def buffers_file(self) -> FileEntry | None:
        return next((f for f in self.files if f.role == "buffers"), None)

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)


# ---------------------------------------------------------------------- tensor positions (pure)


@dataclass(frozen=True, slots=True)
class TensorSlot:
    """Where one tensor lies inside a file's data section (byte offsets relative to data start)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


def shard_slots(components: Mapping[str, Component], mesh: Mesh,
                version: tuple[int, int] = VERSION) -> list[TensorSlot]:
    """Tensors of every shard file, in file order; tensor ``"<group>.<kind>"`` is 1-D.

    Every shard file of a checkpoint has the same slots. From format 1.0 the order is components,
    then state kinds (in order of first appearance over the groups), then groups: each kind is
    contiguous in the file, so reading the weights alone (consolidation, weights-only loads)
    reads one contiguous range per shard. Format 0.x ordered components, groups, then kinds.
    """
    out: list[TensorSlot] = []
    pos = 0

    def add(g: FlatGroup, kind: str, dtype: str) -> None:
        nonlocal pos
        s = g.padded_numel // mesh.shard_degree
        n = s * itemsize(dtype)
        out.append(TensorSlot(f"{g.name}.{kind}", dtype, (s,), pos, pos + n))
        pos += n

    for comp in components.values():
        if version[0] < 1:
            for g in comp.layout.groups:
                for kind, dtype in comp.states[g.name]:
                    add(g, kind, dtype)
            continue
        kinds: dict[str, None] = {}
        for g in comp.layout.groups:
            kinds.update((k, None) for k, _ in comp.states[g.name])
        for kind in kinds:
            for g in comp.layout.groups:
                dtype = dict(comp.states[g.name]).get(kind)
                if dtype is not None:
                    add(g, kind, dtype)
    return out


def chunked_slots(m: "Manifest", path: str) -> list[TensorSlot]:
    """Tensors of chunks file ``path`` (chunks ``<fqn>@<offsets>``, blobs ``<key>#blob``)."""
    if m.chunked is None:
        return []
    return [TensorSlot(*t) for t in file_layout(m.chunked, path)]


def buffer_slots(components: Mapping[str, Component]) -> list[TensorSlot]:
    """Tensors of ``buffers.safetensors`` by FQN, in manifest order."""
    out: list[TensorSlot] = []
    pos = 0
    for comp in components.values():
        for b in comp.buffers:
            out.append(TensorSlot(b.fqn, b.dtype, b.shape, pos, pos + b.nbytes))
            pos += b.nbytes
    return out


# ------------------------------------------------------------------------------------ encode


def to_json(m: Manifest) -> bytes:
    """Encode a manifest; ``parse`` of the result gives back an equal manifest."""
    doc = {
        "format": FORMAT_NAME,
        "version": f"{m.version[0]}.{m.version[1]}",
        "save_id": m.save_id,
        "created_at": m.created_at,
        "mesh": {"axes": [{"name": n, "size": s} for n, s in m.mesh.axes]},
        "chunk_size": m.chunk_size,
        "components": {name: _component_doc(c) for name, c in m.components.items()},
        "optimizer": None if m.optimizer is None else {
            "name": m.optimizer.name,
            "param_groups": [dict(pg) for pg in m.optimizer.param_groups],
        },
        "extras": dict(m.extras),
        "per_rank_state": dict(m.per_rank_state),
        "files": [_file_doc(f) for f in m.files],
    }
    if m.chunked is not None:
        doc["requires"] = [CHUNKED_FEATURE]
        doc["chunked"] = section_doc(m.chunked)
    return seal(doc)


def _component_doc(c: Component) -> dict[str, Any]:
    return {
        "groups": [
            {"name": g.name, "unit": g.unit, "dtype": g.dtype, "requires_grad": g.requires_grad,
             "numel": g.numel, "padded_numel": g.padded_numel,
             "states": [{"kind": k, "dtype": d} for k, d in c.states[g.name]]}
            for g in c.layout.groups
        ],
        "params": [{"fqn": p.fqn, "shape": list(p.shape), "group": p.group, "offset": p.offset}
                   for p in c.layout.params],
        "aliases": dict(c.aliases),
        "buffers": [{"fqn": b.fqn, "shape": list(b.shape), "dtype": b.dtype} for b in c.buffers],
    }


def _file_doc(f: FileEntry) -> dict[str, Any]:
    doc: dict[str, Any] = {"path": f.path, "role": f.role}
    if f.index is not None:
        doc["index"] = f.index
    doc.update(size=f.size, header_size=f.header_size, crc32c=f"{f.crc32c:08x}",
               chunk_crc32c=ChunkCrcs(f.chunk_crc32c).hex())
    return doc


# ------------------------------------------------------------------------------------ decode


class _Ctx:
    """Validation context: the manifest's name for messages."""

    def __init__(self, source: str) -> None:
        self.source = source

    def fail(self, where: str, what: str) -> ManifestError:
        return ManifestError(f"{self.source}: {where}: {what}")

    def obj(self, v: Any, where: str) -> dict[str, Any]:
        if not isinstance(v, dict):
            raise self.fail(where, f"expected an object, found {type(v).__name__}")
        return v

    def lst(self, v: Any, where: str) -> list[Any]:
        if not isinstance(v, list):
            raise self.fail(where, f"expected a list, found {type(v).__name__}")
        return v

    def str_(self, v: Any, where: str, limit: int = MAX_NAME) -> str:
        if not isinstance(v, str):
            raise self.fail(where, f"expected a string, found {type(v).__name__}")
        if len(v) > limit:
            raise self.fail(where, f"a string of {len(v)} characters ({v[:40]!r}...); at most "
                            f"{limit} are allowed")
        return v

    def bool_(self, v: Any, where: str) -> bool:
        if not isinstance(v, bool):
            raise self.fail(where, f"expected true or false, found {v!r}")
        return v

    def int_(self, v: Any, where: str, lo: int = 0, hi: int = MAX_INT) -> int:
        if not isinstance(v, int) or isinstance(v, bool):
            raise self.fail(where, f"expected an integer, found {type(v).__name__}")
        if not lo <= v <= hi:
            raise self.fail(where, f"{v} is outside [{lo}, {hi}]")
        return v

    def key(self, d: dict[str, Any], k: str, where: str) -> Any:
        if k not in d:
            raise self.fail(where, f"missing field {k!r}")
        return d[k]

    def dtype(self, v: Any, where: str) -> str:
        s = self.str_(v, where, MAX_SHORT)
        if s not in DTYPES:
            raise self.fail(where, f"unknown dtype {s!r}")
        return s

    def shape(self, v: Any, where: str) -> tuple[int, ...]:
        dims = self.lst(v, where)
        if len(dims) > 16:
            raise self.fail(where, f"{len(dims)} dimensions; at most 16 are allowed")
        out = tuple(self.int_(d, f"{where}[{i}]") for i, d in enumerate(dims))
        n = 1
        for d in out:
            n *= d
            if n > MAX_INT:
                raise self.fail(where, f"shape {list(out)} has more than 2**53 elements")
        return out

    def hex32(self, v: Any, where: str) -> int:
        s = self.str_(v, where)
        if len(s) != 8 or not all(c in "0123456789abcdef" for c in s):
            raise self.fail(where, f"expected 8 lowercase hex digits, found {s[:20]!r}")
        return int(s, 16)


def no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``json.loads`` hook that refuses duplicate keys (the stdlib keeps the last one)."""
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"duplicate key {k!r}")
        out[k] = v
    return out


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _finite_float(text: str) -> float:
    # ``1e400`` parses to inf: as hostile as ``Infinity``, and ``to_json`` could not re-encode it
    v = float(text)
    if not math.isfinite(v):
        raise ValueError(f"{text} is out of range for a JSON number")
    return v


def parse(data: bytes | str, source: str = MANIFEST_NAME) -> Manifest:
    """Decode and validate a manifest; raise :class:`ManifestError` naming ``source`` and the field."""
    ctx = _Ctx(source)
    if len(data) > MAX_MANIFEST_BYTES:
        raise ctx.fail("size", f"{len(data)} bytes; at most {MAX_MANIFEST_BYTES} are accepted")
    raw, text = decode_text(data, source)
    try:
        doc = json.loads(text, object_pairs_hook=no_duplicate_keys, parse_constant=_reject_constant,
                         parse_float=_finite_float)
    except (ValueError, RecursionError) as e:  # JSONDecodeError is a ValueError
        raise ManifestError(f"{source}: not valid manifest JSON: {e}") from e
    doc = ctx.obj(doc, "top level")
    check_surrogates(text, doc, source)
    del text
    if doc.get("format") != FORMAT_NAME:
        found = doc.get("format")
        raise ctx.fail("format", f"expected {FORMAT_NAME!r}, found "
                       f"{found[:40] if isinstance(found, str) else found!r}")
    version = _parse_version(ctx, ctx.key(doc, "version", "top level"))
    # Checked after the fields, so that a damaged field is named; either failure refuses it.
    damaged = checksum_problem(raw, doc, version)
    try:
        m = _parse_body(ctx, doc, version)
    except ManifestError as e:
        if damaged is None:
            raise
        raise ManifestError(f"{e}; also, {CHECKSUM_FIELD}: {damaged}") from e
    if damaged is not None:
        raise ctx.fail(CHECKSUM_FIELD, damaged)
    return m


def _parse_body(ctx: _Ctx, doc: dict[str, Any], version: tuple[int, int]) -> Manifest:
    save_id = ctx.str_(ctx.key(doc, "save_id", "top level"), "save_id", MAX_SHORT)
    if not _SAFE_NAME.match(save_id) or save_id in (".", ".."):
        raise ctx.fail("save_id", f"{save_id!r} is not a plain name (letters, digits, _ . -)")
    created_at = ctx.str_(doc.get("created_at", ""), "created_at", MAX_SHORT)
    mesh = _parse_mesh(ctx, ctx.key(doc, "mesh", "top level"))
    chunk_size = ctx.int_(ctx.key(doc, "chunk_size", "top level"), "chunk_size", 4096, 1 << 30)
    files_doc = ctx.lst(ctx.key(doc, "files", "top level"), "files")
    comps_doc = ctx.obj(ctx.key(doc, "components", "top level"), "components")
    components = {name: _parse_component(ctx, name, c, mesh) for name, c in comps_doc.items()}
    _check_unique_groups(ctx, components)
    optimizer = _parse_optimizer(ctx, doc.get("optimizer"), components)
    extras = ctx.obj(doc.get("extras", {}), "extras")
    per_rank = ctx.obj(doc.get("per_rank_state", {}), "per_rank_state")
    check_free_text(extras, "extras", ctx.source)
    check_free_text(per_rank, "per_rank_state", ctx.source)
    files = tuple(_parse_file(ctx, i, f, chunk_size) for i, f in enumerate(files_doc))
    chunked = _parse_chunked(ctx, doc, version, files)
    m = Manifest(version, save_id, created_at, mesh, chunk_size, components, optimizer, extras,
                 per_rank, files, chunked)
    _check_files(ctx, m)
    return m


def _parse_chunked(ctx: _Ctx, doc: dict[str, Any], version: tuple[int, int],
                   files: tuple[FileEntry, ...]) -> ChunkedSection | None:
    """The ``requires`` list (every feature known) and the ``chunked`` section (format >= 1.2)."""
    requires = [ctx.str_(r, "requires", MAX_SHORT) for r in ctx.lst(doc.get("requires", []), "requires")]
    unknown = [r for r in requires if r not in KNOWN_FEATURES]
    if unknown:
        raise ctx.fail("requires", f"this checkpoint needs {', '.join(map(repr, unknown[:10]))}, "
                       "which this shardckpt does not read; upgrade shardckpt to read it")
    if "chunked" not in doc:
        if CHUNKED_FEATURE in requires:
            raise ctx.fail("requires", f"lists {CHUNKED_FEATURE!r} but there is no chunked section")
        return None
    if version < CHUNKED_VERSION or CHUNKED_FEATURE not in requires:
        raise ctx.fail("chunked", f"a chunked section needs format {CHUNKED_VERSION[0]}."
                       f"{CHUNKED_VERSION[1]} or later and {CHUNKED_FEATURE!r} in requires")
    data_sizes = {f.path: f.size - f.data_start for f in files if f.role == "chunks"}
    return parse_section(ctx, doc["chunked"], data_sizes)


def _parse_version(ctx: _Ctx, v: Any) -> tuple[int, int]:
    s = ctx.str_(v, "version", MAX_SHORT)
    m = re.fullmatch(r"(\d{1,6})\.(\d{1,6})", s)
    if not m:
        raise ctx.fail("version", f"expected 'MAJOR.MINOR', found {s!r}")
    major, minor = int(m.group(1)), int(m.group(2))
    if major > VERSION[0]:
        raise ctx.fail(
            "version",
            f"format {major}.{minor} is newer than this shardckpt reads "
            f"({VERSION[0]}.x); upgrade shardckpt to read it",
        )
    if major not in READABLE_MAJORS:
        raise ctx.fail("version", f"format {major}.{minor} is older than any this shardckpt reads")
    return major, minor


def _parse_mesh(ctx: _Ctx, v: Any) -> Mesh:
    axes_doc = ctx.lst(ctx.key(ctx.obj(v, "mesh"), "axes", "mesh"), "mesh.axes")
    axes = []
    for i, a in enumerate(axes_doc):
        a = ctx.obj(a, f"mesh.axes[{i}]")
        axes.append((ctx.str_(ctx.key(a, "name", f"mesh.axes[{i}]"), f"mesh.axes[{i}].name", MAX_SHORT),
                     ctx.int_(ctx.key(a, "size", f"mesh.axes[{i}]"), f"mesh.axes[{i}].size", 1, 1 << 24)))
    try:
        return Mesh(tuple(axes))
    except Exception as e:
        raise ctx.fail("mesh", str(e)) from e


def _parse_component(ctx: _Ctx, name: str, v: Any, mesh: Mesh) -> Component:
    w = f"components.{name[:64]}"
    if len(name) > MAX_SHORT or not _SAFE_NAME.match(name):
        raise ctx.fail(w, "component names are letters, digits, _ . -")
    c = ctx.obj(v, w)
    groups: list[FlatGroup] = []
    states: dict[str, tuple[tuple[str, str], ...]] = {}
    quantum = SHARD_ALIGN * mesh.shard_degree
    for i, gd in enumerate(ctx.lst(ctx.key(c, "groups", w), f"{w}.groups")):
        gw = f"{w}.groups[{i}]"
        gd = ctx.obj(gd, gw)
        gname = ctx.str_(ctx.key(gd, "name", gw), f"{gw}.name")
        if not _SAFE_NAME.match(gname):
            raise ctx.fail(f"{gw}.name", f"{gname!r} is not letters, digits, _ . -")
        numel = ctx.int_(ctx.key(gd, "numel", gw), f"{gw}.numel")
        padded = ctx.int_(ctx.key(gd, "padded_numel", gw), f"{gw}.padded_numel")
        if padded < numel or padded % quantum or padded == 0:
            raise ctx.fail(f"{gw}.padded_numel", f"{padded} is not a positive multiple of 16 x "
                           f"{mesh.shard_degree} shards that holds {numel} elements")
        kinds = []
        for j, sd in enumerate(ctx.lst(ctx.key(gd, "states", gw), f"{gw}.states")):
            sd = ctx.obj(sd, f"{gw}.states[{j}]")
            kind = ctx.str_(ctx.key(sd, "kind", f"{gw}.states[{j}]"), f"{gw}.states[{j}].kind", MAX_SHORT)
            if not re.fullmatch(r"[A-Za-z0-9_]+", kind):
                raise ctx.fail(f"{gw}.states[{j}].kind", f"{kind!r} is not letters, digits and _")
            kinds.append((kind, ctx.dtype(ctx.key(sd, "dtype", f"{gw}.states[{j}]"), f"{gw}.states[{j}].dtype")))
        if len({k for k, _ in kinds}) != len(kinds):
            raise ctx.fail(f"{gw}.states", "state kinds repeat")
        if not kinds or kinds[0][0] != "master":
            raise ctx.fail(f"{gw}.states", "the first state kind of every group must be 'master'")
        groups.append(FlatGroup(gname, ctx.str_(gd.get("unit", ""), f"{gw}.unit"),
                                ctx.dtype(ctx.key(gd, "dtype", gw), f"{gw}.dtype"),
                                ctx.bool_(ctx.key(gd, "requires_grad", gw), f"{gw}.requires_grad"),
                                numel, padded, ()))
        if gname in states:
            raise ctx.fail(f"{gw}.name", f"group {gname!r} appears twice")
        states[gname] = tuple(kinds)
    by_name = {g.name: g for g in groups}
    members: dict[str, list[ParamSpec]] = {g.name: [] for g in groups}
    specs: list[ParamSpec] = []
    seen: set[str] = set()
    plist = ctx.lst(ctx.key(c, "params", w), f"{w}.params")
    for i, pd in enumerate(plist):
        plist[i] = None  # its spec replaces it: each parameter is held in one form, not two
        pw = f"{w}.params[{i}]"
        pd = ctx.obj(pd, pw)
        fqn = ctx.str_(ctx.key(pd, "fqn", pw), f"{pw}.fqn")
        if fqn in seen:
            raise ctx.fail(pw, f"parameter {fqn!r} appears twice")
        seen.add(fqn)
        gname = ctx.str_(ctx.key(pd, "group", pw), f"{pw}.group")
        if gname not in by_name:
            raise ctx.fail(f"{pw}.group", f"{fqn!r} names group {gname!r}, which does not exist")
        group = by_name[gname]  # its name and dtype strings are shared by all its parameters
        spec = ParamSpec(fqn, ctx.shape(ctx.key(pd, "shape", pw), f"{pw}.shape"),
                         group.dtype, group.name, ctx.int_(ctx.key(pd, "offset", pw), f"{pw}.offset"))
        specs.append(spec)
        members[group.name].append(spec)
    _check_tiling(ctx, w, groups, members)
    final_groups = [FlatGroup(g.name, g.unit, g.dtype, g.requires_grad, g.numel, g.padded_numel,
                              tuple(p.fqn for p in members[g.name])) for g in groups]
    layout = Layout(mesh, tuple(final_groups), tuple(specs))
    aliases = {}
    for a, t in ctx.obj(c.get("aliases", {}), f"{w}.aliases").items():
        ctx.str_(a, f"{w}.aliases (a key)")
        t = ctx.str_(t, f"{w}.aliases.{a}")
        if t not in seen or a in seen:
            raise ctx.fail(f"{w}.aliases.{a}", f"alias must name an existing parameter and not be one; "
                           f"{a!r} -> {t!r}")
        aliases[a] = t
    buffers = []
    for i, bd in enumerate(ctx.lst(c.get("buffers", []), f"{w}.buffers")):
        bw = f"{w}.buffers[{i}]"
        bd = ctx.obj(bd, bw)
        buffers.append(BufferSpec(ctx.str_(ctx.key(bd, "fqn", bw), f"{bw}.fqn"),
                                  ctx.shape(ctx.key(bd, "shape", bw), f"{bw}.shape"),
                                  ctx.dtype(ctx.key(bd, "dtype", bw), f"{bw}.dtype")))
    if len({b.fqn for b in buffers}) != len(buffers):
        raise ctx.fail(f"{w}.buffers", "buffer names repeat")
    clash = sorted({b.fqn for b in buffers} & seen)
    if clash:
        raise ctx.fail(f"{w}.buffers", f"names used by both a buffer and a parameter: {', '.join(clash[:10])}")
    return Component(name, layout, states, aliases, tuple(buffers))


def _listed(items: list[str]) -> str:
    more = len(items) - MAX_LISTED
    return "; ".join(items[:MAX_LISTED]) + (f"; and {more} more" if more > 0 else "")


def _check_tiling(ctx: _Ctx, w: str, groups: list[FlatGroup],
                  members: Mapping[str, list[ParamSpec]]) -> None:
    """Each group's parameters, in list order, tile ``[0, numel)``: every offender is named."""
    order: list[str] = []
    tiles: list[str] = []
    totals: list[str] = []
    for g in groups:
        ps = members[g.name]
        late = [f"{p.fqn!r} (offset {p.offset}) after {q.fqn!r} (offset {q.offset}) in group "
                f"{g.name!r}" for q, p in zip(ps, ps[1:]) if p.offset < q.offset]
        if late:
            order += late
            continue
        pos, bad = 0, False
        for p in ps:
            if p.offset != pos:
                what = "overlaps the parameter before it" if p.offset < pos else "leaves a gap before it"
                tiles.append(f"{p.fqn!r} at offset {p.offset} in group {g.name!r} {what} "
                             f"(expected offset {pos})")
                bad = True
            pos = p.offset + p.numel
        if not bad and pos != g.numel:
            totals.append(f"group {g.name!r} says {g.numel} elements but its parameters hold {pos}")
    if order:
        raise ctx.fail(f"{w}.params", "parameters are listed out of flat order (each group's "
                       f"parameters must be listed by increasing offset): {_listed(order)}")
    if tiles:
        raise ctx.fail(f"{w}.params", _listed(tiles))
    if totals:
        raise ctx.fail(f"{w}.groups", _listed(totals))


def _check_unique_groups(ctx: _Ctx, components: Mapping[str, Component]) -> None:
    seen: dict[str, str] = {}
    for c in components.values():
        for g in c.layout.groups:
            if g.name in seen:
                raise ctx.fail("components", f"group {g.name!r} is in both {seen[g.name]!r} and {c.name!r}")
            seen[g.name] = c.name


def _parse_optimizer(ctx: _Ctx, v: Any, components: Mapping[str, Component]) -> OptimizerInfo | None:
    if v is None:
        return None
    d = ctx.obj(v, "optimizer")
    name = ctx.str_(ctx.key(d, "name", "optimizer"), "optimizer.name", MAX_SHORT)
    known = {p.fqn for c in components.values() for p in c.layout.params}
    groups = []
    claimed: set[str] = set()
    for i, pg in enumerate(ctx.lst(ctx.key(d, "param_groups", "optimizer"), "optimizer.param_groups")):
        w = f"optimizer.param_groups[{i}]"
        pg = ctx.obj(pg, w)
        params = [ctx.str_(p, f"{w}.params") for p in ctx.lst(ctx.key(pg, "params", w), f"{w}.params")]
        bad = [p for p in params if p not in known]
        if bad:
            raise ctx.fail(f"{w}.params", f"unknown parameters: {', '.join(bad[:10])}")
        dup = [p for p in params if p in claimed]
        if dup:
            raise ctx.fail(f"{w}.params", f"parameters in two param groups: {', '.join(dup[:10])}")
        claimed.update(params)
        ctx.obj(pg.get("hparams", {}), f"{w}.hparams")
        check_free_text(pg, w, ctx.source)  # hparams and any field kept for a later rewrite
        ctx.int_(pg.get("step", 0), f"{w}.step")
        groups.append(pg)
    return OptimizerInfo(name, tuple(groups))


def _parse_file(ctx: _Ctx, i: int, v: Any, chunk_size: int) -> FileEntry:
    w = f"files[{i}]"
    d = ctx.obj(v, w)
    path = ctx.str_(ctx.key(d, "path", w), f"{w}.path")
    parts = path.split("/")
    if (path.startswith("/") or "\\" in path or ":" in path
            or any(p in ("", ".", "..") or not _SAFE_NAME.match(p) for p in parts)):
        raise ctx.fail(f"{w}.path", f"{path!r} is not a plain relative path inside the checkpoint")
    role = ctx.str_(ctx.key(d, "role", w), f"{w}.role", MAX_SHORT)
    if role not in ROLES:
        raise ctx.fail(f"{w}.role", f"{role!r} is not one of {ROLES}")
    index = None
    if role in ("shard", "rank", "chunks"):
        index = ctx.int_(ctx.key(d, "index", w), f"{w}.index", 0, 1 << 24)
    size = ctx.int_(ctx.key(d, "size", w), f"{w}.size")
    header_size = ctx.int_(ctx.key(d, "header_size", w), f"{w}.header_size", 2, 100_000_000)
    if 8 + header_size > size:
        raise ctx.fail(f"{w}.header_size", f"{path}: header of {header_size} bytes does not fit in {size} bytes")
    crc = ctx.hex32(ctx.key(d, "crc32c", w), f"{w}.crc32c")
    chunks = ctx.str_(ctx.key(d, "chunk_crc32c", w), f"{w}.chunk_crc32c", MAX_INT)
    n_chunks = -(-size // chunk_size)
    if len(chunks) != 8 * n_chunks:
        raise ctx.fail(f"{w}.chunk_crc32c", f"{path}: {len(chunks) // 8} chunk checksums for "
                       f"{n_chunks} chunks of {chunk_size} bytes")
    if not _LOWER_HEX.fullmatch(chunks):  # int(x, 16) alone would take "0x12", " 1_2", "ABCD"
        raise ctx.fail(f"{w}.chunk_crc32c", f"{path}: expected 8 lowercase hex digits per chunk")
    return FileEntry(path, role, size, header_size, crc, ChunkCrcs.from_hex(chunks), index)


def _check_files(ctx: _Ctx, m: Manifest) -> None:
    paths = [f.path for f in m.files]
    if len(set(paths)) != len(paths):
        raise ctx.fail("files", "a path appears twice")
    S = m.mesh.shard_degree
    # Nothing here or in any reader grows with S unless S files are listed: a mesh the files
    # cannot describe is refused before anything is allocated per shard rank.
    n_shards = sum(1 for f in m.files if f.role == "shard")
    chunk_files = {f.path for f in m.files if f.role == "chunks"}
    if m.chunked is None and chunk_files:
        raise ctx.fail("files", f"{sorted(chunk_files)[0]} is a chunks file but there is no chunked section")
    unused = sorted(chunk_files - m.chunked.files()) if m.chunked is not None else []
    if unused:
        raise ctx.fail("files", f"chunks files that hold no chunk or blob: {_listed(unused)}")
    # A checkpoint of chunked tensors alone has no flat groups and so no shard files.
    chunked_only = m.chunked is not None and not m.components and n_shards == 0
    if not chunked_only and n_shards != S:
        raise ctx.fail("files", f"the mesh has {S} shard ranks but the files list {n_shards} "
                       "shard files")
    misplaced = []
    for i, f in enumerate(f for f in m.files if f.role == "shard"):
        name = _SHARD_NAME.fullmatch(f.path.rsplit("/", 1)[-1])
        if f.index != i:
            misplaced.append(f"shard entry {i} ({f.path}) has index {f.index}")
        elif name is None or (int(name.group(1)), int(name.group(2))) != (i, S):
            misplaced.append(f"shard entry {i} is {f.path}, not named shard-{i:05d}-of-{S:05d}")
    if misplaced:
        raise ctx.fail("files", f"shard files must be listed in order 0 .. {S - 1}, the i-th named "
                       f"shard-<i>-of-<S>: {_listed(misplaced)}")
    data_bytes = shard_slots(m.components, m.mesh, m.version)
    shard_data = data_bytes[-1].end if data_bytes else 0
    bufs = buffer_slots(m.components)
    buf_data = bufs[-1].end if bufs else 0
    wrong = [f"{f.path}: size {f.size} does not match its header of {f.header_size} bytes plus "
             f"{shard_data if f.role == 'shard' else buf_data} bytes of "
             f"{'tensors' if f.role == 'shard' else 'buffers'}"
             for f in m.files
             if (f.role == "shard" and f.size != f.data_start + shard_data)
             or (f.role == "buffers" and f.size != f.data_start + buf_data)]
    if wrong:
        raise ctx.fail("files", _listed(wrong))
    if bufs and m.buffers_file() is None:
        raise ctx.fail("files", "the manifest lists buffers but no buffers file")
    if sum(1 for f in m.files if f.role == "buffers") > 1:
        raise ctx.fail("files", "more than one buffers file")
    ranks = sorted(f.index for f in m.files if f.role == "rank")  # type: ignore[type-var]
    if len(set(ranks)) != len(ranks) or any(r >= m.mesh.world_size for r in ranks):  # type: ignore[operator]
        raise ctx.fail("files", f"rank files need distinct indices below the world size "
                       f"{m.mesh.world_size}; found {ranks[:20]}")


def iter_param_groups(m: Manifest) -> Iterator[tuple[Component, FlatGroup]]:
    for c in m.components.values():
        for g in c.layout.groups:
            yield c, g


def default_states(group: FlatGroup, optimizer_kinds: tuple[str, ...]) -> tuple[tuple[str, str], ...]:
    """``master`` plus the optimizer's per-element kinds (fp32) for trained groups; frozen: master."""
    kinds = [("master", group.master_dtype)]
    if group.requires_grad:
        kinds += [(k, "float32") for k in optimizer_kinds]
    return tuple(kinds)
