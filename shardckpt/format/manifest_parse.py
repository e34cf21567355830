"""The manifest's strict parser: :func:`parse` validates every field before anything is trusted.

Types, bounds, that the parameters of each flat group tile it exactly, that every file name is a
plain relative path, and that every shard file's recorded size equals the size its tensors
imply. Duplicate JSON keys are refused. Every problem found is named in one
:class:`~shardckpt.errors.ManifestError`: the independent parts (top-level fields, each
component, group, parameter, buffer, optimizer param group and file entry) are each checked, and
a check that depends on a faulty part is skipped. A fault that makes the rest meaningless (too
large, not JSON, not a shardckpt manifest, an unreadable version, an unknown required feature)
is reported alone.
"""

from __future__ import annotations

import json
import re
from typing import Any
from collections.abc import Mapping

from shardckpt.errors import ManifestError
from shardckpt.format.chunked import FEATURE as CHUNKED_FEATURE, ChunkedSection, parse_section
from shardckpt.format.integrity import (
    CHECKSUM_FIELD, MAX_SHORT, checksum_problem, check_surrogates, decode_text, free_text_problem,
)
from shardckpt.format.component_parse import parse_components
from shardckpt.format.layout import Mesh
from shardckpt.format.digests import ALGORITHMS
from shardckpt.format.manifest import (
    CHUNKED_VERSION, FORMAT_NAME, FROZEN_FEATURE, FROZEN_ROLE, FROZEN_VERSION, KNOWN_FEATURES,
    MANIFEST_NAME, MAX_MANIFEST_BYTES, READABLE_MAJORS,
    SAFE_NAME, VERSION, Component, FileEntry, Manifest, OptimizerInfo, buffer_slots,
    frozen_slots, has_frozen_groups, shard_slots,
)
from shardckpt.format.records import ParamGroupRecord
from shardckpt.format.parse_context import (
    ParseContext, Problem, finite_float, listed, no_duplicate_keys, reject_constant,
)

_SHARD_NAME = re.compile(r"shard-([0-9]{1,9})-of-([0-9]{1,9})\.safetensors")
_FROZEN_NAME = re.compile(r"frozen-([0-9]{1,9})-of-([0-9]{1,9})\.safetensors")
_TOP = "top level"


def parse(data: bytes | str, source: str = MANIFEST_NAME) -> Manifest:
    """Decode and validate a manifest; raise :class:`ManifestError` naming ``source`` and, for
    every problem found, the field."""
    ctx = ParseContext(source)
    if len(data) > MAX_MANIFEST_BYTES:
        raise ctx.fail("size", f"{len(data)} bytes; at most {MAX_MANIFEST_BYTES} are accepted")
    raw, text = decode_text(data, source)
    try:
        doc = json.loads(text, object_pairs_hook=no_duplicate_keys, parse_constant=reject_constant,
                         parse_float=finite_float)
    except (ValueError, RecursionError) as e:  # JSONDecodeError is a ValueError
        raise ManifestError(f"{source}: not valid manifest JSON: {e}") from e
    doc = ctx.obj(doc, _TOP)
    check_surrogates(text, doc, source)
    del text
    if doc.get("format") != FORMAT_NAME:
        found = doc.get("format")
        raise ctx.fail("format", f"expected {FORMAT_NAME!r}, found "
                       f"{found[:40] if isinstance(found, str) else found!r}")
    version = _parse_version(ctx, ctx.key(doc, "version", _TOP))
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


