"""Gradient clipping over the reduced gradient shards (:meth:`ZeroEngine.clip_grad_norm_`)."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from shardckpt.runtime import collectives
from shardckpt.runtime.accounting import Accounting
from shardckpt.runtime.flat import FlatParamGroup
from shardckpt.runtime.mesh import ProcessMesh


def clip_grad_shards(groups: Iterable[FlatParamGroup], pm: ProcessMesh, acct: Accounting,
                     max_norm: float, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale every group's ``grad`` in place by ``min(1, max_norm / (norm + eps))``, the norm
    summed in fp64 per shard, then over the shard group. Returns (norm, coefficient), both
    0-dim fp64. Collective."""
    groups = list(groups)
    total = torch.zeros((), dtype=torch.float64, device=pm.device)
    for g in groups:
        if g.grad is not None:
            total += g.grad.double().square().sum()
    norm = collectives.all_reduce_shard_sum(pm, total, acct).sqrt()
    coef = torch.clamp(max_norm / (norm + eps), max=1.0)
    for g in groups:
        if g.grad is not None:
            g.grad.mul_(coef.to(g.grad.dtype))
    return norm, coef
