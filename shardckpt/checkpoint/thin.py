"""Thinning: a committed checkpoint past its optimizer window becomes a weights-only checkpoint,
in place (retention per component, ``keep_optimizer_last``).

The optimizer's per-element state (``exp_avg``, ``exp_avg_sq``, ...) lies in the same shard files
as the ``master`` weights, one file per shard rank. From format 1.0 a shard file holds its
tensors kind by kind, so every group's ``master`` is one contiguous range at the start of the
data section. Thinning therefore writes, per shard rank, a new weights-only shard file: a new
header, then that range, read with every chunk's CRC32C checked and written with new checksums
as the bytes go by. That is the least I/O a correct rewrite needs (the weights once in, once
out; for AdamW a third of the shard bytes); the frozen, buffers and rank files are kept as they
are, and named again by the new manifest.

Order (a reader never sees a manifest that names a missing file; a kill anywhere leaves the
checkpoint whole, as it was or thinned):

1. the new shard files go to a new save directory, under a lease (so ``clean`` leaves it alone);
2. every file the new manifest names is checked to be there with its size, directories synced;
3. ``manifest.json`` is replaced only if it still holds the bytes thinning read
   (:meth:`~shardckpt.storage.Storage.replace_if`: on S3 a PUT with ``If-Match``), so that a
   concurrent writer is never overwritten; on a conflict the new files are removed and the
   checkpoint is left as that writer made it;
4. the old shard files are removed, one by one, confined to the checkpoint.

A kill between 1 and 3 leaves an unnamed save directory (debris ``shardckpt clean`` removes); a
kill during 4 leaves old shard files no manifest names, which the thinned manifest lists
(``extras.thinned.removed``) and ``shardckpt clean`` or a second thinning removes.

A signed checkpoint is thinned only by a caller that can sign the new manifest (``resign``);
otherwise it is left whole, with a warning, never re-written with a signature that no longer
matches. The manifest's ``extras.thinned`` records what was done (docs/FORMAT.md section 17).
"""

from __future__ import annotations

import datetime as _dt
import json
import logging
import posixpath
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any
from collections.abc import Callable, Iterator, Mapping

from shardckpt.checkpoint.references import RunFiles
from shardckpt.checkpoint.writer import CheckpointSpec, CheckpointWriter, new_save_id
from shardckpt.errors import LinkRefusedError, ShardckptError
from shardckpt.format.digests import recorded_algorithm
from shardckpt.format.manifest import (
    MANIFEST_NAME, SAFE_NAME, Component, FileEntry, Manifest, TensorSlot, shard_slots, to_json,
)
from shardckpt.format.manifest_parse import parse
from shardckpt.format.signing import SigningKey
from shardckpt.storage import Storage, commit as _commit

log = logging.getLogger(__name__)

#: The ``extras`` key a thinned manifest carries (docs/FORMAT.md section 17).
THINNED = "thinned"
WEIGHTS = "master"
#: Bytes read and written at a time per shard file (whole checksum chunks are read around it).
PIECE = 16 << 20
_OLD_SHARD = re.compile(r"shard-[0-9]{5,9}-of-[0-9]{5,9}\.safetensors\Z")

#: ``on_point(name)`` is called at each named point of a thinning: ``"shard_written"`` (after
#: each new shard file), ``"files_written"`` (before the manifest is replaced),
#: ``"manifest_replaced"``, ``"removing"`` (before each old file is removed).
Hook = Callable[[str], None]
#: ``resign(manifest_bytes) -> manifest_bytes``: signs a thinned manifest (a signed checkpoint).
Resign = Callable[[bytes], bytes]


def resign_with(key: SigningKey) -> Resign:
    """The :data:`Resign` of a caller that holds ``key``: the thinned manifest signed with it."""
    def resign(data: bytes) -> bytes:
        return to_json(parse(data, "thinned manifest"), key)
    return resign


def optimizer_kinds(m: Manifest) -> list[str]:
    """The optimizer state kinds (every kind but ``master``) the checkpoint holds, sorted."""
    return sorted({k for c in m.components.values() for ks in c.states.values()
                   for k, _ in ks if k != WEIGHTS})


