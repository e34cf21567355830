"""Benchmark: `shardckpt import deepspeed` against DeepSpeed's `zero_to_fp32` on one checkpoint.

A DeepSpeed ZeRO checkpoint of the package's Llama (about ``--params`` parameters, one AdamW step,
``--ranks`` gloo CPU ranks, ``--stage``) is written once by DeepSpeed itself (needs
``pip install -e '.[deepspeed]'``). Then, in fresh processes, interleaved, median of ``--reps``:

* ``python -m deepspeed.utils.zero_to_fp32 SRC OUT``: DeepSpeed's consolidation, weights only
  (that is all it produces), written with ``torch.save`` (its ``--safe_serialization`` refuses
  a tied embedding);
* ``shardckpt import deepspeed SRC DST --ranks M``: weights, Adam moments, step and buffers into
  a shardckpt checkpoint for M ranks (more work than zero_to_fp32 does);
* ``shardckpt consolidate DST --dtype fp32`` of that import: the weights-only output that
  zero_to_fp32 gives (import plus consolidate is the like-for-like total).

Peak RSS is summed over each command's process tree. Nothing here asserts.

    DS_ACCELERATOR=cpu python bench/interop.py [--params 50e6] [--ranks 2] [--stage 3] [--to 4]

With ``--dcp``: ``shardckpt import dcp`` against ``python -m torch.distributed.checkpoint.format_utils
dcp_to_torch`` (DCP's ``dcp_to_torch_save``) on a checkpoint DCP's own ``FileSystemWriter`` wrote
from FSDP2 (model + AdamW; ``--params 170e6`` is about 2 GB), time and peak RSS in the same run::

    python bench/interop.py --dcp --params 170e6 --ranks 2
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))
from common import SHARDCKPT, dir_bytes, drop_tree, median, run_measured  # noqa: E402


def model_config(params: float) -> dict:
    """A Llama shape of about ``params`` parameters (4 blocks, vocab 32k)."""
    hidden = 64
    while True:
        cfg = dict(vocab_size=32000, hidden_size=hidden, intermediate_size=hidden * 8 // 3 // 8 * 8,
                   num_hidden_layers=4, num_attention_heads=max(1, hidden // 64),
                   num_key_value_heads=max(1, hidden // 64), max_position_embeddings=64)
        n = 32000 * hidden + 4 * (4 * hidden * hidden + 3 * hidden * cfg["intermediate_size"])
        if n >= params or hidden >= 8192:
            return cfg
        hidden += 64


def job_save(rank: int, world: int, out: str, stage: int, cfg: dict) -> None:
    import deepspeed
    import torch

    from shardckpt.runtime.models.llama import LlamaConfig, LlamaForCausalLM, causal_lm_loss

    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**cfg))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    ds = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
          "zero_allow_untested_optimizer": True, "zero_optimization": {"stage": stage}}
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=ds)
    tokens = torch.randint(0, cfg["vocab_size"], (1, 16))
    engine.backward(causal_lm_loss(engine(tokens), tokens))
    engine.step()
    engine.save_checkpoint(out, tag="bench")


def job_save_dcp(rank: int, world: int, out: str, cfg: dict) -> None:
    """FSDP2 Llama, one AdamW step, saved by DCP's own FileSystemWriter (model + optimizer)."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from shardckpt.runtime.models.llama import LlamaConfig, LlamaForCausalLM, causal_lm_loss

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**cfg))
    mesh = init_device_mesh("cpu", (world,))
    for block in model.model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    tokens = torch.randint(0, cfg["vocab_size"], (1, 16))
    causal_lm_loss(model(tokens), tokens).backward()
    opt.step()
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=out)


