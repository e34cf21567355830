"""ZeRO-3 runtime on real gloo process groups: bit-exact parity, frozen/mixed dtypes, meta init.

One spawned job per world size runs every case on one process group and reports per-case
problems (empty list = pass) back through :mod:`testing.ranks`; the tests below read those reports.

The references (``testing/reference.py``) use plain PyTorch only (no shardckpt runtime code):
each rank's micro-batch is run in turn, gradients are summed in rank order and divided by the
world size, and ``torch.optim.AdamW`` / ``SGD`` with ``foreach=False`` take the step, one thread
per process.
"""

from __future__ import annotations

from typing import Callable

import pytest
import torch

from testing.models import LLAMA, Toy, ToyBlock, toy_batch, toy_loss
from testing.ranks import case_suite, check_case
from testing.reference import compare_shards, optimizer_tensors, reference_train


# ------------------------------------------------------------------------------- the cases

STEPS = 10


def _warmup(step: int) -> float:
    return min(1.0, (step + 1) / 4)


def _llama_adamw(pm, deterministic: bool = True, exact: bool = True) -> list[str]:
    from torch.optim.lr_scheduler import LambdaLR

    from shardckpt.runtime import ShardedAdamW, ZeroEngine, decay_param_groups
    from shardckpt.runtime.data import SyntheticCorpus, TokenBatches
    from shardckpt.runtime.models.llama import LLAMA_POLICY, LlamaConfig, LlamaForCausalLM, causal_lm_loss

    cfg, W = LlamaConfig(**LLAMA), pm.world_size
    data = TokenBatches(SyntheticCorpus(cfg.vocab_size, seed=1), seq_len=16, micro_batch=2,
                        rank=pm.rank, world_size=W)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    engine = ZeroEngine(model, policy=LLAMA_POLICY, process_mesh=pm, deterministic=deterministic)
    opt = ShardedAdamW(engine, decay_param_groups(engine, 0.1), lr=3e-3, betas=(0.9, 0.95))
    sched = LambdaLR(opt, _warmup)
    for step in range(STEPS):
        tokens = data.batch(step)
        causal_lm_loss(engine(tokens), tokens).backward()
        opt.step()
        sched.step()
        opt.zero_grad()

    torch.manual_seed(0)
    ref = LlamaForCausalLM(cfg)
    ropt = reference_train(
        ref, lambda groups: torch.optim.AdamW(groups, lr=3e-3, betas=(0.9, 0.95), foreach=False),
        data.batch, causal_lm_loss, W, STEPS, 0.1, scheduler=lambda o: LambdaLR(o, _warmup))
    ref_params = dict(ref.named_parameters())
    if not exact:
        full = engine.gather_full_params()
        return [f"{n} differs by {(full[n] - p).abs().max().item():g}"
                for n, p in ref_params.items() if not torch.allclose(full[n], p, rtol=1e-4, atol=1e-5)]
    names = {id(p): n for n, p in ref_params.items()}
    problems = compare_shards(engine, ref_params)
    for kind in ("exp_avg", "exp_avg_sq"):
        problems += compare_shards(engine, optimizer_tensors(ropt, names, kind), kind)
    meta = opt.optimizer_metadata()
    if [g["step"] for g in meta["param_groups"]] != [STEPS, STEPS]:
        problems.append(f"steps {[g['step'] for g in meta['param_groups']]}, expected {STEPS}")
    if [g["lr"] for g in opt.param_groups] != [g["lr"] for g in ropt.param_groups]:
        problems.append("learning rates differ from the reference scheduler's")
    return problems


def case_adamw_llama(pm) -> list[str]:
    return _llama_adamw(pm)