def thinned_record(m: Manifest) -> Mapping[str, Any] | None:
    """``extras.thinned`` of a thinned checkpoint (an object), or None."""
    rec = m.extras.get(THINNED)
    return rec if isinstance(rec, Mapping) else None


def components_held(m: Manifest) -> list[str]:
    """What the checkpoint holds, in words, for ``inspect``: ``weights``, ``optimizer (kinds)``
    or ``optimizer: thinned``, ``frozen files``, ``buffers``, ``rank state``, ``chunked tensors``."""
    out = ["weights"] if m.components else []
    kinds = optimizer_kinds(m)
    if kinds:
        out.append(f"optimizer ({', '.join(kinds)})")
    elif thinned_record(m) is not None:
        out.append("optimizer: thinned (weights only)")
    roles = {f.role for f in m.files}
    out += [word for role, word in (("frozen", "frozen files"), ("buffers", "buffers"),
                                    ("rank", "rank state"), ("chunks", "chunked tensors"))
            if role in roles]
    return out


def is_signed(raw: bytes, storage: Storage) -> bool:
    """Whether the manifest ``raw`` (of the checkpoint at ``storage``) carries a signature: a
    top-level member whose name speaks of one, or a signature file beside ``manifest.json``
    (any name with ``sig`` in it).
    Thinning re-writes the manifest, so a signed one must be signed again or left alone."""
    try:
        doc = json.loads(raw)
    except ValueError:
        return True  # unreadable: not ours to re-write
    if isinstance(doc, dict) and any("sign" in str(k).lower() for k in doc):
        return True
    # save directories are <timestamp>-<hex>: no "sig" in them
    return any(n != MANIFEST_NAME and "sig" in n.lower() for n in storage.ls(""))


def why_not(m: Manifest) -> str | None:
    """Why ``m`` cannot be thinned (None if it can): a format without contiguous weights, or
    chunked tensors (DCP), whose files mix kinds per tensor."""
    if m.version[0] < 1:
        return f"format {m.version[0]}.{m.version[1]} shard files interleave the kinds; reshard it first"
    if m.chunked is not None:
        return "its chunked tensors (DCP) hold weights and optimizer state in the same boxes"
    return None


@dataclass(frozen=True)
class Thinned:
    url: str
    save_id: str             # the new manifest's
    dropped: tuple[str, ...]  # the optimizer state kinds removed
    bytes_written: int
    bytes_removed: int


def thin(storage: Storage, resign: Resign | None = None, on_point: Hook | None = None,
         workers: int = 4) -> Thinned | None:
    """Thin the committed checkpoint at ``storage`` into a weights-only one (see the module
    doc); None where it holds no optimizer state (then leftover old files are removed), cannot be
    thinned, or is signed and ``resign`` is None (each logged). Raises
    :class:`CommitConflictError` where another writer replaced the manifest meanwhile (its
    checkpoint is left as it is)."""
    point = on_point or (lambda name: None)
    raw = _commit.current_manifest(storage)
    if raw is None:
        raise ShardckptError(f"{storage.url}: no {MANIFEST_NAME}; nothing to thin")
    m = parse(raw, storage.url_of(MANIFEST_NAME))
    kinds = optimizer_kinds(m)
    if not kinds:
        finish(storage, m, point)
        return None
    reason = why_not(m)
    if reason is not None:
        log.warning("%s is kept whole, not thinned: %s", storage.url, reason)
        return None
    signed = is_signed(raw, storage)
    if signed and resign is None:
        log.warning("%s is signed and no signing key is at hand: kept whole (optimizer state "
                    "too) rather than thinned into a manifest whose signature would not match",
                    storage.url)
        return None
    new_id = new_save_id()
    old_shards = [f for f in m.files if f.role == "shard"]
    spec = _weights_spec(m, new_id, [f.path for f in old_shards])
    # the new shard files get digests where the old ones had them (every file of a signed one),
    # of the same algorithm: a manifest uses one
    spec.digests = (recorded_algorithm(m.files) or True) if signed or all(f.digest for f in m.files) else False
    writer = CheckpointWriter(storage, spec, new_id)
    with writer.lease():
        try:
            entries = _write_shards(storage, m, writer, old_shards, workers, point)
            new = writer.manifest(entries + [f for f in m.files if f.role != "shard"])
            data = to_json(new)
            if signed and resign is not None:  # an unsigned checkpoint stays unsigned
                data = resign(data)
            parse(data, storage.url_of(MANIFEST_NAME))
            # own files; references (format 1.3) are the old manifest's, untouched
            _commit.check_files(storage, replace(new, files=tuple(f for f in new.files if not f.is_reference)))
            _commit.sync_dirs(storage, new_id)
            point("files_written")
            _commit.replace(storage, data, raw, new_id)
        except BaseException:
            writer.discard()
            raise
    point("manifest_replaced")
    removed = finish(storage, new, point)
    log.info("thinned %s into weights only (%s removed): %d bytes of weights rewritten, %d bytes "
             "of old shard files removed", storage.url, ", ".join(kinds), sum(f.size for f in entries),
             removed)
    return Thinned(storage.url, new_id, tuple(kinds), sum(f.size for f in entries), removed)


