"""A training loop with shardckpt: ZeRO-3, async sharded saves, resume on any world size.

    torchrun --standalone --nproc_per_node 2 integration/example_train.py --ckpt-dir /tmp/run --steps 20

Run it again, with any --nproc_per_node that divides the global batch (12 by default: 1, 2, 3,
4, 6 or 12 ranks), and it resumes from the newest committed checkpoint: weights, optimizer
state, LR schedule and data position. The global batch stays the same whatever the world size
(each rank reads global batch / world size samples per step), so the run continues as if nothing
had changed.
"""

from __future__ import annotations

import argparse
import logging

import torch
from torch.optim.lr_scheduler import LambdaLR

from shardckpt.training.checkpointer import Checkpointer
from shardckpt.runtime import ShardedAdamW, ZeroEngine, decay_param_groups, init_distributed
from shardckpt.runtime.data import SyntheticCorpus, TokenBatches
from shardckpt.runtime.models.llama import LLAMA_POLICY, LlamaConfig, LlamaForCausalLM, causal_lm_loss


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt-dir", required=True, help="run directory or fsspec URL (s3://bucket/run)")
    ap.add_argument("--steps", type=int, default=20, help="train until this many steps are done")
    ap.add_argument("--save-every", type=int, default=5)
    ap.add_argument("--global-batch", type=int, default=12,
                    help="samples per step over all ranks; keep it when resuming")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")

    pm = init_distributed()                                 # RANK, WORLD_SIZE, ... from torchrun
    if args.global_batch < 1 or args.global_batch % pm.world_size:
        raise SystemExit(f"--global-batch {args.global_batch} does not split evenly over "
                         f"{pm.world_size} ranks; run on a number of ranks that divides it")
    cfg = LlamaConfig(vocab_size=2048, hidden_size=64, intermediate_size=172, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    engine = ZeroEngine(model, policy=LLAMA_POLICY, process_mesh=pm, init_seed=0)
    opt = ShardedAdamW(engine, decay_param_groups(engine, 0.1), lr=3e-3, betas=(0.9, 0.95))
    sched = LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))
    data = TokenBatches(SyntheticCorpus(cfg.vocab_size), seq_len=64,
                        micro_batch=args.global_batch // pm.world_size, rank=pm.rank,
                        world_size=pm.world_size)

    # --- the lines a training loop adds -------------------------------------------------
    ckpt = Checkpointer(args.ckpt_dir, engine, app_state={"scheduler": sched, "data": data},
                        keep_last=2, async_save=True)
    start = ckpt.resume()                                   # 0 on a fresh run
    # ------------------------------------------------------------------------------------
    if start >= args.steps and pm.rank == 0:
        logging.info("checkpoint at step %d already reached --steps %d; nothing to train",
                     start, args.steps)
    for step in range(start, args.steps):
        tokens = next(data)
        loss = causal_lm_loss(engine(tokens), tokens)
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad()
        if pm.rank == 0:
            logging.info("step %d loss %.4f", step, loss.item())
        if (step + 1) % args.save_every == 0:
            ckpt.save(step + 1)                             # returns once shards are staged
    ckpt.close()                                            # waits for the last save; ends its gloo group
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
