"""Param groups for the sharded optimizers: weight decay by the layout's shapes, and the
optimizers that cannot run on flat slices (:func:`shardckpt.runtime.optim_rules.build_optimizer`)."""

from __future__ import annotations

from typing import Any
from collections.abc import Callable

from shardckpt.runtime.contracts import ShardedEngine

#: Optimizers whose update of an element depends on whole tensors, with the reason.
WHOLE_TENSOR_OPTIMIZERS = {
    "shampoo": "preconditions each matrix with its own row and column statistics",
    "distributedshampoo": "preconditions each matrix with its own row and column statistics",
    "soap": "runs Adam in each matrix's Shampoo eigenbasis",
    "muon": "orthogonalizes each whole matrix update (Newton-Schulz)",
    "lamb": "scales each tensor's update by its trust ratio ||w|| / ||update||",
    "lars": "scales each tensor's update by its trust ratio ||w|| / ||grad||",
    "adafactor": "factors the second moment into each matrix's row and column means",
    "lbfgs": "takes line-search steps along a direction built from whole-model history",
    "galore": "projects each matrix's gradient onto its low-rank subspace",
}


def is_no_decay(fqn: str, shape: tuple[int, ...]) -> bool:
    """Norm weights, biases and other vectors get no weight decay (the usual LLM recipe)."""
    return len(shape) < 2 or fqn.endswith(".bias") or "norm" in fqn.lower()


def decay_param_groups(engine: ShardedEngine, weight_decay: float,
                       no_decay: Callable[[str, tuple[int, ...]], bool] = is_no_decay
                       ) -> list[dict[str, Any]]:
    """Two param groups of the trained parameters: ``weight_decay`` and ``0.0`` (norms, biases).

    Uses the layout's shapes (parameters are placeholders between steps).
    """
    decay: list[Any] = []
    plain: list[Any] = []
    for fqn, p in engine.named_parameters():
        if p.requires_grad:
            (plain if no_decay(fqn, engine.layout.param(fqn).shape) else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": plain, "weight_decay": 0.0}]
