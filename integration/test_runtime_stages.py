"""ZeRO stages 1/2/3, bf16 mixed precision, gradient accumulation, clipping, tied parameters and
full-parameter access on real gloo process groups.

One spawned job per world size runs every case (see ``cases_for``) on one process group. Each
case trains engines on every rank, all-gathers their shards with plain ``torch.distributed``
(not the runtime's collectives), and rank 0 alone computes the plain-PyTorch reference once per
configuration and compares; other ranks report what they check locally. A report is a list of
problems (empty = pass).

The reference (DESIGN.md, "Deterministic mode"), for every configuration:

* fp32 masters are the parameters of an fp32 model; with a compute dtype, each micro-batch runs on
  a copy of the model whose parameters are the masters cast to bf16 (buffers stay fp32);
* each rank's micro-batch runs in turn; its gradients are cast to the reduce dtype; with
  accumulation ``no_sync`` each rank sums its micro-batches first (in the reduce dtype), with
  ``per_micro`` every micro-batch is reduced and the fp32 means are summed;
* a reduction sums ranks in rank order in the reduce dtype, divides by the world size and casts
  to fp32; ``torch.optim.AdamW(foreach=False)`` steps the fp32 masters.
"""

from __future__ import annotations

import copy
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist

try:  # integration/ as a package, or (no __init__.py) as a rootdir on sys.path
    from .distutil import register_suite, selected_modules, shared_reports
    from .test_runtime_parity import two_groups
except ImportError:
    from distutil import register_suite, selected_modules, shared_reports
    from test_runtime_parity import two_groups

pytestmark = pytest.mark.slow

STEPS = 3
LR, BETAS, WD = 1e-2, (0.9, 0.95), 0.1
TINY = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=1)
#: Clipping: the sharded norm sums squares per shard in fp64, then across ranks; the reference
#: sums per tensor in fp32. Stated tolerance: norms within this relative error, and parameters
#: after clipped AdamW steps within CLIP_PARAM_RTOL / CLIP_PARAM_ATOL.
CLIP_NORM_RTOL = 1e-5
CLIP_PARAM_RTOL, CLIP_PARAM_ATOL = 1e-4, 1e-6


def batch(step: int, micro: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(10_000 * step + 100 * micro + rank)
    return torch.randint(0, TINY["vocab_size"], (2, 8), generator=g)


def _model(seed: int = 0):
    from shardckpt.runtime.llama import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**TINY))


def _loss(logits: torch.Tensor, tokens: torch.Tensor, micro: int) -> torch.Tensor:
    from shardckpt.runtime.llama import causal_lm_loss

    return causal_lm_loss(logits, tokens) / micro


def reference(world: int, micro: int = 1, param_dtype: torch.dtype | None = None,
              reduce_dtype: torch.dtype = torch.float32, accumulate: str = "per_micro",
              clip: float | None = None, steps: int = STEPS) -> dict[str, Any]:
    """Plain PyTorch (see module docstring): masters, AdamW states and pre-clip norms."""
    model = _model()
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    compute = model
    if param_dtype is not None:
        compute = copy.deepcopy(model)  # keeps the tie; parameters only are cast
        for p in compute.parameters():
            p.data = p.data.to(param_dtype)
    cparams = dict(compute.named_parameters())
    opt = torch.optim.AdamW(two_groups(named, WD), lr=LR, betas=BETAS, foreach=False)

    def mean(grads: list[torch.Tensor]) -> torch.Tensor:
        total = grads[0].to(reduce_dtype, copy=True)
        for g in grads[1:]:
            total += g
        return (total / world).float()

    norms = []
    for step in range(steps):
        local = [[{} for _ in range(micro)] for _ in range(world)]
        for m in range(micro):
            for r in range(world):
                compute.zero_grad(set_to_none=True)
                tokens = batch(step, m, r)
                _loss(compute(tokens), tokens, micro).backward()
                local[r][m] = {n: cparams[n].grad.to(reduce_dtype, copy=True) for n, _ in named}
        for n, p in named:
            if accumulate == "no_sync":
                acc = []
                for r in range(world):
                    a = local[r][0][n]
                    for m in range(1, micro):
                        a += local[r][m][n]
                    acc.append(a)
                p.grad = mean(acc)
            else:
                p.grad = mean([local[r][0][n] for r in range(world)])
                for m in range(1, micro):
                    p.grad += mean([local[r][m][n] for r in range(world)])
        if clip is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_([p for _, p in named], clip)))
        opt.step()
        if param_dtype is not None:
            with torch.no_grad():
                for n, p in named:
                    cparams[n].copy_(p)
    names = {id(p): n for n, p in named}
    states = {kind: {names[id(p)]: s[kind] for p, s in opt.state.items()}
              for kind in ("exp_avg", "exp_avg_sq")}
    return {"master": {n: p.detach() for n, p in named}, **states, "norms": norms}