def case_adamw_hsdp(pm) -> list[str]:
    """HSDP 2 x 2: deterministic mode equals the 4-rank reference bit for bit; the default
    (reduce-scatter in the shard group, all-reduce across replicas) up to rounding."""
    from shardckpt.format.layout import Mesh
    from shardckpt.runtime.mesh import ProcessMesh

    hsdp = ProcessMesh.from_process_group(Mesh.hsdp(2, pm.world_size // 2))
    return (_llama_adamw(hsdp)
            + [f"default mode: {p}" for p in _llama_adamw(hsdp, deterministic=False, exact=False)])


def case_nondeterministic(pm) -> list[str]:
    """The default reduce-scatter path: equal to the reference up to rounding."""
    return _llama_adamw(pm, deterministic=False, exact=False)


def case_sgd_toy(pm) -> list[str]:
    from shardckpt.runtime import ShardedSGD, ZeroEngine, decay_param_groups

    W = pm.world_size
    torch.manual_seed(1)
    engine = ZeroEngine(Toy(), policy=ToyBlock, process_mesh=pm, deterministic=True)
    opt = ShardedSGD(engine, decay_param_groups(engine, 0.01), lr=0.05, momentum=0.9,
                     dampening=0.1)
    for step in range(STEPS):
        ids = toy_batch(step, pm.rank)
        toy_loss(engine(ids), ids).backward()
        opt.step()
        opt.zero_grad()
    torch.manual_seed(1)
    ref = Toy()
    ropt = reference_train(
        ref, lambda g: torch.optim.SGD(g, lr=0.05, momentum=0.9, dampening=0.1, foreach=False),
        toy_batch, toy_loss, W, STEPS, 0.01)
    names = {id(p): n for n, p in ref.named_parameters()}
    return (compare_shards(engine, dict(ref.named_parameters()))
            + compare_shards(engine, optimizer_tensors(ropt, names, "momentum_buffer"),
                             "momentum_buffer"))


def case_frozen_mixed(pm) -> list[str]:
    """bf16 block (fp32 masters), frozen ``blocks.0.fc1``: bit-exact, frozen unchanged, no state."""
    from shardckpt.runtime import ShardedAdamW, ZeroEngine, decay_param_groups

    W = pm.world_size
    torch.manual_seed(2)
    engine = ZeroEngine(Toy(bf16_block=1, freeze=True), policy=ToyBlock, process_mesh=pm,
                        deterministic=True)
    opt = ShardedAdamW(engine, decay_param_groups(engine, 0.1), lr=1e-2)
    for step in range(STEPS):
        ids = toy_batch(step, pm.rank)
        toy_loss(engine(ids), ids).backward()
        opt.step()
        opt.zero_grad()
    torch.manual_seed(2)
    ref = Toy(bf16_block=1, freeze=True)
    frozen = {n: p.detach().clone() for n, p in ref.named_parameters() if not p.requires_grad}
    ropt = reference_train(ref, lambda g: torch.optim.AdamW(g, lr=1e-2, foreach=False),
                           toy_batch, toy_loss, W, STEPS, 0.1, fp32_masters=True)
    problems = compare_shards(engine, {**ropt.masters, **frozen})
    dtypes = {(g.dtype, g.requires_grad) for g in engine.layout.groups}
    if not {("bfloat16", True), ("float32", False), ("float32", True)} <= dtypes:
        problems.append(f"unexpected flat groups {sorted(dtypes)}")
    for g in engine.layout.groups:
        kinds = set(engine.local_shards()[g.name])
        expected = {"master", "exp_avg", "exp_avg_sq"} if g.requires_grad else {"master"}
        if kinds != expected:
            problems.append(f"{g.name} has state kinds {sorted(kinds)}, expected {sorted(expected)}")
        if engine.local_shards()[g.name]["master"].dtype != torch.float32:
            problems.append(f"{g.name} master is not fp32")
    return problems


def case_clip_toy(pm) -> list[str]:
    """Gradient clipping by the global norm: equal to the reference up to rounding."""
    from shardckpt.runtime import ShardedAdamW, ZeroEngine, decay_param_groups

    torch.manual_seed(3)
    engine = ZeroEngine(Toy(), policy=ToyBlock, process_mesh=pm, deterministic=True)
    opt = ShardedAdamW(engine, decay_param_groups(engine, 0.1), lr=1e-2)
    norms = []
    for step in range(3):
        ids = toy_batch(step, pm.rank)
        toy_loss(engine(ids), ids).backward()
        norms.append(engine.clip_grad_norm_(0.5))
        opt.step()
        opt.zero_grad()
    torch.manual_seed(3)
    ref = Toy()
    reference_train(ref, lambda g: torch.optim.AdamW(g, lr=1e-2, foreach=False), toy_batch,
                    toy_loss, pm.world_size, 3, 0.1, clip=0.5)
    full = engine.gather_full_params()
    problems = [f"{n} differs by {(full[n] - p).abs().max().item():g}"
                for n, p in ref.named_parameters() if not torch.allclose(full[n], p, atol=1e-6)]
    if min(norms) <= 0.5:
        problems.append(f"clipping never engaged: norms {norms}")
    return problems


def case_meta_init(pm) -> list[str]:
    """A meta-device model initialized unit by unit equals the eager one with the same seed."""
    from shardckpt.runtime import ZeroEngine
    from shardckpt.runtime.models.llama import LLAMA_POLICY, LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**LLAMA)
    torch.manual_seed(5)
    eager = LlamaForCausalLM(cfg)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    engine = ZeroEngine(model, policy=LLAMA_POLICY, process_mesh=pm, init_seed=5)
    full = engine.gather_full_params()
    problems = [n for n, p in eager.named_parameters() if not torch.equal(full[n], p)]
    tokens = torch.arange(12).reshape(2, 6)
    with torch.no_grad():
        if not torch.equal(engine(tokens), eager(tokens)):
            problems.append("logits differ from the eager model's")
    return problems


CASES: dict[str, Callable] = {
    "adamw_llama": case_adamw_llama,
    "sgd_toy": case_sgd_toy,
    "frozen_mixed": case_frozen_mixed,
    "meta_init": case_meta_init,
    "nondeterministic": case_nondeterministic,
    "clip_toy": case_clip_toy,
    "adamw_hsdp": case_adamw_hsdp,
}


def cases_for(world: int) -> list[str]:
    names = ["adamw_llama", "sgd_toy", "frozen_mixed", "meta_init"]
    if world > 1:
        names += ["nondeterministic", "clip_toy"]
    if world == 4:
        names.append("adamw_hsdp")
    return names


reports = case_suite(__name__, CASES, cases_for, [1, 2, 3, 4], timeout_s=170, pg_timeout_s=60,
                     case_pg_timeout_s=60)


# ------------------------------------------------------------------------------- the tests

pytestmark = pytest.mark.slow


_check = check_case


def test_adamw_bit_exact_with_two_param_groups_and_scheduler(reports):
    _check(reports, "adamw_llama")


def test_sgd_momentum_bit_exact(reports):
    _check(reports, "sgd_toy")


def test_frozen_and_mixed_dtype(reports):
    _check(reports, "frozen_mixed")


def test_meta_init_equals_eager(reports):
    _check(reports, "meta_init")


def test_nondeterministic_reduce_scatter_close(reports):
    _check(reports, "nondeterministic")


def test_gradient_clipping_by_global_norm(reports):
    _check(reports, "clip_toy")


def test_hsdp_2x2_equals_reference(reports):
    _check(reports, "adamw_hsdp")
