"""The element-wise update rules: :class:`ShardedAdamW` and :class:`ShardedSGD`, and
:func:`build_optimizer`, which picks one by name and refuses optimizers that need whole tensors.

Each ``_update`` copies the single-tensor (``foreach=False``) code of ``torch.optim.AdamW`` /
``torch.optim.SGD`` op for op, on one parameter's slice of this rank's shard; the slicing, the
state and the step are :class:`~shardckpt.runtime.optim.ShardedOptimizer`'s.
"""

from __future__ import annotations

from typing import Any
from collections.abc import Iterable

import torch

from shardckpt.errors import ConfigError
from shardckpt.runtime.contracts import ShardedEngine
from shardckpt.runtime.optim import ShardedOptimizer
from shardckpt.runtime.param_groups import WHOLE_TENSOR_OPTIMIZERS

__all__ = ["ShardedAdamW", "ShardedSGD", "build_optimizer"]


class ShardedAdamW(ShardedOptimizer):
    """AdamW (decoupled weight decay), element for element as ``torch.optim.AdamW(foreach=False)``."""

    name = "adamw"

    def __init__(self, engine: ShardedEngine, params: Iterable[Any] | None = None, lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, amsgrad: bool = False, maximize: bool = False) -> None:
        if lr < 0 or eps < 0 or weight_decay < 0 or not all(0 <= b < 1 for b in betas):
            raise ConfigError(f"invalid AdamW hyper-parameters: lr={lr}, betas={betas}, eps={eps}, "
                              f"weight_decay={weight_decay}")
        super().__init__(engine, params, dict(lr=lr, betas=tuple(betas), eps=eps,
                                              weight_decay=weight_decay, amsgrad=amsgrad,
                                              maximize=maximize))

    def _state_kinds(self) -> tuple[str, ...]:
        ams = any(g.get("amsgrad") for g in self.param_groups)
        return ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if ams else ())

    def _update(self, param: torch.Tensor, grad: torch.Tensor, state: dict[str, torch.Tensor],
                step: int, hyper: dict[str, Any]) -> None:
        # Mirrors torch.optim.adam._single_tensor_adam (decoupled, not capturable).
        lr, (beta1, beta2) = hyper["lr"], hyper["betas"]
        weight_decay, eps = hyper["weight_decay"], hyper["eps"]
        exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
        if hyper["maximize"]:
            grad = -grad
        if weight_decay != 0:
            param.mul_(1 - lr * weight_decay)
        exp_avg.lerp_(grad, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        t = float(step)
        bias_correction1 = 1 - beta1**t
        bias_correction2 = 1 - beta2**t
        step_size = lr / bias_correction1
        bias_correction2_sqrt = bias_correction2**0.5
        if hyper["amsgrad"]:
            max_sq = state["max_exp_avg_sq"]
            torch.maximum(max_sq, exp_avg_sq, out=max_sq)
            denom = (max_sq.sqrt() / bias_correction2_sqrt).add_(eps)
        else:
            denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
        param.addcdiv_(exp_avg, denom, value=-step_size)


class ShardedSGD(ShardedOptimizer):
    """SGD with momentum, element for element as ``torch.optim.SGD(foreach=False)``."""

    name = "sgd"

    def __init__(self, engine: ShardedEngine, params: Iterable[Any] | None = None, lr: float = 1e-3,
                 momentum: float = 0.0, dampening: float = 0.0, weight_decay: float = 0.0,
                 nesterov: bool = False, maximize: bool = False) -> None:
        if lr < 0 or momentum < 0 or weight_decay < 0:
            raise ConfigError(f"invalid SGD hyper-parameters: lr={lr}, momentum={momentum}, "
                              f"weight_decay={weight_decay}")
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ConfigError("Nesterov momentum requires a momentum and zero dampening")
        super().__init__(engine, params, dict(lr=lr, momentum=momentum, dampening=dampening,
                                              weight_decay=weight_decay, nesterov=nesterov,
                                              maximize=maximize))

    def _state_kinds(self) -> tuple[str, ...]:
        return ("momentum_buffer",) if any(g.get("momentum") for g in self.param_groups) else ()

    def _update(self, param: torch.Tensor, grad: torch.Tensor, state: dict[str, torch.Tensor],
                step: int, hyper: dict[str, Any]) -> None:
        # Mirrors torch.optim.sgd._single_tensor_sgd.
        weight_decay, momentum = hyper["weight_decay"], hyper["momentum"]
        if hyper["maximize"]:
            grad = -grad
        if weight_decay != 0:
            grad = grad.add(param, alpha=weight_decay)
        if momentum != 0:
            buf = state["momentum_buffer"]
            if step == 1:  # torch starts the buffer as a copy of the first gradient
                buf.copy_(grad)
            else:
                buf.mul_(momentum).add_(grad, alpha=1 - hyper["dampening"])
            grad = grad.add(buf, alpha=momentum) if hyper["nesterov"] else buf
        param.add_(grad, alpha=-hyper["lr"])


_ELEMENTWISE: dict[str, type[ShardedOptimizer]] = {"adamw": ShardedAdamW, "sgd": ShardedSGD}


def build_optimizer(engine: ShardedEngine, optimizer: str | type, params: Iterable[Any] | None = None,
                    **hyper: Any) -> ShardedOptimizer:
    """A sharded optimizer by name (``"adamw"``, ``"sgd"``) or torch class (``torch.optim.AdamW``).

    Refuses optimizers that need whole tensors (Shampoo, Muon, LAMB, ...) with the reason.
    """
    name = optimizer if isinstance(optimizer, str) else getattr(optimizer, "__name__", "")
    key = name.lower().replace("_", "").replace("-", "")
    if key.startswith("sharded"):
        key = key[len("sharded"):]
    if key in _ELEMENTWISE:
        return _ELEMENTWISE[key](engine, params, **hyper)
    supported = ", ".join(sorted(_ELEMENTWISE))
    if key in WHOLE_TENSOR_OPTIMIZERS:
        raise ConfigError(
            f"{name} needs whole tensors: it {WHOLE_TENSOR_OPTIMIZERS[key]}. ZeRO-3 splits every "
            f"parameter into flat slices across ranks, so only element-wise optimizers work here "
            f"({supported}); use one of those or a runtime that gathers whole tensors.")
    raise ConfigError(f"unsupported optimizer {name!r}; supported: {supported}")
