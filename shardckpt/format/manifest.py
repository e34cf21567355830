"""The manifest: the versioned JSON that describes one checkpoint, its records and its writer.

``docs/FORMAT.md`` is the specification; this module and :mod:`shardckpt.format.manifest_parse`
(the strict parser, :func:`~shardckpt.format.manifest_parse.parse`) are its reference
implementation. :func:`to_json` writes a manifest; each :class:`FileEntry` has one JSON form,
:meth:`FileEntry.to_doc` / :meth:`FileEntry.from_doc`, used in the manifest and wherever an entry
travels between processes. The manifest's own checksum, text encoding and string bounds are in
:mod:`shardckpt.format.integrity`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any
from collections.abc import Callable, Iterator, Mapping, Sequence

from shardckpt.format.chunked import FEATURE as CHUNKED_FEATURE, ChunkedSection, file_layout, section_doc
from shardckpt.format.digests import SHA256, digest_member
from shardckpt.format.dtypes import itemsize
from shardckpt.format.layout import FlatGroup, Layout, Mesh, prod
from shardckpt.format.integrity import MAX_SHORT, ChunkCrcs, seal
from shardckpt.format.parse_context import MAX_INT, ParseContext
from shardckpt.format.records import RunExtras
from shardckpt.format.signing import SigningKey, seal_signed

FORMAT_NAME = "shardckpt"
#: 1.1 adds the manifest's own checksum (``manifest_crc32c``); see docs/FORMAT.md section 9.
VERSION = (1, 1)
#: 1.2 adds chunked tensors and blobs (the ``chunked`` section, docs/FORMAT.md section 13); a
#: manifest with that section is written as 1.2 and lists ``chunked_tensors`` in ``requires``.
#: Manifests without it are written as :data:`VERSION`.
CHUNKED_VERSION = (1, 2)
#: 1.3 moves the slots of frozen groups (``requires_grad`` false) out of the shard files into one
#: ``frozen`` file per shard rank, which a later checkpoint of the same run may reference instead
#: of rewriting (docs/FORMAT.md section 15); such a manifest lists :data:`FROZEN_FEATURE` in
#: ``requires``, so that a reader of an earlier minor version refuses it instead of misreading.
FROZEN_VERSION = (1, 3)
FROZEN_FEATURE = "frozen_files"
FROZEN_ROLE = "frozen"
#: Features a manifest may list in ``requires``; a reader refuses any other (it would misread).
KNOWN_FEATURES = (CHUNKED_FEATURE, FROZEN_FEATURE)
#: Major versions this shardckpt reads. 0.x shard files hold their tensors group by group; from
#: 1.0 they are kind by kind (every group's master weights first), see :func:`shard_slots`.
READABLE_MAJORS = (0, 1)
MANIFEST_NAME = "manifest.json"
#: A manifest larger than this is refused before it is read (a 70B, 1024-rank manifest is ~10 MB).
MAX_MANIFEST_BYTES = 512 << 20
DEFAULT_CHUNK_SIZE = 1 << 20
ROLES = ("shard", "buffers", "rank", "chunks", FROZEN_ROLE)
#: Names of save ids, components, groups and path segments: letters, digits, ``_ . -``.
SAFE_NAME = re.compile(r"^[A-Za-z0-9_.\-]+\Z")
#: A reference (format 1.3, ``frozen`` entries only): the frozen file of a sibling checkpoint of
#: the same run directory, ``../<step-dir>/<save-id>/frozen-<i>-of-<S>.safetensors``: exactly one
#: leading ``..``, then a step directory name, nothing else.
REFERENCE = re.compile(r"\.\./(step-[0-9]{8,20})/([A-Za-z0-9_.\-]{1,256})/"
                       r"frozen-([0-9]{5,9})-of-([0-9]{5,9})\.safetensors\Z")
_LOWER_HEX = re.compile(r"[0-9a-f]*")


@dataclass(frozen=True, slots=True)
class FileEntry:
    """One file of the checkpoint, relative to the checkpoint directory, with its checksums."""

    path: str
    role: str                 # one of ROLES
    size: int
    header_size: int          # safetensors JSON header length (the u64 at byte 0)
    crc32c: int
    chunk_crc32c: Sequence[int]  # held as ChunkCrcs, whatever sequence of ints is given
    index: int | None = None  # shard rank for "shard" and "frozen", global rank for "rank"
    digest: str | None = None  # format 1.4: digest of shardckpt.format.digests (hex), if recorded
    algorithm: str = SHA256    # the digest's: member "sha256" (1.4) or "blake3" (1.5)

    def __post_init__(self) -> None:
        if not isinstance(self.chunk_crc32c, ChunkCrcs):
            object.__setattr__(self, "chunk_crc32c", ChunkCrcs(self.chunk_crc32c))

    @property
    def data_start(self) -> int:
        return 8 + self.header_size

    @property
    def is_reference(self) -> bool:
        """Whether the file lies in a sibling checkpoint (format 1.3 ``frozen`` references)."""
        return self.path.startswith("../")

    def to_doc(self) -> dict[str, Any]:
        """The entry as the manifest's ``files`` list holds it (checksums as lowercase hex)."""
        doc: dict[str, Any] = {"path": self.path, "role": self.role}
        if self.index is not None:
            doc["index"] = self.index
        doc.update(size=self.size, header_size=self.header_size, crc32c=f"{self.crc32c:08x}",
                   chunk_crc32c=ChunkCrcs(self.chunk_crc32c).hex())
        if self.digest is not None:
            doc[self.algorithm] = self.digest
        return doc

    @classmethod
    def from_doc(cls, v: Any, where: str = "file", chunk_size: int | None = None,
                 ctx: ParseContext | None = None) -> FileEntry:
        """The entry :meth:`to_doc` wrote, every field checked; a fault raises a
        :class:`~shardckpt.format.parse_context.Problem` naming ``where``. With ``chunk_size``,
        the number of chunk checksums must be the number of chunks of the file's size."""
        ctx = ctx or ParseContext("file entry")
        d = ctx.obj(v, where)
        path = ctx.str_(ctx.key(d, "path", where), f"{where}.path")
        parts = path.split("/")
        if path.startswith("../") and d.get("role") == FROZEN_ROLE:
            if reference_of(path) is None:
                raise ctx.fail(f"{where}.path", f"{path[:300]!r} is not a reference to a frozen file "
                               "of a sibling checkpoint (../step-<digits>/<save-id>/"
                               "frozen-<i>-of-<S>.safetensors); refused")
        elif (path.startswith("/") or "\\" in path or ":" in path
                or any(p in ("", ".", "..") or not SAFE_NAME.match(p) for p in parts)):
            raise ctx.fail(f"{where}.path", f"{path!r} is not a plain relative path inside the checkpoint")
        role = ctx.str_(ctx.key(d, "role", where), f"{where}.role", MAX_SHORT)
        if role not in ROLES:
            raise ctx.fail(f"{where}.role", f"{role!r} is not one of {ROLES}")
        index = None
        if role in ("shard", "rank", "chunks", FROZEN_ROLE):
            index = ctx.int_(ctx.key(d, "index", where), f"{where}.index", 0, 1 << 24)
        size = ctx.int_(ctx.key(d, "size", where), f"{where}.size")
        header_size = ctx.int_(ctx.key(d, "header_size", where), f"{where}.header_size", 2, 100_000_000)
        if 8 + header_size > size:
            raise ctx.fail(f"{where}.header_size",
                           f"{path}: header of {header_size} bytes does not fit in {size} bytes")
        crc = ctx.hex32(ctx.key(d, "crc32c", where), f"{where}.crc32c")
        chunks = ctx.str_(ctx.key(d, "chunk_crc32c", where), f"{where}.chunk_crc32c", MAX_INT)
        n_chunks = None if chunk_size is None else -(-size // chunk_size)
        if n_chunks is not None and len(chunks) != 8 * n_chunks:
            raise ctx.fail(f"{where}.chunk_crc32c", f"{path}: {len(chunks) // 8} chunk checksums for "
                           f"{n_chunks} chunks of {chunk_size} bytes")
        # int(x, 16) alone would take "0x12", " 1_2", "ABCD"
        if len(chunks) % 8 or not _LOWER_HEX.fullmatch(chunks):
            raise ctx.fail(f"{where}.chunk_crc32c", f"{path}: expected 8 lowercase hex digits per chunk")
        algorithm, digest, problem = digest_member(d)
        if problem is not None:
            raise ctx.fail(f"{where}.{problem[0]}", f"{path}: {problem[1]}")
        return cls(path, role, size, header_size, crc, ChunkCrcs.from_hex(chunks), index, digest, algorithm)



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
    frozen: bool = False  # format 1.3: frozen groups' slots lie in "frozen" files, not shard files

    @cached_property
    def run_extras(self) -> RunExtras:
        """:attr:`extras` as the typed record, decoded on first use and kept. Extras are free-form
        JSON to the parser: a fault in a key shardckpt relies on is an error of whoever reads it
        (:func:`shardckpt.format.records.run_extras` names the file), not of the manifest."""
        return RunExtras.from_doc(dict(self.extras), "extras")

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

    def frozen_file(self, shard: int) -> FileEntry:
        for f in self.files:
            if f.role == FROZEN_ROLE and f.index == shard:
                return f
        raise KeyError(f"frozen {shard}")

    def references(self) -> tuple[FileEntry, ...]:
        """The entries that name a file of a sibling checkpoint (none before format 1.3)."""
        return tuple(f for f in self.files if f.is_reference)

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
                version: tuple[int, int] = VERSION, frozen: bool = False) -> list[TensorSlot]:
    """Tensors of every shard file, in file order; tensor ``"<group>.<kind>"`` is 1-D.

    Every shard file of a checkpoint has the same slots. From format 1.0 the order is components,
    then state kinds (in order of first appearance over the groups), then groups: each kind is
    contiguous in the file, so reading the weights alone (consolidation, weights-only loads)
    reads one contiguous range per shard. Format 0.x ordered components, groups, then kinds.
    With ``frozen`` (a manifest that lists :data:`FROZEN_FEATURE`), the groups whose
    ``requires_grad`` is false are left out: their slots are :func:`frozen_slots`.
    """
    return _group_slots(components, mesh, version, lambda g: not (frozen and not g.requires_grad))


