"""Whole parameters outside forward: gather, summon (optionally writable), full state dicts.

Everything here reads or writes the fp32 **master** shards (the declared dtype for frozen
groups), never the compute copies, so it sees exactly what the optimizer steps and a checkpoint
stores, whatever the stage or mixed-precision policy. Each function holds whole flat groups in
memory: for tests, demos, evaluation and small models (use checkpoints and the offline
consolidator for big ones).

Collective functions (every rank calls them in the same order): :func:`gather_full_params`,
:func:`summon_full_params`, :func:`full_state_dict`. :func:`load_full_state_dict` is local:
every rank already holds the whole tensors and keeps its slice. Each reads the sharded module
through a :class:`ShardedModule`, which the engine builds once.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field
from collections.abc import Iterator, Mapping

import torch
from torch import nn

from shardckpt.errors import ConfigError
from shardckpt.format.layout import Layout
from shardckpt.runtime import collectives
from shardckpt.runtime.flat import FlatParamGroup, point_params
from shardckpt.runtime.mesh import ProcessMesh
from shardckpt.runtime.offload.master import master_tensor, store_master
from shardckpt.runtime.stages import StageSchedule, in_backward

log = logging.getLogger(__name__)


class PlaceholderGuard:
    """Whether ``state_dict()`` hooks refuse placeholders: off only while
    :func:`full_state_dict` reads the module's keys."""

    __slots__ = ("active",)

    def __init__(self) -> None:
        self.active = True

    @contextlib.contextmanager
    def suspended(self) -> Iterator[None]:
        self.active = False
        try:
            yield
        finally:
            self.active = True


@dataclass(frozen=True, eq=False)
class ShardedModule:
    """What the whole-parameter functions read of a sharded module; the engine builds it once.

    ``params`` maps each distinct parameter's canonical FQN to it (aliases left out);
    ``schedule`` gives the stage, the units and whether a backward runs.
    """

    module: nn.Module
    layout: Layout
    groups: Mapping[str, FlatParamGroup]
    params: Mapping[str, nn.Parameter]
    tied_aliases: Mapping[str, str]
    process_mesh: ProcessMesh
    schedule: StageSchedule
    guard: PlaceholderGuard = field(default_factory=PlaceholderGuard)


def persistent_buffers(module: nn.Module) -> dict[str, torch.Tensor]:
    """Persistent buffers of ``module`` by FQN (the live tensors)."""
    out = {}
    for mfqn, m in module.named_modules():
        for key, b in m._buffers.items():
            if b is not None and key not in m._non_persistent_buffers_set:
                out[f"{mfqn}.{key}" if mfqn else key] = b
    return out


def load_buffers(mine: Mapping[str, torch.Tensor], buffers: Mapping[str, torch.Tensor],
                 strict: bool = True) -> None:
    """Copy ``buffers`` into ``mine`` in place; one error names every mismatch."""
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


def refuse_placeholder_state_dicts(sharded: ShardedModule) -> None:
    """Make ``state_dict()`` of the module (or any submodule) raise instead of holding placeholders.

    Between steps a sharded parameter holds 0 elements, and a state dict of those saves nothing
    (``save_pretrained``, ``torch.save(model.state_dict())``, ``dcp.save({"model": model})``).
    Gathering whole tensors there instead would be a collective, and ``state_dict()`` is often
    called on rank 0 alone, where a collective hangs; so the error points at the collective
    :meth:`ZeroEngine.full_state_dict` and at the checkpointer.
    """
    fqn_of = {id(p): fqn for fqn, p in sharded.params.items()}
    for m in sharded.module.modules():
        if any(p is not None for p in m._parameters.values()):
            m.register_state_dict_post_hook(
                lambda module, *_: _refuse_placeholders(sharded, fqn_of, module, "state_dict"))
            m.register_load_state_dict_pre_hook(
                lambda module, *_: _refuse_placeholders(sharded, fqn_of, module,
                                                        "load_state_dict"))


