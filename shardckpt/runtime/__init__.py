"""The ZeRO-1/2/3 training runtime on torch.distributed (gloo on CPU, NCCL on CUDA).

Typical use, on every rank (launched by ``torchrun``)::

    from shardckpt.runtime import (MixedPrecisionPolicy, ZeroEngine, ShardedAdamW,
                                   decay_param_groups, init_distributed)
    from shardckpt.runtime.models.llama import LlamaConfig, LlamaForCausalLM, LLAMA_POLICY, causal_lm_loss

    pm = init_distributed()                          # RANK, WORLD_SIZE, LOCAL_RANK, MASTER_*
    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig())
    engine = ZeroEngine(model, policy=LLAMA_POLICY, process_mesh=pm, init_seed=0,
                        stage=3, mixed_precision=MixedPrecisionPolicy(torch.bfloat16))
    opt = ShardedAdamW(engine, decay_param_groups(engine, 0.1), lr=1e-3)
    for micro_batches in batches:                  # gradient accumulation: reduce once
        with engine.no_sync():
            for tokens in micro_batches[:-1]:
                causal_lm_loss(engine(tokens), tokens).backward()
        causal_lm_loss(engine(micro_batches[-1]), micro_batches[-1]).backward()
        engine.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()

Checkpoints read and write ``engine.local_shards()``, ``opt.optimizer_metadata()`` and
``engine.buffers()``; see :class:`ZeroEngine` for the contract. ``engine.summon_full_params()``
and ``engine.full_state_dict()`` give whole tensors of small models; ``checkpoint_units(engine)``
turns on activation checkpointing per unit. ``ZeroEngine(..., zeropp=ZeroPP(qwz=True, hpz=True,
qgz=True))`` turns on ZeRO++ (:mod:`shardckpt.runtime.zeropp`), with nodes of
``init_distributed(ranks_per_node=K)`` ranks. ``ZeroEngine(..., offload_optimizer="cpu")`` (or
``"nvme"`` with ``offload_dir=``) keeps the fp32 masters, optimizer state and step in host memory
or in files (:mod:`shardckpt.runtime.offload`); ``engine.close()`` removes the files.
``ZeroEngine(..., compile_units=True)`` runs each unit's forward under ``torch.compile``, the
hooks outside the graph (:mod:`shardckpt.runtime.compiled`). The small Llama of the example is
in :mod:`shardckpt.runtime.models`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# Lazy (PEP 562): importing a torch-free submodule such as ``llama_config`` must not import torch.
_EXPORTS = {
    "MixedPrecisionPolicy": "precision",
    "checkpoint_units": "activation",
    "ZeroEngine": "engine",
    "skip_weight_init": "init",
    "shard_model": "engine",
    "ProcessMesh": "mesh",
    "TorchrunEnv": "mesh",
    "init_distributed": "mesh",
    "ShardedAdamW": "optim_rules",
    "ShardedOptimizer": "optim",
    "ShardedSGD": "optim_rules",
    "build_optimizer": "optim_rules",
    "decay_param_groups": "optim",
    "units_by_type": "units",
    "ZeroPP": "zeropp.options",
}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from shardckpt.runtime.activation import checkpoint_units  # noqa: F401
    from shardckpt.runtime.engine import ZeroEngine, shard_model  # noqa: F401
    from shardckpt.runtime.init import skip_weight_init  # noqa: F401
    from shardckpt.runtime.mesh import ProcessMesh, TorchrunEnv, init_distributed  # noqa: F401
    from shardckpt.runtime.optim import ShardedOptimizer, decay_param_groups  # noqa: F401
    from shardckpt.runtime.optim_rules import ShardedAdamW, ShardedSGD, build_optimizer  # noqa: F401
    from shardckpt.runtime.precision import MixedPrecisionPolicy  # noqa: F401
    from shardckpt.runtime.units import units_by_type  # noqa: F401
    from shardckpt.runtime.zeropp.options import ZeroPP  # noqa: F401


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"shardckpt.runtime.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'shardckpt.runtime' has no attribute {name!r}")
