"""Benchmark: a few bf16 training steps of the package's small Llama on one CUDA GPU (world size 1).

Runs the ZeRO engine on ``cuda:0`` without ``torch.distributed`` (one rank, so no collectives:
every "all-gather" is a cast-and-copy of the fp32 master into the bf16 compute buffer, issued on
the engine's communication side stream), with bf16 compute, fp32 gradient reduction, fp32
masters and AdamW. Prints each step's time, the median after warm-up, and the peak CUDA memory
allocated, next to the model-state bytes the engine and the estimator count.

    python bench/gpu_step.py [--steps 5] [--warmup 2] [--batch 8] [--seq 256] [--layers 2]
                             [--hidden 64] [--vocab 1024] [--json]

The defaults are the package's small Llama (``LlamaConfig()``). Exits with status 2 and a message
when CUDA is not available. Nothing here asserts.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=5, help="timed steps")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--intermediate", type=int, default=176)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    import torch

    if not torch.cuda.is_available():
        print("bench/gpu_step.py needs a CUDA GPU: torch.cuda.is_available() is False "
              f"(torch {torch.__version__}, CUDA build {torch.version.cuda}). Nothing was run.",
              file=sys.stderr)
        return 2

    from shardckpt.runtime import MixedPrecisionPolicy, ShardedAdamW, ZeroEngine
    from shardckpt.runtime import decay_param_groups
    from shardckpt.runtime.models.llama import (LLAMA_POLICY, LlamaConfig, LlamaForCausalLM,
                                         causal_lm_loss)
    from shardckpt.runtime.mesh import ProcessMesh

    device = torch.device("cuda", 0)
    cfg = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden,
                      intermediate_size=args.intermediate, num_hidden_layers=args.layers,
                      max_position_embeddings=max(256, args.seq))
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    engine = ZeroEngine(model, policy=LLAMA_POLICY, process_mesh=ProcessMesh.single(device),
                        init_seed=0, mixed_precision=MixedPrecisionPolicy(torch.bfloat16))
    opt = ShardedAdamW(engine, decay_param_groups(engine, 0.1), lr=3e-4)
    gen = torch.Generator(device=device).manual_seed(1)
    batches = [torch.randint(0, cfg.vocab_size, (args.batch, args.seq), device=device,
                             generator=gen) for _ in range(args.warmup + args.steps)]

    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    times, losses = [], []
    for tokens in batches:
        start = time.perf_counter()
        loss = causal_lm_loss(engine(tokens), tokens)
        loss.backward()
        opt.step()
        torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
        losses.append(float(loss.detach()))
        state = engine.model_state_bytes()  # after the step, before the gradients are dropped
        opt.zero_grad()
    timed = times[args.warmup:]
    result = {
        "device": torch.cuda.get_device_name(device),
        "params": sum(spec.numel for spec in engine.layout.params),
        "tokens_per_step": args.batch * args.seq,
        "step_s": timed, "median_step_s": statistics.median(timed),
        "peak_allocated_mb": torch.cuda.max_memory_allocated(device) / 1e6,
        "peak_reserved_mb": torch.cuda.max_memory_reserved(device) / 1e6,
        "model_state_mb": sum(state.values()) / 1e6,
        "estimated_model_state_mb": engine.estimate().model_state_bytes / 1e6,
        "losses": losses,
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"gpu step: Llama {result['params'] / 1e6:.2f}M params on {result['device']}, world "
          f"size 1, bf16 compute / fp32 reduce and masters, {args.batch}x{args.seq} tokens")
    print("step times s: " + " ".join(f"{t:.4f}" for t in times)
          + f"  (first {args.warmup} warm-up)")
    print(f"median step s {result['median_step_s']:.4f}   peak allocated MB "
          f"{result['peak_allocated_mb']:.1f}   peak reserved MB {result['peak_reserved_mb']:.1f}")
    print(f"model state MB {result['model_state_mb']:.2f} (estimator "
          f"{result['estimated_model_state_mb']:.2f})   losses "
          + " ".join(f"{x:.4f}" for x in losses))
    return 0


if __name__ == "__main__":
    sys.exit(main())