def _parse_body(ctx: ParseContext, doc: dict[str, Any], version: tuple[int, int]) -> Manifest:
    requires = _parse_requires(ctx, doc)
    frozen = FROZEN_FEATURE in requires
    if frozen and version < FROZEN_VERSION:
        ctx.note("requires", f"{FROZEN_FEATURE!r} needs format {FROZEN_VERSION[0]}."
                 f"{FROZEN_VERSION[1]} or later; this manifest says {version[0]}.{version[1]}")
    save_id = ctx.attempt(_parse_save_id, ctx, doc)
    created_at = ctx.attempt(ctx.str_, doc.get("created_at", ""), "created_at", MAX_SHORT)
    mesh = ctx.attempt(_parse_mesh, ctx, doc)
    chunk_size = ctx.attempt(lambda: ctx.int_(ctx.key(doc, "chunk_size", _TOP), "chunk_size", 4096, 1 << 30))
    files_doc = ctx.attempt(lambda: ctx.lst(ctx.key(doc, "files", _TOP), "files"))
    comps_doc = ctx.attempt(lambda: ctx.obj(ctx.key(doc, "components", _TOP), "components"))
    components = parse_components(ctx, comps_doc, mesh)
    optimizer = ctx.attempt(_parse_optimizer, ctx, doc.get("optimizer"), components)
    extras = ctx.attempt(ctx.obj, doc.get("extras", {}), "extras")
    per_rank = ctx.attempt(ctx.obj, doc.get("per_rank_state", {}), "per_rank_state")
    for v, w in ((extras, "extras"), (per_rank, "per_rank_state")):
        problem = free_text_problem(v, w)
        if problem is not None:
            ctx.note(*problem)
    files = _parse_files(ctx, files_doc, chunk_size)
    if files is not None:
        _check_digests(ctx, files, version)
    chunked = None
    if files is not None:
        chunked = ctx.attempt(_parse_chunked, ctx, doc, version, requires, files)
    ctx.finish()
    m = Manifest(version, save_id, created_at, mesh, chunk_size, components, optimizer,  # type: ignore[arg-type]
                 extras, per_rank, files, chunked, frozen)  # type: ignore[arg-type]
    _check_files(ctx, m)
    ctx.finish()
    return m


def _parse_version(ctx: ParseContext, v: Any) -> tuple[int, int]:
    s = ctx.str_(v, "version", MAX_SHORT)
    m = re.fullmatch(r"([0-9]{1,6})\.([0-9]{1,6})", s)
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


def _parse_requires(ctx: ParseContext, doc: dict[str, Any]) -> list[str]:
    """The ``requires`` list; a feature this shardckpt does not know refuses the manifest."""
    requires = [ctx.str_(r, "requires", MAX_SHORT) for r in ctx.lst(doc.get("requires", []), "requires")]
    unknown = [r for r in requires if r not in KNOWN_FEATURES]
    if unknown:
        raise ctx.fail("requires", f"this checkpoint needs {', '.join(map(repr, unknown[:10]))}, "
                       "which this shardckpt does not read; upgrade shardckpt to read it")
    return requires


def _parse_save_id(ctx: ParseContext, doc: dict[str, Any]) -> str:
    save_id = ctx.str_(ctx.key(doc, "save_id", _TOP), "save_id", MAX_SHORT)
    if not SAFE_NAME.match(save_id) or save_id in (".", ".."):
        raise ctx.fail("save_id", f"{save_id!r} is not a plain name (letters, digits, _ . -)")
    return save_id


def _parse_mesh(ctx: ParseContext, doc: dict[str, Any]) -> Mesh:
    axes_doc = ctx.lst(ctx.key(ctx.obj(ctx.key(doc, "mesh", _TOP), "mesh"), "axes", "mesh"), "mesh.axes")
    axes = []
    for i, a in enumerate(axes_doc):
        a = ctx.obj(a, f"mesh.axes[{i}]")
        axes.append((ctx.str_(ctx.key(a, "name", f"mesh.axes[{i}]"), f"mesh.axes[{i}].name", MAX_SHORT),
                     ctx.int_(ctx.key(a, "size", f"mesh.axes[{i}]"), f"mesh.axes[{i}].size", 1, 1 << 24)))
    try:
        return Mesh(tuple(axes))
    except Exception as e:
        raise ctx.fail("mesh", str(e)) from e


# --------------------------------------------------------------------- optimizer, files, chunked


