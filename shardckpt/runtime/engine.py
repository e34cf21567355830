"""ZeRO-3 over any ``nn.Module``: flat groups per unit, gather/free/reduce-scatter hooks.

Life of one training step on every rank (Rajbhandari et al., "ZeRO", 2020, stage 3; the hook
structure follows PyTorch FSDP):

1. before a unit's forward its flat groups are all-gathered and its parameters become views into
   the gathered buffers; after the forward the buffers are freed (the root stays gathered until
   its backward, since that comes next);
2. when the gradient of a unit's output arrives, the unit is gathered again for its backward;
3. as soon as every parameter of a trained flat group has its local gradient, the group's
   gradient is reduce-scattered (mean over ranks) into an fp32 shard and the local copy is freed;
4. when a unit's backward is done (its inputs have gradients and its groups are reduced) it is
   freed; whatever is left is reduced and freed at the end of the backward pass;
5. the sharded optimizer (:mod:`shardckpt.runtime.optim`) updates the fp32 master shards and calls
   :meth:`ZeroEngine.refresh_params`.

Frozen groups (``requires_grad=False``) are gathered like the others but never reduced, and carry
no optimizer state. Every rank must run the same modules in the same order (the collectives pair
up by order). Outside forward/backward every parameter is a 0-element placeholder; read weights
through :meth:`ZeroEngine.local_shards` or :meth:`ZeroEngine.gather_full_params`.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping

import torch
from torch import nn
from torch.utils import _pytree as pytree

from shardckpt.errors import ConfigError
from shardckpt.layout import Layout, build_layout
from shardckpt.runtime import collectives
from shardckpt.runtime.flat import FlatParamGroup
from shardckpt.runtime.init import InitFn, shard_unit_by_unit, swap_meta_params
from shardckpt.runtime.mesh import ProcessMesh, current_process_mesh
from shardckpt.runtime.units import ROOT, PolicyLike, plan_units

log = logging.getLogger(__name__)


@dataclass(eq=False)
class _Unit:
    name: str
    module: nn.Module
    groups: list[FlatParamGroup]
    reshard_after_forward: bool
    trained: int = 0                 # trained groups in this unit
    reduced: int = 0                 # of those, reduced in the current backward
    inputs_done: bool = False        # gradients w.r.t. the unit's inputs were computed
    hooks: list[Any] = field(default_factory=list)


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


class ZeroEngine:
    """Shard ``module`` ZeRO-3 style over ``process_mesh`` (default: the current process group).

    Args:
        module: any ``nn.Module``, materialized or built on the meta device.
        policy: which submodules are units (a callable ``(fqn, module) -> bool``, a class or a
            tuple of classes); the root's leftover parameters form one more unit.
        process_mesh: topology and groups; :func:`~shardckpt.runtime.mesh.init_distributed`.
        deterministic: reduce gradients by summing in global rank order, then dividing by the
            world size (bit-exact against a single-process reference); else reduce-scatter.
        init_fn: initializes one module holding meta tensors (default ``reset_parameters()``).
        init_seed: if given, meta initialization runs under ``torch.manual_seed(init_seed)``.
        prefix: namespaces flat-group names (the checkpoint component; ``"model."``).
        reshard_root_after_forward: free the root unit after forward too (saves memory, costs
            one more all-gather of the root per step).

    Public surface (what checkpointing and tools rely on):

    * ``layout``: ``build_layout(infos, process_mesh.mesh, prefix)``, one info per distinct
      parameter in ``named_parameters()`` order, unit = FQN of its innermost unit module
      (``""`` for the root); ``tied_aliases`` maps alias FQNs (``lm_head.weight``) to them;
    * :meth:`local_shards` (live storage) and :meth:`refresh_params`;
    * :meth:`buffers` / :meth:`load_buffers` (persistent buffers by FQN);
    * the optimizer's ``optimizer_metadata()`` / ``load_optimizer_metadata()``;
    * :meth:`gather_full_params` and :meth:`clip_grad_norm_` (collective).

    Construction runs no collectives, but every rank must build the same module under the same
    RNG state (or pass ``init_seed``), since each keeps its slice of the same whole. Set
    ``requires_grad`` before constructing: it decides the flat groups. Several backward passes
    before a step add their (already averaged) gradients.
    """

    def __init__(self, module: nn.Module, *, policy: PolicyLike = None,
                 process_mesh: ProcessMesh | None = None, deterministic: bool = False,
                 init_fn: InitFn | None = None, init_seed: int | None = None,
                 prefix: str = "model.", reshard_root_after_forward: bool = False) -> None:
        self.module = module
        self.process_mesh = pm = process_mesh or current_process_mesh()
        self.deterministic = deterministic
        plan = plan_units(module, policy)
        self.layout: Layout = build_layout(plan.param_infos(), pm.mesh, prefix=prefix)
        self.tied_aliases: dict[str, str] = dict(plan.aliases)
        params, fresh = swap_meta_params(module, [(f, p) for f, p, _ in plan.params], pm.device)
        self._params = params
        self._fqn_of = {id(p): fqn for fqn, p in params.items()}
        self.groups: dict[str, FlatParamGroup] = {
            g.name: FlatParamGroup(g, self.layout, [params[f] for f in g.params], pm)
            for g in self.layout.groups
        }
        self.units: list[_Unit] = []
        for name in plan.units:
            groups = [g for g in self.groups.values() if g.spec.unit == name]
            self.units.append(_Unit(name, plan.modules[name], groups,
                                    reshard_root_after_forward or name != ROOT,
                                    trained=sum(g.trainable for g in groups)))
        unit_of = {id(params[f]): unit for f, _, unit in plan.params}
        shard_unit_by_unit(module, {u.name: u.groups for u in self.units}, unit_of,
                           {id(params[f]) for f in fresh}, pm.device, init_fn, init_seed)
        self._in_backward = False
        self._optimizer: Any = None
        for unit in self.units:
            self._register_hooks(unit)
        log.info("ZeroEngine: %d units, %d flat groups, %d parameters; %s", len(self.units),
                 len(self.groups), len(params), pm.describe())

    # ---------------------------------------------------------------------------- public

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """Each distinct parameter once, by canonical FQN (tied aliases left out)."""
        yield from self._params.items()

    def fqn_of(self, param: torch.Tensor) -> str:
        """The canonical FQN of one of the module's parameters."""
        try:
            return self._fqn_of[id(param)]
        except KeyError:
            raise ConfigError("this tensor is not a parameter of the engine's module; build "
                              "optimizer groups from engine.named_parameters()") from None

    def local_shards(self) -> dict[str, dict[str, torch.Tensor]]:
        """Group name -> {state kind -> this rank's live 1-D shard of ``layout.shard_numel``}.

        Kinds: ``master`` (fp32 if trained, the param dtype if frozen) and, for trained groups
        once an optimizer is attached, its per-element kinds. These are the real storage: write
        into them (e.g. from a checkpoint), then call :meth:`refresh_params`.
        """
        out: dict[str, dict[str, torch.Tensor]] = {}
        for name, g in self.groups.items():
            kinds = {"master": g.master}
            if self._optimizer is not None and g.trainable:
                kinds.update(self._optimizer.local_state(name))
            out[name] = kinds
        return out

    def refresh_params(self) -> None:
        """Re-derive the compute shards from the masters and drop any stale gathered buffer.

        Local (no collectives); call between steps, on every rank.
        """
        for g in self.groups.values():
            g.free()
            g.refresh()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the reduced gradient shards (and any stray ``.grad``)."""
        for g in self.groups.values():
            g.zero_grad(set_to_none)
        for p in self._params.values():
            p.grad = None

    def clip_grad_norm_(self, max_norm: float, eps: float = 1e-6) -> float:
        """Scale the reduced gradient shards so that their global L2 norm is at most ``max_norm``.

        Returns the norm before clipping. Same rule as ``torch.nn.utils.clip_grad_norm_``
        (coefficient ``max_norm / (norm + eps)``, capped at 1), but the squares are summed per
        shard (in fp64) and then across ranks, so the norm is not bit-exact against an unsharded
        one. Collective: call on every rank, between ``backward()`` and ``step()``.
        """
        device = self.process_mesh.device
        total = torch.zeros((), dtype=torch.float64, device=device)
        for g in self.groups.values():
            if g.grad is not None:
                total += g.grad.double().square().sum()
        norm = collectives.all_reduce_shard_sum(self.process_mesh, total).sqrt()
        coef = torch.clamp(max_norm / (norm + eps), max=1.0)
        for g in self.groups.values():
            if g.grad is not None:
                g.grad.mul_(coef.to(g.grad.dtype))
        return float(norm)

    def buffers(self) -> dict[str, torch.Tensor]:
        """Persistent buffers by FQN (replicated on every rank; the live tensors)."""
        out = {}
        for mfqn, m in self.module.named_modules():
            for key, b in m._buffers.items():
                if b is not None and key not in m._non_persistent_buffers_set:
                    out[f"{mfqn}.{key}" if mfqn else key] = b
        return out

    def load_buffers(self, buffers: Mapping[str, torch.Tensor], strict: bool = True) -> None:
        """Copy ``buffers`` into the persistent buffers in place; strict names every mismatch."""
        mine = self.buffers()
        missing = sorted(set(mine) - set(buffers))
        unexpected = sorted(set(buffers) - set(mine))
        shape = sorted(k for k in set(mine) & set(buffers)
                       if tuple(mine[k].shape) != tuple(buffers[k].shape))
        if shape or (strict and (missing or unexpected)):
            raise ConfigError(f"buffers do not match: missing {missing}, unexpected {unexpected}, "
                              f"different shape {shape}")
        with torch.no_grad():
            for k in set(mine) & set(buffers):
                mine[k].copy_(buffers[k])

    def gather_full_params(self, fqns: list[str] | None = None) -> dict[str, torch.Tensor]:
        """Whole parameters (from the masters, in the master dtype) by FQN. Collective.

        Holds every requested group whole at once: for tests, demos and small models.
        """
        wanted = set(fqns) if fqns is not None else None
        out: dict[str, torch.Tensor] = {}
        for g in self.groups.values():
            if wanted is not None and not wanted.intersection(g.spec.params):
                continue
            full = collectives.all_gather_flat(self.process_mesh, g.master)
            for spec in g.param_specs:
                if wanted is None or spec.fqn in wanted:
                    out[spec.fqn] = full[spec.offset:spec.offset + spec.numel].view(spec.shape).clone()
        return out

    @property
    def optimizer(self) -> Any:
        return self._optimizer

    def attach_optimizer(self, optimizer: Any) -> None:
        """Called by the sharded optimizer; one optimizer per engine."""
        if self._optimizer is not None and self._optimizer is not optimizer:
            raise ConfigError("this engine already has an optimizer; create one per engine")
        self._optimizer = optimizer

    # ----------------------------------------------------------------------------- hooks

    def _register_hooks(self, unit: _Unit) -> None:
        unit.hooks.append(unit.module.register_forward_pre_hook(
            functools.partial(self._pre_forward, unit), with_kwargs=True))
        unit.hooks.append(unit.module.register_forward_hook(
            functools.partial(self._post_forward, unit)))
        for g in unit.groups:
            if g.trainable:
                for i, p in enumerate(g.params):
                    unit.hooks.append(p.register_post_accumulate_grad_hook(
                        functools.partial(self._on_grad, unit, g, i)))

    def _pre_forward(self, unit: _Unit, module: nn.Module, args: tuple, kwargs: dict) -> Any:
        for g in unit.groups:
            g.gather()
        if not torch.is_grad_enabled():
            return None
        flat, spec = pytree.tree_flatten((args, kwargs))
        idx = [i for i, t in enumerate(flat) if isinstance(t, torch.Tensor) and t.requires_grad]
        if not idx:
            return None
        marked = _PostBackward.apply(functools.partial(self._post_backward, unit),
                                     *(flat[i] for i in idx))
        for i, t in zip(idx, marked):
            flat[i] = t
        return pytree.tree_unflatten(flat, spec)

    def _post_forward(self, unit: _Unit, module: nn.Module, args: tuple, output: Any) -> None:
        outs = [t for t in pytree.tree_leaves(output)
                if isinstance(t, torch.Tensor) and t.requires_grad]
        if torch.is_grad_enabled() and outs:
            for t in outs:
                t.register_hook(functools.partial(self._pre_backward, unit))
            if unit.reshard_after_forward:
                self._free(unit)
        else:
            self._free(unit)

    def _enter_backward(self) -> None:
        if not self._in_backward:
            self._in_backward = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)

    def _pre_backward(self, unit: _Unit, grad: torch.Tensor) -> None:
        self._enter_backward()
        for g in unit.groups:
            g.gather()

    def _post_backward(self, unit: _Unit) -> None:
        unit.inputs_done = True
        self._maybe_free(unit)

    def _on_grad(self, unit: _Unit, group: FlatParamGroup, index: int, param: nn.Parameter) -> None:
        self._enter_backward()
        grad, param.grad = param.grad, None
        if grad is not None and group.add_param_grad(index, grad):
            group.reduce_grad(self.deterministic)
            unit.reduced += 1
            self._maybe_free(unit)

    def _maybe_free(self, unit: _Unit) -> None:
        if unit.inputs_done and unit.reduced >= unit.trained:
            self._free(unit)

    def _finish_backward(self) -> None:
        """End of the backward pass: reduce what is left (unused parameters count as zero)."""
        try:
            for unit in self.units:
                for g in unit.groups:
                    if g.has_pending_grad:
                        g.reduce_grad(self.deterministic)
        finally:
            for unit in self.units:
                self._free(unit)
                unit.inputs_done = False
                unit.reduced = 0
            self._in_backward = False

    @staticmethod
    def _free(unit: _Unit) -> None:
        for g in unit.groups:
            g.free()


def shard_model(module: nn.Module, policy: PolicyLike = None, **kwargs: Any) -> ZeroEngine:
    """``ZeroEngine(module, policy=policy, **kwargs)``: the functional spelling."""
    return ZeroEngine(module, policy=policy, **kwargs)
