"""The per-step schedule of ZeRO stages 1, 2 and 3: when units are gathered, freed and reduced.

What each stage shards (Rajbhandari et al., "ZeRO", 2020; every stage keeps the same fp32 master
and optimizer-state shards, so ``local_shards()`` and checkpoints do not depend on the stage):

========  ==========================================  =========================================
stage     parameters (compute dtype)                  gradients
========  ==========================================  =========================================
1         whole on every rank: a unit, once gathered,  reduce-scattered into an fp32 shard per
          stays gathered until the optimizer step      rank (the mean of the slice it updates),
          re-gathers the updated shards               but not partitioned: the whole local
                                                      gradient buffer stays allocated on every
                                                      rank, the shard in its own slice
2         as stage 1                                  reduce-scattered: an fp32 shard per rank;
                                                      the local buffer is freed once reduced
3         gathered before a unit's forward and its    as stage 2
          backward, freed after each
========  ==========================================  =========================================

Per step (elements, padded Ψ): stages 1 and 2 send 2Ψ (reduce-scatter of the gradient, all-gather
of the updated parameters), stage 3 3Ψ; the gradient shard holds the same bits at every stage.

The hook structure follows PyTorch FSDP: a forward pre-hook gathers the unit; a forward hook
frees it (stage 3) and hooks the unit's outputs, whose gradients gather it again for backward; a
post-accumulate-grad hook on each parameter copies its local gradient into the flat buffer and,
once a group is complete, reduces it (unless gradient sync is off, see
:meth:`~shardckpt.runtime.engine.ZeroEngine.no_sync`); an identity function on the unit's inputs
tells when its backward is done, so it can be freed; an autograd callback at the end of backward
reduces what is left (parameters that got no gradient count as zero) and frees everything.
A reduction is issued asynchronously and left in flight while backward computes the next unit;
issuing the next one finishes the older ones (at most :data:`REDUCTIONS_IN_FLIGHT` wait on the
wire), and the end of backward finishes them all, in the same order on every rank, so ``grad``
holds the same bits as with synchronous reductions. Each finished reduction is reported
(to the :class:`~shardckpt.runtime.contracts.ReductionListener`, if any): with the optimizer offloaded, that group's gradient goes to the host, and its
host step may run, while backward goes on (:mod:`shardckpt.runtime.offload.store`).

Activation checkpointing (``torch.utils.checkpoint``, non-reentrant) re-runs a unit's forward
inside backward: the pre-hook gathers (idempotent) and the forward hook neither frees nor hooks
again, so the recomputation finds the weights it needs and the unit is freed when its backward is
done.

Stage 3 options: ``reshard_after_forward=False`` keeps every unit gathered from its forward to its
backward (one all-gather per unit and step instead of two, for the memory of the whole model's
compute copy; FSDP2's option of the same name); with prefetch (:mod:`shardckpt.runtime.prefetch`)
the next unit's all-gather is issued asynchronously while the current one computes, in forward
and (in reverse order) in backward.
"""

from __future__ import annotations

import collections
import functools
from dataclasses import dataclass, field
from typing import Any
from collections.abc import Iterable, Mapping, Sequence

import torch
from torch import nn
from torch.utils import _pytree as pytree

from shardckpt.errors import ConfigError
from shardckpt.runtime.contracts import ReductionListener
from shardckpt.runtime.flat import FlatParamGroup, GradBufferPool
from shardckpt.runtime.prefetch import Prefetcher
from shardckpt.runtime.units import ROOT

STAGES = (1, 2, 3)

#: Gradient reductions left in flight while backward goes on: the newest one (the older are
#: finished when a new one is issued, so at most one unit's gradient buffer waits on the wire).
REDUCTIONS_IN_FLIGHT = 1


def check_stage(stage: int) -> int:
    """``stage`` if it is 1, 2 or 3; else a :class:`ConfigError` that names the field."""
    if isinstance(stage, bool) or stage not in STAGES:
        raise ConfigError(f"stage is {stage!r}; ZeRO stages are 1 (optimizer state), "
                          "2 (+ gradients) and 3 (+ parameters)")
    return int(stage)


