"""Section b2 of ``bench/gpu_check.py``: the ZeRO-3 step with compiled units against FSDP2 +
``torch.compile`` per decoder layer (torchtitan's setup), same model, weights and batches,
interleaved.

Both sides compile each decoder layer with the same ``torch.compile`` arguments
(:data:`COMPILE`, torchtitan's ``fullgraph=True``) and keep the root eager; shardckpt through
``ZeroEngine(compile_units=...)`` (the layer's forward compiled, its hooks outside), FSDP2 the way
torchtitan's ``apply_compile`` does it (each layer wrapped by ``torch.compile`` before
``fully_shard``). The record has the keys of section b (``ratio_step_time_shardckpt_over_fsdp2``,
``paired_ratio`` and per side ``median_step_s``, ``tokens_per_s``, ``mfu``), plus each side's first
step (the compilation) and the graph breaks and graphs dynamo counted.

``g`` is the ``gpu_check`` module itself (its helpers: sizes, the engine, the batches, timing).
"""

from __future__ import annotations

import statistics
from typing import Any

#: torch.compile arguments of both sides (torchtitan compiles each block with fullgraph=True).
COMPILE: dict[str, Any] = {"fullgraph": True}

#: The issue's target on the H200: step time at most 0.95x FSDP2 + compile's, MFU 0.46 at 1.03 B.
TARGET = {"ratio_step_time_shardckpt_over_fsdp2": 0.95, "mfu": 0.46}


