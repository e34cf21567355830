"""ZeRO++ (Wang et al., "ZeRO++: Extremely Efficient Collective Communication for Giant Model
Training", 2023): three independent options of :class:`~shardckpt.runtime.engine.ZeroEngine` that
cut cross-node traffic. They change bytes moved and bytes resident, never the fp32 masters, the
optimizer state or the checkpoint format.

* **qwZ** (``qwz``): each rank quantizes its weight shard blockwise to int8 (one fp32 scale per
  ``block_size`` elements, :mod:`shardckpt.runtime.zeropp.quant`) before the all-gather and every rank
  dequantizes the whole group after it, into the compute dtype. Every rank computes with the same
  dequantized weights (its own shard included); each differs from the master by at most
  ``absmax(block) / 254``. A gather moves ``S * (s + 4 * ceil(s / block_size))`` bytes instead of
  ``S * s`` compute-dtype elements.
* **hpZ** (``hpz``, stage 3): after a unit's forward gather (with gradients enabled) each rank keeps
  its ``1/K`` slice of the gathered weights (``K`` = ranks per node), so the backward gather is an
  all-gather inside the node of those slices: a byte copy of the forward's weights, no cross-node
  traffic. Memory: each unit's weights / K per rank, from its forward to the end of the backward
  (or the next optimizer step); units that stay gathered (the root by default) keep none.
* **qgZ** (``qgz``): gradients are reduced hierarchically: the local gradient's ``W`` slices are
  quantized blockwise (int4 or int8, ``grad_bits``) and exchanged by an all-to-all inside the node
  (each rank receives, from every rank of its node, the slices whose shard ranks share its local
  index), dequantized and summed in fp32 in local-rank order; the node sums are quantized again
  and exchanged by an all-to-all across nodes (ranks with the same local index), dequantized,
  summed in fp32 in node order and divided by the world size. Each rank receives its shard of the
  mean gradient. The order of every sum is fixed, so the result does not depend on the backend.
  A stage with one participant (one rank per node, or one node) moves and quantizes nothing.

Nodes are blocks of ``ranks_per_node`` consecutive ranks
(:attr:`~shardckpt.runtime.mesh.ProcessMesh.ranks_per_node`, torchrun's ``LOCAL_WORLD_SIZE``).
hpZ and qgZ need the world size to be a multiple of it. ZeRO++ runs on a plain ZeRO mesh (R = 1).

- :mod:`~shardckpt.runtime.zeropp.options` — :class:`ZeroPP` and its checks against the engine;
- :mod:`~shardckpt.runtime.zeropp.comm` — the collectives above, as a flat group issues them;
- :mod:`~shardckpt.runtime.zeropp.quant` — blockwise int8 / int4 quantization.
- :mod:`~shardckpt.runtime.zeropp.fused` — the same quantization compiled (``torch.compile``), the
  default; ``SHARDCKPT_ZEROPP_KERNEL=eager`` runs :mod:`quant`'s eager reference instead.
"""

from __future__ import annotations

from shardckpt.runtime.zeropp.options import ZeroPP, check_zeropp

__all__ = ["ZeroPP", "check_zeropp"]
