"""torchtitan's checkpoint manager over shardckpt: the class itself (what it overrides, and why:
:mod:`shardckpt.integrations.torchtitan`, the module to import it from).

This module imports torchtitan when it is imported: :mod:`shardckpt.integrations.torchtitan`
imports it the first time ``ShardckptCheckpointManager`` is named, so that module imports
without torchtitan.
"""

from __future__ import annotations

import importlib
import logging
import posixpath
import queue
import re
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any
from collections.abc import Callable

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType, AsyncSaveResponse

from shardckpt.checkpoint.collective import agree, rank_and_world, same_error
from shardckpt.checkpoint.resume_policy import pick_committed
from shardckpt.checkpoint.run_dir import STEP_DIR, CheckpointManager as RunDir, step_dir
from shardckpt.errors import CollectiveError, ConfigError, IncompleteCheckpointError, ShardckptError, UnsafePickleError
from shardckpt.format.records import RunExtras
from shardckpt.interop.dcp.plain_bytes import PlainBytesLoadPlanner
from shardckpt.interop.dcp.storage import ShardckptReader, ShardckptWriter

try:  # by name: torchtitan ships no type information, so it stays Any for the type checker
    checkpointer = importlib.import_module("torchtitan.components.checkpointer")
    filesystem = importlib.import_module("torchtitan.tools.filesystem")
    GarbageCollection = importlib.import_module("torchtitan.tools.utils").GarbageCollection
except ImportError as e:
    raise ConfigError(f"shardckpt's torchtitan integration needs torchtitan (0.3.0 tested): {e}. "
                      "Install it with `pip install --no-deps torchtitan==0.3.0` and "
                      "`pip install 'shardckpt[torchtitan]'` (torchtitan's own requirements would move "
                      "fsspec below what s3fs needs)") from e

log = logging.getLogger(__name__)

MODEL, AsyncMode = checkpointer.MODEL, checkpointer.AsyncMode
CheckpointManager: Any = checkpointer.CheckpointManager

#: The torchtitan ``CheckpointManager`` hooks this integration overrides; each must exist in the
#: installed torchtitan (checked when the class is built), or the seams have moved.
HOOKS = ("dcp_save", "dcp_load", "_create_checkpoint_id", "_find_load_step",
         "_purge_stale_checkpoints", "_close")

#: A directory name torchtitan's own manager writes (``step-100``), for the hint on a folder
#: that holds only those.
TITAN_STEP = re.compile(r"^step-([0-9]+)\Z")

PICKLE_HINT = ("If every writer of this folder is trusted, set checkpoint.allow_pickle=True "
               "(shardckpt_config(..., allow_pickle=True)), which runs whatever code they name; "
               "or leave the data loader out with exclude_from_loading=['dataloader']")


missing = [h for h in HOOKS if not callable(getattr(CheckpointManager, h, None))]
if missing:
    raise ConfigError(f"this torchtitan's CheckpointManager has no {', '.join(missing)}: "
                      "shardckpt's integration was built on torchtitan 0.3.0's seams")


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
        if rank_and_world()[0] == 0:
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
            if step is not None and rank_and_world()[0] == 0 and self.purge_thread is not None:
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
        """The newest committed checkpoint of ``folder`` that passes the check, or -1 (the one
        resume policy, :func:`~shardckpt.checkpoint.resume_policy.pick_committed`; collective)."""
        run = self.run if not folder or folder == self.folder else \
            RunDir(folder, storage_options=self.storage_options)
        found = pick_committed(run, self.full_verify)
        if found is not None:
            return found.step

        def foreign() -> None:  # rank 0 looks; its error is every rank's
            names = _foreign_steps(run) if rank_and_world()[0] == 0 else []
            if names:
                newest = max(names, key=lambda n: int(n[len("step-"):]))
                target = step_dir(int(newest[len("step-"):]))
                raise IncompleteCheckpointError(
                    f"{run.url} holds {len(names)} checkpoints of torchtitan's own manager (DCP "
                    f".metadata, newest {newest}) and no committed shardckpt checkpoint; convert "
                    f"it with `shardckpt import dcp {run.url}/{newest} {run.url}/{target}`, or "
                    "use another checkpoint.folder")
        try:
            agree(foreign, f"search of {run.url} for torchtitan's own checkpoints")
        except CollectiveError as e:
            raise same_error(e, f"resume from {run.url}") from e
        return -1

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

