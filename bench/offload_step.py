"""The offloaded optimizer step, old against new, on this machine (median of ``--reps`` runs).

1. The host AdamW of one flat group of ``--numel`` fp32 elements: the optimizer's update on the
   whole group (the unpipelined step's: each op over the group, ATen's threads), the
   :class:`~shardckpt.runtime.offload.host_step.HostStepper` (slices on ``--threads`` threads,
   the same bits) and torch's fused CPU AdamW (opt-in, not the same bits).
2. ``optimizer.step()`` of a bf16 ZeRO-3 Llama (world 1, ``--device``) with
   ``offload_optimizer="cpu"``: the unpipelined step (``OffloadConfig(pipeline=False)``; its
   gradient copies made in backward are not timed), the pipelined bit-exact step and the fused
   opt-in (interleaved); the final masters and moments compared bit for bit with the
   unpipelined run's.

    python bench/offload_step.py [--numel 50e6] [--params 30e6] [--reps 5] [--threads N]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

from shardckpt.runtime import MixedPrecisionPolicy, ShardedAdamW, ZeroEngine, decay_param_groups
from shardckpt.runtime.mesh import ProcessMesh
from shardckpt.runtime.models.llama import LLAMA_POLICY, LlamaConfig, LlamaForCausalLM, causal_lm_loss
from shardckpt.runtime.offload import OffloadConfig
from shardckpt.runtime.offload.host_step import HostStepper
from shardckpt.runtime.optim import _Segment

HYPER = dict(lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, amsgrad=False,
             maximize=False)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def host_kernel(numel: int, reps: int, threads: int) -> dict[str, Any]:
    """Seconds per update of one group (median), and whether each variant kept the bits."""
    def update(master: Any, grad: Any, state: Any, items: Any) -> None:
        for seg, step, hyper in items:
            ShardedAdamW._update(None, master[seg.lo:seg.hi], grad[seg.lo:seg.hi],  # type: ignore[arg-type]
                                 {k: v[seg.lo:seg.hi] for k, v in state.items()}, step, hyper)

    gen = torch.Generator().manual_seed(0)
    start = [torch.randn(numel, generator=gen) for _ in range(3)]
    grad = torch.randn(numel, generator=gen)
    items = [(_Segment(None, 0, numel), 3, HYPER)]  # type: ignore[arg-type]
    sliced, fused = HostStepper(threads), HostStepper(threads, fused=True,
                                                      kinds=("exp_avg", "exp_avg_sq"))
    variants = {"whole": lambda m, g, s: update(m, g, s, items),
                "sliced": lambda m, g, s: sliced.run(update, m, g, s, items),
                "fused": lambda m, g, s: fused.run(update, m, g, s, items)}
    times: dict[str, list[float]] = {k: [] for k in variants}
    out: dict[str, list[torch.Tensor]] = {}
    for _ in range(reps):
        for name, fn in variants.items():  # interleaved
            master, m, v = (t.clone() for t in start)
            v.abs_()
            t0 = time.perf_counter()
            fn(master, grad, {"exp_avg": m, "exp_avg_sq": v})
            times[name].append(time.perf_counter() - t0)
            out[name] = [master, m, v]
    sliced.close()
    med = {k: statistics.median(v) for k, v in times.items()}
    same = {k: all(torch.equal(a, b) for a, b in zip(out[k], out["whole"], strict=True)) for k in out}
    return {"median_s": med, "same_bits_as_whole": same}


def _llama(params: float) -> LlamaConfig:
    hidden, inter, vocab = 512, 1408, 8192
    per_layer = 2 * hidden * hidden + 2 * hidden * 128 + 3 * hidden * inter + 2 * hidden
    layers = max(1, round((params - vocab * hidden) / per_layer))
    return LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
                       num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=2)


def build(cfg: LlamaConfig, device: torch.device, offload: OffloadConfig) -> tuple[Any, Any]:
    """A bf16 ZeRO-3 engine and its AdamW, after one backward."""
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    engine = ZeroEngine(model, policy=LLAMA_POLICY, init_seed=0,
                        process_mesh=ProcessMesh.single(device),
                        mixed_precision=MixedPrecisionPolicy(torch.bfloat16, torch.float32),
                        offload_optimizer=offload)
    opt = ShardedAdamW(engine, decay_param_groups(engine, 0.1), lr=3e-4, betas=(0.9, 0.95))
    tokens = torch.randint(0, cfg.vocab_size, (2, 64), generator=torch.Generator().manual_seed(1))
    causal_lm_loss(engine(tokens.to(device)), tokens.to(device)).backward()
    return engine, opt


def engine_steps(cfg: LlamaConfig, device: torch.device, runs: dict[str, OffloadConfig],
                 reps: int) -> dict[str, tuple[list[float], dict, int]]:
    """Per run: ``reps`` timed ``optimizer.step()`` calls on the gradients of one backward
    (the runs interleaved, one warm-up step each), the final shards, the pinned bytes."""
    built = {name: build(cfg, device, off) for name, off in runs.items()}
    times: dict[str, list[float]] = {name: [] for name in runs}
    for rep in range(reps + 1):
        for name, (_engine, opt) in built.items():
            _sync(device)
            t0 = time.perf_counter()
            opt.step()
            _sync(device)
            if rep:
                times[name].append(time.perf_counter() - t0)
    out = {}
    for name, (engine, opt) in built.items():
        state = {(g, k): t.detach().to("cpu", copy=True)
                 for g, kinds in engine.local_shards().items() for k, t in kinds.items()}
        out[name] = (times[name], state, opt._offload.pinned_bytes)
        engine.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--numel", type=float, default=50e6)
    ap.add_argument("--params", type=float, default=30e6)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    device = torch.device(args.device)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} ATen threads, "
          f"{args.threads} step threads, device {device}")
    k = host_kernel(int(args.numel), args.reps, args.threads)
    med, same = k["median_s"], k["same_bits_as_whole"]
    print(f"host AdamW, one group of {args.numel:.3g} fp32 elements (median of {args.reps}):")
    for name in med:
        print(f"  {name:6s} {med[name]:.4f} s  whole/{name} {med['whole'] / med[name]:.2f}x  "
              f"bits equal to whole: {same[name]}")
    cfg = _llama(args.params)
    runs = {"unpipelined": OffloadConfig("cpu", pipeline=False),
            "pipelined": OffloadConfig("cpu", host_threads=args.threads),
            "fused": OffloadConfig("cpu", host_threads=args.threads, fused_adamw=True)}
    results = engine_steps(cfg, device, runs, args.reps)
    n = sum(t.numel() for (g, kind), t in results["unpipelined"][1].items() if kind == "master")
    print(f"optimizer.step(), bf16 ZeRO-3 Llama, {n / 1e6:.1f} M elements, offload cpu "
          f"(median of {args.reps}):")
    old = statistics.median(results["unpipelined"][0])
    for name, (times, state, pinned) in results.items():
        med_s = statistics.median(times)
        equal = all(torch.equal(state[key], t) for key, t in results["unpipelined"][1].items())
        print(f"  {name:11s} {med_s:.4f} s  unpipelined/{name} {old / med_s:.2f}x  "
              f"pinned {pinned / 1e6:.1f} MB  bits equal to unpipelined: {equal}")


if __name__ == "__main__":
    main()
