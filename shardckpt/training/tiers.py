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

from shardckpt.checkpoint.collective import agree, broadcast_bytes, failed_with
from shardckpt.checkpoint.reader import as_storage
from shardckpt.checkpoint.run_dir import Found, step_dir
from shardckpt.checkpoint.tiers import (
    HEADER_ALLOWANCE, LocalTier, Transfer, as_full, commit_node, committed_steps, durable_references,
    ensure_room, fetch_plan, files_needed, held_whole, holdings, prune, put_manifest,
)
from shardckpt.checkpoint.writer import CheckpointWriter, new_save_id
from shardckpt.errors import CollectiveError, InsufficientSpaceError, IntegrityError, ShardckptError
from shardckpt.format.manifest import MANIFEST_NAME, MAX_MANIFEST_BYTES, FileEntry, Manifest
from shardckpt.format.manifest_parse import parse
from shardckpt.storage import iter_file_chunks
from shardckpt.training.abandon import LossFlag, lost_contact, watched_agree
from shardckpt.training.direct_load import direct_ready
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
    (to disk, or in ``peers`` straight into memory during the load), and the loss flag's key
    for that load."""

    url: str
    fetched: int
    peers: list[Transfer]
    flag_key: str


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
        save_id = broadcast_bytes(new_save_id().encode() if self.rank == 0 else None, 0,
                                  self.group).decode()
        job.writer = writer = CheckpointWriter(self.storage.child(step_dir(step)), job.spec, save_id)

        def write() -> list[dict[str, Any]]:
            try:
                ensure_room(self.tier, self.storage, planned_bytes(job), f"local save of step {step}")
                return job.write_files()
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
        plan = sorted((Transfer(e.path, r, p) for r, files in save.by_rank.items() for e in files
                       for p in nodes.peers_of(r, peers)), key=lambda t: (t.src, t.dst, t.path))
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
            watched_agree(copy, f"peer copy of {here.url}", self.group,
                          LossFlag.for_group(self.group, f"peer-copy/{save_id}"), left_behind)
        except CollectiveError as e:
            if not failed_with(e, InsufficientSpaceError):
                raise
            self.turn_off(str(e))
            return None
        m = save.writer.manifest(save.entries)
        mine = set(nodes.ranks_of(self.node))
        held = [e for r in mine for e in save.by_rank.get(r, [])]
        held += [entries[t.path] for t in plan if t.dst in mine]

        def commit() -> None:
            if self.rank == nodes.leader(self.node):
                commit_node(here, m, held)
                for name in prune(self.storage, self.tier.keep, foreign_steps(self.storage, self.run)):
                    log.info("local tier: removed %s", self.storage.url_of(name))

        watched_agree(commit, f"local commit of {here.url}", self.group,
                      LossFlag.for_group(self.group, f"node-commit/{save_id}"))
        if self.rank == 0:
            log.info("local tier: committed step %d on %d node(s) (%d peer cop%s)", save.step,
                     nodes.count, len(plan), "y" if len(plan) == 1 else "ies")
        return m

    def copy_to_durable(self, save: LocalSave, url: str,
                        storage_options: Mapping[str, Any] | None) -> Manifest:
        """Commit ``save`` at ``url`` from the node directories: each rank streams the files it
        wrote, checked against what it wrote; rank 0 commits (collective on the tier's group).
        A frozen file whose entry equals the frozen file of the run's latest committed durable
        checkpoint is not copied: the durable manifest references that file (rank 0 decides, from
        the manifests and the referenced files' sizes, reading none of their bytes). A rank lost
        on the way fails every survivor at once (:func:`watched_agree`)."""
        dst = as_storage(url, storage_options)
        writer = CheckpointWriter(dst, save.writer.spec, save.writer.save_id)
        here = self.storage.child(step_dir(save.step))
        chunk = save.writer.spec.chunk_size
        save_id = save.writer.save_id

        def watched(fn: Any, what: str, key: str) -> list[dict[str, Any]]:
            flag = LossFlag.for_group(self.group, f"{key}/{save_id}")
            return watched_agree(fn, what, self.group, flag)[1]

        def plan() -> dict[str, str] | None:
            if self.rank:
                return None
            return durable_references(dst, save.writer.manifest(save.entries))

        refs: dict[str, str] = {}  # set by the plan, before the copy runs

        def copy() -> None:
            for e in save.by_rank.get(self.rank, []):
                if e.path in refs:
                    continue  # referenced in the previous durable checkpoint: not a byte read
                with dst.writer(e.path, chunk) as w:
                    for piece in iter_file_chunks(here, e.path, COPY_PIECE):
                        w.write(piece)
                    got = w.close()
                if (got[0], got[1], tuple(got[2])) != (e.size, e.crc32c, tuple(e.chunk_crc32c)):
                    raise IntegrityError(f"{here.url_of(e.path)} no longer holds what was written "
                                         f"(size or CRC32C differ); {dst.url} is not committed")

        with writer.lease(hold=self.rank == 0):
            refs = watched(plan, f"durable copy plan of {url}", "durable-plan")[0]["payload"] or {}
            entries = [replace(e, path=refs[e.path]) if e.path in refs else e for e in save.entries]
            watched(copy, f"save to {url}", "durable-copy")
            watched(lambda: writer.commit(entries).save_id if self.rank == 0 else None,
                    f"commit of {url}", "durable-commit")
        if self.rank == 0 and refs:
            log.info("durable copy of step %d: %d frozen file(s) referenced in the previous "
                     "checkpoint, not copied", save.step, len(refs))
        return writer.manifest(entries)

    # ---------------------------------------------------------------------------- resume

    def survey(self, durable: list[int]) -> tuple[list[Any], list[int]]:
        """Every rank's node holdings and rank 0's durable committed steps (collective)."""
        _, reports = agree(lambda: {"held": own_holdings(self.storage, holdings(self.storage), self.run),
                                    "durable": durable},
                           "survey of the checkpoint tiers")
        return [r["payload"]["held"] for r in reports], reports[0]["payload"]["durable"]

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
        data = here.read_limited(MANIFEST_NAME, MAX_MANIFEST_BYTES) if self.rank == holder else None
        data = broadcast_bytes(data, holder)
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
                     and readers[(nodes.node_of(t.dst), t.path)] == 1]
        files = [t for t in plan if t not in peers]

        def fetch() -> int:
            n = run_transfers(files, self.rank, here, entries, m.chunk_size, None)
            if self.rank == nodes.leader(self.node) and not here.exists(MANIFEST_NAME):
                put_manifest(here, data)
            return n

        flag = LossFlag.for_group(None, f"fetch/{save_id}/{next(FETCHES)}")
        try:
            watched_agree(fetch, f"assembly of local step {step}", None, flag)
        except CollectiveError as e:
            if lost_contact(e):
                raise
            return f"fetching from peers failed: {e}"
        return Assembled(here.url, len(plan), peers, f"direct/{save_id}/{next(FETCHES)}")


def planned_bytes(job: SaveJob) -> int:
    """About the bytes ``job`` writes on this rank (headers aside: an allowance for them)."""
    n = HEADER_ALLOWANCE
    for kinds in job.shards.values():
        n += sum(t.numel() * t.element_size() for t in kinds.values())
    n += sum(t.numel() * t.element_size() for t in job.rank_state.values())
    n += sum(t.numel() * t.element_size() for t in job.buffers.values())
    return n


def resume_tiers(ckpt: Any, node: NodeTier, full_verify: bool, strict: bool) -> int:
    """Load the newest checkpoint that can be assembled from the local tier (own copies, then
    peers' copies) or is committed durably; every rank alike. Returns its step, or 0."""
    from shardckpt.checkpoint.collective import is_distributed

    rank, world = ckpt.rank, ckpt.world_size
    manager = ckpt.manager
    durable = [f.step for f in manager.committed()] if rank == 0 else []
    held, durable = node.survey(durable)
    per_node = [held[node.nodes.leader(n)] for n in range(node.nodes.count)]
    local = committed_steps(per_node)
    candidates = sorted([(s, 1, sid) for s, sid in local] + [(s, 0, "") for s in durable],
                        reverse=True)
    passed: list[str] = []
    damaged: list[str] = []
    for step, is_local, save_id in candidates:
        fetched, peers, flag_key = 0, [], None
        if is_local:
            got = node.assemble(step, save_id, held, ckpt.engine.layout, world,
                                direct=lambda m: direct_ready(ckpt.engine, m))
            if isinstance(got, str):
                passed.append(f"local step {step}: {got}")
                if rank == 0:
                    log.warning("local tier: step %d cannot be assembled: %s", step, got)
                continue
            url, fetched, peers, flag_key = got.url, got.fetched, got.peers, got.flag_key
            source = (f"the local tier, {fetched} file(s) from peers" if fetched
                      else "the local tier, each rank's own node")
        else:
            url = manager.url_for(step)
            problem = ""
            if rank == 0:
                problems = manager.check(Found(step, step_dir(step), url), full_verify)
                problem = problems[0] if problems else ""
            if is_distributed():
                problem = broadcast_bytes(problem.encode() if rank == 0 else None, 0).decode()
            if problem:
                passed.append(f"durable step {step}: {problem}")
                if rank == 0:
                    log.warning("skipping %s: %s", url, problem)
                continue
            source = "the durable tier"
        try:
            ckpt.load(url, strict=strict, storage_options={} if is_local else None, direct=is_local,
                      peers=peers, flag_key=flag_key)
        except CollectiveError as e:
            ranks = failed_with(e, IntegrityError)
            if not ranks:
                raise
            damaged.append(f"{url}: {e.failures[ranks[0]]}")
            passed.append(f"{url}: fails its checksums")
            if rank == 0:
                log.warning("%s fails its checksums on rank(s) %s (%s); trying the next "
                            "checkpoint (nothing is deleted)", url, ranks, e.failures[ranks[0]])
            continue
        if rank == 0:
            why = f" (passed over: {'; '.join(passed)})" if passed else ""
            log.info("resumed from %s at step %d: %s%s", source, step, url, why)
        ckpt.last_resume = {"tier": "local" if is_local else "durable", "step": step,
                            "fetched": fetched, "url": url}
        return step
    if damaged:
        raise IntegrityError(f"{manager.url} and the local tier: no checkpoint loads; "
                             f"{len(damaged)} failed their checksums: " + "; ".join(damaged))
    if rank == 0:
        log.info("no checkpoint in the local tier or below %s; starting at step 0", manager.url)
    ckpt.last_resume = {"tier": None, "step": 0, "fetched": 0, "url": None}
    return 0
