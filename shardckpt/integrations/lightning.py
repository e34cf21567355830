"""Lightning's FSDP strategies saving and resuming through shardckpt, without patching Lightning.

::

    import lightning.pytorch as L
    from lightning.pytorch.callbacks import ModelCheckpoint
    from shardckpt.integrations.lightning import ShardckptModelParallelStrategy

    trainer = L.Trainer(strategy=ShardckptModelParallelStrategy(storage_options={...}),
                        callbacks=[ModelCheckpoint(dirpath="s3://bucket/run", save_top_k=2, save_last=True)])
    trainer.fit(model, ckpt_path="s3://bucket/run/last.ckpt")        # or a local path

Lightning's sharded strategies save with DCP themselves and never reach a ``CheckpointIO``
plugin, so the hooks are the strategy's own ``save_checkpoint`` / ``load_checkpoint`` /
``remove_checkpoint``: :class:`ShardckptModelParallelStrategy` (FSDP2, ``ModelParallelStrategy``)
and :class:`ShardckptFSDPStrategy` (FSDP1, ``FSDPStrategy``, always sharded; untested here, as
FSDP1 refuses CPU modules) override those three, and the two that hand Lightning the sharded state
(``lightning_module_state_dict``, ``optimizer_state``: torch's ``get_model_state_dict`` /
``get_optimizer_state_dict``). Both classes are built on first use: importing this module does
not import Lightning. Each Lightning save is one committed shardckpt checkpoint at the
path Lightning names (``epoch=1-step=40.ckpt/``, ``last.ckpt/``), written through
:class:`~shardckpt.interop.dcp.storage.ShardckptWriter` by DCP on every rank:

* every tensor of Lightning's checkpoint dict is a DCP item named by its path, dots between the
  parts: ``state_dict.<fqn>`` (``get_model_state_dict``: FSDP2 ``DTensor`` shards, FQNs without
  wrapper prefixes, so ``shardckpt consolidate --prefix state_dict.`` gives the weights),
  ``optimizer_states.0.state.<fqn>.exp_avg``, and the few tensors callbacks keep (a
  ``ModelCheckpoint``'s scores);
* everything else (loops, callbacks, epoch and step, hyper-parameters, LR schedulers, the
  optimizers' param groups) is JSON in the manifest, ``extras["app"]["lightning"]``, with each
  tensor replaced by ``{"$tensor": name}``; tuples, dicts with keys that are not strings and
  floats that JSON lacks (nan, inf) are tagged (``$tuple``, ``$dict``, ``$float``) so that they
  come back as they were. A value that is none of these (an ``nn.Module`` among the
  hyper-parameters, say) is refused before anything is written, with one
  :class:`~shardckpt.errors.ConfigError` naming its place: nothing is pickled, by shardckpt or by
  DCP (no DCP item is a value, so no ``torch.save`` bytes are written).

Saving to a path that holds a committed checkpoint (``last.ckpt`` every epoch) replaces its
manifest only if it is unchanged since the save began, then removes the replaced save's files.
``remove_checkpoint`` (``ModelCheckpoint``'s ``save_top_k`` / ``save_last``) deletes only a
committed checkpoint that the listing of a ``ModelCheckpoint``'s own ``dirpath`` finds directly
below it (a path read from a checkpoint is never a delete target: see
:mod:`~shardckpt.integrations.lightning_paths`), manifest first, then the directory, through
:meth:`~shardckpt.storage.Storage.remove_inside`, and never the newest good checkpoint there
(latest commit, then highest step, among those whose files are all present at their recorded
sizes; where several tie, one may go while another stays).

``load_checkpoint`` reads the JSON, loads every tensor into the model's and optimizers' own
state dicts (DCP reshards: another world size loads), puts model and optimizer state in place with
``set_model_state_dict`` / ``set_optimizer_state_dict``, and hands Lightning the rest of the dict,
less any ``ModelCheckpoint`` path that is not a committed checkpoint in that callback's own
directory (dropped, with a warning).
"""

from __future__ import annotations

import logging
from typing import Any
from collections.abc import Mapping

import torch

from shardckpt.checkpoint.collective import agree, same_error
from shardckpt.checkpoint.reader import read_manifest
from shardckpt.errors import CollectiveError, ConfigError, ShardckptError
from shardckpt.format.manifest import MANIFEST_NAME
from shardckpt.format.records import RunExtras
from shardckpt.integrations.lightning_paths import confine_restored, remove_checkpoint
from shardckpt.integrations.lightning_hf import APP_KEY, hf_extras, load_targets
from shardckpt.integrations.lightning_state import (
    LAYOUT_VERSION, join_state, lightning_doc, split_state, tensor_names,
)
from shardckpt.interop.dcp.storage import ShardckptReader, ShardckptWriter
from shardckpt.storage import Storage

