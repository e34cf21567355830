"""Mixed precision for the ZeRO runtime, as a policy like FSDP2's ``MixedPrecisionPolicy``.

Three dtypes matter for a flat group:

* the **master** dtype: what ``local_shards()["master"]`` holds and the optimizer updates (fp32 for
  trained groups, the declared dtype for frozen ones). A policy never changes it, so a checkpoint
  is the same with or without mixed precision;
* the **compute** dtype (``param_dtype``): the shard that all-gathers read, the gathered buffer,
  and so the parameters forward and backward see. Derived from ``master`` by ``Tensor.to``
  (round to nearest even) after every optimizer step;
* the **reduce** dtype (``reduce_dtype``): the local gradient buffer (where micro-batches
  accumulate), the bytes exchanged, and the rank-order sum; the mean is then kept as an fp32 shard.

Without a policy each group computes in its declared dtype, exchanges gradients in that dtype and
sums them in fp32 (the behaviour of a model built in bf16). With a policy, gradients are reduced
in ``reduce_dtype`` (fp32 unless asked otherwise; ``None`` means the compute dtype, as in FSDP2).
Casts apply to floating-point groups only; buffers are never cast. There is no loss scaling: use
bf16 rather than fp16 for ``param_dtype``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shardckpt.errors import ConfigError

FP32 = torch.float32


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype for a layout dtype name (``"bfloat16"`` -> ``torch.bfloat16``)."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ConfigError(f"unknown dtype {name!r}")
    return dtype


def dtype_name(dtype: torch.dtype) -> str:
    """The layout name of a torch dtype (``torch.float32`` -> ``"float32"``)."""
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True, slots=True)
class MixedPrecisionPolicy:
    """Compute parameters in ``param_dtype``, reduce gradients in ``reduce_dtype``.

    ``None`` for ``param_dtype`` keeps each group's declared dtype; ``None`` for ``reduce_dtype``
    reduces in the compute dtype. The defaults are the usual recipe: bf16 compute, fp32 reduce,
    fp32 master shards and optimizer state. With ``cast_forward_inputs`` (as in FSDP2) every
    unit's floating-point tensor inputs are cast to ``param_dtype`` before its forward (also in
    an activation recomputation); integer inputs such as token ids are left alone.
    """

    param_dtype: torch.dtype | None = torch.bfloat16
    reduce_dtype: torch.dtype | None = torch.float32
    cast_forward_inputs: bool = True

    def __post_init__(self) -> None:
        bad = [f"{name}={value!r}" for name, value in (("param_dtype", self.param_dtype),
                                                       ("reduce_dtype", self.reduce_dtype))
               if value is not None and not (isinstance(value, torch.dtype)
                                             and value.is_floating_point)]
        if bad:
            raise ConfigError(f"MixedPrecisionPolicy: {', '.join(bad)}; use a floating-point "
                              "torch dtype (torch.bfloat16, torch.float32, ...) or None")


def check_policy(policy: object) -> MixedPrecisionPolicy | None:
    """``policy`` if it is a :class:`MixedPrecisionPolicy` or ``None``; else a
    :class:`ConfigError` that names the field."""
    if policy is not None and not isinstance(policy, MixedPrecisionPolicy):
        raise ConfigError(f"mixed_precision is {policy!r}; pass a "
                          "MixedPrecisionPolicy(param_dtype=..., reduce_dtype=...) or None")
    return policy


@dataclass(frozen=True, slots=True)
class GroupPrecision:
    """The resolved dtypes of one flat group (see module docstring).

    ``grad`` is the dtype of the local (unreduced, possibly accumulated) gradient buffer and of
    the exchange; ``sum`` the dtype the rank-order sum and the division by the world size run in.
    """

    compute: torch.dtype
    grad: torch.dtype
    sum: torch.dtype


def resolve_precision(policy: MixedPrecisionPolicy | None, declared: torch.dtype) -> GroupPrecision:
    """The dtypes of a group declared as ``declared`` under ``policy`` (``None``: no policy)."""
    if policy is None or not declared.is_floating_point:
        return GroupPrecision(declared, declared, FP32 if declared.is_floating_point else declared)
    compute = policy.param_dtype or declared
    reduce = policy.reduce_dtype or compute
    return GroupPrecision(compute, reduce, reduce)


def input_cast_dtype(policy: MixedPrecisionPolicy | None) -> torch.dtype | None:
    """The dtype units cast their floating-point inputs to, or ``None`` for no cast."""
    if policy is None or not policy.cast_forward_inputs:
        return None
    return policy.param_dtype
