"""Model-state memory per GPU and communication per step for DDP, ZeRO-1/2/3 and HSDP.

Pure arithmetic: no torch, no numpy, no I/O. The formulas are those of Rajbhandari et al. 2020,
"ZeRO: Memory Optimizations Toward Training Trillion Parameter Models" (SC'20), Sections 5 and 7,
generalised from their fp16 case to any bytes per kind. With Ψ parameters, N data-parallel ranks,
p / g bytes per parameter for the working parameters / gradients and K bytes for the optimizer
("master" fp32 weights plus the optimizer's per-element states)::

    DDP      (P_0)        (p + g + K) Ψ           paper, p = g = 2, K = 12: 16Ψ
    ZeRO-1   (P_os)       (p + g) Ψ + K Ψ / N     4Ψ + 12Ψ/N
    ZeRO-2   (P_os+g)     p Ψ + (g + K) Ψ / N     2Ψ + 14Ψ/N
    ZeRO-3   (P_os+g+p)   (p + g + K) Ψ / N       16Ψ/N
    HSDP R×S              ZeRO-3 with N = S (world = R·S; states sharded over S, replicated over R)

Ψ = 7.5e9 on N = 64 with the ``paper`` preset gives 120.0, 31.4, 16.6 and 1.9 GB (Figure 1).
GB = 1e9 bytes. Padding (under 16·S elements per flat group) and activations are not counted.

Communication convention (the headline, :attr:`Estimate.comm_elements`): the *logical volume* of
each collective, summed over the collectives of one step, in elements. A reduce-scatter or
all-gather of a Ψ-element buffer counts Ψ; an all-reduce counts 2Ψ (reduce-scatter + all-gather,
as in the paper, Section 7). A collective over a group of one rank moves nothing and counts 0.
So per step: DDP 2Ψ, ZeRO-1/2 2Ψ, ZeRO-3 3Ψ, HSDP 3Ψ + 2Ψ/S (the all-reduce of the Ψ/S gradient
shard over R; 0 when R = 1). :attr:`Estimate.comm_sent_per_rank` gives what one rank actually
sends with ring algorithms: volume · (n − 1)/n for each collective over n ranks.

ZeRO++ traffic and optimizer offload: :mod:`shardckpt.format.footprint_levers`. The offline tool
(``shardckpt estimate``) is :mod:`shardckpt.tools.estimate`; the runtime compares an engine's
measured figures with these (:mod:`shardckpt.runtime.footprint`). Both sit above this module.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from shardckpt.errors import ConfigError
from shardckpt.format.layout import REPLICATE_AXIS, SHARD_AXIS

GB = 1e9
STRATEGIES = ("ddp", "zero1", "zero2", "zero3", "hsdp")
KINDS = ("params", "grads", "master", "optim")
# Placements of one kind of state on one GPU.
REPLICATED, SHARDED, TRANSIENT, ABSENT = "replicated", "sharded", "transient", "absent"
# Stage from which each kind is sharded (ZeRO: P_os at 1, +g at 2, +p at 3); 0 = DDP.
_SHARDED_FROM = {"params": 3, "grads": 2, "master": 1, "optim": 1}
_STAGE = {"ddp": 0, "zero1": 1, "zero2": 2, "zero3": 3, "hsdp": 3}
_LABEL = {"ddp": "DDP", "zero1": "ZeRO-1", "zero2": "ZeRO-2", "zero3": "ZeRO-3"}


class EstimateError(ConfigError):
    """One input of the estimator is invalid; ``option`` names it, ``value`` is what was given."""

    def __init__(self, option: str, value: object, reason: str) -> None:
        super().__init__(f"{option} = {value!r}: {reason}")
        self.option, self.value, self.reason = option, value, reason


@dataclass(frozen=True, slots=True)
class Precision:
    """Bytes per parameter for each kind of model state.

    ``params`` is the working (compute) copy, ``master`` the fp32 weights the optimizer updates
    (0 when the working copy is itself fp32), ``optim`` all per-element optimizer states together
    (AdamW: ``exp_avg`` + ``exp_avg_sq``). With ``transient_params`` the working copy is not held
    once parameters are sharded (ZeRO-3 / HSDP): it is gathered per unit from ``master`` and
    counted as gathered working memory instead (FSDP2 with a bf16 ``MixedPrecisionPolicy``).
    """

    name: str
    params: int
    grads: int
    master: int
    optim: int
    transient_params: bool
    description: str

    @property
    def k(self) -> int:
        """The paper's K: optimizer-state bytes per parameter (master + per-element states)."""
        return self.master + self.optim

    def bytes_of(self, kind: str) -> int:
        return int(getattr(self, kind))


