"""ZeRO stages 1/2/3, bf16 mixed precision, gradient accumulation and clipping on real gloo
process groups (tied parameters and full-parameter access: ``test_runtime_access.py``).

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

import contextlib
import copy
from typing import Any, Callable, Iterator

import pytest
import torch
import torch.distributed as dist

try:  # integration/ as a package, or (no __init__.py) as a rootdir on sys.path
    from .distutil import case_suite, check_case
    from .test_runtime_parity import two_groups
except ImportError:
    from distutil import case_suite, check_case
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
          after_backward: Callable[[Any], None] | None = None,
          deterministic: bool = True) -> tuple[Any, list[float]]:
    """The engine's run of the reference's configuration on this rank."""
    from shardckpt.runtime import ShardedAdamW, ZeroEngine, checkpoint_units, decay_param_groups
    from shardckpt.runtime.llama import LLAMA_POLICY

    engine = ZeroEngine(_model(), policy=LLAMA_POLICY, process_mesh=pm,
                        deterministic=deterministic, stage=stage, mixed_precision=mp)
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


@contextlib.contextmanager
def counting(*names: str) -> Iterator[list[int]]:
    """Bytes of the first tensor of every call of the named ``torch.distributed`` functions
    (the runtime looks them up at call time)."""
    calls: list[int] = []
    real = {name: getattr(dist, name) for name in names}

    def wrap(fn: Callable) -> Callable:
        def counted(out: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            calls.append(out.numel() * out.element_size())
            return fn(out, *args, **kwargs)
        return counted

    for name, fn in real.items():
        setattr(dist, name, wrap(fn))
    try:
        yield calls
    finally:
        for name, fn in real.items():
            setattr(dist, name, fn)


def gathered(engine) -> tuple[dict[str, dict[str, torch.Tensor]], list[str]]:
    """kind -> FQN -> whole tensor, all-gathered over the shard group from every rank's
    ``local_shards()`` with plain ``torch.distributed``; and the groups whose padding is not
    zero."""
    pm = engine.process_mesh
    out: dict[str, dict[str, torch.Tensor]] = {}
    bad = []
    for name, kinds in engine.local_shards().items():
        g = engine.layout.group(name)
        for kind, shard in kinds.items():
            full = shard.clone()
            if pm.shard_degree > 1:
                full = torch.empty(shard.numel() * pm.shard_degree, dtype=shard.dtype)
                dist.all_gather_single(full, shard.contiguous(), group=pm.shard_group)
            if full[g.numel:].any():
                bad.append(f"{name}.{kind} has non-zero padding")
            for spec in engine.layout.group_params(g):
                out.setdefault(kind, {})[spec.fqn] = full[spec.offset:spec.offset + spec.numel
                                                          ].view(spec.shape)
    return out, bad


def differences(label: str, got: dict[str, dict[str, torch.Tensor]], ref: dict[str, Any],
                kinds: tuple[str, ...] = ("master", "exp_avg", "exp_avg_sq")) -> list[str]:
    """Every (kind, FQN) where ``got`` is not bit-identical to the reference (the first few
    named, then a count)."""
    out = []
    for kind in kinds:
        for fqn, want in ref[kind].items():
            have = got[kind][fqn]
            if have.dtype != want.dtype or not torch.equal(have, want):
                diff = (have.double() - want.double()).abs().max().item()
                out.append(f"{label}: {kind} {fqn} differs (max {diff:g})")
    return out[:4] + ([f"{label}: and {len(out) - 4} more"] if len(out) > 4 else [])


def compare_runs(pm, runs: dict[str, dict], ref_kwargs: dict) -> list[str]:
    """Train each engine configuration in ``runs`` (on the mesh ``mesh`` if given, else ``pm``);
    rank 0 compares all with one reference of ``pm.world_size`` ranks: bit for bit, or (runs
    with ``deterministic=False``) the masters up to rounding."""
    problems, got, exact = [], {}, {}
    for label, kwargs in runs.items():
        kwargs = dict(kwargs)
        engine, _ = train(kwargs.pop("mesh", pm), **kwargs)
        got[label], bad = gathered(engine)
        exact[label] = kwargs.get("deterministic", True)
        problems += [f"{label}: {b}" for b in bad]
    if pm.rank == 0:
        ref = reference(pm.world_size, **ref_kwargs)
        for label, states in got.items():
            if exact[label]:
                problems += differences(label, states, ref)
                continue
            problems += [f"{label}: {n} off by {(states['master'][n] - t).abs().max():g}"
                         for n, t in ref["master"].items()
                         if not torch.allclose(states["master"][n], t, rtol=1e-4, atol=1e-5)]
    return problems


# ------------------------------------------------------------------------------- the cases


def case_stages_fp32(pm) -> list[str]:
    """Stages 1 and 2 (and 3 with activation checkpointing; on 4 ranks HSDP 2 x 2 at stages 1
    and 2 too) equal the fp32 reference; stage 1 with the backend's reduce-scatter is close to it;
    the stored state has the same names, kinds, shapes and dtypes whatever the stage."""
    runs = {"stage 1": dict(stage=1), "stage 2": dict(stage=2),
            "stage 3 + checkpointing": dict(stage=3, ac=True)}
    if pm.world_size > 1:  # the backend's reduce-scatter: equal up to rounding
        runs["stage 1, default reduction"] = dict(stage=1, deterministic=False)
    if pm.world_size == 4:
        from shardckpt.format.layout import Mesh
        from shardckpt.runtime.mesh import ProcessMesh

        hsdp = ProcessMesh.from_process_group(Mesh.hsdp(2, 2))
        runs.update({f"HSDP 2x2 stage {s}": dict(stage=s, mesh=hsdp) for s in (1, 2)})
    problems = compare_runs(pm, runs, {})
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
    """4 micro-batches: no_sync (one reduction per step; stages 1, 3) and per-micro-batch
    reductions (stages 1, 2: stage 1 reuses its resident gradient buffer for every micro-batch
    while the means add up), each against its reference, over 2 steps."""
    micro, steps, trained = 4, 2, 3  # trained flat groups: the root and two layers
    with counting("all_to_all_single") as no_sync_exchanges:
        problems = compare_runs(
            pm, {f"no_sync stage {s}": dict(stage=s, micro=micro, accumulate="no_sync",
                                            steps=steps) for s in (1, 3)},
            dict(micro=micro, accumulate="no_sync", steps=steps))
    with counting("all_to_all_single") as per_micro_exchanges:
        problems += compare_runs(pm, {f"per-micro stage {s}": dict(stage=s, micro=micro,
                                                                   steps=steps) for s in (1, 2)},
                                 dict(micro=micro, steps=steps))
    if pm.world_size > 1:
        if len(no_sync_exchanges) != 2 * trained * steps:
            problems.append(f"no_sync ran {len(no_sync_exchanges)} gradient exchanges for 2 "
                            f"engines, expected one per group and step ({2 * trained * steps})")
        if len(per_micro_exchanges) != 2 * trained * steps * micro:
            problems.append(f"per-micro ran {len(per_micro_exchanges)} gradient exchanges for "
                            f"2 engines, expected {2 * trained * steps * micro}")
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


CASES: dict[str, Callable] = {
    "stages_fp32": case_stages_fp32,
    "mixed_bf16": case_mixed_bf16,
    "accumulation": case_accumulation,
    "clip": case_clip,
}


def cases_for(world: int) -> list[str]:
    names = ["stages_fp32", "mixed_bf16"]
    if world in (2, 3):
        names += ["accumulation", "clip"]
    return names


reports = case_suite(__name__, CASES, cases_for, [1, 2, 3, 4], timeout_s=240, pg_timeout_s=150,
                     case_pg_timeout_s=120)


# ------------------------------------------------------------------------------- the tests


_check = check_case


def test_stages_1_and_2_bit_exact(reports):
    _check(reports, "stages_fp32")


def test_bf16_mixed_precision_bit_exact_at_every_stage(reports):
    _check(reports, "mixed_bf16")


def test_gradient_accumulation_both_modes_bit_exact(reports):
    _check(reports, "accumulation")


def test_clipping_within_tolerance_at_every_stage(reports):
    _check(reports, "clip")