def fsdp2_compiled_model(ctx: Any, cfg: Any, full: dict[str, Any]) -> tuple[Any, Any, dict]:
    """The Llama with the engine's weights, each decoder layer ``torch.compile``d and then
    ``fully_shard``ed, then the root (torchtitan's order); bf16 compute, fp32 reduce; torch's
    AdamW with section b's groups."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    try:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    except ImportError:  # torch < 2.6
        from torch.distributed._composable.fsdp import MixedPrecisionPolicy, fully_shard

    from shardckpt.runtime.models.llama import LlamaForCausalLM

    torch.manual_seed(0)
    with torch.device(ctx.device):
        model = LlamaForCausalLM(cfg)
    missing, unexpected = model.load_state_dict(full, strict=False)
    info = {"missing_weights": list(missing), "unexpected_weights": list(unexpected),
            "same_weights_as_shardckpt": not missing and not unexpected}
    layers = model.model.layers
    for name, layer in list(layers.named_children()):
        layers.register_module(name, torch.compile(layer, **COMPILE))
    mesh = init_device_mesh(ctx.device.type, (1,))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    named = list(model.named_parameters())
    nodecay = [p for n, p in named if p.ndim < 2 or "norm" in n]
    decay = [p for n, p in named if not (p.ndim < 2 or "norm" in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": nodecay, "weight_decay": 0.0}], lr=3e-4, betas=(0.9, 0.95))
    return model, opt, info


def _dynamo_counts() -> dict[str, int]:
    from torch._dynamo.utils import counters

    return {"graph_breaks": sum(counters["graph_break"].values()),
            "graphs": int(counters["stats"]["unique_graphs"])}


def _run(g: Any, ctx: Any, rec: dict[str, Any], sides: dict[str, tuple[Any, Any]],
         batches: list[Any], warmup: int) -> dict[str, dict[str, Any]]:
    """Steps interleaved A B B A ..., the same batch for both sides at each step; per side the
    timed steps after ``warmup``, every loss, the first step (compilation) and dynamo's counts
    around it."""
    names = list(sides)
    out: dict[str, dict[str, Any]] = {s: {"times": [], "losses": [], "first_step_s": None}
                                      for s in names}
    failed: set[str] = set()
    for k, tokens in enumerate(batches):
        for side in (names if k % 2 == 0 else names[::-1]):
            if side in failed:
                continue
            with g.guarded(rec, f"{side}_step", ctx):
                before = _dynamo_counts()
                try:
                    dt, loss = g.train_step(ctx, sides[side][0], sides[side][1], tokens)
                except Exception:
                    failed.add(side)
                    raise
                after = _dynamo_counts()
                row = out[side]
                row["losses"].append(loss)
                if k == 0:
                    row["first_step_s"] = round(dt, 3)
                    row["first_step_dynamo"] = {key: after[key] - before[key] for key in after}
                elif k >= warmup:
                    row["times"].append(dt)
                    # a graph made after the first step is a recompilation
                    row["recompiled_graphs"] = (row.get("recompiled_graphs", 0)
                                                + after["graphs"] - before["graphs"])
        g.log(f"  b2: step {k}: " + ", ".join(f"{s} {out[s]['times'][-1]:.3f} s" for s in names
                                           if out[s]["times"] and k >= warmup))
    return out


def section_b2(ctx: Any, rec: dict[str, Any], g: Any) -> None:
    sz = ctx.size("b2")
    cfg = g.llama_config(sz["model"], sz["seq"])
    tokens_per_step = sz["batch"] * sz["seq"]
    engine, opt = g.zero_engine(ctx, cfg, compile_units=COMPILE)
    psi = sum(spec.numel for spec in engine.layout.params)
    flops_per_token = 6 * psi + 12 * cfg.num_hidden_layers * cfg.hidden_size * sz["seq"]
    peak, peak_source = g.peak_tflops(ctx)
    rec["settings"] = {
        "model": sz["model"], "params": psi, "seq": sz["seq"], "batch": sz["batch"],
        "tokens_per_step": tokens_per_step, "warmup": sz["warmup"], "steps": sz["steps"],
        "precision": "bf16 compute, fp32 reduce, fp32 masters and AdamW state on both sides",
        "compile": f"torch.compile(**{COMPILE!r}) per decoder layer on both sides, root eager",
        "shardckpt": "ZeroEngine stage 3, prefetch on, compile_units (each layer's forward "
                     f"compiled, hooks outside; {len(engine.compiled_units)} units), ShardedAdamW",
        "fsdp2": "torch.compile(layer) then fully_shard per decoder layer + root (torchtitan's "
                 "apply_compile + apply_fsdp), torch.optim.AdamW (default implementation)",
        "flops_per_token": flops_per_token, "peak_tflops": peak, "peak_source": peak_source,
        "schedule": "interleaved A B B A ... step by step, same batch for both sides at each "
                    "step; the first step of each side compiles and is reported apart",
        "dynamo_counts": "first_step_dynamo: graph breaks and new graphs during a side's first "
                         "step; dynamo keeps one graph per code and guards, so the side that "
                         "runs second may reuse the first side's layer graph (0 new graphs); "
                         "recompiled_graphs: new graphs after the first step",
        "target": TARGET}
    sides: dict[str, tuple[Any, Any]] = {"shardckpt": (engine, opt)}
    with g.guarded(rec, "fsdp2_build", ctx):
        full = engine.full_state_dict()
        model, fopt, info = fsdp2_compiled_model(ctx, cfg, full)
        del full
        rec["settings"]["fsdp2_weights"] = info
        sides["fsdp2"] = (model, fopt)
    ctx.free()
    batches = g.token_batches(cfg, sz["seq"], sz["batch"], sz["warmup"] + sz["steps"],
                              ctx.device)
    runs = _run(g, ctx, rec, sides, batches, sz["warmup"])
    res = {}
    for side, run in runs.items():
        med = g.median(run["times"])
        row: dict[str, Any] = {"median_step_s": med, "steps_s": run["times"],
                               "losses": run["losses"], "first_step_s": run["first_step_s"],
                               "first_step_dynamo": run.get("first_step_dynamo"),
                               "recompiled_graphs": run.get("recompiled_graphs")}
        if med:
            row["tokens_per_s"] = round(tokens_per_step / med, 1)
            row["achieved_tflops"] = float(f"{flops_per_token * tokens_per_step / med / 1e12:.4g}")
            row["mfu"] = round(row["achieved_tflops"] / peak, 4) if peak else None
        res[side] = row
    rec["results"] = res
    ours, theirs = runs["shardckpt"], runs.get("fsdp2")
    if theirs and res["fsdp2"].get("median_step_s") and res["shardckpt"].get("median_step_s"):
        rec["ratio_step_time_shardckpt_over_fsdp2"] = g.ratio(res["shardckpt"]["median_step_s"],
                                                              res["fsdp2"]["median_step_s"])
        rec["paired_ratio"] = round(statistics.median(
            a / b for a, b in zip(ours["times"], theirs["times"], strict=False)), 4)
        rec["last_loss_abs_diff"] = abs(ours["losses"][-1] - theirs["losses"][-1])
    engine.close()