def train(pm, stage: int, micro: int = 1, mp: Any = None, accumulate: str = "per_micro",
          clip: float | None = None, ac: bool = False, steps: int = STEPS,
          after_backward: Callable[[Any], None] | None = None) -> tuple[Any, list[float]]:
    """The engine's run of the reference's configuration on this rank."""
    from shardckpt.runtime import ShardedAdamW, ZeroEngine, checkpoint_units, decay_param_groups
    from shardckpt.runtime.llama import LLAMA_POLICY

    engine = ZeroEngine(_model(), policy=LLAMA_POLICY, process_mesh=pm, deterministic=True,
                        stage=stage, mixed_precision=mp)
    if ac:
        checkpoint_units(engine)
    opt = ShardedAdamW(engine, decay_param_groups(engine, WD), lr=LR, betas=BETAS)
    norms = []
    for step in range(steps):
        for m in range(micro):
            tokens = batch(step, m, pm.rank)
            sync = accumulate == "per_micro" or m == micro - 1
            engine.set_requires_gradient_sync(sync)
            _loss(engine(tokens), tokens, micro).backward()
        if after_backward is not None:
            after_backward(engine)
        if clip is not None:
            norms.append(engine.clip_grad_norm_(clip))
        opt.step()
        opt.zero_grad()
    return engine, norms


def gathered(engine) -> tuple[dict[str, dict[str, torch.Tensor]], list[str]]:
    """kind -> FQN -> whole tensor, all-gathered from every rank's ``local_shards()`` with plain
    ``torch.distributed`` (plain ZeRO meshes); and the groups whose padding is not zero."""
    world = engine.process_mesh.world_size
    out: dict[str, dict[str, torch.Tensor]] = {}
    bad = []
    for name, kinds in engine.local_shards().items():
        g = engine.layout.group(name)
        for kind, shard in kinds.items():
            full = shard.clone()
            if world > 1:
                full = torch.empty(shard.numel() * world, dtype=shard.dtype)
                dist.all_gather_single(full, shard.contiguous())
            if full[g.numel:].any():
                bad.append(f"{name}.{kind} has non-zero padding")
            for spec in engine.layout.group_params(g):
                out.setdefault(kind, {})[spec.fqn] = full[spec.offset:spec.offset + spec.numel
                                                          ].view(spec.shape)
    return out, bad


def differences(label: str, got: dict[str, dict[str, torch.Tensor]], ref: dict[str, Any],
                kinds: tuple[str, ...] = ("master", "exp_avg", "exp_avg_sq")) -> list[str]:
    """Every (kind, FQN) where ``got`` is not bit-identical to the reference."""
    out = []
    for kind in kinds:
        for fqn, want in ref[kind].items():
            have = got[kind][fqn]
            if have.dtype != want.dtype or not torch.equal(have, want):
                diff = (have.double() - want.double()).abs().max().item()
                out.append(f"{label}: {kind} {fqn} differs (max {diff:g})")
    return out


