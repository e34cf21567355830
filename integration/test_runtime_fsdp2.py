"""The ZeRO-3 runtime against PyTorch FSDP2 (``torch.distributed.fsdp.fully_shard``) on gloo.

Shares the job of each world size with the other runtime suites (``testing.ranks.shared_reports``).
The same tiny Llama (``test_runtime_stages.py``; the embedding tied to the head), the same
initial weights, the same batches on each rank, the same AdamW hyper-parameters and param groups
(``torch.optim.AdamW(foreach=False)`` on FSDP2's DTensor shards), the same units (each decoder
layer, then the root) and the same mixed precision (none, or bf16 compute with fp32 gradient
reduction); both in their default (non-deterministic) reduction mode.

Stated tolerance over 10 steps, each rank's loss: relative ``FP32_RTOL`` in fp32 and
``BF16_RTOL`` with bf16 compute. They differ only in the rounding of the gradient mean (FSDP2
divides before or after its reduce-scatter; the runtime sums, then divides) and, in bf16, in
where that rounding lands after a bf16 cast.
"""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch

from testing.models import BETAS, LR, WD, tiny_batch, tiny_llama, tiny_loss, two_groups
from testing.ranks import case_suite

pytestmark = pytest.mark.slow

STEPS = 10
FP32_RTOL = 1e-6
BF16_RTOL = 1e-4


def _losses(forward: Callable, opt: torch.optim.Optimizer, rank: int) -> list[float]:
    out = []
    for i in range(STEPS):
        tokens = tiny_batch(i, 0, rank)
        loss = tiny_loss(forward(tokens), tokens, 1)
        loss.backward()
        opt.step()
        opt.zero_grad()
        out.append(float(loss.detach()))
    return out


def fsdp2_losses(pm, bf16: bool) -> list[float]:
    """FSDP2 on the default group: ``fully_shard`` on each decoder layer, then the root."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from shardckpt.runtime.models.llama import LlamaDecoderLayer

    mesh = init_device_mesh("cpu", (pm.world_size,))
    kwargs: dict[str, Any] = {"mesh": mesh}
    if bf16:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                   reduce_dtype=torch.float32)
    model = tiny_llama()
    for m in model.modules():
        if isinstance(m, LlamaDecoderLayer):
            fully_shard(m, **kwargs)
    fully_shard(model, **kwargs)
    opt = torch.optim.AdamW(two_groups(model.named_parameters(), WD), lr=LR, betas=BETAS,
                            foreach=False)
    return _losses(model, opt, pm.rank)


def shardckpt_losses(pm, bf16: bool) -> list[float]:
    from shardckpt.runtime import MixedPrecisionPolicy, ShardedAdamW, ZeroEngine
    from shardckpt.runtime import decay_param_groups
    from shardckpt.runtime.models.llama import LLAMA_POLICY

    mp = MixedPrecisionPolicy(torch.bfloat16, torch.float32) if bf16 else None
    engine = ZeroEngine(tiny_llama(), policy=LLAMA_POLICY, process_mesh=pm, mixed_precision=mp)
    opt = ShardedAdamW(engine, decay_param_groups(engine, WD), lr=LR, betas=BETAS)
    return _losses(engine, opt, pm.rank)


def case_fsdp2_losses(pm) -> list[str]:
    problems = []
    for bf16, rtol in ((False, FP32_RTOL), (True, BF16_RTOL)):
        ours, theirs = shardckpt_losses(pm, bf16), fsdp2_losses(pm, bf16)
        worst = max(abs(a - b) / abs(b) for a, b in zip(ours, theirs))
        if worst > rtol:
            problems.append(f"{'bf16' if bf16 else 'fp32'}: losses differ by up to {worst:.3g} "
                            f"(relative) > {rtol:g}: {ours} vs FSDP2 {theirs}")
        if ours[-1] >= ours[0]:
            problems.append(f"{'bf16' if bf16 else 'fp32'}: the loss did not fall: {ours}")
    return problems


CASES: dict[str, Callable] = {"fsdp2_losses": case_fsdp2_losses}


def cases_for(world: int) -> list[str]:
    return ["fsdp2_losses"] if world == 2 else []


reports = case_suite(__name__, CASES, cases_for, [2], timeout_s=120, pg_timeout_s=150,
                     case_pg_timeout_s=120)


def test_losses_agree_with_fsdp2_over_ten_steps(reports):
    failed = {rank: p for rank, p in enumerate(reports["fsdp2_losses"]) if p}
    assert not failed, f"fsdp2_losses: problems by rank: {failed}"