_WAY_OUT = {
    "state_dict": "For whole tensors call engine.full_state_dict() on every rank (a collective); "
                  "to save and resume, use shardckpt.training.checkpointer.Checkpointer (any world size "
                  "loads it; `shardckpt consolidate` turns it into safetensors)",
    "load_state_dict": "Load whole tensors with engine.load_full_state_dict(state_dict) (local: "
                       "each rank keeps its slice), or a shardckpt checkpoint with "
                       "shardckpt.training.checkpointer.Checkpointer",
}


def _refuse_placeholders(sharded: ShardedModule, fqn_of: Mapping[int, str], module: nn.Module,
                         what: str) -> None:
    if not sharded.guard.active:
        return
    layout = sharded.layout
    for p in module._parameters.values():
        if p is None:
            continue
        fqn = fqn_of.get(id(p))
        if fqn is None or p.numel() or not layout.param(fqn).numel:
            continue
        raise ConfigError(
            f"{type(module).__name__}.{what}(): {fqn} is a 0-element placeholder (its shape is "
            f"{list(layout.param(fqn).shape)}): the engine keeps parameters sharded between "
            f"steps. {_WAY_OUT[what]}")


def gather_full_params(sharded: ShardedModule, fqns: list[str] | None = None
                       ) -> dict[str, torch.Tensor]:
    """Whole parameters (clones, master dtype) by canonical FQN; only groups holding ``fqns``
    are gathered. Collective."""
    wanted = set(fqns) if fqns is not None else None
    out: dict[str, torch.Tensor] = {}
    for g in sharded.groups.values():
        if wanted is not None and not wanted.intersection(g.spec.params):
            continue
        full = collectives.all_gather_flat(sharded.process_mesh, master_tensor(g))
        for spec in g.param_specs:
            if wanted is None or spec.fqn in wanted:
                out[spec.fqn] = full[spec.offset:spec.offset + spec.numel].view(spec.shape).clone()
    return out


def _refuse_mid_step(sharded: ShardedModule, what: str) -> None:
    schedule = sharded.schedule
    mid_forward = schedule.stage == 3 and any(g.gathered for g in sharded.groups.values())
    if in_backward() or schedule.in_backward or mid_forward:
        raise ConfigError(f"{what} was called inside forward or backward; call it between "
                          "steps (after backward and step, or before the first forward)")


@contextlib.contextmanager
def summon_full_params(sharded: ShardedModule, writeback: bool = False
                       ) -> Iterator[dict[str, torch.Tensor]]:
    """Inside the block, every parameter of ``sharded.module`` is its whole master-dtype tensor.

    Yields FQN -> parameter (tied aliases included, as the same tensor). With ``writeback``,
    the parameters' values on a normal exit (whether written in place under ``torch.no_grad()``
    or rebound through ``.data``) become the new masters: each rank keeps its slice, so every
    rank must write the same values. Afterwards the parameters are what they were before
    (placeholders in stage 3, gathered compute views in stages 1 and 2, re-gathered after a
    writeback). Collective on entry, and on exit with ``writeback`` in stages 1 and 2.
    """
    _refuse_mid_step(sharded, "summon_full_params()")
    pm = sharded.process_mesh
    fulls: dict[str, torch.Tensor] = {}
    for name, g in sharded.groups.items():
        fulls[name] = full = collectives.all_gather_flat(pm, master_tensor(g))
        point_params(g.params, g.param_specs, full)
    params: dict[str, torch.Tensor] = dict(sharded.params)
    params.update({alias: params[canon] for alias, canon in sharded.tied_aliases.items()})
    try:
        yield params
    except BaseException:
        for g in sharded.groups.values():
            g.repoint()
        raise
    if writeback:
        with torch.no_grad():
            for name, g in sharded.groups.items():
                full = fulls[name]
                for p, spec in zip(g.params, g.param_specs, strict=True):
                    target = full[spec.offset:spec.offset + spec.numel]
                    if p.data.data_ptr() != target.data_ptr():  # rebound through .data
                        if tuple(p.shape) != spec.shape:
                            raise ConfigError(f"summon_full_params(writeback=True): {spec.fqn} "
                                              f"now has shape {tuple(p.shape)}, expected "
                                              f"{spec.shape}")
                        target.copy_(p.data.reshape(-1))
                g.free()
                g.shard_from_full(full)
        log.debug("summon_full_params: wrote back %d flat groups", len(fulls))
    for g in sharded.groups.values():
        g.repoint()
    if writeback and sharded.schedule.stage < 3:
        for unit in sharded.schedule.units:
            unit.gather()


