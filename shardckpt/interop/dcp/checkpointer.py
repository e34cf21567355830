"""``latest``, retention and resume for a plain FSDP2 training loop that saves through DCP.

:class:`DcpCheckpointer` saves each step with :class:`shardckpt.interop.dcp.storage.ShardckptWriter`
into a run directory (:class:`shardckpt.checkpoint.run_dir.CheckpointManager`) and loads the newest
good checkpoint with :class:`~shardckpt.interop.dcp.storage.ShardckptReader`.

Values that are not tensors load only if ``torch.load(weights_only=True)`` loads them: the reader
checks each one and the load planner
(:class:`~shardckpt.interop.dcp.storage.WeightsOnlyLoadPlanner`) decodes them with
``weights_only=True``. ``allow_pickle=True`` turns both off, for runs whose every
checkpoint comes from a writer you trust: loading then runs whatever code a value names.
"""

from __future__ import annotations

import logging
from typing import Any
from collections.abc import Mapping

from shardckpt.checkpoint.collective import rank_and_world
from shardckpt.checkpoint.resume_policy import LOADED, PASSED, Candidate, Outcome, pick_committed
from shardckpt.errors import ShardckptError, UnsafePickleError
from shardckpt.interop.dcp.storage import ShardckptReader, ShardckptWriter, WeightsOnlyLoadPlanner
from shardckpt.format.records import RunExtras

log = logging.getLogger(__name__)

__all__ = ["DcpCheckpointer"]


class DcpCheckpointer:
    """``latest``, keep-last-K and resume for a plain FSDP2 training loop over DCP.

    Checkpoints go to ``<run>/step-<step>/`` (:class:`shardckpt.checkpoint.run_dir.CheckpointManager`);
    after a save commits, rank 0 moves ``latest`` and applies retention. :meth:`load_latest`
    loads the newest committed checkpoint that passes the manager's check and loads cleanly,
    skipping uncommitted and damaged ones; every rank makes the same choice. A checkpoint holding
    a value ``torch.load(weights_only=True)`` refuses is not skipped: :meth:`load_latest` raises
    :class:`~shardckpt.errors.UnsafePickleError` (falling back to an older step would hide
    both a hostile checkpoint and one that needs ``torch.serialization.add_safe_globals``).
    ``allow_pickle=True`` loads such values, running the code they name: trusted runs only.

        ckpt = DcpCheckpointer("s3://bucket/run", keep_last=3)
        start = ckpt.load_latest(state_dict) or 0
        ...
        ckpt.save(step, state_dict)
    """

    def __init__(self, run_url: str, keep_last: int | None = None,
                 storage_options: Mapping[str, Any] | None = None, async_save: bool = False,
                 full_verify: bool = False, allow_pickle: bool = False) -> None:
        from shardckpt.checkpoint.run_dir import CheckpointManager

        self.manager = CheckpointManager(run_url, keep_last, storage_options)
        self.storage_options = dict(storage_options or {})
        self.async_save, self.full_verify = async_save, full_verify
        self.allow_pickle = bool(allow_pickle)
        self._pending: tuple[int, Any] | None = None

    def save(self, step: int, state_dict: dict[str, Any]) -> None:
        """Save ``state_dict`` as step ``step`` (collective); async saves finish in the background
        and are marked committed at the next :meth:`save` or :meth:`wait`."""
        import torch.distributed.checkpoint as dcp

        self.wait()
        writer = ShardckptWriter(self.manager.url_for(step), self.storage_options,
                                 extras=RunExtras(step=step).to_doc(), replace_existing=True)
        if self.async_save:
            self._pending = (step, dcp.async_save(state_dict, storage_writer=writer))
            return
        dcp.save(state_dict, storage_writer=writer)
        self._committed(step)

    def wait(self) -> None:
        """Finish a pending async save and move ``latest`` to it."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending[1].result()
            self._committed(pending[0])

    close = wait

    def _committed(self, step: int) -> None:
        if rank_and_world()[0] == 0:
            self.manager.mark_committed(step)

    def load_latest(self, state_dict: dict[str, Any]) -> int | None:
        """Load the newest good checkpoint into ``state_dict`` (collective); its step, or None."""
        found = pick_committed(self.manager, self.full_verify, lambda c: self._load(c, state_dict))
        return found.step if found is not None else None

    def _load(self, c: Candidate, state_dict: dict[str, Any]) -> Outcome:
        """``dcp.load`` of ``c`` into ``state_dict``: passed over where it fails with shardckpt's
        errors only; a value ``weights_only`` refuses is raised (see the class docstring)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.api import CheckpointException

        reader = ShardckptReader(c.url, self.storage_options, allow_pickle=self.allow_pickle)
        planner = None if self.allow_pickle else WeightsOnlyLoadPlanner()
        try:
            dcp.load(state_dict, storage_reader=reader, planner=planner)
            return Outcome(LOADED)
        except CheckpointException as e:
            unsafe = [exc for exc, _ in e.failures.values() if isinstance(exc, UnsafePickleError)]
            if unsafe:
                raise unsafe[0] from e
            if not all(isinstance(exc, ShardckptError) for exc, _ in e.failures.values()):
                raise
            why = str(next(iter(e.failures.values()))[0])
            log.warning("skipping %s: %s", c.url, why)
            return Outcome(PASSED, why)
