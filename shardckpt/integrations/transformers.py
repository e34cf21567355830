"""Checkpoints of a Hugging Face ``Trainer`` run written and resumed through shardckpt.

::

    from transformers import Trainer
    from shardckpt.integrations.transformers import ShardckptTrainerMixin

    class MyTrainer(ShardckptTrainerMixin, Trainer): ...      # or ShardckptTrainer itself
    trainer = MyTrainer(model=model, args=args, train_dataset=ds,
                        shardckpt_url="s3://bucket/run", storage_options={...})  # default: output_dir
    trainer.train(resume_from_checkpoint=True)

Each save step is one committed shardckpt checkpoint at ``<run>/checkpoint-<step>`` (Trainer's
own naming), written by :class:`~shardckpt.interop.dcp.storage.ShardckptWriter` through DCP, the
same on DDP (every rank holds the whole model; DCP saves each tensor once) and on FSDP2
(``DTensor`` shards, each rank its own). What it holds:

* ``model.<fqn>`` and ``optim.<...>``: the model's and optimizer's state from
  ``torch.distributed.checkpoint.state_dict.get_state_dict`` (FQNs without wrapper prefixes, so
  ``shardckpt consolidate --prefix model.`` gives Hugging Face names);
* ``rng.rank-XXXXX``: each rank's RNG states (Python, numpy, torch CPU and CUDA) as the UTF-8
  bytes of a JSON document in a uint8 tensor;
* the manifest's ``extras``: ``step``, ``hf_config`` (the model's ``config.json``, for
  ``consolidate``) and ``app.trainer``: the text of ``trainer_state.json`` (callbacks' state and
  the data position, which Trainer derives from ``global_step``), the LR scheduler's and the
  gradient scaler's ``state_dict()`` (JSON), the world size and the RNG documents' lengths.

Nothing is pickled by shardckpt; the optimizer's hyper-parameters are values DCP's planner
serializes itself, loaded back with ``torch.load(weights_only=True)``.

Resume: ``resume_from_checkpoint=True`` takes the newest committed checkpoint under the run that
passes :meth:`~shardckpt.checkpoint.run_dir.CheckpointManager.check` (directories without a
manifest are skipped, whatever their step), chosen alike on every rank by the one resume policy
(:func:`~shardckpt.checkpoint.resume_policy.pick_committed`); a path or URL names one. Trainer reads the trainer
state from a local copy of ``trainer_state.json`` made for the run and removed after it, without
``best_model_checkpoint`` (:mod:`~shardckpt.integrations.trainer_checks`: Trainer would delete
by it; a path there that is not a committed checkpoint of the run is named in a warning). On
another world size the model, optimizer, scheduler and trainer state load (DCP reshards); the
per-rank RNG states do not (logged).

Retention: ``save_total_limit`` keeps that many committed checkpoints, never the newest, deletes
only below the run (``Storage.remove_inside``), manifest first; directories without a manifest
(an interrupted save, Trainer's own checkpoints) are neither counted nor deleted. The live
``state.best_model_checkpoint`` stays None (each save records the best committed checkpoint's
URL in its ``trainer_state``), so Trainer's own end-of-training deletion never runs.

Not supported (refused when the Trainer is built): ``load_best_model_at_end`` and
``push_to_hub``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from typing import Any
from collections.abc import Mapping

from shardckpt.checkpoint.collective import all_gather_bytes, rank_and_world
from shardckpt.checkpoint.reader import as_storage
from shardckpt.checkpoint.resume_policy import pick_committed
from shardckpt.checkpoint.run_dir import CheckpointManager
from shardckpt.checkpoint.run_names import TRAINER_DIR
from shardckpt.errors import ConfigError, IncompleteCheckpointError, ManifestError
from shardckpt.format.manifest import MANIFEST_NAME
from shardckpt.format.records import RunExtras
from shardckpt.integrations.trainer_checks import (
    APP_VERSION, read_trainer_record, restored_trainer_state, rng_lengths, rng_name,
)
from shardckpt.integrations.trainer_rng import rng_state, set_rng_state
from shardckpt.integrations.teardown import destroy_group_at_exit
from shardckpt.integrations.trainer_export import check_every, consolidate_step

log = logging.getLogger(__name__)

# and ShardckptTrainer, built on first use (module __getattr__)
__all__ = ["ShardckptTrainerMixin", "TrainerRun", "CHECKPOINT_DIR", "read_trainer_record"]

#: Trainer's checkpoint directory names (``PREFIX_CHECKPOINT_DIR``): :mod:`~shardckpt.checkpoint.run_names`.
CHECKPOINT_DIR = TRAINER_DIR
TRAINER_STATE_NAME = "trainer_state.json"


class TrainerRun(CheckpointManager):
    """The ``checkpoint-<step>`` directories of one Trainer run (``CheckpointManager``'s rules:
    only committed ones count, retention never deletes the newest). There is no ``latest``
    pointer: Trainer finds the newest by name, and so does :meth:`resume_points`."""

    DIR_PATTERN = CHECKPOINT_DIR

    def dir_name(self, step: int) -> str:
        return f"checkpoint-{step}"

    def read_latest(self) -> str | None:
        return None

    def mark_committed(self, step: int) -> None:
        if not self.is_committed(step):
            raise IncompleteCheckpointError(f"{self.url_for(step)} has no {MANIFEST_NAME}; "
                                            "retention is not applied after an uncommitted save")
        self.apply_retention()


@dataclass
class _Resume:
    """A resume in progress: the checkpoint, its trainer record, and the local folder holding the
    ``trainer_state.json`` Trainer reads."""

    url: str
    app: dict[str, Any]
    stub: str
    rng: dict[str, Any] | None = None


class ShardckptTrainerMixin:
    """Put before ``transformers.Trainer`` (or a subclass of it) in the bases: Trainer's
    checkpoints then go through shardckpt (module docstring). Keyword arguments taken here:

    * ``shardckpt_url``: where the run's ``checkpoint-<step>`` folders go (a path or fsspec URL;
      default ``args.output_dir``);
    * ``storage_options``: fsspec options for it (``s3://``: endpoint, credentials);
    * ``full_verify``: check every checksum, not only sizes, when choosing the checkpoint to
      resume from;
    * ``consolidate_every``: every K-th save also written as a Hugging Face model folder at
      ``<consolidate_dir>/checkpoint-<step>`` (default ``<run>/hf``;
      :mod:`~shardckpt.integrations.trainer_export`).
    """

    def __init__(self, *args: Any, shardckpt_url: str | os.PathLike | None = None,
                 storage_options: Mapping[str, Any] | None = None, full_verify: bool = False,
                 consolidate_every: int | None = None, consolidate_dir: str | None = None,
                 **kwargs: Any) -> None:
        model = kwargs.get("model", args[0] if args else None)
        given: Any = kwargs.get("args", args[1] if len(args) > 1 else None)
        # Trainer refuses to checkpoint a model sharded at load time (from_pretrained with a
        # DistributedConfig: FSDP2 without Accelerate's plugin) unless save_only_model, because its
        # own files cannot hold that optimizer state; DCP over the DTensors can. The flag is set
        # for Trainer's check only.
        lift = (getattr(model, "is_distributed_loading_by_transformers", False) and given is not None
                and not given.save_only_model and given.save_strategy != "no")
        if lift:
            given.save_only_model = True
        try:
            super().__init__(*args, **kwargs)
        finally:
            if lift:
                given.save_only_model = False
        targs = self.args  # type: ignore[attr-defined]
        refused = [name for name in ("load_best_model_at_end", "push_to_hub") if getattr(targs, name)]
        if refused:
            raise ConfigError(f"TrainingArguments {', '.join(refused)}: not supported with "
                              "shardckpt checkpoints; set it to False")
        url = str(shardckpt_url) if shardckpt_url is not None else targs.output_dir
        if not url:
            raise ConfigError("no place for checkpoints: pass shardckpt_url= or set "
                              "TrainingArguments.output_dir")
        limit = targs.save_total_limit
        # Trainer keeps every checkpoint for a limit of None or <= 0
        self.shardckpt_run = TrainerRun(url, limit if limit and limit > 0 else None, storage_options)
        self.shardckpt_storage_options = dict(storage_options or {})
        self.shardckpt_full_verify = bool(full_verify)
        self.shardckpt_consolidate = (check_every(consolidate_every), consolidate_dir or f"{url.rstrip('/')}/hf")
        self._shardckpt_saves = 0
        self._shardckpt_resume: _Resume | None = None

    # ------------------------------------------------------------------------------------ save

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        """Save model, optimizer, scheduler, RNG and trainer state as one shardckpt checkpoint
        (collective: every rank calls it, as Trainer does), then apply retention on rank 0."""
        import torch
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict
        from shardckpt.interop.dcp.storage import ShardckptWriter
        from shardckpt.training.hf_record import hf_config_dict

        trainer: Any = self
        state = trainer.state
        step = int(state.global_step)
        if trainer.hp_search_backend is None and trial is None:
            trainer.store_flos()
        run = self.shardckpt_run
        best = state.best_global_step  # recorded, never live: Trainer deletes by it (trainer_checks)
        best_url = run.url_for(int(best)) if best and run.is_committed(int(best)) else None
        _export_callback_states(trainer)
        rank, world = rank_and_world()
        model_only = bool(trainer.args.save_only_model)
        if model_only:
            from torch.distributed.checkpoint.state_dict import get_model_state_dict

            state_dict: dict[str, Any] = {"model": get_model_state_dict(trainer.model)}
        else:
            msd, osd = get_state_dict(trainer.model, trainer.optimizer)
            state_dict = {"model": msd, "optim": osd}
        rng_blob = json.dumps(rng_state(), allow_nan=False).encode()
        lengths = [int(b) for b in all_gather_bytes(str(len(rng_blob)).encode())]
        state_dict["rng"] = {f"rank-{rank:05d}": torch.frombuffer(bytearray(rng_blob), dtype=torch.uint8)}
        app = {"version": APP_VERSION, "world_size": world, "rng_bytes": lengths,
               "model_only": model_only,
               "trainer_state": json.dumps({**dataclasses.asdict(state), "best_model_checkpoint": best_url},
                                           sort_keys=True),
               "lr_scheduler": _json_checked(trainer.lr_scheduler, "the LR scheduler"),
               "scaler": _json_checked(getattr(trainer.accelerator, "scaler", None), "the gradient scaler")}
        config = getattr(getattr(trainer.model, "config", None), "to_dict", None)
        extras = RunExtras(step=step, app={"trainer": app}, hf_prefix="model.",
                           hf_config=hf_config_dict(trainer.model.config, model=trainer.model) if config else None)
        url = run.url_for(step)
        dcp.save(state_dict, storage_writer=ShardckptWriter(
            url, self.shardckpt_storage_options, extras=extras.to_doc(), replace_existing=True))
        log.info("saved step %d to %s", step, url)
        self._shardckpt_saves += 1
        every, where = self.shardckpt_consolidate
        if rank == 0:
            run.mark_committed(step)
            if every is not None and self._shardckpt_saves % every == 0:
                consolidate_step(url, f"{where}/checkpoint-{step}", trainer.model, self.shardckpt_storage_options)

    # ---------------------------------------------------------------------------------- resume

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any,
              **kwargs: Any) -> Any:
        """``Trainer.train``; ``resume_from_checkpoint`` is True (the newest good checkpoint of
        the run), a shardckpt checkpoint's path or URL, or a folder Trainer itself wrote."""
        destroy_group_at_exit()  # see integrations.teardown: no abort after a run that succeeded
        url = self._resume_url(resume_from_checkpoint)
        if url is None:
            return super().train(resume_from_checkpoint, *args, **kwargs)  # type: ignore[misc]
        app = read_trainer_record(url, self.shardckpt_storage_options)
        text = restored_trainer_state(app["trainer_state"], self.shardckpt_run, url)
        stub = tempfile.mkdtemp(prefix="shardckpt-resume-")
        try:
            with open(os.path.join(stub, TRAINER_STATE_NAME), "w", encoding="utf-8") as f:
                f.write(text)
            self._shardckpt_resume = _Resume(url, app, stub)
            log.info("resuming from %s", url)
            return super().train(stub, *args, **kwargs)  # type: ignore[misc]
        finally:
            self._shardckpt_resume = None
            shutil.rmtree(stub, ignore_errors=True)

    def _resume_url(self, resume: str | bool | None) -> str | None:
        """The shardckpt checkpoint to resume from (the same on every rank), or None where
        Trainer's own resume applies (no resume, or a folder Trainer wrote)."""
        if resume is None or resume is False:
            return None
        if resume is True:
            found = pick_committed(self.shardckpt_run, self.shardckpt_full_verify)
            if found is None:
                raise IncompleteCheckpointError(
                    f"{self.shardckpt_run.url} holds no committed checkpoint-<step> that checks out; "
                    "nothing to resume from")
            return found.url
        path = str(resume)
        storage = as_storage(path, self.shardckpt_storage_options)
        if storage.exists(MANIFEST_NAME):
            return path
        if storage.exists(TRAINER_STATE_NAME):
            return None  # written by Trainer itself: its own loader takes it
        raise IncompleteCheckpointError(f"{path} has no {MANIFEST_NAME} (the save never committed) "
                                        f"and no {TRAINER_STATE_NAME}; resume from a committed "
                                        f"checkpoint, or pass resume_from_checkpoint=True")

    def _mine(self, checkpoint: Any) -> _Resume | None:
        r = self._shardckpt_resume
        return r if r is not None and checkpoint == r.stub else None

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        if self._mine(resume_from_checkpoint) is None:
            super()._load_from_checkpoint(resume_from_checkpoint, model)  # type: ignore[misc]
        # else: the weights load with the optimizer, once the model is prepared

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        r = self._mine(checkpoint)
        if r is None:
            super()._load_optimizer_and_scheduler(checkpoint)  # type: ignore[misc]
            return
        self._load_shardckpt(r)

    def _load_scaler(self, checkpoint: str | None) -> None:
        r = self._mine(checkpoint)
        if r is None:
            super()._load_scaler(checkpoint)  # type: ignore[misc]
            return
        scaler = getattr(getattr(self, "accelerator", None), "scaler", None)
        if scaler is not None and r.app.get("scaler") is not None:
            scaler.load_state_dict(r.app["scaler"])

    def _load_rng_state(self, checkpoint: str | None) -> None:
        r = self._mine(checkpoint)
        if r is None:
            super()._load_rng_state(checkpoint)  # type: ignore[misc]
            return
        if r.rng is None:
            log.info("%s: RNG states not restored (saved by %d ranks, this job has %d)", r.url,
                     r.app["world_size"], rank_and_world()[1])
            return
        set_rng_state(r.rng)

    def _load_shardckpt(self, r: _Resume) -> None:
        """Load model, optimizer (unless the checkpoint is model-only), scheduler and this rank's
        RNG document from ``r`` (collective)."""
        import torch
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import (
            get_model_state_dict, get_state_dict, set_model_state_dict, set_state_dict,
        )
        from shardckpt.interop.dcp.storage import ShardckptReader, WeightsOnlyLoadPlanner

        trainer: Any = self
        rank, world = rank_and_world()
        if r.app["model_only"]:
            state_dict: dict[str, Any] = {"model": get_model_state_dict(trainer.model)}
        else:
            msd, osd = get_state_dict(trainer.model, trainer.optimizer)
            state_dict = {"model": msd, "optim": osd}
        same_world = r.app["world_size"] == world
        if same_world:  # sized by what is stored, checked against rng_bytes before anything is allocated
            n = rng_lengths(r.url, self.shardckpt_storage_options, r.app["rng_bytes"])[rank]
            state_dict["rng"] = {f"rank-{rank:05d}": torch.empty(n, dtype=torch.uint8)}
        reader = ShardckptReader(r.url, self.shardckpt_storage_options)
        dcp.load(state_dict, storage_reader=reader, planner=WeightsOnlyLoadPlanner())
        if r.app["model_only"]:
            set_model_state_dict(trainer.model, state_dict["model"])
            log.warning("%s holds no optimizer state (save_only_model): the optimizer starts anew", r.url)
        else:
            set_state_dict(trainer.model, trainer.optimizer, model_state_dict=state_dict["model"],
                           optim_state_dict=state_dict["optim"])
        if trainer.lr_scheduler is not None and r.app.get("lr_scheduler") is not None:
            trainer.lr_scheduler.load_state_dict(r.app["lr_scheduler"])
        if same_world:
            blob = state_dict["rng"][f"rank-{rank:05d}"].numpy().tobytes()
            try:
                r.rng = json.loads(blob)
            except ValueError as e:
                raise ManifestError(f"{r.url}: {rng_name(rank)} is not a JSON document: {e}") from e


def __getattr__(name: str) -> Any:
    """``ShardckptTrainer``: the mixin on ``transformers.Trainer`` (built on first use, so that
    importing this module does not import transformers)."""
    if name == "ShardckptTrainer":
        from transformers import Trainer

        cls = type("ShardckptTrainer", (ShardckptTrainerMixin, Trainer),
                   {"__module__": __name__, "__doc__": "transformers.Trainer with shardckpt checkpoints."})
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ------------------------------------------------------------------------------------ helpers

def _json_checked(obj: Any, what: str) -> Any:
    """``obj.state_dict()`` as JSON data (None for None); a clear error where it is not JSON."""
    if obj is None:
        return None
    sd = obj.state_dict()
    try:
        return json.loads(json.dumps(sd, allow_nan=False))
    except (TypeError, ValueError) as e:
        raise ConfigError(f"the state_dict() of {what} ({type(obj).__name__}) is not JSON data, "
                          f"which a shardckpt checkpoint stores without pickle: {e}") from e


def _export_callback_states(trainer: Any) -> None:
    """Record the state of stateful callbacks (and of ``TrainerControl``) in the trainer state,
    as Trainer does before it writes ``trainer_state.json``."""
    from transformers.trainer_callback import ExportableState

    for cb in [*trainer.callback_handler.callbacks, trainer.control]:
        if not isinstance(cb, ExportableState):
            continue
        name = type(cb).__name__
        slot = trainer.state.stateful_callbacks.get(name)
        if isinstance(slot, list):
            slot.append(cb.state())
        else:
            trainer.state.stateful_callbacks[name] = cb.state()
