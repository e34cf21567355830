"""What a rank of the engine holds, and what the estimator predicts for the same engine.

* **model state** (:func:`model_state_bytes`): bytes held now, by the estimator's kinds:
  ``params`` (resident gathered compute copies: stages 1 and 2 keep them), ``grads`` (reduced
  gradient shards, unreduced local buffers, and stage 1's resident whole-size gradient buffers,
  which hold their reduced fp32 shard in their own slice), ``master`` (the engine's weight
  shards: the master shards, the parameters' storage in the checkpoint; with the optimizer
  offloaded and a narrower compute dtype, the compute-dtype shards, the masters being off the
  device) and ``optim`` (the optimizer's per-element shards, unless offloaded). What the offload
  store holds (host memory or files) is not counted. Each storage counts once.
* :func:`estimate_for` asks the estimator (:mod:`shardckpt.format.footprint_math`) for the same model
  (padded Ψ, largest unit), strategy, mesh and precision policy, so the two can be compared
  figure by figure.

Communication and gathered-weight counters are :mod:`shardckpt.runtime.accounting`'s.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from shardckpt.errors import ConfigError
from shardckpt.format.layout import Layout
from shardckpt.runtime.contracts import EngineOptimizer
from shardckpt.runtime.flat import FlatParamGroup
from shardckpt.runtime.mesh import ProcessMesh
from shardckpt.format.footprint_math import Estimate, estimate

KINDS = ("params", "grads", "master", "optim")


def model_state_bytes(groups: Mapping[str, FlatParamGroup],
                      optimizer: EngineOptimizer | None) -> dict[str, int]:
    """Bytes of model state this rank holds now in ``groups`` and the optimizer's shards of
    them, by kind (see the module docstring).

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

    offloaded = optimizer is not None and getattr(optimizer, "offloaded", False)
    for name, g in groups.items():
        add("master", g.shard)
        if g.gathered:
            add("params", g.full)
        for t in (g.grad_buffer, g.grad, g.local_grad):
            add("grads", t)
        if optimizer is not None and g.trainable and not offloaded:
            for t in optimizer.local_state(name).values():
                add("optim", t)
    return out


def precision_preset_for(groups: Mapping[str, FlatParamGroup]) -> str:
    """The estimator preset that describes the dtypes of ``groups``: ``fsdp2-fp32`` (fp32
    compute) or ``fsdp2-bf16`` (a 2-byte compute dtype); fp32 masters, fp32 reduced gradients
    and fp32 per-element optimizer state either way. Refuses frozen or mixed groups, which no
    preset describes."""
    frozen = [n for n, g in groups.items() if not g.trainable]
    sizes = {g.dtype.itemsize for g in groups.values()}
    if frozen or len(sizes) != 1 or sizes - {2, 4}:
        raise ConfigError(
            f"no estimator preset describes this engine (frozen groups {frozen[:3]}, compute "
            f"bytes per element {sorted(sizes)}); pass precision= explicitly")
    return "fsdp2-fp32" if sizes == {4} else "fsdp2-bf16"


def estimate_for(layout: Layout, pm: ProcessMesh, stage: int,
                 groups: Mapping[str, FlatParamGroup], precision: str | None = None) -> Estimate:
    """:func:`shardckpt.format.footprint_math.estimate` for an engine of ``layout`` at ``stage`` on
    ``pm``: Ψ = the padded parameter count, the strategy of its stage and mesh (``hsdp`` when
    R > 1), ``largest_unit`` = the padded size of its largest unit, and the preset of
    :func:`precision_preset_for` (``groups``: the runtime groups) unless given."""
    psi = sum(g.padded_numel for g in layout.groups)
    units: dict[str, int] = {}
    for g in layout.groups:
        units[g.unit] = units.get(g.unit, 0) + g.padded_numel
    R = pm.mesh.world_size // pm.shard_degree
    if stage == 3:
        strategy = "hsdp" if R > 1 else "zero3"
    elif R > 1:
        raise ConfigError(f"the estimator models HSDP at stage 3 only; this engine is stage "
                          f"{stage} on {pm.mesh.describe()}")
    else:
        strategy = f"zero{stage}"
    return estimate(psi, strategy, pm.world_size, replicate=R,
                    precision=precision or precision_preset_for(groups),
                    largest_unit=max(units.values()))
