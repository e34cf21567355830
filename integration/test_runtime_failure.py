"""A rank that fails inside a step makes every rank fail with an error instead of hanging.

Two ways to fail: rank 1 raises in the middle of a forward (its peers are blocked in an
all-gather and see the broken group, long before the process-group timeout), or rank 1 stalls
(its peers' collectives hit the process-group timeout and raise). Either way every other rank
reports a ``CollectiveError``.
"""

from __future__ import annotations

import time

import pytest
import torch

from testing.ranks import run_ranks

pytestmark = pytest.mark.slow

PG_TIMEOUT_S = 3.0


def _job(rank: int, world_size: int, mode: str, timeout_s: float) -> None:
    from shardckpt.runtime import ShardedAdamW, ZeroEngine, init_distributed
    from shardckpt.runtime.models.llama import LLAMA_POLICY, LlamaConfig, LlamaForCausalLM, causal_lm_loss

    pm = init_distributed(timeout_s=timeout_s)  # from RANK, WORLD_SIZE, MASTER_ADDR/PORT
    cfg = LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2)
    torch.manual_seed(0)
    engine = ZeroEngine(LlamaForCausalLM(cfg), policy=LLAMA_POLICY, process_mesh=pm)
    opt = ShardedAdamW(engine)
    state = {"step": 0}

    def inject(module, args):
        if rank == 1 and state["step"] == 2:
            if mode == "raise":
                raise ValueError("injected failure on rank 1")
            time.sleep(PG_TIMEOUT_S + 1)  # longer than the peers' process-group timeout

    engine.module.model.layers[1].register_forward_pre_hook(inject)
    for step in range(4):
        state["step"] = step
        tokens = torch.randint(0, cfg.vocab_size, (2, 8))
        causal_lm_loss(engine(tokens), tokens).backward()
        opt.step()
        opt.zero_grad()


def test_a_raising_rank_fails_every_rank_before_the_timeout():
    # a process-group timeout longer than the join guard: peers that waited for it would be
    # reported as hung; they must see the broken group instead
    long_timeout_s = 3600.0
    results = run_ranks(_job, 3, args=("raise", long_timeout_s), timeout_s=300,
                        init_process_group=False)
    assert results[1].error_type == "ValueError" and "injected" in results[1].error, results[1]
    for r in (results[0], results[2]):
        assert r.error_type == "CollectiveError", r.describe()
        assert f"rank {r.rank} of 3" in r.error
        assert "timed out" not in r.error.lower(), r.error
        assert r.elapsed_s < long_timeout_s, r.describe()


def test_a_stalled_rank_times_peers_out_with_collective_error():
    results = run_ranks(_job, 2, args=("stall", PG_TIMEOUT_S), timeout_s=90,
                        init_process_group=False)
    peer = results[0]
    assert peer.error_type == "CollectiveError", peer.describe()
    assert f"timeout is {PG_TIMEOUT_S:g}s" in peer.error
    assert not results[1].ok and results[1].error_type != "Hung", results[1].describe()
