"""Per-rank accounting of the ZeRO runtime, in the units of :mod:`shardckpt.format.footprint_math`.

The counters, each for this rank:

* **communication**: the *logical volume* of every collective the runtime issues, by type, in
  elements (and bytes): an all-gather or a reduce-scatter of an ``n``-element flat buffer counts
  ``n``, an all-reduce ``2n``, the deterministic mode's all-to-all exchange of ``n`` elements
  ``n``; a collective over a group of one rank is not issued and counts nothing. These are the
  conventions of :attr:`shardckpt.format.footprint_math.Estimate.comm_elements`, so a ZeRO-3 step counts 3Ψ
  (forward all-gather, backward all-gather, reduce-scatter), where Ψ is the *padded* parameter
  count (each flat group is padded to a multiple of 16·S elements);
* **in-node and cross-node bytes**: the same logical volume in bytes, split by whether the
  collective's group holds ranks of more than one node (``ProcessMesh.ranks_per_node``; one node
  unless given). Quantized collectives (ZeRO++, :mod:`shardckpt.runtime.zeropp`) count the bytes
  they move (integers and scales) and, as elements, the model elements they carry;
* **secondary weights** (ZeRO++ hpZ): bytes of the in-node secondary weight copies held now and
  their peak;
* **gathered weights**: bytes of the gathered (whole) compute-dtype flat buffers held now and
  their peak since the last :meth:`Accounting.reset`; a prefetched buffer counts from the moment
  its all-gather is issued.

The bytes of model state a rank holds, and the estimator's figures for the same engine, are
:mod:`shardckpt.runtime.footprint`'s.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

#: Collective types, as counted.
OPS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")


def _zeros() -> dict[str, int]:
    return dict.fromkeys(OPS, 0)


@dataclass
class Accounting:
    """Counters of one engine on this rank (see the module docstring). Not thread-safe: the
    runtime records from the thread that issues collectives and allocates buffers."""

    elements: dict[str, int] = field(default_factory=_zeros)
    bytes: dict[str, int] = field(default_factory=_zeros)
    calls: dict[str, int] = field(default_factory=_zeros)
    cross_node_bytes: dict[str, int] = field(default_factory=_zeros)
    in_node_bytes: dict[str, int] = field(default_factory=_zeros)
    gathered_bytes: int = 0
    peak_gathered_bytes: int = 0
    secondary_bytes: int = 0
    peak_secondary_bytes: int = 0

    def record(self, op: str, tensor: torch.Tensor, factor: int = 1, *,
               cross_node: bool = False, elements: int | None = None) -> None:
        """One collective of type ``op`` over ``tensor`` (the whole buffer: the all-gather's
        output, the reduce-scatter's input); ``factor`` 2 for an all-reduce; ``cross_node`` if
        its group spans nodes; ``elements``: the model elements a quantized buffer carries."""
        nbytes = factor * tensor.numel() * tensor.element_size()
        self.elements[op] += factor * (tensor.numel() if elements is None else elements)
        self.bytes[op] += nbytes
        self.calls[op] += 1
        (self.cross_node_bytes if cross_node else self.in_node_bytes)[op] += nbytes

    def secondary(self, nbytes: int) -> None:
        """ZeRO++ hpZ: ``nbytes`` of secondary weights kept (positive) or dropped (negative)."""
        self.secondary_bytes += nbytes
        self.peak_secondary_bytes = max(self.peak_secondary_bytes, self.secondary_bytes)

    def allocated(self, nbytes: int) -> None:
        self.gathered_bytes += nbytes
        self.peak_gathered_bytes = max(self.peak_gathered_bytes, self.gathered_bytes)

    def released(self, nbytes: int) -> None:
        self.gathered_bytes -= nbytes

    def reset(self) -> None:
        """Zero the communication counters; the peak restarts from what is gathered now."""
        self.elements, self.bytes, self.calls = _zeros(), _zeros(), _zeros()
        self.cross_node_bytes, self.in_node_bytes = _zeros(), _zeros()
        self.peak_gathered_bytes = self.gathered_bytes
        self.peak_secondary_bytes = self.secondary_bytes

    @property
    def comm_elements(self) -> int:
        """All collectives together (the estimator's ``comm_elements``)."""
        return sum(self.elements.values())

    @property
    def cross_node_total(self) -> int:
        """Bytes of all collectives whose group spans nodes."""
        return sum(self.cross_node_bytes.values())

    def snapshot(self) -> dict[str, Any]:
        """The counters as plain JSON-able values."""
        return {"elements": dict(self.elements), "bytes": dict(self.bytes),
                "calls": dict(self.calls), "comm_elements": self.comm_elements,
                "cross_node_bytes": dict(self.cross_node_bytes),
                "in_node_bytes": dict(self.in_node_bytes),
                "gathered_bytes": self.gathered_bytes,
                "peak_gathered_bytes": self.peak_gathered_bytes,
                "secondary_bytes": self.secondary_bytes,
                "peak_secondary_bytes": self.peak_secondary_bytes}
