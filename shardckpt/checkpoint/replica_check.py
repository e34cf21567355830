"""HSDP replica check: before a save commits, the replicas compare the CRC32C of every chunk.

With HSDP (replicate degree R > 1) the R replicas of shard rank ``s`` hold the same bytes, bit
for bit: gradients are reduced across replicas before every step and the optimizer step works
element by element. Only replica ``s % R`` writes shard ``s`` (docs/FORMAT.md sections 3.3, 8). A rank
whose memory or arithmetic went wrong without an error (silent data corruption) holds other
bytes, and nothing else would notice: a checkpoint written from it reads back with every CRC
right, and a run resumed from it carries the damage on. So every replica that writes nothing
computes the CRC32C of each chunk of the files it would write (shard file, and frozen file where
there is one) and compares them with the chunk CRCs the writer recorded, which every rank has
once the file entries are exchanged; then one all-gather of the verdicts (empty where all is well)
lets every rank raise the same :class:`~shardckpt.errors.ReplicaMismatchError`, before the
manifest exists: the save is not committed, and ``latest`` still names the previous checkpoint.

Cost: one pass of CRC32C over the shard bytes on each replica that does not write (while the
writers write; with an async save, while the other ranks copy their shards aside, before training
goes on), and one all-gather of a few bytes per rank. Call order, on every rank of the save's
group: :meth:`ReplicaCheck.take` (early, from the live shards, before they change; or inside the
write exchange), then :meth:`ReplicaCheck.compare` with the exchanged entries, before the commit.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, TypeVar

from shardckpt.checkpoint.collective import agree
from shardckpt.checkpoint.writer import CheckpointSpec, frozen_header, new_save_id, shard_header
from shardckpt.errors import ReplicaMismatchError
from shardckpt.format.integrity import crc32c
from shardckpt.format.layout import REPLICATE_AXIS, Mesh
from shardckpt.format.manifest import (
    FROZEN_ROLE, FileEntry, TensorSlot, frozen_slots, shard_slots,
)
from shardckpt.storage import crc32c_combine

log = logging.getLogger(__name__)

T = TypeVar("T")
Producer = Callable[[TensorSlot], Iterable[Any]]
#: Chunks named per file in an error (the count of all is given).
SHOWN = 4


def writer_rank(mesh: Mesh, shard: int) -> int:
    """The rank that writes shard ``shard``: its replica ``shard % R``."""
    return mesh.ranks_along(REPLICATE_AXIS, shard)[shard % mesh.replicate_degree]


def data_chunk_crcs(pieces: Iterable[Any], header_size: int, chunk_size: int) -> tuple[list[int], int]:
    """CRC32C of the data bytes ``pieces`` (in order) cut where the chunks of a file that holds
    ``header_size`` bytes of header before them are cut; and the number of data bytes."""
    limit = chunk_size - header_size % chunk_size  # data bytes in the chunk where the header ends
    crcs: list[int] = []
    crc, fill, n = 0, 0, 0
    for piece in pieces:
        view = memoryview(piece).cast("B")
        pos = 0
        while pos < len(view):
            take = min(len(view) - pos, limit - fill)
            crc = crc32c(view[pos:pos + take], crc)
            fill += take
            pos += take
            if fill == limit:
                crcs.append(crc)
                crc, fill, limit = 0, 0, chunk_size
        n += len(view)
    if fill:
        crcs.append(crc)
    return crcs, n


def file_chunk_crcs(header: bytes, data_crcs: Sequence[int], data_size: int,
                    chunk_size: int) -> list[int]:
    """The per-chunk CRC32C of the file ``header`` + data, from :func:`data_chunk_crcs`."""
    full, rest = divmod(len(header), chunk_size)
    out = [crc32c(header[i * chunk_size:(i + 1) * chunk_size]) for i in range(full)]
    if not rest:
        return out + list(data_crcs)
    head = crc32c(header[full * chunk_size:])
    if not data_crcs:
        return out + [head]
    first = min(chunk_size - rest, data_size)
    return out + [crc32c_combine(head, data_crcs[0], first)] + list(data_crcs[1:])


class ReplicaCheck:
    """One rank's side of the replica check of one save (every rank of an HSDP mesh has one;
    ``produce`` gives this rank's shard bytes where it writes none, else it is None)."""

    def __init__(self, spec: CheckpointSpec, rank: int, produce: Producer | None) -> None:
        self.spec, self.rank, self.produce = spec, rank, produce
        self.shard = spec.mesh.shard_rank(rank)
        self.slots = {"shard": shard_slots(spec.components, spec.mesh, frozen=spec.frozen_files)}
        if spec.frozen_files:
            self.slots[FROZEN_ROLE] = frozen_slots(spec.components, spec.mesh)
        #: role -> (header size it was taken with, data chunk CRCs, data bytes)
        self.taken: dict[str, tuple[int, list[int], int]] | None = None
        self.failure: BaseException | None = None

    @classmethod
    def of(cls, spec: CheckpointSpec, rank: int, writes: bool, produce: Callable[[], Producer],
           wanted: bool = True) -> ReplicaCheck | None:
        """The check of a save from ``rank`` (None where not ``wanted`` or the mesh has no
        replicas); ``produce()`` gives this rank's shard bytes, asked where it writes none."""
        if not wanted or spec.mesh.replicate_degree < 2:
            return None
        return cls(spec, rank, None if writes else produce())

    def around(self, write: Callable[[], T], save_id: str) -> Callable[[], T]:
        """``write`` (this rank's part of the write exchange), after :meth:`take` where this rank
        writes nothing: its CRCs are computed while the writers write."""
        def both() -> T:
            self.take(save_id)
            return write()
        return both

    def header(self, role: str, save_id: str) -> bytes:
        S = self.spec.mesh.shard_degree
        if role == FROZEN_ROLE:
            return frozen_header(self.slots[role], self.shard, S)
        return shard_header(self.slots[role], save_id, self.shard, S)

    def take(self, save_id: str | None = None) -> None:
        """Where this rank writes nothing: the CRC32C of its shard bytes, now (once). Without
        ``save_id`` (before it is agreed), the header's length is that of any save id's; a
        failure is kept and raised by :meth:`claims`, inside the write exchange."""
        if self.produce is None or self.taken is not None:
            return
        try:
            produce, chunk = self.produce, self.spec.chunk_size
            self.taken = {}
            for role, slots in self.slots.items():
                h = len(self.header(role, save_id or new_save_id()))
                pieces = (p for slot in slots for p in produce(slot))
                crcs, n = data_chunk_crcs(pieces, h, chunk)
                self.taken[role] = (h, crcs, n)
        except Exception as e:  # noqa: BLE001 - raised inside the write exchange, on every rank
            self.failure = e

    def claims(self, save_id: str) -> dict[str, list[int]]:
        """role -> the chunk CRC32Cs of the file this rank would write (nothing on a writer)."""
        self.take(save_id)
        if self.failure is not None:
            raise self.failure
        out = {}
        for role, (h, crcs, n) in (self.taken or {}).items():
            header = self.header(role, save_id)
            if len(header) != h:  # taken early with another header length: cannot be compared
                log.warning("replica check: the %s header of shard %d changed length; not compared",
                            role, self.shard)
                continue
            out[role] = file_chunk_crcs(header, crcs, n, self.spec.chunk_size)
        return out

    def compare(self, save_id: str, entries: Sequence[FileEntry], url: str, group: Any = None) -> None:
        """Compare this rank's chunk CRCs with the writer's entries, exchange the verdicts, and
        raise :class:`ReplicaMismatchError` on every rank if any replica differs. Collective."""
        mine = mismatches(self.rank, self.shard, self.claims(save_id), entries, self.spec.chunk_size,
                          self.slots)
        _, reports = agree(lambda: mine, f"replica check of {url}", group)
        found = [p for rep in reports for p in rep["payload"] or ()]
        if found:
            raise ReplicaMismatchError(describe(found, url, self.spec.mesh))
        if self.rank == 0:
            log.debug("%s: the %d replicas of every shard agree", url, self.spec.mesh.replicate_degree)


