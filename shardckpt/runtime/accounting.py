"""Per-rank accounting of the ZeRO runtime, in the units of :mod:`shardckpt.tools.estimate`.

Three figures, each for this rank:

* **communication**: the *logical volume* of every collective the runtime issues, by type, in
  elements (and bytes): an all-gather or a reduce-scatter of an ``n``-element flat buffer counts
  ``n``, an all-reduce ``2n``, the deterministic mode's all-to-all exchange of ``n`` elements
  ``n``; a collective over a group of one rank is not issued and counts nothing. These are the
  conventions of :attr:`shardckpt.tools.estimate.Estimate.comm_elements`, so a ZeRO-3 step counts 3Ψ
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
  its all-gather is issued;
* **model state** (:func:`model_state_bytes`): bytes held now, by the estimator's kinds:
  ``params`` (resident gathered compute copies: stages 1 and 2 keep them), ``grads`` (reduced
  gradient shards, unreduced local buffers, and stage 1's resident whole-size gradient buffers,
  which hold their reduced fp32 shard in their own slice), ``master`` (the master shards,
  the parameters' storage in the checkpoint) and ``optim`` (the optimizer's per-element shards).
  Each storage counts once.

:func:`estimate_for` asks the estimator for the same model (padded Ψ, largest unit), strategy,
mesh and precision policy, so the two can be compared figure by figure.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from shardckpt.errors import ConfigError
from shardckpt.tools.estimate import Estimate, estimate

if TYPE_CHECKING:
    from shardckpt.runtime.engine import ZeroEngine

#: Collective types, as counted.
OPS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")
KINDS = ("params", "grads", "master", "optim")


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


def model_state_bytes(engine: "ZeroEngine") -> dict[str, int]:
    """Bytes of model state this rank holds now, by kind (see the module docstring).

    Call between steps (after ``step()``, before ``zero_grad()`` to include the gradients); in
    stage 3 the gathered weights of a running step are the accounting's, not ``params``.
    """
    out = dict.fromkeys(KINDS, 0)
    seen: set[int] = set()

    def add(kind: str, t: torch.Tensor | None) -> None:
        if not isinstance(t, torch.Tensor):  # None, or optimizer state in an offload file
            return
        storage = t.untyped_storage()
        if storage.nbytes() and storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            out[kind] += storage.nbytes()

    optimizer = engine.optimizer
    for name, g in engine.groups.items():
        add("master", g.master)
        if g.gathered:
            add("params", g.full)
        for t in (g.grad_buffer, g.grad, g.local_grad):
            add("grads", t)
        if optimizer is not None and g.trainable:
            for t in optimizer.local_state(name).values():
                add("optim", t)
    return out


def precision_preset_for(engine: "ZeroEngine") -> str:
    """The estimator preset that describes the engine's dtypes: ``fsdp2-fp32`` (fp32 compute)
    or ``fsdp2-bf16`` (a 2-byte compute dtype); fp32 masters, fp32 reduced gradients and fp32
    per-element optimizer state either way. Refuses frozen or mixed groups, which no preset
    describes."""
    frozen = [n for n, g in engine.groups.items() if not g.trainable]
    sizes = {g.dtype.itemsize for g in engine.groups.values()}
    if frozen or len(sizes) != 1 or sizes - {2, 4}:
        raise ConfigError(
            f"no estimator preset describes this engine (frozen groups {frozen[:3]}, compute "
            f"bytes per element {sorted(sizes)}); pass precision= explicitly")
    return "fsdp2-fp32" if sizes == {4} else "fsdp2-bf16"


def estimate_for(engine: "ZeroEngine", precision: str | None = None) -> Estimate:
    """:func:`shardckpt.tools.estimate.estimate` for this engine: Ψ = the padded parameter count,
    the strategy of its stage and mesh (``hsdp`` when R > 1), ``largest_unit`` = the padded
    size of its largest unit, and the preset of :func:`precision_preset_for` unless given."""
    pm, layout = engine.process_mesh, engine.layout
    psi = sum(g.padded_numel for g in layout.groups)
    units: dict[str, int] = {}
    for g in layout.groups:
        units[g.unit] = units.get(g.unit, 0) + g.padded_numel
    R = pm.mesh.world_size // pm.shard_degree
    if engine.stage == 3:
        strategy = "hsdp" if R > 1 else "zero3"
    elif R > 1:
        raise ConfigError(f"the estimator models HSDP at stage 3 only; this engine is stage "
                          f"{engine.stage} on {pm.mesh.describe()}")
    else:
        strategy = f"zero{engine.stage}"
    return estimate(psi, strategy, pm.world_size, replicate=R,
                    precision=precision or precision_preset_for(engine),
                    largest_unit=max(units.values()))