@dataclass(eq=False)
class Unit:
    """One unit at run time: its module, its flat groups, and how far the current backward got."""

    name: str
    module: nn.Module
    groups: list[FlatParamGroup]
    reshard_after_forward: bool
    trained: int = 0                 # trained groups in this unit
    done: int = 0                    # of those, complete (reduced, or accumulated without sync)
    inputs_done: bool = False        # gradients w.r.t. the unit's inputs were computed
    hooks: list[Any] = field(default_factory=list)

    @property
    def gathered(self) -> bool:
        return all(g.gathered for g in self.groups)

    def start_gather(self) -> None:
        """Issue the all-gathers of every group without waiting (prefetch). Collective."""
        for g in self.groups:
            g.start_gather()

    def wait_gather(self) -> None:
        """Wait for the all-gathers in flight (no-op for groups without one)."""
        for g in self.groups:
            g.wait_gather()

    def gather(self) -> None:
        """Gather every group (issued together, then waited for). Collective; idempotent."""
        self.start_gather()
        self.wait_gather()

    def free(self) -> None:
        for g in self.groups:
            g.free()


def build_units(names: Sequence[str], modules: Mapping[str, nn.Module],
                groups: Iterable[FlatParamGroup], stage: int, reshard_root_after_forward: bool,
                reshard_after_forward: bool) -> list[Unit]:
    """One :class:`Unit` per name, in order, with its flat groups. In stage 3 a unit is freed
    after its forward if its flag says so (``reshard_root_after_forward`` for the root)."""
    groups = list(groups)
    units = []
    for name in names:
        mine = [g for g in groups if g.spec.unit == name]
        reshard = reshard_root_after_forward if name == ROOT else reshard_after_forward
        units.append(Unit(name, modules[name], mine, stage == 3 and reshard,
                          trained=sum(g.trainable for g in mine)))
    return units