def _parse_optimizer(ctx: ParseContext, v: Any,
                     components: Mapping[str, Component] | None) -> OptimizerInfo | None:
    """The optimizer; its parameters must be known when ``components`` are (each param group
    is checked on its own)."""
    if v is None:
        return None
    d = ctx.obj(v, "optimizer")
    name = ctx.str_(ctx.key(d, "name", "optimizer"), "optimizer.name", MAX_SHORT)
    known = None if components is None else {p.fqn for c in components.values() for p in c.layout.params}
    groups = []
    claimed: set[str] = set()
    for i, pg in enumerate(ctx.lst(ctx.key(d, "param_groups", "optimizer"), "optimizer.param_groups")):
        try:
            groups.append(_parse_param_group(ctx, f"optimizer.param_groups[{i}]", pg, known, claimed))
        except Problem as p:
            ctx.add(p)
    return OptimizerInfo(name, tuple(groups))


def _parse_param_group(ctx: ParseContext, w: str, v: Any, known: set[str] | None,
                       claimed: set[str]) -> dict[str, Any]:
    pg = ctx.obj(v, w)
    params = ParamGroupRecord.from_doc(pg, w, ctx=ctx).params  # types and bounds of every field
    bad = [] if known is None else [p for p in params if p not in known]
    if bad:
        raise ctx.fail(f"{w}.params", f"unknown parameters: {', '.join(bad[:10])}")
    dup = [p for p in params if p in claimed]
    if dup:
        raise ctx.fail(f"{w}.params", f"parameters in two param groups: {', '.join(dup[:10])}")
    claimed.update(params)
    return pg


def _parse_files(ctx: ParseContext, files_doc: list[Any] | None,
                 chunk_size: int | None) -> tuple[FileEntry, ...] | None:
    """Every file entry, or None when one has a problem (or the chunk size has)."""
    if files_doc is None:
        return None
    mark = ctx.mark()
    files = []
    for i, f in enumerate(files_doc):
        try:
            files.append(FileEntry.from_doc(f, f"files[{i}]", chunk_size, ctx))
        except Problem as p:
            ctx.add(p)
    return tuple(files) if ctx.clean_since(mark) and chunk_size is not None else None


def _check_digests(ctx: ParseContext, files: tuple[FileEntry, ...], version: tuple[int, int]) -> None:
    """One digest algorithm for every file, and a version that has it (docs/FORMAT.md section 16)."""
    used = sorted({f.algorithm for f in files if f.digest is not None})
    if len(used) > 1:
        ctx.note("files", f"file digests of {' and '.join(used)}; a manifest uses one algorithm for all its files")
    for a in used:
        if version < ALGORITHMS[a]:
            ctx.note("files", f"{a!r} digests need format {ALGORITHMS[a][0]}.{ALGORITHMS[a][1]} or "
                     f"later; this manifest says {version[0]}.{version[1]}")


def _parse_chunked(ctx: ParseContext, doc: dict[str, Any], version: tuple[int, int],
                   requires: list[str], files: tuple[FileEntry, ...]) -> ChunkedSection | None:
    """The ``chunked`` section (format >= 1.2, with its feature in ``requires``)."""
    if "chunked" not in doc:
        if CHUNKED_FEATURE in requires:
            raise ctx.fail("requires", f"lists {CHUNKED_FEATURE!r} but there is no chunked section")
        return None
    if version < CHUNKED_VERSION or CHUNKED_FEATURE not in requires:
        raise ctx.fail("chunked", f"a chunked section needs format {CHUNKED_VERSION[0]}."
                       f"{CHUNKED_VERSION[1]} or later and {CHUNKED_FEATURE!r} in requires")
    data_sizes = {f.path: f.size - f.data_start for f in files if f.role == "chunks"}
    return parse_section(ctx, doc["chunked"], data_sizes)