PRECISIONS: dict[str, Precision] = {
    p.name: p
    for p in (
        Precision("paper", 2, 2, 4, 8, False,
                  "ZeRO paper: fp16 params and grads, fp32 master + two fp32 Adam moments "
                  "(K = 12)"),
        Precision("fsdp2-bf16", 2, 4, 4, 8, True,
                  "FSDP2 / shardckpt, bf16 compute: fp32 master params, fp32 grads, two fp32 Adam "
                  "moments; the bf16 compute copy is resident while params are replicated, "
                  "gathered per unit once they are sharded"),
        Precision("fp32", 4, 4, 0, 8, False,
                  "fp32 params and grads, two fp32 Adam moments, no separate master (K = 8)"),
        Precision("fsdp2-fp32", 4, 4, 4, 8, True,
                  "FSDP2 / shardckpt without mixed precision: the fp32 sharded params are the "
                  "master, fp32 grads, two fp32 Adam moments; the fp32 compute copy is "
                  "resident (beside the master shard) while params are replicated, gathered "
                  "per unit once they are sharded"),
    )
}


@dataclass(frozen=True, slots=True)
class KindMemory:
    """One kind of model state on one GPU: ``bytes = bytes_per_param · Ψ / divisor``."""

    kind: str
    bytes_per_param: int
    placement: str        # replicated | sharded | transient | absent
    divisor: int          # ranks it is sharded over (1 when replicated)
    bytes: float          # per GPU; 0 when transient or absent


@dataclass(frozen=True, slots=True)
class Collective:
    """One collective of a training step; volumes are in elements (see the module docstring)."""

    op: str               # all_reduce | reduce_scatter | all_gather
    purpose: str
    axis: str             # mesh axis it runs over (dp_shard or dp_replicate)
    group_size: int
    elements: float       # buffer size (unsharded for reduce-scatter / all-gather)
    logical_elements: float
    sent_per_rank: float


@dataclass(frozen=True, slots=True)
class Estimate:
    """Model-state memory per GPU and communication per step for one strategy."""

    strategy: str         # ddp | zero1 | zero2 | zero3 | hsdp
    label: str            # "DDP", "ZeRO-1", ..., "HSDP-4×16"
    params: int           # Ψ
    world_size: int
    replicate: int        # R: copies of each shard (world for DDP, 1 for ZeRO-1/2/3)
    shard: int            # S: ranks the sharded kinds are divided over (1 for DDP, world for ZeRO)
    precision: str
    kinds: tuple[KindMemory, ...]
    collectives: tuple[Collective, ...]
    largest_unit: int | None
    gathered_bytes: float  # largest unit's working copy, when params are sharded; else 0

    @property
    def model_state_bytes(self) -> float:
        return sum(k.bytes for k in self.kinds)

    @property
    def model_state_gb(self) -> float:
        return self.model_state_bytes / GB

    @property
    def comm_elements(self) -> float:
        """Headline: logical volume summed over the step's collectives (DDP 2Ψ, ZeRO-3 3Ψ)."""
        return sum(c.logical_elements for c in self.collectives)

    @property
    def comm_sent_per_rank(self) -> float:
        return sum(c.sent_per_rank for c in self.collectives)

    def kind(self, name: str) -> KindMemory:
        for k in self.kinds:
            if k.kind == name:
                return k
        raise KeyError(name)

    def to_dict(self) -> dict[str, Any]:
        return {
            "strategy": self.strategy, "label": self.label, "params": self.params,
            "world_size": self.world_size, "replicate": self.replicate, "shard": self.shard,
            "precision": self.precision,
            "model_state_bytes": self.model_state_bytes, "model_state_gb": self.model_state_gb,
            "kinds": [fields_dict(k) for k in self.kinds],
            "comm_elements": self.comm_elements, "comm_sent_per_rank": self.comm_sent_per_rank,
            "collectives": [fields_dict(c) for c in self.collectives],
            "largest_unit": self.largest_unit, "gathered_bytes": self.gathered_bytes,
        }


def fields_dict(obj: Any) -> dict[str, Any]:
    """A slotted dataclass's fields, in order, as a dict (JSON values stay as they are)."""
    return {name: getattr(obj, name) for name in obj.__slots__}


# --------------------------------------------------------------------------------- validation


def check_count(option: str, value: object, minimum: int = 1) -> int:
    """``value`` as an int when it is a whole number >= ``minimum``; else :class:`EstimateError`."""
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise EstimateError(option, value, f"must be a whole number >= {minimum}")
    return value


def precision_preset(name: str) -> Precision:
    try:
        return PRECISIONS[name]
    except KeyError:
        raise EstimateError("precision", name, f"unknown; known: {', '.join(PRECISIONS)}") from None