def frozen_slots(components: Mapping[str, Component], mesh: Mesh) -> list[TensorSlot]:
    """Tensors of every ``frozen`` file (format 1.3): the slots of the groups whose
    ``requires_grad`` is false, in the order :func:`shard_slots` gives them."""
    return _group_slots(components, mesh, FROZEN_VERSION, lambda g: not g.requires_grad)


def has_frozen_groups(components: Mapping[str, Component]) -> bool:
    return any(not g.requires_grad for c in components.values() for g in c.layout.groups)


def frozen_part(components: Mapping[str, Component]) -> list[Any]:
    """What must match for a frozen file of one checkpoint to stand for another's: each frozen
    group (component, group, its parameters' specs, its state kinds)."""
    out: list[Any] = []
    for name, c in components.items():
        for g in c.layout.groups:
            if not g.requires_grad:
                out.append((name, g, tuple(c.layout.group_params(g)), tuple(c.states[g.name])))
    return out


def _group_slots(components: Mapping[str, Component], mesh: Mesh, version: tuple[int, int],
                 keep: Callable[[FlatGroup], bool]) -> list[TensorSlot]:
    out: list[TensorSlot] = []
    pos = 0

    def add(g: FlatGroup, kind: str, dtype: str) -> None:
        nonlocal pos
        s = g.padded_numel // mesh.shard_degree
        n = s * itemsize(dtype)
        out.append(TensorSlot(f"{g.name}.{kind}", dtype, (s,), pos, pos + n))
        pos += n

    for comp in components.values():
        groups = [g for g in comp.layout.groups if keep(g)]
        if version[0] < 1:
            for g in groups:
                for kind, dtype in comp.states[g.name]:
                    add(g, kind, dtype)
            continue
        kinds: dict[str, None] = {}
        for g in groups:
            kinds.update((k, None) for k, _ in comp.states[g.name])
        for kind in kinds:
            for g in groups:
                state_dtype = dict(comp.states[g.name]).get(kind)
                if state_dtype is not None:
                    add(g, kind, state_dtype)
    return out


