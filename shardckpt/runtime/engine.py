"""ZeRO stages 1, 2 and 3 over any ``nn.Module``: flat groups per unit, gather/free/reduce hooks.

Life of one training step on every rank (Rajbhandari et al., "ZeRO", 2020; the hook structure
follows PyTorch FSDP; :mod:`shardckpt.runtime.stages` has the per-stage schedule):

1. before a unit's forward its flat groups are all-gathered and its parameters become views into
   the gathered buffers (in the compute dtype of the mixed-precision policy, if any); in stage 3
   the buffers are freed after the forward (the root stays gathered until its backward, since
   that comes next; with ``reshard_after_forward=False`` every unit does); in stages 1 and 2 they
   stay until the optimizer step. With ``prefetch`` the next unit's all-gather is already in
   flight (:mod:`shardckpt.runtime.prefetch`);
2. when the gradient of a unit's output arrives, the unit is gathered again for its backward
   (with ``prefetch``, the unit whose backward comes next starts gathering);
3. as soon as every parameter of a trained flat group has its local gradient, the group's
   gradient is reduced (mean over ranks): reduce-scattered into an fp32 shard, at every stage.
   Stages 2 and 3 then free the local gradient buffer; stage 1 keeps it (gradients are not
   partitioned: a whole-size buffer per rank, reused every step, the shard in its own slice).
   Under :meth:`ZeroEngine.no_sync` it is accumulated locally instead and reduced with the next
   synced backward;
4. when a unit's backward is done (its inputs have gradients and its groups are complete) it is
   freed (stage 3); whatever is left is reduced at the end of the backward pass;
5. the sharded optimizer (:mod:`shardckpt.runtime.optim`) updates the fp32 master shards and calls
   :meth:`ZeroEngine.after_step`, which re-derives the compute shards (and, in stages 1 and 2,
   all-gathers the updated parameters).

Frozen groups (``requires_grad=False``) are gathered like the others but never reduced, and carry
no optimizer state. Every rank must run the same modules in the same order (the collectives pair
up by order). In stage 3, outside forward/backward every parameter is a 0-element placeholder;
read weights through :meth:`ZeroEngine.local_shards`, :meth:`ZeroEngine.gather_full_params`,
:meth:`ZeroEngine.summon_full_params` or :meth:`ZeroEngine.full_state_dict`. ``state_dict()`` of
the module (or of any submodule) raises an error that says so rather than return placeholders.
``p.ndim`` and ``p.shape`` of a placeholder mislead too: build weight-decay groups with
:func:`~shardckpt.runtime.optim.decay_param_groups` (the layout's shapes).
"""

from __future__ import annotations

import contextlib
import logging
from collections import OrderedDict
from typing import Any
from collections.abc import Callable, Iterator, Mapping

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from shardckpt.errors import ConfigError
from shardckpt.format.footprint_math import Estimate
from shardckpt.format.layout import Layout, build_layout
from shardckpt.runtime import footprint, full_params
from shardckpt.runtime.accounting import Accounting
from shardckpt.runtime.compiled import CompileLike, check_compile, compile_unit_forwards
from shardckpt.runtime.contracts import EngineOptimizer, ReductionListener
from shardckpt.runtime.engine_grads import GradientControls
from shardckpt.runtime.flat import FlatParamGroup, GradBufferPool
from shardckpt.runtime.init import InitFn, shard_unit_by_unit, swap_meta_params
from shardckpt.runtime.offload.config import OffloadConfig, check_offload
from shardckpt.runtime.mesh import ProcessMesh, current_process_mesh
from shardckpt.runtime.precision import (MixedPrecisionPolicy, check_policy, input_cast_dtype,
                                         resolve_precision, torch_dtype)
from shardckpt.runtime.prefetch import CommStream
from shardckpt.runtime.stages import StageSchedule, Unit, build_units, check_stage
from shardckpt.runtime.units import PolicyLike, plan_units
from shardckpt.runtime.zeropp.options import ZeroPP, check_zeropp

log = logging.getLogger(__name__)


