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
  chosen on rank 0 and broadcast; a save that never committed is skipped, whatever its name.
- ``_purge_stale_checkpoints``: nothing at save time. When a save commits (synchronous: on
  return; asynchronous: when its future completes), rank 0's retention thread moves ``latest``
  to it and keeps the newest ``keep_latest_k`` committed checkpoints, deleting the others with
  shardckpt's confined deletes (manifest first, nothing outside the folder, no link followed).
  Uncommitted directories neither count nor are deleted (``shardckpt clean`` removes them).

The Hugging Face paths stay torchtitan's: ``last_save_in_hf`` writes safetensors for inference
(an export, not a resumable checkpoint) and ``initial_load_in_hf`` reads them.

torchtitan is imported when :class:`ShardckptCheckpointManager` is first named (this module
imports without it).
"""

from __future__ import annotations

import logging
import posixpath
import queue
import re
import threading
from concurrent.futures import Future
from dataclasses import fields
from typing import TYPE_CHECKING, Any
from collections.abc import Callable, Mapping

from shardckpt.checkpoint.run_dir import STEP_DIR, CheckpointManager as RunDir, step_dir
from shardckpt.errors import ConfigError, IncompleteCheckpointError, ShardckptError, UnsafePickleError
from shardckpt.format.records import RunExtras

log = logging.getLogger(__name__)

__all__ = ["ShardckptCheckpointManager", "shardckpt_config"]

if TYPE_CHECKING:
    #: built on first use (module ``__getattr__``): torchtitan is imported then
    ShardckptCheckpointManager: Any

#: The torchtitan ``CheckpointManager`` hooks this integration overrides; each must exist in the
#: installed torchtitan (checked when the class is built), or the seams have moved.
HOOKS = ("dcp_save", "dcp_load", "_create_checkpoint_id", "_find_load_step",
         "_purge_stale_checkpoints", "_close")

#: A directory name torchtitan's own manager writes (``step-100``), for the hint on a folder
#: that holds only those.
TITAN_STEP = re.compile(r"^step-([0-9]+)\Z")

_built: dict[str, type] = {}

PICKLE_HINT = ("If every writer of this folder is trusted, set checkpoint.allow_pickle=True "
               "(shardckpt_config(..., allow_pickle=True)), which runs whatever code they name; "
               "or leave the data loader out with exclude_from_loading=['dataloader']")


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


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _broadcast_int(value: int) -> int:
    """Rank 0's ``value`` on every rank (a tensor: nothing is pickled)."""
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return value
    backend = str(dist.get_backend())
    on_gpu = "nccl" in backend and "gloo" not in backend
    t = torch.tensor([value], dtype=torch.int64,
                     device=torch.device("cuda", torch.cuda.current_device()) if on_gpu else "cpu")
    dist.broadcast(t, 0)
    return int(t.item())


def _then(fut: Future, after: Callable[[], None]) -> Future:
    """A future that completes like ``fut``, once ``after`` has run (only if ``fut`` succeeded)."""
    out: Future = Future()

    def done(f: Future) -> None:
        try:
            value = f.result()
            after()
        except BaseException as e:  # noqa: BLE001 - handed on to whoever waits on ``out``
            out.set_exception(e)
        else:
            out.set_result(value)

    fut.add_done_callback(done)
    return out


def _retention_loop(work: queue.Queue, run: RunDir) -> None:
    """Rank 0: for each committed step, move ``latest`` and apply retention; ``None`` stops."""
    while True:
        step = work.get()
        if step is None:
            return
        try:
            run.mark_committed(step)
        except (ShardckptError, OSError) as e:
            log.warning("checkpoint step %d: latest and retention skipped: %s", step, e)


def _foreign_steps(run: RunDir) -> list[str]:
    """Directories of ``run`` that torchtitan's own manager (DCP's ``FileSystemWriter``) wrote."""
    return [n for n in run.storage.ls("")
            if TITAN_STEP.match(n) and run.storage.exists(f"{n}/.metadata")]