log = logging.getLogger(__name__)

# the two strategy classes are built by __getattr__, on first use
__all__ = ["ShardckptFSDPStrategy", "ShardckptModelParallelStrategy",  # noqa: F822
           "ShardckptStrategyMixin"]


# ------------------------------------------------------------------------------ the strategy


class ShardckptStrategyMixin:
    """``save_checkpoint`` / ``load_checkpoint`` / ``remove_checkpoint`` of a Lightning strategy
    whose model is sharded with FSDP (1 or 2), through shardckpt (module doc). Put it before the
    strategy class: ``class S(ShardckptStrategyMixin, ModelParallelStrategy)``; the keywords
    ``storage_options`` (fsspec, e.g. S3 credentials) and ``hf_config`` (the Hugging Face config
    ``consolidate`` writes; default: that of the Hugging Face model inside the LightningModule,
    :mod:`~shardckpt.integrations.lightning_hf`) are taken, the rest goes to the strategy."""

    model: Any
    optimizers: list[Any]
    lightning_module: Any
    is_global_zero: bool
    #: Arguments of the parent strategy that must have these values (sharded state).
    FORCED: dict[str, Any] = {}

    def __init__(self, *args: Any, storage_options: Mapping[str, Any] | None = None,
                 hf_config: Any = None, **kwargs: Any) -> None:
        for k, v in self.FORCED.items():
            if kwargs.setdefault(k, v) != v:
                raise ConfigError(f"{type(self).__name__} saves sharded state: {k} must be {v!r}, "
                                  f"got {kwargs[k]!r}")
        super().__init__(*args, **kwargs)
        self.storage_options, self.hf_config = dict(storage_options or {}), hf_config

    # Lightning's dump_checkpoint asks the strategy for these: sharded, on every rank
    def lightning_module_state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return get_model_state_dict(self.model)

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        return get_optimizer_state_dict(self.model, getattr(optimizer, "_optimizer", optimizer))

    def _options(self, extra: Any) -> dict[str, Any]:
        if extra is not None and not isinstance(extra, Mapping):
            raise ConfigError(f"storage_options must be a mapping of fsspec options; got {type(extra).__name__}")
        return {**self.storage_options, **dict(extra or {})}

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any,
                        storage_options: Any | None = None) -> None:
        """Collective: every rank writes its shards; the coordinator commits (module doc)."""
        import torch.distributed.checkpoint as dcp

        url = str(self.broadcast(str(filepath)))  # type: ignore[attr-defined]
        options = self._options(storage_options)
        what = f"save of {url}"

        def prepare() -> tuple[dict[str, Any], dict[str, torch.Tensor], str | None]:
            doc, tensors = split_state(checkpoint)
            step = checkpoint.get("global_step")
            extras = RunExtras.from_doc(
                {"step": step if isinstance(step, int) and step >= 0 else None,
                 "app": {APP_KEY: {"version": LAYOUT_VERSION, "state": doc}},
                 **hf_extras(self.lightning_module, self.hf_config)},
                "extras", what).to_doc()
            return extras, tensors, _current_save_id(url, options) if self.is_global_zero else None

        try:
            prepared, _ = agree(prepare, what)
        except CollectiveError as e:
            raise same_error(e, what) from e
        assert prepared is not None
        extras, tensors, replaced = prepared
        writer = ShardckptWriter(url, options, extras=extras, replace_existing=True)
        dcp.save(tensors, storage_writer=writer)
        if self.is_global_zero and replaced is not None:
            _remove_replaced(url, options, replaced)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Collective: load model and optimizer state in place, return the rest of the dict."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions, get_model_state_dict, set_model_state_dict, set_optimizer_state_dict,
        )

        from lightning.pytorch.trainer.states import TrainerFn

        url = str(self.broadcast(str(checkpoint_path)))  # type: ignore[attr-defined]
        options = dict(self.storage_options)
        strict = bool(getattr(self.lightning_module, "strict_loading", True))
        fitting = self.lightning_module.trainer.state.fn == TrainerFn.FITTING
        optimizers = list(self.optimizers) if fitting else []
        what = f"load of {url}"

        def read() -> tuple[Any, dict[str, tuple[str, tuple[int, ...]]]]:
            m = read_manifest(Storage(url, options))
            doc = lightning_doc(m, url)
            shapes = {t.fqn: (t.dtype, t.shape) for t in (m.chunked.tensors.values() if m.chunked else ())}
            return doc, shapes

        try:
            got, _ = agree(read, what)
        except CollectiveError as e:
            raise same_error(e, what) from e
        assert got is not None
        doc, shapes = got
        live = {"state_dict": get_model_state_dict(self.model),
                "optimizer_states": [_optimizer_template(self.model, o) for o in optimizers]}
        saved_optim = doc.get("optimizer_states", []) if isinstance(doc, dict) else []
        if optimizers and len(saved_optim) != len(optimizers):
            raise ConfigError(f"{url}: {len(saved_optim)} optimizer states saved, "
                              f"{len(optimizers)} optimizers configured")
        into = load_targets(url, tensor_names(doc), split_state(live)[1], shapes, strict, bool(optimizers))
        dcp.load(into, storage_reader=ShardckptReader(url, options))
        left_out = {n: torch.empty(0) for n in tensor_names(doc) if n not in into}
        state = join_state(doc, {**into, **left_out}, url)
        model_state = state.pop("state_dict")
        for name in left_out:  # strict_loading=False: what the model does not have is dropped
            model_state.pop(name.removeprefix("state_dict."), None)
        set_model_state_dict(self.model, model_state, options=StateDictOptions(strict=strict))
        for o, s in zip(optimizers, state.pop("optimizer_states", []), strict=False):
            set_optimizer_state_dict(self.model, o, optim_state_dict=s)
        confine_restored(state, self._checkpoint_callbacks(), options, url)
        return state

    def _checkpoint_callbacks(self) -> list[Any]:
        trainer = getattr(self.lightning_module, "trainer", None)
        return list(getattr(trainer, "checkpoint_callbacks", None) or [])

    def remove_checkpoint(self, filepath: Any) -> None:
        """Rank 0 deletes (:func:`remove_checkpoint`), only a committed checkpoint listed in a
        ``ModelCheckpoint``'s own directory; the others do nothing."""
        if self.is_global_zero:
            dirs = [cb.dirpath for cb in self._checkpoint_callbacks() if isinstance(cb.dirpath, str)]
            remove_checkpoint(str(filepath), self.storage_options, within=dirs)


