"""The node-local tier of a :class:`~shardckpt.training.checkpointer.Checkpointer`: save to it,
copy each rank's files to its peers, commit on every node, copy to the durable tier from it, and
resume from the newest checkpoint that can be assembled from any tier.

Save (every ``LocalTier.every`` steps), on every rank:

1. in the caller's thread: each rank writes its files (shard, rank state; buffers on rank 0)
   straight from the live tensors into its node's directory, and the ranks exchange the file
   entries (size, CRC32C per chunk); then training may go on;
2. in the background, over the checkpointer's own process group: each rank sends its files to
   its peers (:mod:`.peer_copy`, checked on receipt); once every rank reports its files and their
   copies durable, each node's lowest rank creates the manifest there (create-only) and prunes
   the node to ``keep`` checkpoints;
3. where the durable tier is due too: each rank streams its own files from the node directory to
   the durable URL (their CRC32Cs compared with what was written: no second copy of device
   memory, and nothing that changed on the node is committed), and rank 0 commits there; a
   frozen file the run's latest durable checkpoint holds with the same entry is referenced
   there (docs/FORMAT.md section 15) instead of copied. Its agreements, like the peer copy's,
   fail every survivor at once when a rank is lost.

A node out of room (``quota_bytes``, or ENOSPC) turns the tier off with one warning; saves then
go to the durable tier alone, and a durable save due at that step still happens (from memory
where the local write failed, from the node directories where only the peer copy did).

Resume: every rank lists its node's directory; the candidates are the local steps with a manifest
on some node and the durable committed ones, newest first (local first at equal steps). A local
step is taken where every file each rank's load reads (its reshard plan's source shards, the
buffers, its rank state on the same world size) is whole on some node: a missing shard file
that one rank of its node alone reads goes from a node that holds it straight into that rank's
shards during the load (every chunk's CRC32C checked as it arrives, nothing written); any other
missing file is fetched into the rank's node directory, checked, then loaded from there (every
chunk's CRC32C checked again as it is read). A candidate that cannot be assembled, or
fails a checksum while loading on any rank, gives way to the next; every rank decides alike.
"""

from __future__ import annotations

import itertools
import logging
from collections import Counter
from dataclasses import dataclass, replace
from typing import Any
from collections.abc import Callable, Mapping

from shardckpt.checkpoint.attempt import Attempt, Steps
from shardckpt.checkpoint.collective import agree, broadcast_bytes, failed_with
from shardckpt.checkpoint.job import Job
from shardckpt.checkpoint.loss_flag import LossFlag, lost_contact
from shardckpt.checkpoint.node_files import below_node, held_whole, newest_committed, prune
from shardckpt.checkpoint.reader import as_storage
from shardckpt.checkpoint.references import RunFiles
from shardckpt.checkpoint.run_dir import CheckpointManager, Found, step_dir
from shardckpt.checkpoint.tiers import (
    HEADER_ALLOWANCE, LocalTier, Transfer, as_full, commit_node, durable_references,
    ensure_room, fetch_plan, files_needed, holdings, put_manifest,
)
from shardckpt.checkpoint.writer import CheckpointWriter, new_save_id
from shardckpt.errors import CollectiveError, InsufficientSpaceError, IntegrityError, ShardckptError
from shardckpt.format.manifest import (
    MANIFEST_NAME, MAX_MANIFEST_BYTES, FileEntry, Manifest, frozen_file_name,
)
from shardckpt.format.manifest_parse import parse
from shardckpt.storage import iter_file_chunks
from shardckpt.training.peer_checks import report_entries
from shardckpt.training.peer_copy import run_transfers
from shardckpt.training.save_load import SaveJob
from shardckpt.training.tier_guard import foreign_steps, own_holdings, private_node, run_identity

log = logging.getLogger(__name__)

COPY_PIECE = 8 << 20

#: Numbers the resumes' fetches (the same on every rank): each gets a loss flag of its own.
FETCHES = itertools.count()


@dataclass(frozen=True)
class Assembled:
    """A local step made loadable: this node's URL of it, the files taken from peers in all
    (to disk, or in ``peers`` straight into memory during the load), the loss flag's key
    for that load, and the step's manifest."""

    url: str
    fetched: int
    peers: list[Transfer]
    flag_key: str
    manifest: Manifest  # the one the ranks agreed on, read once


@dataclass
class LocalSave:
    """A save written to the node directories, not yet copied to peers or committed."""

    step: int
    writer: CheckpointWriter
    by_rank: dict[int, list[FileEntry]]  # the files each rank wrote

    @property
    def entries(self) -> list[FileEntry]:
        return [e for r in sorted(self.by_rank) for e in self.by_rank[r]]


