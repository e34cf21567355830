"""Activation checkpointing of units: ``torch.utils.checkpoint`` (non-reentrant) per unit.

A checkpointed unit keeps no activations from its forward; backward re-runs the forward to get
them. In stage 3 the unit's weights are freed after the forward, so the recomputation must find
them gathered again: the unit's pre-backward hook gathers it before its backward starts, and the
recomputed function gathers it itself as well (a no-op when it is already gathered), so the
recomputation never reads a freed buffer, whatever order autograd runs hooks in. Recomputing
with the same compute weights gives the same activations bit for bit, so gradients equal those
of an uncheckpointed run.

Wrapping a unit's call in ``torch.utils.checkpoint.checkpoint(unit, ..., use_reentrant=False)``
inside a model's own forward works too: the recomputation then runs the unit's hooks, whose
pre-hook gathers and whose forward hook neither frees nor hooks again while backward runs
(see :mod:`shardckpt.runtime.stages`).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any
from collections.abc import Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from shardckpt.runtime.units import ROOT

if TYPE_CHECKING:
    from shardckpt.runtime.engine import ZeroEngine
    from shardckpt.runtime.stages import Unit

log = logging.getLogger(__name__)

_MARK = "_shardckpt_checkpointed"


def _checkpointed_forward(unit: Unit, forward: Callable[..., Any]) -> Callable[..., Any]:
    def recompute(*args: Any, **kwargs: Any) -> Any:
        unit.gather()  # in backward: the recomputation gathers the weights it reads
        return forward(*args, **kwargs)

    def checkpointed(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        return checkpoint(recompute, *args, use_reentrant=False, **kwargs)

    return checkpointed


def checkpoint_units(engine: ZeroEngine,
                     select: Callable[[str, nn.Module], bool] | None = None) -> list[str]:
    """Checkpoint the activations of the engine's non-root units (those ``select(fqn, module)``
    accepts; default all). Idempotent; returns the FQNs of the units now checkpointed.

    Replaces each unit module's ``forward`` by one that runs the original under
    ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`` when gradients are enabled;
    the module hooks (gather before, free after) stay outside. Call on every rank alike.
    """
    done = []
    for unit in engine.units:
        if unit.name == ROOT or (select is not None and not select(unit.name, unit.module)):
            continue
        if not getattr(unit.module, _MARK, False):
            unit.module.forward = _checkpointed_forward(unit, unit.module.forward)
            setattr(unit.module, _MARK, True)
        done.append(unit.name)
    log.info("activation checkpointing on %d units", len(done))
    return done
