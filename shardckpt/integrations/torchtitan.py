"""torchtitan's checkpoint manager over shardckpt, plugged in from the user's side (no patching).

:class:`ShardckptCheckpointManager` is a subclass of torchtitan's DCP ``CheckpointManager``
(``torchtitan.components.checkpointer``, tested with torchtitan 0.3.0). It keeps torchtitan's
policy (interval, ``last_step``, ``load_step``, ``exclude_from_loading``, ``async_mode``, model-only
first and last checkpoints) and changes where the bytes go. Its nested ``Config`` is a
``checkpoint`` section of torchtitan's ``Trainer.Config``, so the trainer builds it as it builds its
own::

    from shardckpt.integrations.torchtitan import ShardckptCheckpointManager, shardckpt_config

    config.checkpoint = ShardckptCheckpointManager.Config(
        enable=True, folder="s3://bucket/run", interval=500, keep_latest_k=3)
    config.checkpoint = shardckpt_config(config.checkpoint)     # or: keep every other setting

What it overrides (torchtitan's seams; its files are untouched):

- ``dcp_save``: every save, synchronous or ``async_mode="async"`` / ``"async_with_pinned_mem"``
  (the last needs CUDA; it is not tested on CPU), writes through
  :class:`~shardckpt.interop.dcp.storage.ShardckptWriter`: CRC32C on every byte, the create-only
  ``manifest.json`` as the commit, fsspec URLs with shardckpt's retries.
- ``dcp_load``: every load reads through :class:`~shardckpt.interop.dcp.storage.ShardckptReader`
  with :class:`~shardckpt.interop.dcp.plain_bytes.PlainBytesLoadPlanner`: values that are not
  tensors load only as ``torch.load(weights_only=True)`` allows, and ``bytes`` among them (the
  data loader's ``dp_rank_<r>``, which torchtitan hands to ``pickle.loads``) only if they are a
  pickle of plain data that names no class or function; anything else is one
  :class:`~shardckpt.errors.UnsafePickleError` naming the value, before any state sees it.
  ``allow_pickle=True`` (warned once) is for runs whose every writer you trust.
- ``_create_checkpoint_id``: ``<folder>/step-00000100``, so that the folder is a shardckpt run
  directory (:mod:`shardckpt.checkpoint.run_dir`): ``latest``, and every ``shardckpt`` command
  (``verify``, ``inspect``, ``reshard``, ``consolidate``, ``clean``) on it or on a step.
- ``_find_load_step``: the newest *committed* checkpoint that passes the run directory's check
  (manifest parses, every file present with its size; every checksum with ``full_verify``),
  chosen alike on every rank by the one resume policy
  (:func:`~shardckpt.checkpoint.resume_policy.pick_committed`); a save that never committed is
  skipped, whatever its name.
- ``_purge_stale_checkpoints``: nothing at save time. When a save commits (synchronous: on
  return; asynchronous: when its future completes), rank 0's retention thread moves ``latest``
  to it and keeps the newest ``keep_latest_k`` committed checkpoints, deleting the others with
  shardckpt's confined deletes (manifest first, nothing outside the folder, no link followed).
  Uncommitted directories neither count nor are deleted (``shardckpt clean`` removes them).

The Hugging Face paths stay torchtitan's: ``last_save_in_hf`` writes safetensors for inference
(an export, not a resumable checkpoint) and ``initial_load_in_hf`` reads them.

torchtitan is imported when :class:`ShardckptCheckpointManager` is first named (this module
imports without it): the class lives at module level in :mod:`.torchtitan_manager`, which imports
torchtitan.
"""

from __future__ import annotations

from dataclasses import fields
from typing import TYPE_CHECKING, Any
from collections.abc import Mapping

from shardckpt.errors import ConfigError

__all__ = ["ShardckptCheckpointManager", "shardckpt_config"]

if TYPE_CHECKING:
    #: built on first use (module ``__getattr__``): torchtitan is imported then
    ShardckptCheckpointManager: Any

_built: dict[str, type] = {}


def __getattr__(name: str) -> Any:
    if name == "ShardckptCheckpointManager":
        if name not in _built:
            _built[name] = _build_manager()
        return _built[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def shardckpt_config(checkpoint: Any, *, storage_options: Mapping[str, Any] | None = None,
                     full_verify: bool = False, allow_pickle: bool = False) -> Any:
    """``checkpoint`` (a torchtitan ``CheckpointManager.Config``, e.g. ``trainer_config.checkpoint``)
    as a :class:`ShardckptCheckpointManager` ``Config`` with the same settings."""
    cls = __getattr__("ShardckptCheckpointManager")
    base = cls.__mro__[1].Config
    if not isinstance(checkpoint, base):
        raise ConfigError(f"shardckpt_config: expected torchtitan's CheckpointManager.Config, "
                          f"got {type(checkpoint).__name__}")
    same = {f.name: getattr(checkpoint, f.name) for f in fields(base) if f.init}
    return cls.Config(**same, storage_options=dict(storage_options or {}),
                      full_verify=full_verify, allow_pickle=allow_pickle)


def _build_manager() -> type:
    """The class of :mod:`.torchtitan_manager` (torchtitan is imported with it), named as this
    module's attribute, so that pickle and torchtitan's config tools find it here."""
    from shardckpt.integrations.torchtitan_manager import ShardckptCheckpointManager as cls

    cls.__module__ = cls.Config.__module__ = __name__
    cls.__qualname__ = "ShardckptCheckpointManager"
    cls.Config.__qualname__ = "ShardckptCheckpointManager.Config"
    return cls