def main_dcp(args: argparse.Namespace, work: str) -> None:
    """``shardckpt import dcp`` against DCP's ``dcp_to_torch_save`` on one stock DCP checkpoint
    (``--params`` about 170e6 gives about 2 GB with AdamW), interleaved, median of ``--reps``."""
    src = os.path.join(work, f"dcp-{args.ranks}-{int(args.params)}")
    if not os.path.exists(os.path.join(src, ".metadata")):
        from testing.ranks import run_distributed

        run_distributed(job_save_dcp, args.ranks, args=(src, model_config(args.params)),
                        timeout_s=3600, pg_timeout_s=1800)
    exe = list(SHARDCKPT)
    cmds = {
        "dcp_to_torch_save": lambda d: [sys.executable, "-m",
                                        "torch.distributed.checkpoint.format_utils",
                                        "dcp_to_torch", src, d + ".pt"],
        "import dcp": lambda d: [*exe, "import", "dcp", src, d],
    }
    times: dict[str, list[float]] = {k: [] for k in cmds}
    peaks: dict[str, list[int]] = {k: [] for k in cmds}
    for rep in range(args.reps):
        for which in (cmds if rep % 2 == 0 else reversed(list(cmds))):
            dst = os.path.join(work, "out-" + which.replace(" ", "-"))
            drop_tree(dst)
            drop_tree(dst + ".pt")
            dt, peak = run_measured(cmds[which](dst))
            times[which].append(dt)
            peaks[which].append(peak)
    rows = {k: {"seconds": median(v), "peak_rss_mb": max(peaks[k]) / 2**20} for k, v in times.items()}
    result = {"source_bytes": dir_bytes(src), "ranks": args.ranks, "results": rows}
    if args.json:
        print(json.dumps(result, indent=1))
        return
    print(f"DCP checkpoint (FSDP2, {args.ranks} ranks), {result['source_bytes'] / 2**20:.1f} MiB")
    for k, r in rows.items():
        print(f"  {k:<18} {r['seconds']:8.2f} s   peak RSS {r['peak_rss_mb']:8.1f} MiB")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", type=float, default=50e6)
    ap.add_argument("--ranks", type=int, default=2, help="DeepSpeed world size")
    ap.add_argument("--stage", type=int, default=3)
    ap.add_argument("--to", type=int, default=4, help="world size of the shardckpt checkpoint")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--dcp", action="store_true", help="benchmark `import dcp` against DCP's "
                    "dcp_to_torch_save instead (FSDP2 checkpoint by DCP's FileSystemWriter)")
    args = ap.parse_args()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    work = args.workdir or tempfile.mkdtemp(prefix="shardckpt-interop-")
    if args.dcp:
        main_dcp(args, work)
        return
    src = os.path.join(work, f"ds-z{args.stage}-{args.ranks}-{int(args.params)}")
    if not os.path.exists(os.path.join(src, "latest")):
        from testing.ranks import run_distributed

        run_distributed(job_save, args.ranks, args=(src, args.stage, model_config(args.params)),
                        timeout_s=3600, pg_timeout_s=1800, env={"DS_ACCELERATOR": "cpu"})
    exe = list(SHARDCKPT)
    cmds = {
        # torch.save output: its safetensors output refuses a tied embedding
        "zero_to_fp32": lambda d: [sys.executable, "-m", "deepspeed.utils.zero_to_fp32", src, d],
        "import": lambda d: [*exe, "import", "deepspeed", src, d, "--ranks", str(args.to)],
        "consolidate": lambda d: [*exe, "consolidate", os.path.join(work, "out-import"), d,
                                  "--dtype", "fp32"],
    }
    times: dict[str, list[float]] = {k: [] for k in cmds}
    peaks: dict[str, list[int]] = {k: [] for k in cmds}
    for rep in range(args.reps):
        for which in (cmds if rep % 2 == 0 else reversed(list(cmds))):
            if which == "consolidate" and not os.path.exists(os.path.join(work, "out-import")):
                continue
            dst = os.path.join(work, f"out-{which}")
            drop_tree(dst)
            if which == "import":
                drop_tree(os.path.join(work, "out-consolidate"))
            dt, peak = run_measured(cmds[which](dst))
            times[which].append(dt)
            peaks[which].append(peak)
    rows = {k: {"seconds": median(v), "peak_rss_mb": max(peaks[k]) / 2**20}
            for k, v in times.items() if v}
    result = {"source_bytes": dir_bytes(src), "ranks": args.ranks, "stage": args.stage,
              "to": args.to, "results": rows}
    if args.json:
        print(json.dumps(result, indent=1))
        return
    print(f"DeepSpeed ZeRO-{args.stage} checkpoint, {args.ranks} ranks, "
          f"{result['source_bytes'] / 2**20:.1f} MiB")
    for k, r in rows.items():
        print(f"  {k:<14} {r['seconds']:8.2f} s   peak RSS {r['peak_rss_mb']:8.1f} MiB")


if __name__ == "__main__":
    main()