def reference_of(path: str) -> tuple[str, str, int, int] | None:
    """(step directory, save id, shard rank, S) of a reference path (:data:`REFERENCE`), or None
    when ``path`` is not one."""
    m = REFERENCE.fullmatch(path)
    if m is None or m.group(2) in (".", ".."):
        return None
    return m.group(1), m.group(2), int(m.group(3)), int(m.group(4))


def frozen_file_name(save_id: str, shard: int, shard_degree: int) -> str:
    return f"{save_id}/frozen-{shard:05d}-of-{shard_degree:05d}.safetensors"


def chunked_slots(m: Manifest, path: str) -> list[TensorSlot]:
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


def to_json(m: Manifest, key: SigningKey | None = None) -> bytes:
    """Encode a manifest; :func:`~shardckpt.format.manifest_parse.parse` of the result gives
    back an equal manifest. ``key``: signed with it (:mod:`shardckpt.format.signing`)."""
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
        "files": [f.to_doc() for f in m.files],
    }
    requires = ([CHUNKED_FEATURE] if m.chunked is not None else []) + ([FROZEN_FEATURE] if m.frozen else [])
    if requires:
        doc["requires"] = requires
    if m.chunked is not None:
        doc["chunked"] = section_doc(m.chunked)
    return seal(doc) if key is None else seal_signed(doc, key)


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