def compare_runs(pm, runs: dict[str, dict], ref_kwargs: dict) -> list[str]:
    """Train each engine configuration in ``runs``; rank 0 compares all with one reference."""
    problems, got = [], {}
    for label, kwargs in runs.items():
        engine, _ = train(pm, **kwargs)
        got[label], bad = gathered(engine)
        problems += [f"{label}: {b}" for b in bad]
    if pm.rank == 0:
        ref = reference(pm.world_size, **ref_kwargs)
        for label, states in got.items():
            problems += differences(label, states, ref)
    return problems


# ------------------------------------------------------------------------------- the cases


def case_stages_fp32(pm) -> list[str]:
    """Stages 1 and 2 (and 3 with activation checkpointing) equal the fp32 reference; the
    stored state has the same names, kinds, shapes and dtypes whatever the stage."""
    problems = compare_runs(pm, {"stage 1": dict(stage=1), "stage 2": dict(stage=2),
                                 "stage 3 + checkpointing": dict(stage=3, ac=True)}, {})
    shapes = []
    for stage in (1, 2, 3):
        engine, _ = train(pm, stage, steps=0)
        shapes.append({(n, k): (tuple(t.shape), t.dtype) for n, kinds in
                       engine.local_shards().items() for k, t in kinds.items()})
    if not shapes[0] == shapes[1] == shapes[2]:
        problems.append("local_shards() differs between stages")
    return problems


def case_mixed_bf16(pm) -> list[str]:
    """bf16 compute, fp32 reduce, fp32 masters at stages 1, 2, 3; and bf16 reduce at stage 3."""
    from shardckpt.runtime import MixedPrecisionPolicy

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    problems = compare_runs(pm, {f"bf16 stage {s}": dict(stage=s, mp=mp) for s in (1, 2, 3)},
                            dict(param_dtype=torch.bfloat16))
    bf16_reduce = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    problems += compare_runs(pm, {"bf16 reduce stage 3": dict(stage=3, mp=bf16_reduce)},
                             dict(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16))
    return problems


def case_accumulation(pm) -> list[str]:
    """4 micro-batches: no_sync (one reduction per step) and per-micro-batch reductions."""
    micro = 4
    calls = {"n": 0}
    real = dist.all_to_all_single

    def counting(*args, **kwargs):
        calls["n"] += 1
        return real(*args, **kwargs)

    dist.all_to_all_single = counting
    try:
        problems = compare_runs(
            pm, {f"no_sync stage {s}": dict(stage=s, micro=micro, accumulate="no_sync")
                 for s in (1, 2, 3)}, dict(micro=micro, accumulate="no_sync"))
        reductions_no_sync, calls["n"] = calls["n"], 0
        problems += compare_runs(
            pm, {f"per-micro stage {s}": dict(stage=s, micro=micro) for s in (1, 3)},
            dict(micro=micro))
        reductions_per_micro = calls["n"]
    finally:
        dist.all_to_all_single = real
    trained = 3  # flat groups: root and two blocks, all fp32 and trained
    if pm.world_size > 1:
        if reductions_no_sync != 3 * trained * STEPS:
            problems.append(f"no_sync ran {reductions_no_sync} gradient exchanges for 3 engines, "
                            f"expected one per group and step ({3 * trained * STEPS})")
        if reductions_per_micro != 2 * trained * STEPS * micro:
            problems.append(f"per-micro ran {reductions_per_micro} gradient exchanges, expected "
                            f"{2 * trained * STEPS * micro}")
    return problems


