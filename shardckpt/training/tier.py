"""The ``Tier`` protocol: one place a :class:`~shardckpt.training.checkpointer.Checkpointer` keeps
checkpoints (:class:`~shardckpt.training.durable_tier.DurableTier`, the run directory;
:class:`~shardckpt.training.tiers.NodeTier`, each node's own directory).

Call order. The Checkpointer holds its tiers, in order of preference (the node tier first), and
one :class:`~shardckpt.training.save_executor.SaveExecutor`; control goes one way, from the
Checkpointer to a tier to what the tier was built with (the run's
:class:`~shardckpt.training.run_state.RunState`, the tiers after it), never back up.

* ``save(step)``: where any tier is ``due(step)``, the extras of the save (each tier's
  ``extras()`` among them) are built once; then each tier in turn is asked to ``save(step, ext)``
  until one takes it (returns a :class:`~shardckpt.training.save_executor.Pending`; None: not due,
  or it cannot, e.g. a node tier out of room). The executor runs what is pending. A tier that
  takes a save due in a later tier too does that tier's part (the node tier copies to the
  durable tier from the node directories).
* ``resume()``: each tier's ``source(full_verify, strict)`` goes to
  :func:`~shardckpt.checkpoint.resume_policy.resume_newest`, the one resume policy.
* ``under_way()``: at a ``save(step)`` that saves nothing: the run is training, and a tier may
  prepare for its saves in the background (the node tier's first spare file; not earlier, so
  that nothing competes with a resume, nor with a save's own write).
* ``close()``: after the last save is done; a tier gives back what it holds for later saves
  (the node tier's spare file).
"""

from __future__ import annotations

from typing import Any, Protocol
from collections.abc import Mapping

from shardckpt.checkpoint.resume_policy import ResumeSource
from shardckpt.training.save_executor import Pending


class Tier(Protocol):
    """Where a Checkpointer keeps checkpoints: save a step (to something pending), and offer
    candidates for resume (module docstring)."""

    name: str
    #: the Checkpointer's own process group (None: one process, or the Checkpointer is closed)
    group: Any

    def due(self, step: int) -> bool: ...

    def extras(self) -> dict[str, Any]: ...

    def save(self, step: int, ext: Mapping[str, Any]) -> Pending | None: ...

    def source(self, full_verify: bool, strict: bool) -> ResumeSource: ...

    def under_way(self) -> None: ...

    def close(self) -> None: ...