class NodeTier:
    """This rank's view of the local tier: its node, its peers, its node's directory."""

    def __init__(self, tier: LocalTier, rank: int, world_size: int, group: Any, run_url: str = "") -> None:
        self.tier, self.rank, self.group, self.run = tier, rank, group, run_identity(run_url)
        self.nodes = tier.topology(world_size)
        self.node = self.nodes.node_of(rank)
        self.storage = private_node(tier, self.node, group)
        self.enabled = True
        if tier.peers and self.nodes.count < 2 and rank == 0:
            log.warning("local tier: one node (%d ranks per node); no peer copies, so a node lost "
                        "is recovered from the durable tier only", self.nodes.ranks_per_node)

    def url_for(self, step: int) -> str:
        return self.storage.url_of(step_dir(step))

    def turn_off(self, why: str) -> None:
        if self.enabled and self.rank == 0:
            log.warning("local tier turned off, saves go to the durable tier only: %s", why)
        self.enabled = False

    # ------------------------------------------------------------------------------ save

    def write(self, job: SaveJob, step: int) -> LocalSave | None:
        """Write this rank's files of ``job`` into the node directory (collective on the
        tier's group); None where a node is full (the tier is then off)."""
        def plan() -> dict[str, Any]:  # the save id; each node's newest committed step
            newest = None
            if job.spec.frozen_files:
                try:
                    newest = newest_committed(self.storage, self.frozen_held(job.spec.mesh))
                except ShardckptError as e:
                    log.info("local tier: %s cannot be listed (%s); writing the frozen files",
                             self.storage.url, e)
            return {"save_id": new_save_id() if self.rank == 0 else None, "newest": newest}

        _, plans = agree(plan, f"plan of the local save of step {step}", self.group)
        save_id = plans[0]["payload"]["save_id"]
        newest = plans[0]["payload"]["newest"]
        if newest is not None and newest[0] < step and all(p["payload"]["newest"] == newest for p in plans):
            # committed on every node: its frozen files are where this save's would go
            job.previous = self.url_for(newest[0])
        writer = CheckpointWriter(self.storage.child(step_dir(step)), job.spec, save_id)

        def write() -> list[dict[str, Any]]:
            try:
                ensure_room(self.tier, self.storage, planned_bytes(job), f"local save of step {step}")
                return job.write_files(writer)
            except ShardckptError as e:
                full = as_full(e, job.url)
                if full is e:
                    raise
                raise full from e

        try:
            _, reports = agree(write, f"local save to {job.url}", self.group)
        except CollectiveError as e:
            if not failed_with(e, InsufficientSpaceError):
                raise
            self.turn_off(str(e))
            self.discard(step)
            return None
        by_rank = {r: report_entries(rep["payload"], r, f"local save of step {step}")
                   for r, rep in enumerate(reports)}
        return LocalSave(step, writer, by_rank)

    def frozen_held(self, mesh: Any) -> list[int]:
        """The shard ranks whose frozen file this rank's node keeps for it: its own (where it
        writes one) and those of the ranks whose files it keeps copies of."""
        peers = self.tier.peers
        ranks = [self.rank] + [r for r in range(self.nodes.world_size)
                               if self.rank in self.nodes.peers_of(r, peers)]
        return sorted({mesh.shard_rank(r) for r in ranks
                       if mesh.replicate_rank(r) == mesh.shard_rank(r) % mesh.replicate_degree})

    def discard(self, step: int) -> None:
        """Remove an uncommitted step from this node (its leader; every rank has stopped writing)."""
        if self.rank != self.nodes.leader(self.node):
            return
        name = step_dir(step)
        try:
            if not self.storage.exists(f"{name}/{MANIFEST_NAME}"):
                self.storage.remove_inside(name, recursive=True)
        except ShardckptError as e:
            log.warning("local tier: could not remove %s: %s", self.storage.url_of(name), e)

    def commit(self, save: LocalSave) -> Manifest | None:
        """Copy each rank's files to its peers, then commit on every node (collective; may run in
        a background thread). None where a node had no room for the copies (the tier is off)."""
        nodes, peers = self.nodes, self.tier.peers
        # a frozen file referenced in the previous step is on the peers' nodes already
        plan = sorted((Transfer(e.path, r, p) for r, files in save.by_rank.items() for e in files
                       for p in nodes.peers_of(r, peers) if not e.is_reference),
                      key=lambda t: (t.src, t.dst, t.path))
        entries = {e.path: e for e in save.entries}
        here = self.storage.child(step_dir(save.step))
        chunk = save.writer.spec.chunk_size

        def copy() -> int:
            return run_transfers(plan, self.rank, here, entries, chunk, self.group,
                                 room=lambda n: ensure_room(self.tier, self.storage, n, "peer copy"))

        def left_behind() -> str:
            return f"step {save.step} is committed on no node; resume takes an earlier checkpoint"

        save_id = save.writer.save_id
        try:
            agree(copy, f"peer copy of {here.url}", self.group, left_behind,
                  LossFlag.for_group(self.group, f"peer-copy/{save_id}"))
        except CollectiveError as e:
            if not failed_with(e, InsufficientSpaceError):
                raise
            self.turn_off(str(e))
            return None
        m = save.writer.manifest(save.entries)
        mine = set(nodes.ranks_of(self.node))
        held = [e for r in mine for e in save.by_rank.get(r, [])]
        held += [entries[t.path] for t in plan if t.dst in mine]
        held += [e for r, files in save.by_rank.items() for e in files if e.is_reference
                 and r not in mine and mine & set(nodes.peers_of(r, peers))]

        def commit() -> None:
            if self.rank == nodes.leader(self.node):
                commit_node(here, m, held)
                for name in prune(self.storage, self.tier.keep, foreign_steps(self.storage, self.run)):
                    log.info("local tier: removed %s", self.storage.url_of(name))

        agree(commit, f"local commit of {here.url}", self.group,
              flag=LossFlag.for_group(self.group, f"node-commit/{save_id}"))
        if self.rank == 0:
            log.info("local tier: committed step %d on %d node(s) (%d peer cop%s)", save.step,
                     nodes.count, len(plan), "y" if len(plan) == 1 else "ies")
        return m

    def copy_to_durable(self, save: LocalSave, url: str,
                        storage_options: Mapping[str, Any] | None) -> Manifest:
        """Commit ``save`` at ``url`` from the node directories: an
        :class:`~shardckpt.checkpoint.attempt.Attempt` over the tier's group under the save's id,
        whose every agreement is watched (a rank lost on the way fails every survivor at once).
        Its guard, on rank 0: a frozen file whose entry equals the frozen file of the run's latest
        committed durable checkpoint is not copied; the durable manifest references that file
        (decided from the manifests and the referenced files' sizes, reading none of their
        bytes). Its share: each rank streams the files it wrote, checked against what it wrote.
        Rank 0 commits."""
        dst = as_storage(url, storage_options)
        here = self.storage.child(step_dir(save.step))
        chunk = save.writer.spec.chunk_size
        save_id = save.writer.save_id
        # a frozen file the node references in an earlier local step is the durable copy's own
        S, files = save.writer.spec.mesh.shard_degree, RunFiles(here)
        own = {e.path: replace(e, path=frozen_file_name(save_id, e.index or 0, S))
               if e.is_reference else e for e in save.entries}

        def refs() -> dict[str, str]:  # the guard's plan, on every rank once open
            return attempt.guarded or {}

        def copy(_: CheckpointWriter) -> None:
            for e in save.by_rank.get(self.rank, []):
                d = own[e.path]
                if d.path in refs():
                    continue  # referenced in the previous durable checkpoint: not a byte read
                with dst.writer(d.path, chunk) as w:
                    for piece in iter_file_chunks(*files.locate(e.path), COPY_PIECE):
                        w.write(piece)
                    got = w.close()
                if (got[0], got[1], tuple(got[2])) != (e.size, e.crc32c, tuple(e.chunk_crc32c)):
                    raise IntegrityError(f"{files.url_of(e.path)} no longer holds what was written "
                                         f"(size or CRC32C differ); {dst.url} is not committed")

        def entries() -> list[FileEntry]:
            return [replace(e, path=refs()[e.path]) if e.path in refs() else e for e in own.values()]

        job = Job.of_group(self.group, LossFlag.for_group(self.group, f"durable/{save_id}"))
        attempt = Attempt(job, url, Steps(f"durable copy plan of {url}", f"save to {url}",
                                          f"commit of {url}"),
                          lambda sid: CheckpointWriter(dst, save.writer.spec, sid), save_id=save_id,
                          guard=lambda: durable_references(dst, save.writer.manifest(own.values())),
                          tell_guard=True, discard=False)
        m = attempt.run(copy, lambda w, _: w.commit(entries()))
        if self.rank == 0 and refs():
            log.info("durable copy of step %d: %d frozen file(s) referenced in the previous "
                     "checkpoint, not copied", save.step, len(refs()))
        return m or save.writer.manifest(entries())

    # ---------------------------------------------------------------------------- resume

    def survey(self, manager: CheckpointManager) -> tuple[list[Any], list[int]]:
        """Every rank's node holdings and the durable committed steps rank 0 lists (collective)."""
        def survey() -> dict[str, Any]:
            durable = [f.step for f in manager.committed()] if self.rank == 0 else []
            return {"held": own_holdings(self.storage, holdings(self.storage), self.run),
                    "durable": durable}

        _, reports = agree(survey, "survey of the checkpoint tiers")
        return [r["payload"]["held"] for r in reports], reports[0]["payload"]["durable"]

    def check_durable(self, manager: CheckpointManager, step: int, full_verify: bool,
                      optimizer: bool = False) -> str:
        """What rank 0 finds wrong with durable ``step`` ("" if nothing; collective); with
        ``optimizer``, a checkpoint thinned into weights only too."""
        def check() -> str:
            if self.rank:
                return ""
            found = Found(step, step_dir(step), manager.url_for(step))
            problems = manager.check(found, full_verify) or manager.lacks(found, optimizer)
            return problems[0] if problems else ""

        try:
            return str(agree(check, f"check of {manager.url_for(step)}")[1][0]["payload"])
        except CollectiveError as e:
            if lost_contact(e):
                raise
            return str(e)

    def assemble(self, step: int, save_id: str, held: list[Any], layout: Any, world_size: int,
                 direct: Callable[[Manifest], bool] = lambda m: False) -> Assembled | str:
        """Make local ``step`` loadable from every rank's node directory (collective): the
        manifest and the files each rank's load reads, fetched from other nodes where missing.
        Where ``direct(manifest)`` holds on every rank (the load reads straight into the
        engine's shards), a missing shard file that one rank of its node alone reads is not
        fetched here: the load takes it from the peer into memory (:attr:`Assembled.peers`).
        Returns what was done, or why it cannot be done."""
        nodes = self.nodes
        holder = min(r for r in range(world_size) if held[r].get(str(step), {}).get("manifest") == save_id)
        here = self.storage.child(step_dir(step))
        read: list[bytes] = []

        def read_manifest() -> None:  # inside the agreement: a read that fails fails everywhere
            if self.rank == holder:
                read.append(here.read_limited(MANIFEST_NAME, MAX_MANIFEST_BYTES))
                parse(read[0], here.url_of(MANIFEST_NAME))
        try:
            agree(read_manifest, f"read of local step {step}'s manifest")
        except CollectiveError as e:
            if lost_contact(e):
                raise
            return f"its manifest on rank {holder}'s node cannot be read: {e}"
        data = broadcast_bytes(read[0] if read else None, holder)
        m = parse(data, f"{here.url_of(MANIFEST_NAME)} (from rank {holder})")
        shard = layout.mesh.shard_rank(self.rank)
        mine = sorted(f.path for f in files_needed(m, layout, shard, self.rank, world_size))
        _, reports = agree(lambda: {"needs": mine, "direct": bool(direct(m))},
                           f"files needed from local step {step}")
        needs = {r: rep["payload"]["needs"] for r, rep in enumerate(reports)}
        by_node = {nodes.node_of(r): held_whole(held[r], step, m) for r in range(world_size)}
        plan, lost = fetch_plan(nodes, needs, by_node)
        if lost:
            return f"{len(lost)} file(s) are whole on no node ({', '.join(lost[:3])})"
        entries = {f.path: f for f in m.files}
        readers = Counter((nodes.node_of(r), p) for r, paths in needs.items() for p in paths)
        peers: list[Transfer] = []
        if all(rep["payload"]["direct"] for rep in reports):
            peers = [t for t in plan if entries[t.path].role in ("shard", "frozen")
                     and not entries[t.path].is_reference and readers[(nodes.node_of(t.dst), t.path)] == 1]
        files = [t for t in plan if t not in peers and not entries[t.path].is_reference]
        # a referenced file goes where the referenced step holds it, below the node's directory
        refs = [replace(t, path=below_node(t.path)) for t in plan if entries[t.path].is_reference]
        below = {below_node(p): replace(e, path=below_node(p)) for p, e in entries.items() if e.is_reference}

        def fetch() -> int:
            n = run_transfers(files, self.rank, here, entries, m.chunk_size, None)
            n += run_transfers(refs, self.rank, self.storage, below, m.chunk_size, None)
            if self.rank == nodes.leader(self.node):
                put_manifest(here, data)  # the agreed copy, where this node's is gone or damaged
            return n

        flag = LossFlag.for_group(None, f"fetch/{save_id}/{next(FETCHES)}")
        try:
            agree(fetch, f"assembly of local step {step}", None, flag=flag)
        except CollectiveError as e:
            if lost_contact(e):
                raise
            return f"fetching from peers failed: {e}"
        return Assembled(here.url, len(plan), peers, f"direct/{save_id}/{next(FETCHES)}", m)


def planned_bytes(job: SaveJob) -> int:
    """About the bytes ``job`` writes on this rank (headers aside: an allowance for them)."""
    n = HEADER_ALLOWANCE
    for kinds in job.shards.values():
        n += sum(t.numel() * t.element_size() for t in kinds.values())
    n += sum(t.numel() * t.element_size() for t in job.rank_state.values())
    n += sum(t.numel() * t.element_size() for t in job.buffers.values())
    return n
