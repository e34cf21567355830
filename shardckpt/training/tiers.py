"""The node-local tier of a :class:`~shardckpt.training.checkpointer.Checkpointer`: save to it,
copy each rank's files to its peers, commit on every node, copy to the durable tier from it, and
resume from the newest checkpoint that can be assembled from any tier.

Save (every ``LocalTier.every`` steps), on every rank:

1. in the caller's thread: each rank writes its files (shard, rank state; buffers on rank 0)
   straight from the live tensors into its node's directory, and the ranks exchange the file
   entries (size, CRC32C per chunk); with HSDP, the replicas that write nothing compare their
   chunk CRCs with the writers' (:mod:`shardckpt.checkpoint.replica_check`: a mismatch fails
   the save on every rank, and no node commits it); then training may go on. With
   ``async_save`` this step runs in the background thread too: ``save()`` returns once the
   small state is snapshotted (buffers, per-rank state), the next forward and backward overlap
   the write, and the optimizer's next update waits until the files are written (the node's
   file is the staging copy: no staging buffer is taken for it);
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
where the local write failed, from the node directories where only the peer copy did; with
``async_save``, from the live shards before the next update, which waits for it).

Resume: :class:`~shardckpt.training.node_resume.LocalSource`, this tier's candidates for the one
resume policy (:mod:`shardckpt.checkpoint.resume_policy`).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import replace
from typing import Any
from collections.abc import Mapping

from shardckpt.checkpoint.collective import agree, failed_with
from shardckpt.checkpoint import manifest_memo
from shardckpt.checkpoint.loss_flag import LossFlag
from shardckpt.checkpoint.node_files import newest_committed, prune
from shardckpt.checkpoint.reader import as_storage
from shardckpt.checkpoint.run_dir import step_dir
from shardckpt.checkpoint.tiers import (
    HEADER_ALLOWANCE, LocalTier, Transfer, as_full, commit_node, ensure_room,
)
from shardckpt.checkpoint.writer import CheckpointWriter, new_save_id
from shardckpt.errors import (
    CollectiveError, InsufficientSpaceError, ReplicaMismatchError, ShardckptError,
)
from shardckpt.format.manifest import MANIFEST_NAME, Manifest
from shardckpt.training.durable_tier import DurableTier
from shardckpt.training.node_durable import LocalSave, copy_to_durable
from shardckpt.training.node_resume import LocalSource
from shardckpt.training.node_spare import NodeSpare
from shardckpt.training.peer_checks import report_entries
from shardckpt.training.peer_copy import run_transfers
from shardckpt.training.run_state import RunState
from shardckpt.training.save_executor import Pending
from shardckpt.training.save_load import SaveJob
from shardckpt.training.tier_guard import foreign_steps, private_node, run_identity

log = logging.getLogger(__name__)


class NodeTier:
    """This rank's view of the local tier: its node, its peers, its node's directory; a
    :class:`~shardckpt.training.tier.Tier` whose saves also do ``durable``'s part where it is
    due at the same step (copied from the node directories)."""

    name = "local"

    def __init__(self, tier: LocalTier, state: RunState, group: Any, run_url: str,
                 durable: DurableTier | None = None, background: bool = False) -> None:
        rank = state.rank
        self.tier, self.rank, self.group, self.state, self.durable = tier, rank, group, state, durable
        self.background = background  # async: the files are written in the background too
        self.run = run_identity(run_url)
        self.nodes = tier.topology(state.world_size)
        self.node = self.nodes.node_of(rank)
        self.storage = private_node(tier, self.node, group)
        self.enabled = True
        self.spare = NodeSpare(tier, self.storage, rank, state.engine) if tier.preallocate else None
        if tier.peers and self.nodes.count < 2 and rank == 0:
            log.warning("local tier: one node (%d ranks per node); no peer copies, so a node lost "
                        "is recovered from the durable tier only", self.nodes.ranks_per_node)

    def url_for(self, step: int) -> str:
        return self.storage.url_of(step_dir(step))

    def turn_off(self, why: str) -> None:
        if self.enabled and self.rank == 0:
            log.warning("local tier turned off, saves go to the durable tier only: %s", why)
        self.enabled = False
        self.close()

    def under_way(self) -> None:
        """Start the first spare file, if it is not (the run has resumed, or saves)."""
        if self.spare is not None and self.enabled:
            self.spare.start()

    def close(self) -> None:
        """Give back the spare file, if any."""
        if self.spare is not None:
            self.spare.close()

    # ------------------------------------------------------------------------------ save

    def due(self, step: int) -> bool:
        return self.enabled and step % self.tier.every == 0

    def extras(self) -> dict[str, Any]:
        """The run's identity in every save's extras while the tier is on (:mod:`.tier_guard`)."""
        return {"run": self.run} if self.enabled else {}

    def save(self, step: int, ext: Mapping[str, Any]) -> Pending | None:
        """Write ``step`` to the node directories; what is pending: the peer copies, the commit
        and (where the durable tier is due too) the durable copy. None where not due, or a node
        is full (the tier is then off, and the durable save, if due, is the next tier's).
        ``background`` (async): the write is pending too, and stages (a full node found there
        is handled there, :meth:`_from_memory`)."""
        if not self.due(step):
            return None
        job = self.state.begin(self.url_for(step), ext, None, self.group)
        durable = self.durable if self.durable is not None and self.durable.due(step) else None
        name = f"shardckpt-tiers-{step}"
        if not self.background:
            written = self.write(job, step)
            if written is None:
                return None
            return Pending(lambda staged: self._finish(written, durable), name)

        def work(staged: threading.Event) -> Manifest | None:  # the next update waits for the files
            try:
                written = self.write(job, step)
                if written is None:  # the node is full (the tier is off): the durable save, if due
                    return self._from_memory(job, step, durable) if durable is not None else None
            finally:
                staged.set()
            return self._finish(written, durable)

        return Pending(work, name, stages=True)

    def _from_memory(self, job: SaveJob, step: int, durable: DurableTier) -> Manifest:
        """The durable save of ``step`` from the live shards, where the node had no room for it
        (before the next update: it waits), with the snapshot ``job`` took at the save's call
        (buffers, per-rank state)."""
        url = durable.manager.url_for(step)
        again = replace(job, storage=as_storage(url, self.state.storage_options),
                        previous=durable.manager.latest_url())
        return durable.finish(again, step)

    def _finish(self, written: LocalSave, durable: DurableTier | None) -> Manifest:
        local = self.commit(written)
        m = local
        if durable is not None:
            step = written.step
            try:
                m = self.copy_to_durable(written, durable.manager.url_for(step),
                                         self.state.storage_options)
            except CollectiveError:
                durable.after_loss(step)
                raise
            finally:
                if local is None:  # the peer copy found no room: nothing committed locally
                    self.discard(written.step)
            durable.committed(step)
        elif local is None:
            self.discard(written.step)
        if local is not None and self.spare is not None and self.enabled:
            self.spare.after_save(sum(e.size for e in written.by_rank.get(self.rank, [])
                                      if e.role == "shard"))
        return m if m is not None else written.writer.manifest(written.entries)

    def source(self, full_verify: bool, strict: bool) -> LocalSource:
        """This tier's resume candidates (``full_verify`` is the durable tier's: a local step's
        every chunk is checked as it loads). Each resume validates the manifests it finds, as a
        job started afresh would: none is taken from this process's earlier reads."""
        manifest_memo.forget()
        return LocalSource(self, self.state, strict)

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
        writer.spare = self.spare.spare if self.spare is not None else None

        def write() -> list[dict[str, Any]]:
            try:
                spare = self.spare.nbytes if self.spare is not None else 0
                ensure_room(self.tier, self.storage, planned_bytes(job) - spare, f"local save of step {step}")
                if job.replicas is not None:  # HSDP: a replica that writes nothing takes its CRCs
                    job.replicas.take(save_id)
                files = job.write_files(writer)
                if self.spare is not None:
                    self.spare.drop_unused()
                return files
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
        if job.replicas is not None:  # HSDP: ReplicaMismatchError on every rank, nothing committed
            try:
                job.replicas.compare(save_id, LocalSave(step, writer, by_rank).entries, job.url, self.group)
            except ReplicaMismatchError:
                self.discard(step)
                raise
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
        """Commit ``save`` at ``url`` from the node directories (:func:`.node_durable.copy_to_durable`)."""
        return copy_to_durable(self.storage, self.group, self.rank, save, url, storage_options)


def planned_bytes(job: SaveJob) -> int:
    """About the bytes ``job`` writes on this rank (headers aside: an allowance for them)."""
    n = HEADER_ALLOWANCE
    for kinds in job.shards.values():
        n += sum(t.numel() * t.element_size() for t in kinds.values())
    n += sum(t.numel() * t.element_size() for t in job.rank_state.values())
    n += sum(t.numel() * t.element_size() for t in job.buffers.values())
    return n
