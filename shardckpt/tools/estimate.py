"""``shardckpt estimate`` as a library call: the estimator's figures for counts given as text.

The arithmetic (memory per GPU and communication per step for DDP, ZeRO-1/2/3 and HSDP, ZeRO++
traffic, optimizer offload) is pure and lives below every layer that needs it, in
:mod:`shardckpt.format.footprint_math` and :mod:`shardckpt.format.footprint_levers`: the runtime
compares an engine's measured figures with the same formulas without importing an offline tool.
This module is the tool's surface over them: the names the command and its users call, and
:func:`parse_count` for counts written as ``7.5B`` or ``125M``.
"""

from __future__ import annotations

from shardckpt.format import quantities
from shardckpt.format.footprint_levers import (
    OFFLOAD_MODES, OFFLOAD_WINDOW_GROUPS, ZEROPP_VARIANTS, OffloadSplit, ZeroPPTraffic, offload_split,
    zeropp_traffic,
)
from shardckpt.format.footprint_math import (
    ABSENT, GB, KINDS, PRECISIONS, REPLICATED, SHARDED, STRATEGIES, TRANSIENT, Collective, Estimate,
    EstimateError, KindMemory, Precision, check_count, estimate, estimate_all, fields_dict,
    precision_preset,
)

__all__ = ["ABSENT", "GB", "KINDS", "OFFLOAD_MODES", "OFFLOAD_WINDOW_GROUPS", "PRECISIONS",
           "REPLICATED", "SHARDED", "STRATEGIES", "TRANSIENT", "ZEROPP_VARIANTS", "Collective",
           "Estimate", "EstimateError", "KindMemory", "OffloadSplit", "Precision", "ZeroPPTraffic",
           "check_count", "estimate", "estimate_all", "fields_dict", "offload_split",
           "parse_count", "precision_preset", "zeropp_traffic"]


def parse_count(text: str, option: str = "params") -> int:
    """Parse a parameter count: ``7.5e9``, ``7.5B``, ``70B``, ``125M``, ``1.2T``, ``350k``,
    ``1_000_000`` (:func:`shardckpt.format.quantities.parse_count`, the one count parser)."""
    try:
        return quantities.parse_count(text, option)
    except quantities.QuantityError as e:
        raise EstimateError(option, text, e.reason) from None