class _PostBackward(torch.autograd.Function):
    """Identity on a unit's inputs whose backward says "this unit's backward is done"."""

    @staticmethod
    def forward(ctx: Any, callback: Any, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.callback = callback
        return tensors

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        ctx.callback()
        return (None, *grads)


def in_backward() -> bool:
    """True while the autograd engine runs a backward pass on this thread."""
    return torch._C._current_graph_task_id() != -1


class StageSchedule:
    """Installs the hooks of ``units`` and runs one step's gather/free/reduce for ``stage``.

    Invariants: every rank runs the same units in the same order, so the collectives (prefetched
    all-gathers included) pair up; with ``sync_grads`` off no gradient collective runs in
    backward; at the end of a synced backward every trained group that got a gradient since the
    last reduction has been reduced exactly once and no all-gather is in flight; in stage 3
    nothing is gathered between steps. ``prefetch`` changes when all-gathers are issued, never
    which (:mod:`shardckpt.runtime.prefetch`).
    """

    def __init__(self, units: Sequence[Unit], stage: int, deterministic: bool,
                 input_dtype: torch.dtype | None = None, prefetch: bool = False,
                 top: nn.Module | None = None, pool: GradBufferPool | None = None) -> None:
        self.units = list(units)
        self.stage = check_stage(stage)
        self.deterministic = deterministic
        self.input_dtype = input_dtype  # floating-point unit inputs are cast to it (if set)
        self.sync_grads = True
        self.in_backward = False
        self.prefetcher = Prefetcher(prefetch)
        self._reducing: collections.deque[FlatParamGroup] = collections.deque()
        self.pool = pool  # emptied at the end of each backward
        # optimizer offload: told of each group whose reduction finished, in order, and when a
        # backward begins
        self.listener: ReductionListener | None = None
        self.hooks: list[Any] = []
        if top is not None:  # a top-level forward starts and ends (before/after the units' hooks)
            self.hooks.append(top.register_forward_pre_hook(self._begin_forward, prepend=True))
            self.hooks.append(top.register_forward_hook(self._end_forward))
        for unit in self.units:
            self._register(unit)

    @property
    def keeps_params(self) -> bool:
        """Stages 1 and 2: gathered units stay gathered until their masters change."""
        return self.stage < 3

    def _register(self, unit: Unit) -> None:
        unit.hooks.append(unit.module.register_forward_pre_hook(
            functools.partial(self._pre_forward, unit), with_kwargs=True))
        unit.hooks.append(unit.module.register_forward_hook(
            functools.partial(self._post_forward, unit)))
        for g in unit.groups:
            if g.trainable:
                for i, p in enumerate(g.params):
                    unit.hooks.append(p.register_post_accumulate_grad_hook(
                        functools.partial(self._on_grad, unit, g, i)))

    def free(self, unit: Unit) -> None:
        if not self.keeps_params:
            unit.free()

    # ------------------------------------------------------------------------- forward

    def _begin_forward(self, module: nn.Module, args: tuple) -> None:
        if not in_backward():
            self.prefetcher.begin_forward()

    def _end_forward(self, module: nn.Module, args: tuple, output: Any) -> None:
        # Without gradients no backward follows: free what a prefetch left (stage 3).
        if not in_backward() and not torch.is_grad_enabled():
            for unit in self.units:
                self.free(unit)

    def _pre_forward(self, unit: Unit, module: nn.Module, args: tuple, kwargs: dict) -> Any:
        unit.gather()
        if not in_backward():  # never prefetch from an activation recomputation
            self.prefetcher.pre_forward(unit)
        flat, spec = pytree.tree_flatten((args, kwargs))
        changed = False
        if self.input_dtype is not None:  # also in a recomputation: it must redo the forward
            for i, t in enumerate(flat):
                if (isinstance(t, torch.Tensor) and t.is_floating_point()
                        and t.dtype != self.input_dtype):
                    flat[i], changed = t.to(self.input_dtype), True
        idx = [i for i, t in enumerate(flat) if isinstance(t, torch.Tensor) and t.requires_grad]
        if idx and torch.is_grad_enabled() and not in_backward():  # not in a recomputation
            marked = _PostBackward.apply(functools.partial(self._post_backward, unit),
                                         *(flat[i] for i in idx))
            for i, t in zip(idx, marked, strict=True):
                flat[i] = t
            changed = True
        return pytree.tree_unflatten(flat, spec) if changed else None

    def _post_forward(self, unit: Unit, module: nn.Module, args: tuple, output: Any) -> None:
        if in_backward():  # activation recomputation: the unit's backward still needs it
            return
        outs = [t for t in pytree.tree_leaves(output)
                if isinstance(t, torch.Tensor) and t.requires_grad]
        if torch.is_grad_enabled() and outs:
            for t in outs:
                t.register_hook(functools.partial(self._pre_backward, unit))
            self.prefetcher.post_forward(unit)
            if unit.reshard_after_forward:
                self.free(unit)
        else:
            self.free(unit)

    # ------------------------------------------------------------------------ backward

    def _enter_backward(self) -> None:
        if not self.in_backward:
            if self.listener is not None:
                self.listener.before_grads_change()
            self.in_backward = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)

    def _pre_backward(self, unit: Unit, grad: torch.Tensor) -> None:
        self._enter_backward()
        unit.gather()
        self.prefetcher.pre_backward(unit)

    def _post_backward(self, unit: Unit) -> None:
        unit.inputs_done = True
        self._maybe_free(unit)

    def _on_grad(self, unit: Unit, group: FlatParamGroup, index: int, param: nn.Parameter) -> None:
        self._enter_backward()
        grad, param.grad = param.grad, None
        if grad is not None and group.add_param_grad(index, grad):
            if self.sync_grads:
                self._reduce(group)
            unit.done += 1
            self._maybe_free(unit)

    def _reduce(self, group: FlatParamGroup) -> None:
        """Issue ``group``'s reduction, then finish the older ones beyond the in-flight limit."""
        if group.reducing:  # its last reduction lands before the next one starts
            self._finish_reductions(lambda g: g is group)
        group.reduce_grad(self.deterministic, wait=False)
        self._reducing.append(group)
        while len(self._reducing) > REDUCTIONS_IN_FLIGHT:
            self._finish(self._reducing.popleft())

    def _finish_reductions(self, until: Any = None) -> None:
        """Finish the reductions in flight, oldest first (all, or up to the first ``until``)."""
        while self._reducing:
            g = self._reducing.popleft()
            self._finish(g)
            if until is not None and until(g):
                return

    def _finish(self, group: FlatParamGroup) -> None:
        """Finish ``group``'s reduction: its ``grad`` is final for this backward."""
        group.finish_reduce()
        if self.listener is not None:
            self.listener.grad_reduced(group)

    def _maybe_free(self, unit: Unit) -> None:
        if unit.inputs_done and unit.done >= unit.trained:
            self.free(unit)

    def _finish_backward(self) -> None:
        """End of the backward pass: reduce what is left (unused parameters count as zero)."""
        try:
            if self.sync_grads:
                for unit in self.units:
                    for g in unit.groups:
                        if g.has_pending_grad:
                            self._reduce(g)
        finally:
            try:
                self._finish_reductions()
            finally:
                self._end_backward()

    def _end_backward(self) -> None:
        self._reducing.clear()
        if self.pool is not None:
            self.pool.clear()
        self.prefetcher.end_backward()
        for unit in self.units:
            unit.wait_gather()  # a prefetch whose unit never ran (stages 1, 2 keep it)
            self.free(unit)
            for g in unit.groups:
                g.end_backward()
            unit.inputs_done = False
            unit.done = 0
        self.in_backward = False