def case_clip(pm) -> list[str]:
    """Global-norm clipping at stages 1, 2, 3 within the stated tolerance of clip_grad_norm_."""
    runs = {s: train(pm, s, clip=0.05) for s in (1, 2, 3)}
    got = {s: gathered(engine)[0] for s, (engine, _) in runs.items()}
    problems = []
    if pm.rank == 0:
        ref = reference(pm.world_size, clip=0.05)
        if min(ref["norms"]) <= 0.05:
            problems.append(f"clipping never engaged: {ref['norms']}")
        for s, (_, norms) in runs.items():
            for mine, theirs in zip(norms, ref["norms"]):
                if abs(mine - theirs) > CLIP_NORM_RTOL * theirs:
                    problems.append(f"stage {s}: norm {mine!r} vs clip_grad_norm_ {theirs!r}")
            for fqn, want in ref["master"].items():
                have = got[s]["master"][fqn]
                if not torch.allclose(have, want, rtol=CLIP_PARAM_RTOL, atol=CLIP_PARAM_ATOL):
                    problems.append(f"stage {s}: {fqn} off by {(have - want).abs().max():g}")
    return problems


def case_tied_and_collectives(pm) -> list[str]:
    """The tied embedding/head: one parameter, one gather of its unit per step, one gradient.
    Stage 1 holds the whole fp32 mean gradient, 2 and 3 a shard; 1 and 2 keep parameters."""
    problems = []
    gathers: list[int] = []
    real = dist.all_gather_into_tensor, dist.all_gather_single

    def counting(out, inp, *args, **kwargs):
        gathers.append(out.numel() * out.element_size())
        return real[0](out, inp, *args, **kwargs)

    def counting_single(out, inp, *args, **kwargs):
        gathers.append(out.numel() * out.element_size())
        return real[1](out, inp, *args, **kwargs)

    for stage in (1, 2, 3):
        seen: dict[str, Any] = {}

        def probe(engine, seen=seen):
            root = engine.groups[engine.layout.groups[0].name]
            seen["root"] = root.spec
            seen["grad"] = (root.grad.numel(), None if root.grad_full is None
                            else root.grad_full.numel())
            seen["kept"] = all(g.gathered for g in engine.groups.values())
            seen["aliases"] = dict(engine.tied_aliases)
            seen["layout"] = [p.fqn for p in engine.layout.params]

        dist.all_gather_into_tensor, dist.all_gather_single = counting, counting_single
        try:
            gathers.clear()
            train(pm, stage, steps=2, after_backward=probe)
        finally:
            dist.all_gather_into_tensor, dist.all_gather_single = real
        root = seen["root"]
        if "lm_head.weight" in seen["layout"] or seen["aliases"] != {
                "lm_head.weight": "model.embed_tokens.weight"}:
            problems.append(f"stage {stage}: tied head not an alias: {seen['aliases']}")
        s, full = root.padded_numel // pm.world_size, root.padded_numel
        want = (s, full) if stage == 1 else (s, None)
        if seen["grad"] != want:
            problems.append(f"stage {stage}: root gradient (shard, whole) {seen['grad']}, "
                            f"expected {want}")
        if seen["kept"] != (stage < 3):
            problems.append(f"stage {stage}: parameters kept gathered after backward: "
                            f"{seen['kept']}")
        if pm.world_size > 1:
            root_gathers = gathers.count(full * 4)  # fp32 compute: the root's gathered bytes
            # stage 3: once per step (the root stays gathered for its backward); stages 1 and 2:
            # once in the first forward and once after each step.
            expected = 2 if stage == 3 else 3
            if stage == 1:  # plus the whole fp32 gradient, all-gathered once per step
                expected += 2
            if root_gathers != expected:
                problems.append(f"stage {stage}: {root_gathers} all-gathers of the tied unit's "
                                f"{full * 4} bytes in 2 steps, expected {expected}")
    return problems