class ZeroEngine(GradientControls):
    """Shard ``module`` ZeRO style over ``process_mesh`` (default: the current process group).

    Args:
        module: any ``nn.Module``, materialized or built on the meta device.
        policy: which submodules are units (a callable ``(fqn, module) -> bool``, a class or a
            tuple of classes); the root's leftover parameters form one more unit. Tied
            parameters must fall in one unit (or the alias's unit inside the owner's).
        process_mesh: topology and groups; :func:`~shardckpt.runtime.mesh.init_distributed`.
        stage: 1 (optimizer state sharded), 2 (+ gradients) or 3 (+ parameters); see
            :mod:`shardckpt.runtime.stages`. The stored state is the same for every stage.
        mixed_precision: compute and reduce dtypes
            (:class:`~shardckpt.runtime.precision.MixedPrecisionPolicy`); masters stay fp32.
        deterministic: reduce gradients by summing in global rank order, then dividing by the
            world size (bit-exact against a single-process reference); else the backend reduces.
        init_fn: initializes one module holding meta tensors (default ``reset_parameters()``).
        init_seed: if given, meta initialization runs under ``torch.manual_seed(init_seed)``.
        prefix: namespaces flat-group names (the checkpoint component; ``"model."``).
        reshard_root_after_forward: stage 3: free the root unit after forward too (saves memory,
            costs one more all-gather of the root per step).
        reshard_after_forward: stage 3: free the other units after their forward (default); with
            ``False`` they stay gathered until their backward is done, so each unit is
            all-gathered once per step (2Ψ per step instead of 3Ψ, for the memory of every
            unit's compute copy during the step; FSDP2's option of the same name).
        prefetch: issue the next unit's all-gather asynchronously while the current unit
            computes, in forward and (reverse order) in backward; on CUDA on a side stream. The
            same collectives and bits as without it (:mod:`shardckpt.runtime.prefetch`).
        zeropp: ZeRO++ options (:class:`~shardckpt.runtime.zeropp.ZeroPP`: quantized weight
            gathers, an in-node secondary weight copy for the backward gather, quantized
            hierarchical gradient reduction); off by default. Nodes are blocks of
            ``process_mesh.ranks_per_node`` ranks. Masters, optimizer state and checkpoints
            are the same with or without them.
        offload_optimizer: ``None`` (optimizer state and step on the device), ``"cpu"`` (fp32
            masters, optimizer state and step in host memory, pinned on CUDA) or ``"nvme"``
            (in files under ``offload_dir``, a writable local directory, streamed group by
            group), or an :class:`~shardckpt.runtime.offload.config.OffloadConfig` (the mode
            and its knobs: the pipeline, host threads, fused AdamW); the weight shard the gathers read stays on the device (in the compute
            dtype alone if narrower: :mod:`~shardckpt.runtime.offload.master`). Same bits,
            same checkpoints (:mod:`shardckpt.runtime.offload.store`). :meth:`close` removes files.
            With ``offload_overlap_step`` each group's host step runs in backward, once its
            gradient is reduced: no clipping, ``no_sync`` to accumulate (the rule is in
            :mod:`shardckpt.runtime.offload.store`); else in ``optimizer.step()``.
        compile_units: ``True`` (``torch.compile``'s defaults) or a dict of ``torch.compile``
            keyword arguments: the forward of each non-root unit is compiled, the gather, free
            and reduce hooks stay outside the graph (:mod:`shardckpt.runtime.compiled`); the
            units compiled are in ``compiled_units``. Not with ``deterministic=True``, which
            stays eager (a :class:`ConfigError`).

    Public surface (what checkpointing and tools rely on):

    * ``layout``: ``build_layout(infos, process_mesh.mesh, prefix)``, one info per distinct
      parameter in ``named_parameters()`` order (declared dtypes, whatever the precision
      policy), unit = FQN of its innermost unit module (``""`` for the root); ``tied_aliases``
      maps alias FQNs (``lm_head.weight``) to them;
    * :meth:`local_shards` (live storage) and :meth:`refresh_params`;
    * :meth:`buffers` / :meth:`load_buffers` (persistent buffers by FQN);
    * the optimizer's ``optimizer_metadata()`` / ``load_optimizer_metadata()``;
    * :meth:`gather_full_params`, :meth:`summon_full_params`, :meth:`full_state_dict` and
      :meth:`clip_grad_norm_` (collective); :meth:`load_full_state_dict` (local);
    * ``accounting`` (:mod:`shardckpt.runtime.accounting`: elements per collective type,
      gathered-weight bytes and peak); :meth:`model_state_bytes` and :meth:`estimate`
      (:mod:`shardckpt.runtime.footprint`).

    Construction runs no collectives (with hpZ or qgZ it creates the node process groups, which
    every rank does alike), but every rank must build the same module under the same
    RNG state (or pass ``init_seed``), since each keeps its slice of the same whole. Set
    ``requires_grad`` before constructing: it decides the flat groups. Several synced backward
    passes before a step add their (already averaged) gradients; under :meth:`no_sync` they
    accumulate locally and are reduced once.
    """

    def __init__(self, module: nn.Module, *, policy: PolicyLike = None,
                 process_mesh: ProcessMesh | None = None, stage: int = 3,
                 mixed_precision: MixedPrecisionPolicy | None = None, deterministic: bool = False,
                 init_fn: InitFn | None = None, init_seed: int | None = None,
                 prefix: str = "model.", reshard_root_after_forward: bool = False,
                 reshard_after_forward: bool = True, prefetch: bool = True,
                 zeropp: ZeroPP | None = None, offload_optimizer: str | OffloadConfig | None = None,
                 offload_dir: Any = None, offload_overlap_step: bool = False,
                 compile_units: CompileLike = False) -> None:
        stage = check_stage(stage)
        compile_options = check_compile(compile_units, deterministic)
        self.offload: OffloadConfig | None = check_offload(offload_optimizer, offload_dir,
                                                           offload_overlap_step)
        mixed_precision = check_policy(mixed_precision)
        zeropp = ZeroPP() if zeropp is None else zeropp
        self.module = module
        self.process_mesh = pm = process_mesh or current_process_mesh()
        self.deterministic = deterministic
        self.stage = stage
        self.mixed_precision = mixed_precision
        plan = plan_units(module, policy)
        self.layout: Layout = build_layout(plan.param_infos(), pm.mesh, prefix=prefix)
        check_zeropp(zeropp, pm, stage, [
            (g.name, resolve_precision(mixed_precision, torch_dtype(g.dtype)).sum)
            for g in self.layout.groups if g.requires_grad])
        self.zeropp = zeropp
        if zeropp.hpz or zeropp.qgz:
            pm.node_groups()  # collective: every rank creates the node groups now, in one order
        self.tied_aliases: dict[str, str] = dict(plan.aliases)
        params, fresh = swap_meta_params(module, [(f, p) for f, p, _ in plan.params], pm.device)
        self._params = params
        self._fqn_of = {id(p): fqn for fqn, p in params.items()}
        self.accounting = Accounting()
        comm = CommStream(pm.device)
        pool = GradBufferPool()
        self.groups: dict[str, FlatParamGroup] = {
            g.name: FlatParamGroup(g, self.layout, [params[f] for f in g.params], pm,
                                   self.accounting, comm, resident_grad=stage == 1, pool=pool)
            for g in self.layout.groups
        }
        self.units: list[Unit] = build_units(plan.units, plan.modules, self.groups.values(), stage,
                                             reshard_root_after_forward, reshard_after_forward)
        for unit in self.units:
            for g in unit.groups:
                g.zeropp = zeropp if zeropp.enabled else None
                g.hpz = zeropp.hpz and unit.reshard_after_forward  # re-gathered in backward
        unit_of = {id(params[f]): unit for f, _, unit in plan.params}
        shard_unit_by_unit(module, {u.name: u.groups for u in self.units}, unit_of,
                           {id(params[f]) for f in fresh}, pm.device, init_fn, init_seed)
        if mixed_precision is not None:  # after init: masters hold the declared-dtype values
            for g in self.groups.values():
                g.set_precision(resolve_precision(mixed_precision, g.dtype))
        self._optimizer: EngineOptimizer | None = None
        self._listener: ReductionListener | None = None  # offload: the store's host copies
        # an OrderedDict: RemovableHandle keeps a weak reference to it
        self._update_hooks: OrderedDict[int, Callable[[], None]] = OrderedDict()
        self._schedule = StageSchedule(self.units, stage, deterministic,
                                       input_cast_dtype(mixed_precision), prefetch, module,
                                       pool=pool)
        self.accounting.reset()  # construction gathered units one by one to initialize them
        self.compiled_units: list[str] = ([] if compile_options is None else
                                          compile_unit_forwards(self.units, compile_options))
        self._sharded = full_params.ShardedModule(module, self.layout, self.groups, params,
                                                  self.tied_aliases, pm, self._schedule)
        full_params.refuse_placeholder_state_dicts(self._sharded)
        log.info("ZeroEngine: stage %d, %d units, %d flat groups, %d parameters%s%s%s%s; %s",
                 stage, len(self.units), len(self.groups), len(params),
                 f", {mixed_precision}" if mixed_precision else "",
                 f", {len(self.compiled_units)} units compiled" if self.compiled_units else "",
                 f", {zeropp.describe()}" if zeropp.enabled else "",
                 f", {self.offload.describe()}" if self.offload else "", pm.describe())

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
        once an optimizer is attached, its per-element kinds. The same for every stage and
        precision policy. These are the real storage (an offloaded ``master`` the store's: a host
        tensor or an ``OffloadedShard``): write into them, then call :meth:`refresh_params`.
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

        Local (no collectives); call between steps, on every rank. In stages 1 and 2 the next
        forward gathers again.
        """
        for g in self.groups.values():
            g.free()
            g.refresh(reload=True)

    def after_step(self) -> None:
        """After the optimizer updated the trained masters: re-derive their compute shards; in
        stages 1 and 2 all-gather the updated parameters at once. Collective in stages 1, 2."""
        for g in self.groups.values():
            if g.trainable:
                g.free()
                g.refresh()
        if self.stage < 3:
            for unit in self.units:  # issue every all-gather, then wait for them
                unit.start_gather()
            for unit in self.units:
                unit.wait_gather()

    def buffers(self) -> dict[str, torch.Tensor]:
        """Persistent buffers by FQN (replicated on every rank; the live tensors)."""
        return full_params.persistent_buffers(self.module)

    def load_buffers(self, buffers: Mapping[str, torch.Tensor], strict: bool = True) -> None:
        """Copy ``buffers`` into the persistent buffers in place; strict names every mismatch."""
        full_params.load_buffers(self.buffers(), buffers, strict)

    def gather_full_params(self, fqns: list[str] | None = None) -> dict[str, torch.Tensor]:
        """Whole parameters (from the masters, in the master dtype) by FQN. Collective.

        Holds every requested group whole at once: for tests, demos and small models.
        """
        return full_params.gather_full_params(self._sharded, fqns)

    def summon_full_params(self, writeback: bool = False
                           ) -> contextlib.AbstractContextManager[dict[str, torch.Tensor]]:
        """Context manager: the module's parameters are whole master-dtype tensors inside.

        Yields FQN (aliases included) -> parameter tensor. With ``writeback``, what was written
        into them (under ``torch.no_grad()``, the same on every rank) goes back into the masters
        on exit. Collective; not inside forward or backward. See
        :func:`shardckpt.runtime.full_params.summon_full_params`.
        """
        return full_params.summon_full_params(self._sharded, writeback)

    def full_state_dict(self, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """``module.state_dict()`` with whole tensors (masters, aliases, persistent buffers),
        cast to ``dtype`` if given. Collective; for small models."""
        return full_params.full_state_dict(self._sharded, dtype)

    def load_full_state_dict(self, state_dict: Mapping[str, torch.Tensor],
                             strict: bool = True) -> None:
        """Load whole tensors (as :meth:`full_state_dict` gives them) into the masters and
        buffers; each rank keeps its slice. Local (no collectives)."""
        full_params.load_full_state_dict(self._sharded, state_dict, strict)

    def model_state_bytes(self) -> dict[str, int]:
        """Bytes of model state this rank holds now by kind (``params``, ``grads``, ``master``,
        ``optim``), each storage once; :func:`shardckpt.runtime.footprint.model_state_bytes`."""
        return footprint.model_state_bytes(self.groups, self._optimizer)

    def estimate(self, precision: str | None = None) -> Estimate:
        """The estimator's figures for this model (padded Ψ), stage, mesh and precision policy;
        :func:`shardckpt.runtime.footprint.estimate_for`."""
        return footprint.estimate_for(self.layout, self.process_mesh, self.stage, self.groups,
                                      precision)

    @property
    def optimizer(self) -> EngineOptimizer | None:
        return self._optimizer

    def register_update_pre_hook(self, hook: Callable[[], None]) -> RemovableHandle:
        """Run ``hook()`` before the optimizer updates the masters and optimizer state in place.

        Whatever optimizer is attached, now or later: an async checkpoint waits here until its
        staging copy of the shards is done. Returns a handle whose ``remove()`` unregisters it.
        """
        handle = RemovableHandle(self._update_hooks)
        self._update_hooks[handle.id] = hook
        return handle

    def before_update(self) -> None:
        """Called by the sharded optimizer right before it changes the shards."""
        for hook in list(self._update_hooks.values()):
            hook()

    def attach_optimizer(self, optimizer: EngineOptimizer) -> None:
        """Called by the sharded optimizer; one optimizer per engine."""
        if self._optimizer is not None and self._optimizer is not optimizer:
            raise ConfigError("this engine already has an optimizer; create one per engine")
        self._optimizer = optimizer

    def set_reduction_listener(self, listener: ReductionListener) -> None:
        """Register the one :class:`~shardckpt.runtime.contracts.ReductionListener` (an
        offloaded optimizer's store): told of each finished reduction in backward, before the
        reduced gradients change in place, and once clipping scaled them."""
        self._listener = self._schedule.listener = listener

    def close(self) -> None:
        """Release the optimizer's offloaded state (``offload_optimizer``: its files are
        removed). The engine cannot step afterwards. Idempotent."""
        if self._optimizer is not None:
            self._optimizer.close_offload()

    @property
    def in_backward(self) -> bool:
        return self._schedule.in_backward


def shard_model(module: nn.Module, policy: PolicyLike = None, **kwargs: Any) -> ZeroEngine:
    """``ZeroEngine(module, policy=policy, **kwargs)``: the functional spelling."""
    return ZeroEngine(module, policy=policy, **kwargs)
