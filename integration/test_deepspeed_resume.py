"""A ``ZeroEngine`` resumed from an imported DeepSpeed checkpoint, at another world size, continues
with the losses DeepSpeed had continuing from its own checkpoint (recorded in the fixtures).

Tolerances: the first loss is computed from the imported weights before any update. fp32 runs
differ from DeepSpeed only in the order of floating-point sums (gradient reduction across ranks,
the per-rank batch split), about 1e-7 relative over the three steps: the bound is 1e-6. bf16 runs
also differ in where bf16 rounding happens (DeepSpeed reduces gradients in bf16, the engine in
fp32), about 5e-5 relative after one update: the bound is 5e-4.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from testing.ranks import run_distributed

pytestmark = pytest.mark.slow

FIXTURES = Path(__file__).parent.parent / "tests" / "fixtures" / "deepspeed"
FROZEN = "model.layers.1.post_attention_layernorm.weight"
TOLERANCE = {"fp32": 1e-6, "bf16": 5e-4}


def job_resume(rank: int, world: int, ckpt: str, doc: dict) -> list[float]:
    import torch.distributed as dist

    from shardckpt.runtime import (
        MixedPrecisionPolicy, ShardedAdamW, ZeroEngine, decay_param_groups, init_distributed,
    )
    from shardckpt.runtime.models.llama import LLAMA_POLICY, LlamaConfig, LlamaForCausalLM, causal_lm_loss
    from shardckpt.training.save_load import load

    pm = init_distributed(timeout_s=60)
    torch.manual_seed(99)  # another init: everything must come from the checkpoint
    model = LlamaForCausalLM(LlamaConfig(**doc["model"]))
    model.get_parameter(FROZEN).requires_grad_(False)
    model.model.register_buffer("pos_scale", torch.zeros(5), persistent=True)
    mp = MixedPrecisionPolicy(torch.bfloat16) if doc["precision"] == "bf16" else None
    engine = ZeroEngine(model, policy=LLAMA_POLICY, process_mesh=pm, mixed_precision=mp)
    opt = ShardedAdamW(engine, decay_param_groups(engine, doc["weight_decay"]), lr=1.0)
    load(engine, ckpt)
    losses = []
    for step in range(doc["steps"], len(doc["batches"])):
        rows = doc["batches"][step]
        per = len(rows) // world
        tokens = torch.tensor(rows[rank * per:(rank + 1) * per])
        loss = causal_lm_loss(engine(tokens), tokens)
        loss.backward()
        opt.step()
        opt.zero_grad()
        mean = loss.detach().float().clone()
        dist.all_reduce(mean)
        losses.append(float(mean) / world)
    return losses


@pytest.mark.parametrize("name,world", [("zero1-fp32-2", 4), ("zero2-bf16-2", 1),
                                        ("zero3-fp32-3", 2), ("zero3-bf16-2", 4)])
def test_resume_continues_like_deepspeed(tmp_path: Path, name: str, world: int) -> None:
    from shardckpt.interop.deepspeed.import_ import import_deepspeed

    doc = json.loads((FIXTURES / name / "reference.json").read_text())
    dst = str(tmp_path / "imported")
    import_deepspeed(str(FIXTURES / name), dst, world)
    losses = run_distributed(job_resume, world, args=(dst, doc), timeout_s=240)[0]
    want = doc["resumed_losses"]
    assert losses == pytest.approx(want, rel=TOLERANCE[doc["precision"]]), (losses, want)