def _build_manager() -> type:
    import importlib

    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType, AsyncSaveResponse

    try:  # by name: torchtitan ships no type information, so it stays Any for the type checker
        checkpointer = importlib.import_module("torchtitan.components.checkpointer")
        filesystem = importlib.import_module("torchtitan.tools.filesystem")
        GarbageCollection = importlib.import_module("torchtitan.tools.utils").GarbageCollection
    except ImportError as e:
        raise ConfigError(f"shardckpt's torchtitan integration needs torchtitan (0.3.0 tested): {e}. "
                          "Install it with `pip install --no-deps torchtitan==0.3.0` and "
                          "`pip install 'shardckpt[torchtitan]'` (torchtitan's own requirements would move "
                          "fsspec below what s3fs needs)") from e
    from dataclasses import dataclass, field

    MODEL, AsyncMode = checkpointer.MODEL, checkpointer.AsyncMode
    CheckpointManager: Any = checkpointer.CheckpointManager

    from torch.distributed.checkpoint.api import CheckpointException

    from shardckpt.interop.dcp.plain_bytes import PlainBytesLoadPlanner
    from shardckpt.interop.dcp.storage import ShardckptReader, ShardckptWriter

    missing = [h for h in HOOKS if not callable(getattr(CheckpointManager, h, None))]
    if missing:
        raise ConfigError(f"this torchtitan's CheckpointManager has no {', '.join(missing)}: "
                          "shardckpt's integration was built on torchtitan 0.3.0's seams")

    class ShardckptCheckpointManager(CheckpointManager):
        """torchtitan's ``CheckpointManager`` whose every save and load goes through shardckpt
        (module docstring). Built by torchtitan's trainer from :class:`Config`."""

        @dataclass(kw_only=True, slots=True)
        class Config(CheckpointManager.Config):
            storage_options: dict[str, Any] = field(default_factory=dict)
            """fsspec options of the folder's file system for shardckpt's reads and writes
            (torchtitan's own existence checks use fsspec's defaults: the environment)."""

            full_verify: bool = False
            """Whether resume reads every checksum of a checkpoint before picking it."""

            allow_pickle: bool = False
            """Whether values load as DCP loads them (``torch.load(weights_only=False)``) and
            the data loader's pickled state is handed on unread: only for a folder whose every
            writer you trust (warned once). Without it, that state must be plain data."""

            def __post_init__(self) -> None:
                CheckpointManager.Config.__post_init__(self)
                if not isinstance(self.storage_options, dict):
                    raise ConfigError("checkpoint.storage_options must be a mapping of fsspec "
                                      f"options, got {type(self.storage_options).__name__}")

        def __init__(self, config: Config, **kwargs: Any) -> None:
            super().__init__(config, **kwargs)
            if not self.enable:
                return
            self.storage_options = dict(config.storage_options)
            self.full_verify, self.allow_pickle = config.full_verify, config.allow_pickle
            self.pickle_warned = False
            self.run = RunDir(self.folder, self.keep_latest_k or None, self.storage_options)
            # torchtitan's purge thread deletes what it lists; ours moves ``latest`` and keeps
            # the newest committed checkpoints, in the same attributes so that close() ends it
            old: threading.Thread | None = getattr(self, "purge_thread", None)
            if old is not None:
                self.purge_queue.put(None)
                old.join()
                self.purge_thread = None
            if _rank() == 0:
                self.purge_queue: queue.Queue[int | None] = queue.Queue()
                self.purge_thread = threading.Thread(target=_retention_loop,
                                                     args=(self.purge_queue, self.run),
                                                     name="shardckpt-retention", daemon=True)
                self.purge_thread.start()

        # ------------------------------------------------------------------ save and load

        @torch.no_grad()
        def dcp_save(self, state_dict: dict[str, Any], checkpoint_id: str, async_mode: Any,
                     enable_garbage_collection: bool = False, to_hf: bool = False) -> Any:
            if to_hf:  # safetensors for inference through torchtitan's HF writer: an export
                return super().dcp_save(state_dict, checkpoint_id, async_mode,
                                        enable_garbage_collection, to_hf)
            name = posixpath.basename(str(checkpoint_id).rstrip("/"))
            m = STEP_DIR.match(name)
            step = int(m.group(1)) if m else None
            writer = ShardckptWriter(checkpoint_id, self.storage_options, replace_existing=True,
                                     extras=RunExtras(step=step).to_doc() if m else None)
            committed = self._committed_hook(step)
            ret: Any
            if async_mode == AsyncMode.ASYNC:
                fut = dcp.async_save(state_dict, storage_writer=writer, process_group=self.pg)
                assert isinstance(fut, Future)  # the thread executor's future
                ret = _then(fut, committed)
            elif async_mode == AsyncMode.ASYNC_WITH_PINNED_MEM:
                resp = dcp.async_save(state_dict, storage_writer=writer, process_group=self.pg,
                                      async_checkpointer_type=AsyncCheckpointerType.PROCESS,
                                      async_stager=self.stager)
                assert isinstance(resp, AsyncSaveResponse)  # staging and upload futures
                ret = AsyncSaveResponse(staging_completion=resp.staging_completion,
                                        upload_completion=_then(resp.upload_completion, committed))
            else:
                dcp.save(state_dict, storage_writer=writer)
                committed()
                ret = None
            if enable_garbage_collection:
                GarbageCollection.collect("GC collection invoked by checkpointer.")
            return ret

        def _committed_hook(self, step: int | None) -> Callable[[], None]:
            """What runs once the save of ``step`` committed: rank 0 queues it for ``latest``
            and retention (a save outside the step directories only commits)."""
            def hook() -> None:
                if step is not None and _rank() == 0 and self.purge_thread is not None:
                    self.purge_queue.put(step)
            return hook

        def dcp_load(self, state_dict: dict[str, Any], checkpoint_id: str, from_hf: bool,
                     from_quantized: bool) -> None:
            if from_hf:  # Hugging Face safetensors (initial weights): torchtitan's HF reader
                return super().dcp_load(state_dict, checkpoint_id, from_hf, from_quantized)
            reader = ShardckptReader(checkpoint_id, self.storage_options,
                                     allow_pickle=self.allow_pickle)
            if self.allow_pickle and not self.pickle_warned:
                self.pickle_warned = True
                log.warning("%s: allow_pickle=True: values load with torch.load(weights_only=False) "
                            "and the data loader unpickles its state as stored; any code they name "
                            "runs. Only for a folder whose every writer you trust", self.folder)
            planner = None if self.allow_pickle else PlainBytesLoadPlanner(
                str(checkpoint_id), "torchtitan's data loader", PICKLE_HINT)
            try:
                dcp.load(state_dict, storage_reader=reader, planner=planner)
            except CheckpointException as e:  # the refusal itself, not DCP's wrapping of it
                unsafe = [x for x, _ in e.failures.values() if isinstance(x, UnsafePickleError)]
                if unsafe:
                    raise unsafe[0] from e
                raise
            # the model's entries are flattened into state_dict: hand them to the model
            if MODEL in self.states:
                self.states[MODEL].load_state_dict(state_dict)
            return None

        # ------------------------------------------------------------------ the run directory

        def _create_checkpoint_id(self, step: int, folder: str = "") -> str:
            return filesystem.join(folder or self.folder, step_dir(step))

        def _find_load_step(self, folder: str = "") -> int:
            """The newest committed checkpoint of ``folder`` that passes the check, or -1;
            chosen on rank 0 (collective)."""
            run = self.run if not folder or folder == self.folder else \
                RunDir(folder, storage_options=self.storage_options)
            step, error = -1, None
            if _rank() == 0:
                try:
                    found = run.resume_point(self.full_verify)
                    step = found.step if found is not None else -1
                    foreign = _foreign_steps(run) if step < 0 else []
                    if foreign:
                        newest = max(foreign, key=lambda n: int(n[len("step-"):]))
                        target = step_dir(int(newest[len("step-"):]))
                        raise IncompleteCheckpointError(
                            f"{run.url} holds {len(foreign)} checkpoints of torchtitan's own "
                            f"manager (DCP .metadata, newest {newest}) and no committed shardckpt "
                            f"checkpoint; convert it with `shardckpt import dcp {run.url}/{newest} "
                            f"{run.url}/{target}`, or use another checkpoint.folder")
                except ShardckptError as e:
                    error, step = e, -2
            step = _broadcast_int(step)
            if error is not None:
                raise error
            if step == -2:
                raise IncompleteCheckpointError(f"rank 0 found no checkpoint to resume from in "
                                                f"{run.url} (its log says why)")
            return step

        def _purge_stale_checkpoints(self) -> None:
            """Nothing here: retention runs when each save commits (class docstring)."""

        def _close(self) -> None:
            # an async save still in flight must commit (and reach the retention thread)
            # before that thread stops
            pending = getattr(self, "save_future", None)
            if pending is not None:
                try:
                    pending.result()
                except Exception as e:  # noqa: BLE001 - close() must still stop the threads
                    log.error("checkpoint save in flight at close failed: %s", e)
                self.save_future = None
            super()._close()

    # named as this module's attribute, so that pickle and torchtitan's config tools find them
    ShardckptCheckpointManager.__module__ = ShardckptCheckpointManager.Config.__module__ = __name__
    ShardckptCheckpointManager.__qualname__ = "ShardckptCheckpointManager"
    ShardckptCheckpointManager.Config.__qualname__ = "ShardckptCheckpointManager.Config"
    return ShardckptCheckpointManager
