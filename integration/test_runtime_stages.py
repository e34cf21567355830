"""ZeRO stages 1/2/3, bf16 mixed precision, gradient accumulation and clipping on real gloo
process groups (tied parameters and full-parameter access: ``test_runtime_access.py``).

One spawned job per world size runs every case (see ``cases_for``) on one process group. Each
case trains engines on every rank, all-gathers their shards with plain ``torch.distributed``
(not the runtime's collectives), and rank 0 alone computes the plain-PyTorch reference once per
configuration and compares; other ranks report what they check locally. A report is a list of
problems (empty = pass).

The reference (``testing.reference.tiny_reference``; DESIGN.md, "Deterministic mode"), for every
configuration:

* fp32 masters are the parameters of an fp32 model; with a compute dtype, each micro-batch runs on
  a copy of the model whose parameters are the masters cast to bf16 (buffers stay fp32);
* each rank's micro-batch runs in turn; its gradients are cast to the reduce dtype; with
  accumulation ``no_sync`` each rank sums its micro-batches first (in the reduce dtype), with
  ``per_micro`` every micro-batch is reduced and the fp32 means are summed;
* a reduction sums ranks in rank order in the reduce dtype, divides by the world size and casts
  to fp32; ``torch.optim.AdamW(foreach=False)`` steps the fp32 masters.
"""

from __future__ import annotations

from typing import Callable

import pytest
import torch

from testing.engines import train_tiny
from testing.ranks import case_suite, check_case
from testing.reference import differences, gathered, tiny_reference
from testing.wire import counting

pytestmark = pytest.mark.slow

#: Clipping: the sharded norm sums squares per shard in fp64, then across ranks; the reference
#: sums per tensor in fp32. Stated tolerance: norms within this relative error, and parameters
#: after clipped AdamW steps within CLIP_PARAM_RTOL / CLIP_PARAM_ATOL.
CLIP_NORM_RTOL = 1e-5
CLIP_PARAM_RTOL, CLIP_PARAM_ATOL = 1e-4, 1e-6


def compare_runs(pm, runs: dict[str, dict], ref_kwargs: dict) -> list[str]:
    """Train each engine configuration in ``runs`` (on the mesh ``mesh`` if given, else ``pm``);
    rank 0 compares all with one reference of ``pm.world_size`` ranks: bit for bit, or (runs
    with ``deterministic=False``) the masters up to rounding."""
    problems, got, exact = [], {}, {}
    for label, kwargs in runs.items():
        kwargs = dict(kwargs)
        engine, _ = train_tiny(kwargs.pop("mesh", pm), **kwargs)
        got[label], bad = gathered(engine)
        exact[label] = kwargs.get("deterministic", True)
        problems += [f"{label}: {b}" for b in bad]
    if pm.rank == 0:
        ref = tiny_reference(pm.world_size, **ref_kwargs)
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
        engine, _ = train_tiny(pm, stage, steps=0)
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
    runs = {s: train_tiny(pm, s, clip=0.05) for s in (1, 2, 3)}
    got = {s: gathered(engine)[0] for s, (engine, _) in runs.items()}
    problems = []
    if pm.rank == 0:
        ref = tiny_reference(pm.world_size, clip=0.05)
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
