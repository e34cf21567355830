"""Plain-PyTorch references the runtime suites compare against, and the comparisons.

The references use plain PyTorch only (no shardckpt runtime code): each rank's micro-batch is run
in turn, gradients are summed in rank order and divided by the world size, and
``torch.optim.AdamW`` / ``SGD`` with ``foreach=False`` take the step, one thread per process.
:func:`tiny_reference` follows DESIGN.md's "Deterministic mode" for the tiny Llama (see
``integration/test_runtime_stages.py``).
"""

from __future__ import annotations

import copy
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from testing.models import BETAS, LR, TINY_STEPS, WD, tiny_batch, tiny_llama, tiny_loss, two_groups



def reference_train(model: nn.Module, make_opt: Callable[[list[dict]], torch.optim.Optimizer],
                    batch: Callable[[int, int], torch.Tensor], loss_fn: Callable, world: int,
                    steps: int, wd: float, fp32_masters: bool = False,
                    scheduler: Callable | None = None,
                    clip: float | None = None) -> torch.optim.Optimizer:
    """Plain-PyTorch data parallelism on one process. With ``fp32_masters`` the optimizer runs on
    fp32 copies of the trained parameters, which are cast back into the (maybe bf16) model."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if fp32_masters:
        masters = {n: p.detach().float().clone().requires_grad_(True) for n, p in named}
        opt = make_opt(two_groups(masters.items(), wd))
    else:
        masters = dict(named)
        opt = make_opt(two_groups(named, wd))
    sched = scheduler(opt) if scheduler else None
    for step in range(steps):
        per_rank = []
        for r in range(world):
            model.zero_grad(set_to_none=True)
            loss_fn(model(batch(step, r)), batch(step, r)).backward()
            per_rank.append({n: p.grad.clone() for n, p in named})
        for n, _ in named:
            total = per_rank[0][n].to(torch.float32, copy=True)
            for r in range(1, world):
                total += per_rank[r][n]
            masters[n].grad = total / world
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(list(masters.values()), clip)
        opt.step()
        if sched:
            sched.step()
        if fp32_masters:
            with torch.no_grad():
                for n, p in named:
                    p.copy_(masters[n])
    opt.masters = masters  # type: ignore[attr-defined]
    return opt


def compare_shards(engine, tensors: dict[str, torch.Tensor], kind: str = "master") -> list[str]:
    """Names of flat groups whose local ``kind`` shard differs (``torch.equal``) from ``tensors``
    laid out by the engine's layout. Padding must be zero."""
    layout, rank = engine.layout, engine.process_mesh.shard_rank
    bad = []
    for name, kinds in engine.local_shards().items():
        if kind not in kinds:
            continue
        g = layout.group(name)
        flat = torch.zeros(g.padded_numel, dtype=kinds[kind].dtype)
        for spec in layout.group_params(g):
            flat[spec.offset:spec.offset + spec.numel] = tensors[spec.fqn].reshape(-1)
        lo, hi = layout.shard_range(g, rank)
        if not torch.equal(kinds[kind], flat[lo:hi]):
            diff = (kinds[kind].double() - flat[lo:hi].double()).abs().max().item()
            bad.append(f"{name}.{kind} (max diff {diff:g})")
    return bad


def optimizer_tensors(opt: torch.optim.Optimizer, names: dict[int, str], key: str) -> dict[str, torch.Tensor]:
    return {names[id(p)]: s[key] for p, s in opt.state.items() if key in s}


def tiny_reference(world: int, micro: int = 1, param_dtype: torch.dtype | None = None,
                   reduce_dtype: torch.dtype = torch.float32, accumulate: str = "per_micro",
                   clip: float | None = None, steps: int = TINY_STEPS) -> dict[str, Any]:
    """Plain PyTorch (see ``integration/test_runtime_stages.py``'s docstring): masters, AdamW
    states and pre-clip norms."""
    model = tiny_llama()
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
                tokens = tiny_batch(step, m, r)
                tiny_loss(compute(tokens), tokens, micro).backward()
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