def _check_files(ctx: ParseContext, m: Manifest) -> None:
    """The files list against the rest: one shard file per shard rank, in order and named for
    it, sizes that match the tensors, one buffers file when there are buffers, rank files."""
    paths = [f.path for f in m.files]
    if len(set(paths)) != len(paths):
        ctx.note("files", "a path appears twice")
    S = m.mesh.shard_degree
    # Nothing here or in any reader grows with S unless S files are listed: a mesh the files
    # cannot describe is refused before anything is allocated per shard rank.
    n_shards = sum(1 for f in m.files if f.role == "shard")
    chunk_files = {f.path for f in m.files if f.role == "chunks"}
    if m.chunked is None and chunk_files:
        ctx.note("files", f"{sorted(chunk_files)[0]} is a chunks file but there is no chunked section")
    unused = sorted(chunk_files - m.chunked.files()) if m.chunked is not None else []
    if unused:
        ctx.note("files", f"chunks files that hold no chunk or blob: {listed(unused)}")
    # A checkpoint of chunked tensors alone has no flat groups and so no shard files.
    chunked_only = m.chunked is not None and not m.components and n_shards == 0
    if not chunked_only and n_shards != S:
        ctx.note("files", f"the mesh has {S} shard ranks but the files list {n_shards} shard files")
    misplaced = []
    for i, f in enumerate(f for f in m.files if f.role == "shard"):
        name = _SHARD_NAME.fullmatch(f.path.rsplit("/", 1)[-1])
        if f.index != i:
            misplaced.append(f"shard entry {i} ({f.path}) has index {f.index}")
        elif name is None or (int(name.group(1)), int(name.group(2))) != (i, S):
            misplaced.append(f"shard entry {i} is {f.path}, not named shard-{i:05d}-of-{S:05d}")
    if misplaced:
        ctx.note("files", f"shard files must be listed in order 0 .. {S - 1}, the i-th named "
                 f"shard-<i>-of-<S>: {listed(misplaced)}")
    _check_frozen(ctx, m)
    _check_sizes(ctx, m)
    ranks = sorted(f.index for f in m.files if f.role == "rank")  # type: ignore[type-var]
    if len(set(ranks)) != len(ranks) or any(r >= m.mesh.world_size for r in ranks):  # type: ignore[operator]
        ctx.note("files", f"rank files need distinct indices below the world size "
                 f"{m.mesh.world_size}; found {ranks[:20]}")


def _check_frozen(ctx: ParseContext, m: Manifest) -> None:
    """Format 1.3: with :data:`FROZEN_FEATURE`, one ``frozen`` file per shard rank (there are
    frozen groups), in order, the i-th named ``frozen-<i>-of-<S>`` (its own or a reference's),
    each of the size its slots imply; without the feature, no ``frozen`` file."""
    entries = [f for f in m.files if f.role == FROZEN_ROLE]
    if not m.frozen:
        if entries:
            ctx.note("files", f"{entries[0].path} is a frozen file but requires does not list "
                     f"{FROZEN_FEATURE!r}")
        return
    if not has_frozen_groups(m.components):
        ctx.note("requires", f"lists {FROZEN_FEATURE!r} but no flat group is frozen")
        return
    S = m.mesh.shard_degree
    if len(entries) != S:
        ctx.note("files", f"the mesh has {S} shard ranks but the files list {len(entries)} frozen files")
        return
    slots = frozen_slots(m.components, m.mesh)
    data = slots[-1].end if slots else 0
    wrong = []
    for i, f in enumerate(entries):
        name = _FROZEN_NAME.fullmatch(f.path.rsplit("/", 1)[-1])
        if f.index != i or name is None or (int(name.group(1)), int(name.group(2))) != (i, S):
            wrong.append(f"frozen entry {i} is {f.path} (index {f.index}), not frozen-{i:05d}-of-{S:05d}")
        elif f.size != f.data_start + data:
            wrong.append(f"{f.path}: size {f.size} does not match its header of {f.header_size} "
                         f"bytes plus {data} bytes of frozen tensors")
    if wrong:
        ctx.note("files", listed(wrong))


def _check_sizes(ctx: ParseContext, m: Manifest) -> None:
    """Shard and buffers files hold their header and exactly the tensors the components imply."""
    data_bytes = shard_slots(m.components, m.mesh, m.version, m.frozen)
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
        ctx.note("files", listed(wrong))
    if bufs and m.buffers_file() is None:
        ctx.note("files", "the manifest lists buffers but no buffers file")
    if sum(1 for f in m.files if f.role == "buffers") > 1:
        ctx.note("files", "more than one buffers file")