# --------------------------------------------------------------------------------- estimation


def _collective(op: str, purpose: str, axis: str, n: int, elements: float) -> Collective:
    factor = 2 if op == "all_reduce" else 1
    if n == 1:
        return Collective(op, purpose, axis, n, elements, 0.0, 0.0)
    return Collective(op, purpose, axis, n, elements, factor * elements,
                      factor * elements * (n - 1) / n)


def _collectives(strategy: str, psi: int, r: int, s: int) -> tuple[Collective, ...]:
    if strategy == "ddp":
        return (_collective("all_reduce", "grads", REPLICATE_AXIS, r, psi),)
    if strategy in ("zero1", "zero2"):
        return (_collective("reduce_scatter", "grads", SHARD_AXIS, s, psi),
                _collective("all_gather", "updated params", SHARD_AXIS, s, psi))
    out: tuple[Collective, ...] = (_collective("all_gather", "params (forward)", SHARD_AXIS, s, psi),
                                   _collective("all_gather", "params (backward)", SHARD_AXIS, s, psi),
                                   _collective("reduce_scatter", "grads", SHARD_AXIS, s, psi))
    if strategy == "hsdp":
        out += (_collective("all_reduce", "grad shard", REPLICATE_AXIS, r, psi / s),)
    return out


def estimate(params: int, strategy: str, ranks: int, *, replicate: int = 1,
             precision: str = "paper", largest_unit: int | None = None) -> Estimate:
    """Memory and communication of one ``strategy`` for Ψ = ``params`` on ``ranks`` GPUs.

    ``replicate`` (R) applies to ``hsdp`` only: world = ``ranks`` = R·S, states sharded over S.
    DDP, ZeRO-1/2/3 use all ``ranks`` as one data-parallel group. ``largest_unit`` (parameters in
    the largest FSDP unit) gives the gathered working memory of ZeRO-3 / HSDP: that unit's
    working copy, ``largest_unit · p`` bytes (one unit in flight; prefetch holds more).
    Raises :class:`EstimateError` naming the bad input.
    """
    psi = check_count("params", params)
    n = check_count("ranks", ranks)
    r = check_count("replicate", replicate)
    prec = precision_preset(precision)
    if strategy not in STRATEGIES:
        raise EstimateError("strategy", strategy, f"unknown; known: {', '.join(STRATEGIES)}")
    if n % r:
        raise EstimateError("replicate", r, f"must divide ranks = {n}")
    if r != 1 and strategy != "hsdp":
        raise EstimateError("replicate", r, f"applies to hsdp only, not {strategy}")
    if largest_unit is not None:
        largest_unit = check_count("largest_unit", largest_unit)
        if largest_unit > psi:
            raise EstimateError("largest_unit", largest_unit, f"exceeds params = {psi}")
    stage = _STAGE[strategy]
    if strategy == "ddp":
        r, s = n, 1
    else:
        s = n // r
    kinds = []
    for kind in KINDS:
        b = prec.bytes_of(kind)
        sharded = stage >= _SHARDED_FROM[kind]
        if b == 0:
            kinds.append(KindMemory(kind, b, ABSENT, 1, 0.0))
        elif kind == "params" and sharded and prec.transient_params:
            kinds.append(KindMemory(kind, b, TRANSIENT, s, 0.0))
        elif sharded:
            kinds.append(KindMemory(kind, b, SHARDED, s, b * psi / s))
        else:
            kinds.append(KindMemory(kind, b, REPLICATED, 1, float(b * psi)))
    gathered = float(largest_unit * prec.params) if largest_unit and stage == 3 else 0.0
    label = f"HSDP-{r}×{s}" if strategy == "hsdp" else _LABEL[strategy]
    return Estimate(strategy, label, psi, n, r, s, prec.name, tuple(kinds),
                    _collectives(strategy, psi, r, s), largest_unit, gathered)


def estimate_all(params: int, ranks: int, *, replicate: int = 1, precision: str = "paper",
                 largest_unit: int | None = None) -> tuple[Estimate, ...]:
    """DDP, ZeRO-1, ZeRO-2, ZeRO-3 on ``ranks`` GPUs, then HSDP R×S when ``replicate`` > 1."""
    n = check_count("ranks", ranks)
    r = check_count("replicate", replicate)
    if n % r:
        raise EstimateError("replicate", r, f"must divide ranks = {n}")
    out = [estimate(params, s, n, precision=precision, largest_unit=largest_unit)
           for s in ("ddp", "zero1", "zero2", "zero3")]
    if r > 1:
        out.append(estimate(params, "hsdp", n, replicate=r, precision=precision,
                            largest_unit=largest_unit))
    return tuple(out)
