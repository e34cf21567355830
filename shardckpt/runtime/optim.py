"""Sharded element-wise optimizers over the fp32 master shards.

A :class:`ShardedOptimizer` is a ``torch.optim.Optimizer``: its ``param_groups`` hold the module's
parameters and their hyper-parameters, so stock LR schedulers work. Each rank updates only its own
slice: for every parameter it intersects the parameter's element range with the rank's shard range
of the parameter's flat group and applies the update to those views of ``master``, ``grad`` and the
state shards, with the hyper-parameters of the parameter's param group. The arithmetic copies the
single-tensor (``foreach=False``) code of ``torch.optim.AdamW`` / ``torch.optim.SGD`` op for op, so
an element gets the same bits as in PyTorch (element-wise ops do not care how a tensor is sliced).

State: per trained flat group, per-element kinds named as in the checkpoint format (``exp_avg``,
``exp_avg_sq`` [, ``max_exp_avg_sq``] for AdamW; ``momentum_buffer`` for SGD with momentum),
allocated as zeros at construction so a checkpoint loader can fill them in place; per param group,
hyper-parameters and the step count (:meth:`ShardedOptimizer.optimizer_metadata`). Frozen
parameters have no state and are skipped. The update rules (AdamW, SGD) and
:func:`~shardckpt.runtime.optim_rules.build_optimizer`, which refuses optimizers that need whole
tensors, are in :mod:`shardckpt.runtime.optim_rules`.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any, ClassVar
from collections.abc import Callable, Iterable, Mapping

import torch

from shardckpt.errors import ConfigError, ShardckptError
from shardckpt.runtime.contracts import ShardedEngine
from shardckpt.runtime.flat import FlatParamGroup
from shardckpt.runtime.offload.attach import open_store, store_state, store_step
from shardckpt.runtime.offload.store import OffloadStore
from shardckpt.runtime.param_groups import decay_param_groups, is_no_decay

__all__ = ["ShardedOptimizer", "decay_param_groups", "is_no_decay"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class _Segment:
    """The part of one parameter inside this rank's shard: ``[lo, hi)`` of the group's shard."""

    group: FlatParamGroup
    lo: int
    hi: int


class ShardedOptimizer(torch.optim.Optimizer):
    """Base of the sharded element-wise optimizers (see module docstring).

    Subclasses set ``name`` and implement :meth:`_state_kinds` and :meth:`_update`. ``step()``
    updates this rank's slices and ends with ``engine.after_step()``: local in stage 3; in stages
    1 and 2 that all-gathers the updated parameters, so every rank must call it. Stage 1's
    ``grad`` is a view into the whole reduced gradient; the update reads only this slice.
    """

    name: ClassVar[str] = ""

    def __init__(self, engine: ShardedEngine, params: Iterable[Any] | None,
                 defaults: dict[str, Any]) -> None:
        self._engine = engine
        self._ready = False
        if params is None:
            params = [p for _, p in engine.named_parameters()]
        super().__init__(params, defaults)
        self._fqns: list[list[str]] = []
        self._segments: list[list[_Segment]] = []
        self._by_group: dict[str, list[tuple[int, _Segment]]] = {}  # flat -> (param group, seg)
        self._flat_groups: list[list[FlatParamGroup]] = []
        self._steps: list[int] = []
        for group in self.param_groups:
            self._index_group(group)
        self._refuse_shape_based_groups()
        self.state_kinds: tuple[str, ...] = self._state_kinds()
        self._offload: OffloadStore | None = None
        self._state: dict[str, dict[str, torch.Tensor]] = {}
        trained = {name: g for name, g in engine.groups.items() if g.trainable}
        if engine.offload is None:
            self._state = {name: {k: torch.zeros_like(g.master) for k in self.state_kinds}
                           for name, g in trained.items()}
        else:
            self._offload = open_store(engine, trained, self.state_kinds,
                                       self._update_segments, self._items)
        self._ready = True
        engine.attach_optimizer(self)

    # ----------------------------------------------------------------- param groups

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        if getattr(self, "_ready", False):
            self._index_group(self.param_groups[-1])
            kinds = self._state_kinds()
            if kinds != self.state_kinds:
                raise ConfigError(f"the new param group changes the state kinds from "
                                  f"{self.state_kinds} to {kinds}; set it at construction")

    def _refuse_shape_based_groups(self) -> None:
        """An empty decaying group beside matrices is the "no decay for ``p.ndim < 2``" recipe
        gone wrong: parameters are 0-element placeholders, so every one looked like a vector."""
        layout = self._engine.layout
        has_matrix = any(len(layout.param(f).shape) >= 2 for fqns in self._fqns for f in fqns)
        empty = [i for i, g in enumerate(self.param_groups)
                 if not g["params"] and g.get("weight_decay", 0)]
        if empty and has_matrix:
            wd = self.param_groups[empty[0]]["weight_decay"]
            raise ConfigError(
                f"param group {empty[0]} has weight_decay={wd} "
                "but no parameters. The engine's parameters are 0-element placeholders between "
                "steps, so p.ndim and p.shape cannot tell matrices from vectors; build the groups "
                "with decay_param_groups(engine, weight_decay), or from "
                "engine.layout.param(fqn).shape")

    def _index_group(self, group: dict[str, Any]) -> None:
        eng = self._engine
        fqns = [eng.fqn_of(p) for p in group["params"]]
        segments, flats = [], {}
        for fqn in fqns:
            spec = eng.layout.param(fqn)
            fg = eng.groups[spec.group]
            if not fg.trainable:
                continue
            flats[fg.name] = fg
            lo, hi = max(spec.offset, fg.shard_start), min(spec.offset + spec.numel, fg.shard_end)
            if lo < hi:
                segments.append(_Segment(fg, lo - fg.shard_start, hi - fg.shard_start))
        self._fqns.append(fqns)
        for seg in segments:
            self._by_group.setdefault(seg.group.name, []).append((len(self._segments), seg))
        self._segments.append(segments)
        self._flat_groups.append(list(flats.values()))
        self._steps.append(0)

    def local_state(self, group_name: str) -> dict[str, torch.Tensor]:
        """State kind -> this rank's live shard of the flat group (empty for frozen groups):
        a tensor, or with ``offload_optimizer="nvme"`` an
        :class:`~shardckpt.runtime.offload.files.OffloadedShard` (its file)."""
        if self._offload is not None:
            return store_state(self._offload, self._engine.groups.get(group_name))
        return dict(self._state.get(group_name, {}))

    @property
    def offloaded(self) -> bool:
        """True if the masters and state are in an offload store, off the device."""
        return self._offload is not None

    def offload_snapshot(self) -> Any:
        """With ``"nvme"`` offload: (trained group names, an empty ``OffloadSnapshot``) for an
        async checkpoint to copy their shards into; else ``None``."""
        offload = self._offload
        snap = offload.snapshot() if offload is not None else None
        return None if offload is None or snap is None else (set(offload.sizes), snap)

    def close_offload(self) -> None:
        """Release the offloaded state (files removed); see :meth:`ZeroEngine.close`."""
        if self._offload is not None:
            self._offload.close()

    # ------------------------------------------------------------------------ step

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._engine.check_grads_reduced()
        self._engine.before_update()  # e.g. an async checkpoint still copying these shards
        # The same on every rank: a flat group's gradient exists after a collective reduce.
        active = [i for i, fgs in enumerate(self._flat_groups)
                  if any(fg.grad is not None for fg in fgs)]
        names = dict.fromkeys(seg.group.name for i in active for seg in self._segments[i]
                              if seg.group.grad is not None)
        # flat group -> its segments to update, with their param group's step and hyper
        work = {name: self._items(name) for name in names}
        for i in active:
            self._steps[i] += 1
        groups = self._engine.groups
        if self._offload is None:
            for name, items in work.items():
                fg = groups[name]
                assert fg.grad is not None  # `names` holds the groups with a gradient
                self._update_segments(fg.master, fg.grad, self._state[name], items)
        else:
            store_step(self._offload, groups, work, self._update_segments)
        self._engine.after_step()
        for name in work:  # after_step re-derived them from what the store holds too
            groups[name].master_changed = False
        return loss

    def _items(self, name: str) -> list[tuple[_Segment, int, dict[str, Any]]]:
        """``name``'s segments, each with its param group's next step and hyper (read now)."""
        items, hypers = [], {}
        for i, seg in self._by_group.get(name, []):
            if i not in hypers:
                hypers[i] = {k: (float(v) if isinstance(v, torch.Tensor) else v)
                             for k, v in self.param_groups[i].items() if k != "params"}
            items.append((seg, self._steps[i] + 1, hypers[i]))
        return items

    def _update_segments(self, master: torch.Tensor, grad: torch.Tensor,
                         state: Mapping[str, torch.Tensor],
                         items: list[tuple[_Segment, int, dict[str, Any]]]) -> None:
        """Update one flat group's shard: each segment with its param group's step and hyper
        (element-wise, so the order of the segments does not change any bit)."""
        for seg, step, hyper in items:
            self._update(master[seg.lo:seg.hi], grad[seg.lo:seg.hi],
                         {k: v[seg.lo:seg.hi] for k, v in state.items()}, step, hyper)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._engine.zero_grad(set_to_none)

    def _state_kinds(self) -> tuple[str, ...]:
        raise NotImplementedError

    def _update(self, param: torch.Tensor, grad: torch.Tensor, state: dict[str, torch.Tensor],
                step: int, hyper: dict[str, Any]) -> None:
        raise NotImplementedError

    # ------------------------------------------------------------------- metadata

    def optimizer_metadata(self) -> dict[str, Any]:
        """JSON-serializable, in the manifest's form: name, state kinds, and per param group
        ``params`` (its FQNs), ``hparams`` (every key of the param group but ``params``, tuples
        as lists) and ``step``."""
        groups = []
        for i, group in enumerate(self.param_groups):
            hyper = {}
            for k, v in group.items():
                if k == "params":
                    continue
                v = float(v) if isinstance(v, torch.Tensor) else v
                v = list(v) if isinstance(v, tuple) else v
                try:
                    json.dumps(v)
                except TypeError:
                    raise ConfigError(f"param group {i} has hyper-parameter {k!r} = {v!r}, which "
                                      "is not JSON-serializable") from None
                hyper[k] = v
            groups.append({"params": list(self._fqns[i]), "hparams": hyper, "step": self._steps[i]})
        return {"name": self.name, "state_kinds": list(self.state_kinds), "param_groups": groups}

    def load_optimizer_metadata(self, metadata: Mapping[str, Any]) -> None:
        """Restore hyper-parameters and steps (the form of :meth:`optimizer_metadata`),
        matching param groups by their FQN sets."""
        if metadata.get("name") != self.name:
            raise ConfigError(f"optimizer metadata is for {metadata.get('name')!r}, but this "
                              f"optimizer is {self.name!r}")
        by_fqns = {frozenset(f): i for i, f in enumerate(self._fqns)}
        saved = list(metadata.get("param_groups", []))
        keys = [frozenset(g.get("params", [])) for g in saved]
        if sorted(map(sorted, keys)) != sorted(map(sorted, by_fqns)):
            raise ConfigError(
                "optimizer param groups do not match: saved groups hold "
                f"{[sorted(k)[:3] for k in keys]}..., this optimizer's hold "
                f"{[sorted(k)[:3] for k in by_fqns]}...; build the same groups before loading")
        for key, g in zip(keys, saved, strict=True):
            i = by_fqns[key]
            for k, v in g.get("hparams", {}).items():
                old = self.param_groups[i].get(k)
                self.param_groups[i][k] = tuple(v) if isinstance(old, tuple) else v
            self._steps[i] = int(g.get("step", 0))

    def state_dict(self) -> dict[str, Any]:
        raise ShardckptError(
            f"{type(self).__name__}.state_dict(): each rank holds only its slice of the optimizer "
            "state, so there is no whole-tensor torch.optim state dict. Save and resume with "
            "shardckpt.training.checkpointer.Checkpointer (or shardckpt.training.save_load.save/load), which store "
            "every rank's slice and load on any world size; for whole tensors offline, "
            "consolidate the checkpoint")

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        raise ShardckptError(
            f"{type(self).__name__}.load_state_dict(): a sharded optimizer loads its slices from "
            "a shardckpt checkpoint; use shardckpt.training.checkpointer.Checkpointer.resume()/load() "
            "(or shardckpt.training.save_load.load)")