def _optimizer_template(model: Any, optimizer: Any) -> dict[str, Any]:
    """``get_optimizer_state_dict`` with every state tensor there to load into. torch creates
    the state of an optimizer that has none by a step with zero gradients, but not where a
    parameter already has a gradient (a second ``fit`` on the same module): those gradients are
    set aside for that step and put back after it."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    held = [] if optimizer.state else [p for g in optimizer.param_groups for p in g["params"]
                                       if p.grad is not None]
    grads = [p.grad for p in held]
    for p in held:
        p.grad = None
    try:
        return get_optimizer_state_dict(model, optimizer)
    finally:
        for p, g in zip(held, grads, strict=True):
            p.grad = g


def _current_save_id(url: str, options: Mapping[str, Any]) -> str | None:
    """The save id of the checkpoint committed at ``url`` now, or None."""
    storage = Storage(url, options)
    if not storage.exists(MANIFEST_NAME):
        return None
    try:
        return read_manifest(storage).save_id
    except ShardckptError as e:  # replaced all the same; its files are left for `shardckpt clean`
        log.warning("%s: %s", url, e)
        return None


def _remove_replaced(url: str, options: Mapping[str, Any], save_id: str) -> None:
    """After a save replaced the checkpoint at ``url``: remove the replaced save's files."""
    storage = Storage(url, options)
    try:
        if read_manifest(storage).save_id == save_id:
            return
        storage.remove_inside(save_id, recursive=True)
    except ShardckptError as e:
        log.warning("could not remove the replaced save %s (%s); `shardckpt clean` removes it",
                    storage.url_of(save_id), e)


_STRATEGIES: dict[str, tuple[str, dict[str, Any], str]] = {
    "ShardckptModelParallelStrategy": (
        "ModelParallelStrategy", {"save_distributed_checkpoint": True},
        "Lightning's ``ModelParallelStrategy`` (FSDP2: ``fully_shard`` in ``configure_model``) "
        "saving, resuming and deleting checkpoints through shardckpt (module doc). Takes the "
        "parent's arguments and ``storage_options``; ``save_distributed_checkpoint`` is always True."),
    "ShardckptFSDPStrategy": (
        "FSDPStrategy", {"state_dict_type": "sharded"},
        "Lightning's ``FSDPStrategy`` (FSDP1) saving, resuming and deleting checkpoints through "
        "shardckpt (module doc). Takes the parent's arguments and ``storage_options``; "
        "``state_dict_type`` is always ``'sharded'``. FSDP1 needs an accelerator: torch refuses "
        "modules on the CPU."),
}


def __getattr__(name: str) -> Any:
    """The strategy classes, built on first use: importing this module does not import Lightning."""
    if name not in _STRATEGIES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import lightning.pytorch.strategies as strategies

    base_name, forced, doc = _STRATEGIES[name]
    cls = type(name, (ShardckptStrategyMixin, getattr(strategies, base_name)),
               {"__module__": __name__, "__qualname__": name, "__doc__": doc, "FORCED": forced})
    globals()[name] = cls
    return cls
