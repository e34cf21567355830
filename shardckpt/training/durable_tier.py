"""The durable tier of a :class:`~shardckpt.training.checkpointer.Checkpointer`: the run directory
(``<run>/step-XXXXXXXX``, ``latest``, retention: :class:`~shardckpt.checkpoint.run_dir.CheckpointManager`).

A save from memory: synchronous, or async (the shards are copied into a staging buffer in the
background, then written and committed over the Checkpointer's own process group). Once a save
commits, rank 0 points ``latest`` at it and applies retention; a rank lost during the final
exchange may leave a committed checkpoint, which ``latest`` then names too. Resume: the run's
committed checkpoints (:class:`~shardckpt.checkpoint.resume_policy.RunDirSource`), put aside
when a resume passes over them.
"""

from __future__ import annotations

import logging
import threading
from functools import partial
from typing import Any
from collections.abc import Mapping

from shardckpt.checkpoint.collective import failed_with
from shardckpt.checkpoint.resume_policy import LOADED, Candidate, Outcome, RunDirSource, damaged
from shardckpt.checkpoint.run_dir import CheckpointManager
from shardckpt.errors import CollectiveError, IntegrityError, ShardckptError
from shardckpt.format.manifest import Manifest
from shardckpt.training.run_state import RunState
from shardckpt.training.save_executor import Pending
from shardckpt.training.save_load import SaveJob
from shardckpt.training.staging import Staging

log = logging.getLogger(__name__)


class DurableTier:
    """The run directory as a tier: due every ``every`` steps (None: every save)."""

    name = "durable"

    def __init__(self, manager: CheckpointManager, state: RunState, every: int | None,
                 group: Any, stager: Staging | None) -> None:
        self.manager, self.state, self.every, self.group = manager, state, every, group
        self.stager = stager  # async saves: the host copies of the shards

    def due(self, step: int) -> bool:
        return self.every is None or step % self.every == 0

    def extras(self) -> dict[str, Any]:
        return {}

    def _offload_snapshot(self) -> tuple[set[str], Any]:
        """The optimizer's offload snapshot (nvme): its groups and the empty snapshot."""
        opt = getattr(self.state.engine, "optimizer", None)
        snap = getattr(opt, "offload_snapshot", lambda: None)()
        return snap if snap is not None else (set(), None)

    def save(self, step: int, ext: Mapping[str, Any]) -> Pending | None:
        """Begin the save of ``step`` from memory (staged, where async), or None if not due."""
        if not self.due(step):
            return None
        staging, snapshot, on_disk = None, None, set[str]()
        engine, stager = self.state.engine, self.stager
        if stager is not None:
            on_disk, snapshot = self._offload_snapshot()
        try:
            if stager is not None:
                staging = stager.get(engine.local_shards(), on_disk, wait=False)
            job = self.state.begin(self.manager.url_for(step), ext, self.state.storage_options,
                                   self.group, staging=staging, snapshot=snapshot,
                                   previous=self.manager.latest_url())
        except BaseException:
            if snapshot is not None:
                snapshot.remove()
            raise
        if stager is None:
            return Pending(lambda staged: self.finish(job, step), f"shardckpt-save-{step}",
                           background=False)

        def work(staged: threading.Event) -> Manifest:
            try:
                try:
                    if job.staging is None and job.shard is not None:
                        job.staging = stager.get(engine.local_shards(), on_disk, True)
                    job.stage()
                finally:  # without staging (max_staging_bytes), updates wait for the write
                    if job.staging is not None or job.shard is None:
                        staged.set()
                return self.finish(job, step)
            finally:
                staged.set()
                job.release()  # the offload snapshot, if any

        return Pending(work, f"shardckpt-save-{step}", stages=True)

    def finish(self, job: SaveJob, step: int) -> Manifest:
        """Run ``job`` (write and commit), then move ``latest`` to it."""
        try:
            m = job.run()
        except CollectiveError:
            self.after_loss(step)
            raise
        self.committed(step)
        return m

    def committed(self, step: int) -> None:
        """Rank 0: ``latest`` names committed ``step``; retention applies."""
        if self.state.rank == 0:
            self.manager.mark_committed(step)

    def after_loss(self, step: int) -> None:
        """Rank 0, after a rank was lost in a save of ``step``: a save that committed all the
        same is what resume picks, so ``latest`` must name it too."""
        if self.state.rank != 0:
            return
        try:
            if self.manager.is_committed(step):
                self.manager.mark_committed(step)
        except ShardckptError as e:
            log.warning("could not point latest at %s: %s", self.manager.url_for(step), e)

    # ---------------------------------------------------------------------------- resume

    def source(self, full_verify: bool, strict: bool) -> RunDirSource:
        return RunDirSource(self.manager, full_verify=full_verify,
                            needs_optimizer=self.state.needs_optimizer,
                            load=partial(self._load, strict), settle=True)

    def under_way(self) -> None:
        """Nothing to prepare."""

    def close(self) -> None:
        """Nothing held for later saves."""

    def _load(self, strict: bool, c: Candidate) -> Outcome:
        try:
            self.state.load(c.url, strict=strict)
        except CollectiveError as e:
            if not failed_with(e, IntegrityError):
                raise
            return damaged(e, c.url)
        return Outcome(LOADED)
