"""A rank that fails inside a step makes every rank fail with an error instead of hanging.

Two ways to fail: rank 1 raises in the middle of a forward (its peers are blocked in an
all-gather and see the broken group, long before the process-group timeout), or rank 1 stalls
(its peers' collectives hit the process-group timeout and raise). Either way every other rank
reports a ``CollectiveError``.

One launch of 3 ranks runs both, each in a default group of its own that the job initializes
(``init_distributed`` with the scenario's timeout): first the stall on ranks 0 and 1 of a group
of 2 (rank 2 waits; every outcome is recorded), then the raise on a group of all 3, whose
raising rank 1 ends its process as before.
"""

from __future__ import annotations

import time

import pytest
import torch

from testing.ckpt_runs import coordinator, new_world, record, records
from testing.ranks import run_ranks

pytestmark = pytest.mark.slow

PG_TIMEOUT_S = 3.0
#: A process-group timeout longer than the join guard: peers that waited for it would be
#: reported as hung; they must see the broken group instead.
LONG_TIMEOUT_S = 3600.0


def _train(rank: int, mode: str, timeout_s: float) -> None:
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


def _job(rank: int, world_size: int, root: str) -> None:
    store = coordinator()
    if new_world(store, "stall", 2, rank):
        try:
            _train(rank, "stall", PG_TIMEOUT_S)
            outcome = {"ok": True}
        except Exception as e:  # noqa: BLE001 - what the test inspects
            outcome = {"ok": False, "error_type": type(e).__name__, "error": str(e)}
        record(root, "stall", rank, outcome)
    new_world(store, "raise", 3, rank)
    _train(rank, "raise", LONG_TIMEOUT_S)  # rank 1 raises, its process ends: the peers must see it


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("failure"))
    return {"raise": run_ranks(_job, 3, args=(root,), timeout_s=300),
            "stall": records(root, "stall", range(2))}


def test_a_raising_rank_fails_every_rank_before_the_timeout(run):
    results = run["raise"]
    assert results[1].error_type == "ValueError" and "injected" in results[1].error, results[1]
    for r in (results[0], results[2]):
        assert r.error_type == "CollectiveError", r.describe()
        assert f"rank {r.rank} of 3" in r.error
        assert "timed out" not in r.error.lower(), r.error
        assert r.elapsed_s < LONG_TIMEOUT_S, r.describe()


def test_a_stalled_rank_times_peers_out_with_collective_error(run):
    peer, stalled = run["stall"]
    # a rank that hung in the stall would have kept the launch from recording it
    assert peer is not None and stalled is not None, [r.describe() for r in run["raise"]]
    assert peer["error_type"] == "CollectiveError", peer
    assert f"timeout is {PG_TIMEOUT_S:g}s" in peer["error"]
    assert not stalled["ok"], stalled