def full_state_dict(sharded: ShardedModule, dtype: torch.dtype | None = None
                    ) -> dict[str, torch.Tensor]:
    """``sharded.module.state_dict()`` with whole tensors, in its key order. Collective.

    Parameters come from the masters (tied aliases map to the same tensor, as in
    ``state_dict()``), persistent buffers are cloned; floating-point tensors are cast to
    ``dtype`` if given.
    """
    _refuse_mid_step(sharded, "full_state_dict()")
    params = gather_full_params(sharded)
    buffers = persistent_buffers(sharded.module)
    out: dict[str, torch.Tensor] = {}
    with sharded.guard.suspended():
        entries = sharded.module.state_dict(keep_vars=True)
    for key, value in entries.items():
        canon = sharded.tied_aliases.get(key, key)
        if canon in params:
            if dtype is not None and params[canon].is_floating_point():
                params[canon] = params[canon].to(dtype)  # once, so aliases share the tensor
            out[key] = params[canon]
        elif key in buffers:
            t = buffers[key].detach().clone()
            out[key] = t.to(dtype) if dtype is not None and t.is_floating_point() else t
        else:  # extra state a module adds to its state dict
            out[key] = value
    return out


def load_full_state_dict(sharded: ShardedModule, state_dict: Mapping[str, torch.Tensor],
                         strict: bool = True) -> None:
    """Copy whole tensors into this rank's master slices and the persistent buffers. Local.

    Keys are canonical FQNs or tied aliases (either one suffices) and buffer FQNs. Wrong
    shapes always raise; with ``strict``, missing and unexpected keys too, all in one error.
    Parameters left out (non-strict) keep their values. The compute copies are refreshed.
    """
    layout, aliases = sharded.layout, sharded.tied_aliases
    buffers = persistent_buffers(sharded.module)
    source: dict[str, torch.Tensor] = {}
    unexpected, shape = [], []
    for key, t in state_dict.items():
        fqn = aliases.get(key, key)
        if layout.has_param(fqn):
            if tuple(t.shape) != layout.param(fqn).shape:
                shape.append(f"{key} {list(t.shape)} (expected {list(layout.param(fqn).shape)})")
            elif fqn not in source or key == fqn:
                source[fqn] = t
        elif key not in buffers:
            unexpected.append(key)
    missing = [p.fqn for p in layout.params if p.fqn not in source]
    missing += [k for k in buffers if k not in state_dict]
    if shape or (strict and (missing or unexpected)):
        raise ConfigError(f"state dict does not match the model: missing {missing}, "
                          f"unexpected {unexpected}, different shape {shape}")
    with torch.no_grad():
        for g in sharded.groups.values():
            g.free()
            master = master_tensor(g)
            for spec in g.param_specs:
                if spec.fqn not in source:
                    continue
                lo = max(spec.offset, g.shard_start)
                hi = min(spec.offset + spec.numel, g.shard_end)
                if lo < hi:
                    flat = source[spec.fqn].reshape(-1)[lo - spec.offset:hi - spec.offset]
                    master[lo - g.shard_start:hi - g.shard_start].copy_(flat)
            store_master(g, master)
        load_buffers(buffers, {k: v for k, v in state_dict.items() if k in buffers}, strict=False)