def case_full_params(pm) -> list[str]:
    """summon_full_params gives whole tensors; writeback changes the masters (and the model);
    full_state_dict equals the eager model's state_dict and loads back."""
    from shardckpt.runtime import MixedPrecisionPolicy

    problems = []
    eager = _model()
    tokens = batch(0, 0, 0)
    for stage, mp in ((3, None), (1, None), (2, MixedPrecisionPolicy())):
        engine, _ = train(pm, stage, mp=mp, steps=0)
        label = f"stage {stage}{' bf16' if mp else ''}"
        with engine.summon_full_params() as full:
            bad = [n for n, p in eager.state_dict().items()
                   if n in full and not torch.equal(full[n], p)]
            if bad or set(full) != {n for n, _ in eager.named_parameters(remove_duplicate=False)}:
                problems.append(f"{label}: summoned tensors differ: {bad[:3]}")
        with engine.summon_full_params(writeback=True) as full, torch.no_grad():
            for p in {id(t): t for t in full.values()}.values():  # the tied one once
                p.mul_(2)
            full["model.norm.weight"].data = torch.full((TINY["hidden_size"],), 3.0)
        expected = {n: p.detach() * 2 for n, p in eager.named_parameters()}
        expected["model.norm.weight"] = torch.full((TINY["hidden_size"],), 3.0)
        after = engine.gather_full_params()
        bad = [n for n, p in expected.items() if not torch.equal(after[n], p)]
        if bad:
            problems.append(f"{label}: writeback did not reach the masters: {bad[:3]}")
        twin = copy.deepcopy(eager)
        twin.load_state_dict({**expected, "lm_head.weight": expected["model.embed_tokens.weight"]})
        if mp is not None:
            for p in twin.parameters():
                p.data = p.data.bfloat16()
        with torch.no_grad():
            if not torch.equal(engine(tokens), twin(tokens)):
                problems.append(f"{label}: the forward after writeback does not use the masters")
        sd = engine.full_state_dict()
        if list(sd) != list(twin.state_dict()) or sd["lm_head.weight"] is not sd[
                "model.embed_tokens.weight"]:
            problems.append(f"{label}: full_state_dict keys {list(sd)[:4]}...")
        engine.load_full_state_dict(eager.state_dict())
        if any(not torch.equal(engine.gather_full_params()[n], p)
               for n, p in eager.named_parameters()):
            problems.append(f"{label}: load_full_state_dict did not restore the masters")
    return problems


CASES: dict[str, Callable] = {
    "stages_fp32": case_stages_fp32,
    "mixed_bf16": case_mixed_bf16,
    "accumulation": case_accumulation,
    "clip": case_clip,
    "tied": case_tied_and_collectives,
    "full_params": case_full_params,
}


def cases_for(world: int) -> list[str]:
    names = ["stages_fp32", "mixed_bf16", "accumulation", "full_params"]
    if world in (2, 3):
        names += ["clip", "tied"]
    return names


def _job(rank: int, world_size: int, names: list[str]) -> dict[str, list[str]]:
    from shardckpt.runtime import init_distributed

    pm = init_distributed(timeout_s=120)
    return {name: CASES[name](pm) for name in names}


register_suite(__name__, "_job", cases_for, timeout_s=240, pg_timeout_s=150)


# ------------------------------------------------------------------------------- the tests


@pytest.fixture(scope="module", params=[1, 2, 3, 4], ids=lambda n: f"world{n}")
def reports(request) -> dict[str, list[list[str]]]:
    """case -> per-rank problem lists, from one job on ``world`` gloo processes (shared with the
    other runtime suites selected in this session)."""
    return shared_reports(__name__, request.param, selected_modules(request.session))


def _check(reports: dict, case: str) -> None:
    if case not in reports:
        pytest.skip(f"{case} does not run at this world size")
    failed = {rank: p for rank, p in enumerate(reports[case]) if p}
    assert not failed, f"{case}: problems by rank: {failed}"


def test_stages_1_and_2_bit_exact(reports):
    _check(reports, "stages_fp32")


def test_bf16_mixed_precision_bit_exact_at_every_stage(reports):
    _check(reports, "mixed_bf16")


def test_gradient_accumulation_both_modes_bit_exact(reports):
    _check(reports, "accumulation")


def test_clipping_within_tolerance_at_every_stage(reports):
    _check(reports, "clip")


def test_tied_parameters_one_gather_one_gradient(reports):
    _check(reports, "tied")


def test_summon_full_params_and_full_state_dict(reports):
    _check(reports, "full_params")