def _weights_spec(m: Manifest, new_id: str, old_paths: list[str]) -> CheckpointSpec:
    comps = {name: Component(c.name, c.layout,
                             {g: tuple((k, d) for k, d in ks if k == WEIGHTS) for g, ks in c.states.items()},
                             c.aliases, c.buffers)
             for name, c in m.components.items()}
    now = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    record = {"at": now, "from_save_id": m.save_id, "dropped": optimizer_kinds(m),
              "optimizer": None if m.optimizer is None else m.optimizer.name,
              "removed": sorted(old_paths)}
    return CheckpointSpec(m.mesh, comps, None, {**m.extras, THINNED: record}, dict(m.per_rank_state),
                          m.chunk_size, None, m.frozen)


def _write_shards(storage: Storage, m: Manifest, writer: CheckpointWriter,
                  old_shards: list[FileEntry], workers: int, point: Hook) -> list[FileEntry]:
    """Write every weights-only shard file (in parallel, ``workers`` at a time); their entries."""
    old_slots = {s.name: s for s in shard_slots(m.components, m.mesh, m.version, frozen=m.frozen)}
    files = RunFiles(storage)

    def one(old: FileEntry) -> FileEntry:
        def produce(slot: TensorSlot) -> Iterator[memoryview]:
            src = old_slots[slot.name]
            a = old.data_start + src.begin
            end = old.data_start + src.end
            while a < end:
                b = min(end, a + PIECE)
                yield files.read_checked(old, m.chunk_size, a, b)
                a = b
        assert old.index is not None
        entry = writer.write_shard(old.index, produce)
        point("shard_written")
        return entry

    with ThreadPoolExecutor(max(1, min(workers, len(old_shards)))) as pool:
        return list(pool.map(one, old_shards))


def leftovers(storage: Storage, m: Manifest) -> list[str]:
    """Old shard files that a thinned manifest ``m`` lists as removed and still exist (a thinning
    killed while it removed them). Only plain paths of shard files that ``m`` no longer names
    count: nothing else is ever removed on the record's word."""
    rec = thinned_record(m)
    paths = rec.get("removed") if rec is not None else None
    if not isinstance(paths, list):
        return []
    named = {f.path for f in m.files}
    out = []
    for p in paths:
        if not isinstance(p, str) or p in named:
            continue
        parts = p.split("/")
        if len(parts) != 2 or not all(SAFE_NAME.match(x) and x not in (".", "..") for x in parts) \
                or not _OLD_SHARD.match(parts[1]):
            continue
        try:
            if storage.exists(p):
                out.append(p)
        except ShardckptError:
            continue
    return out


def finish(storage: Storage, m: Manifest, point: Hook) -> int:
    """Remove the old shard files a thinned ``m`` no longer names; the bytes freed."""
    freed = 0
    for p in leftovers(storage, m):
        point("removing")
        try:
            size = storage.size(p)
            storage.remove_inside(p)
        except LinkRefusedError as e:
            log.warning("thinning: %s", e)
            continue
        freed += size
        d = posixpath.dirname(p)
        try:  # a local directory left empty goes too (object stores have none)
            if d and not storage.ls(d):
                storage.remove_inside(d, recursive=True)
        except ShardckptError:
            pass
    return freed