def mismatches(rank: int, shard: int, claims: Mapping[str, Sequence[int]],
               entries: Sequence[FileEntry], chunk_size: int,
               slots: Mapping[str, Sequence[TensorSlot]]) -> list[dict[str, Any]]:
    """This replica's disagreements with the entries of its shard rank's files (JSON)."""
    out = []
    for role, mine in claims.items():
        entry = next((e for e in entries if e.role == role and e.index == shard), None)
        if entry is None:
            continue
        theirs = list(entry.chunk_crc32c)
        bad = [i for i in range(max(len(mine), len(theirs)))
               if i >= len(mine) or i >= len(theirs) or mine[i] != theirs[i]]
        if not bad:
            continue
        shown = []
        for i in bad[:SHOWN]:
            a, b = i * chunk_size, min((i + 1) * chunk_size, entry.size)
            names = [s.name for s in slots[role]
                     if s.begin + entry.data_start < b and s.end + entry.data_start > a]
            shown.append({"chunk": i, "bytes": [a, b], "tensors": names or ["(header)"]})
        out.append({"rank": rank, "shard": shard, "file": entry.path, "chunks": len(bad),
                    "shown": shown})
    return out


def describe(found: Sequence[Mapping[str, Any]], url: str, mesh: Mesh) -> str:
    """One message naming, per file, the ranks that disagree and the chunks (JSON of
    :func:`mismatches`, the same on every rank)."""
    lines, suspects = [], set()
    for p in sorted(found, key=lambda p: (p["file"], p["rank"])):
        w = writer_rank(mesh, p["shard"])
        suspects |= {w, p["rank"]}
        chunks = "; ".join(f"chunk {c['chunk']} (bytes {c['bytes'][0]}-{c['bytes'][1]}: "
                           f"{', '.join(c['tensors'])})" for c in p["shown"])
        more = f" and {p['chunks'] - len(p['shown'])} more" if p["chunks"] > len(p["shown"]) else ""
        lines.append(f"{p['file']}: rank {p['rank']} holds other bytes than rank {w}, which wrote "
                     f"it, in {p['chunks']} chunk(s): {chunks}{more}")
    ranks = ", ".join(str(r) for r in sorted(suspects))
    return (f"{url}: not committed: HSDP replicas that must hold the same bytes differ. This looks "
            f"like silent data corruption (memory or arithmetic) on one of ranks {ranks}; the "
            "previous checkpoint stays the latest. " + " | ".join(lines) + ". Check the hosts of "
            "those ranks before training on, and resume from the previous checkpoint.")
