"""The ZeRO++ suites' job: K ranks per simulated node, the tiny Llama with SGD, every ZeRO++
configuration (``integration/test_zeropp_runtime.py``, ``test_zeropp_bytes.py``)."""

from __future__ import annotations

from typing import Any

import torch

K = 2          # ranks per simulated node
STEPS = 50
LR = 0.5
VOCAB, SEQ, MICRO = 64, 16, 2
TINY = dict(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=1)


def node_mesh():
    """The job's mesh. Its ranks quantize with the eager reference: the fused kernels write the
    reference's bytes (``tests/test_zeropp_single.py``, one process, every shape class, and the
    engine's qwZ gather through them there), and compiling them on four ranks sharing two cores
    would cost this launch more than all its cases; the collectives carry the same bytes either way."""
    import os

    from shardckpt.runtime import init_distributed
    from shardckpt.runtime.zeropp.quant import KERNEL_ENV

    os.environ[KERNEL_ENV] = "eager"

    pm = init_distributed(ranks_per_node=K)  # the job is up: builds the mesh on its group
    assert (pm.node_size, pm.world_spans_nodes) == (K, True), pm.describe()
    return pm


def zeropp_configs():
    from shardckpt.runtime import ZeroPP

    return {"plain": None, "qwz": ZeroPP(qwz=True), "hpz": ZeroPP(hpz=True),
            "qgz": ZeroPP(qgz=True), "all": ZeroPP(qwz=True, hpz=True, qgz=True)}


def build(pm, zeropp, deterministic: bool = True, lr: float = LR, **kwargs: Any):
    from shardckpt.runtime import ShardedSGD, ZeroEngine
    from shardckpt.runtime.models.llama import LLAMA_POLICY, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    engine = ZeroEngine(LlamaForCausalLM(LlamaConfig(**TINY)), policy=LLAMA_POLICY,
                        process_mesh=pm, deterministic=deterministic, zeropp=zeropp, **kwargs)
    return engine, ShardedSGD(engine, [{"params": [p for _, p in engine.named_parameters()]}],
                              lr=lr)


def batches(rank: int, world: int):
    from shardckpt.runtime.data import SyntheticCorpus, TokenBatches

    return TokenBatches(SyntheticCorpus(VOCAB, seed=1), seq_len=SEQ, micro_batch=MICRO,
                        rank=rank, world_size=world)


def forward_backward(engine, tokens) -> float:
    from shardckpt.runtime.models.llama import causal_lm_loss

    loss = causal_lm_loss(engine(tokens), tokens)
    loss.backward()
    return float(loss.detach())
