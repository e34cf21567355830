"""``bench/train_step.py --zeropp``: a ZeRO-3 step with and without each ZeRO++ option.

One job of ``--ranks`` gloo ranks seen as nodes of ``--ranks-per-node`` ranks. Every variant
(ZeRO-3, + qwZ, + hpZ, + qgZ, all three) has its own engine over the same weights (seed 0) in the
same processes, and the variants take turns step by step (interleaved, so drift on a shared
machine hits all alike), each reading the same batches. Per variant: the median step time (the
slower rank; a barrier before and after) over ``--steps`` steps after ``--warmup``, its ratio to
ZeRO-3, and the bytes of one step by collective, counted by wrapping ``torch.distributed`` and
classed as cross-node when the group holds ranks of more than one node (logical volume: an
all-gather's output, a reduce-scatter's or an all-to-all's input). Nothing here asserts.
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing
import os
import statistics
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

from shardckpt.training.launch import free_port

VARIANTS = ("zero3", "qwz", "hpz", "qgz", "all")
COLLECTIVES = {"all_gather_single": 0, "all_gather_into_tensor": 0, "reduce_scatter_single": 1,
               "reduce_scatter_tensor": 1, "all_to_all_single": 1, "all_reduce": 0}


class NodeWire:
    """Bytes of the wrapped collectives, split into in-node and cross-node."""

    def __init__(self, ranks_per_node: int) -> None:
        import torch.distributed as dist

        self.dist, self.k = dist, ranks_per_node
        self.bytes = {"cross": 0, "in": 0}
        self.real = {n: getattr(dist, n) for n in COLLECTIVES if hasattr(dist, n)}

    def __enter__(self) -> NodeWire:
        for name, fn in self.real.items():
            setattr(self.dist, name, self._wrap(name, fn))
        return self

    def __exit__(self, *exc: Any) -> None:
        for name, fn in self.real.items():
            setattr(self.dist, name, fn)

    def _wrap(self, name: str, fn: Any) -> Any:
        index, dist = COLLECTIVES[name], self.dist

        def counted(*args: Any, **kwargs: Any) -> Any:
            t = args[index] if len(args) > index else kwargs["input" if index else "output"]
            group = kwargs.get("group")
            ranks = (range(dist.get_world_size()) if group in (None, dist.group.WORLD)
                     else dist.get_process_group_ranks(group))
            where = "cross" if len({r // self.k for r in ranks}) > 1 else "in"
            factor = 2 if name == "all_reduce" else 1
            self.bytes[where] += factor * t.numel() * t.element_size()
            return fn(*args, **kwargs)
        return counted


def _engine(variant: str, args: argparse.Namespace, pm: Any) -> tuple[Any, Any]:
    import torch

    from shardckpt.runtime import (MixedPrecisionPolicy, ShardedAdamW, ZeroEngine, ZeroPP,
                                   decay_param_groups)
    from shardckpt.runtime.models.llama import LLAMA_POLICY, LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden,
                      intermediate_size=args.intermediate, num_hidden_layers=args.layers,
                      num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                      max_position_embeddings=max(256, args.seq))
    on = {"zero3": {}, "qwz": {"qwz": True}, "hpz": {"hpz": True}, "qgz": {"qgz": True},
          "all": {"qwz": True, "hpz": True, "qgz": True}}[variant]
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    engine = ZeroEngine(model, policy=LLAMA_POLICY, process_mesh=pm, init_seed=0,
                        mixed_precision=MixedPrecisionPolicy() if args.precision == "bf16"
                        else None, zeropp=ZeroPP(**on) if on else None)
    return engine, ShardedAdamW(engine, decay_param_groups(engine, 0.1), lr=3e-4)


def rank_main(rank: int, args: argparse.Namespace, port: int, out_dir: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(args.ranks), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    result: dict[str, Any] = {"rank": rank}
    try:
        import torch
        import torch.distributed as dist

        from shardckpt.runtime.data import SyntheticCorpus, TokenBatches
        from shardckpt.runtime.models.llama import causal_lm_loss
        from shardckpt.runtime.mesh import ProcessMesh

        torch.set_num_threads(args.threads)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=args.ranks, timeout=datetime.timedelta(seconds=3600))
        pm = ProcessMesh.from_process_group(ranks_per_node=args.ranks_per_node)
        engines = {v: _engine(v, args, pm) for v in VARIANTS}
        data = TokenBatches(SyntheticCorpus(args.vocab, seed=1), seq_len=args.seq,
                            micro_batch=args.batch, rank=rank, world_size=args.ranks)
        times: dict[str, list[float]] = {v: [] for v in VARIANTS}
        total = args.warmup + args.steps + 1
        for k in range(total):
            for v in (VARIANTS if k % 2 == 0 else VARIANTS[::-1]):
                engine, opt = engines[v]
                tokens = data.batch(k)
                counting = k == total - 1
                dist.barrier()
                t0 = time.perf_counter()
                wire = NodeWire(args.ranks_per_node)
                with wire if counting else _Null():
                    loss = causal_lm_loss(engine(tokens), tokens)
                    loss.backward()
                    opt.step()
                    opt.zero_grad()
                dist.barrier()
                dt = time.perf_counter() - t0
                if counting:
                    result[v] = {"bytes": wire.bytes, "loss": float(loss.detach()),
                                 "secondary": engine.accounting.peak_secondary_bytes}
                elif k >= args.warmup:
                    times[v].append(dt)
        result.update(times=times, ok=True)
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        result.update(ok=False, error=f"{type(exc).__name__}: {exc}", tb=traceback.format_exc())
    Path(out_dir, f"rank-{rank}.json").write_text(json.dumps(result))
    os._exit(0)


class _Null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Spawn the ranks, gather their reports, and return one row per variant."""
    if args.ranks % args.ranks_per_node:
        raise SystemExit(f"--ranks {args.ranks} is not a multiple of --ranks-per-node "
                         f"{args.ranks_per_node}")
    ctx = multiprocessing.get_context("spawn")
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="zeropp-step-") as out:
        procs = [ctx.Process(target=rank_main, args=(r, args, port, out))
                 for r in range(args.ranks)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        ranks = []
        for r in range(args.ranks):
            path = Path(out, f"rank-{r}.json")
            res = json.loads(path.read_text()) if path.exists() else {"ok": False,
                                                                      "error": "crashed"}
            if not res.get("ok"):
                raise RuntimeError(f"rank {r} failed: {res.get('error')}\n{res.get('tb', '')}")
            ranks.append(res)
    rows = []
    for v in VARIANTS:
        per_step = [max(ts) for ts in zip(*(r["times"][v] for r in ranks), strict=False)]
        rows.append({"variant": v, "precision": args.precision,
                     "median_s": statistics.median(per_step), "steps_s": per_step,
                     "cross_node_bytes": ranks[0][v]["bytes"]["cross"],
                     "in_node_bytes": ranks[0][v]["bytes"]["in"],
                     "hpz_secondary_bytes": ranks[0][v]["secondary"],
                     "loss": ranks[0][v]["loss"]})
    base = rows[0]
    for row in rows:
        row["time_ratio"] = row["median_s"] / base["median_s"]
        row["cross_node_reduction"] = (base["cross_node_bytes"] / row["cross_node_bytes"]
                                       if row["cross_node_bytes"] else float("inf"))
    return rows


def main(args: argparse.Namespace) -> None:
    rows = []
    for precision in args.precisions.split(","):
        args.precision = precision
        rows += run(args)
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print(f"ZeRO++ step: Llama ({args.layers} layers, hidden {args.hidden}, vocab {args.vocab}), "
          f"{args.ranks} gloo ranks as {args.ranks // args.ranks_per_node} nodes x "
          f"{args.ranks_per_node}, {args.batch}x{args.seq} tokens per rank; median of "
          f"{args.steps} steps after {args.warmup} warm-up, interleaved; bytes of rank 0")
    print(f"{'precision':>9} {'variant':>8} {'median s':>9} {'x ZeRO-3':>9} {'cross MB':>9} "
          f"{'in-node MB':>10} {'cross ÷':>8} {'hpZ MB':>7} {'last loss':>10}")
    for r in rows:
        print(f"{r['precision']:>9} {r['variant']:>8} {r['median_s']:>9.3f} "
              f"{r['time_ratio']:>9.3f} {r['cross_node_bytes'] / 1e6:>9.2f} "
              f"{r['in_node_bytes'] / 1e6:>10.2f} {r['cross_node_reduction']:>8.2f} "
              f"{r['hpz_secondary_bytes'] / 1e6:>7.2f} {r['loss']:>10.4f}")
    print("cross ÷: ZeRO-3's cross-node bytes over the variant's; bytes are logical volume "
          "(all-gather output, reduce-scatter / all-to-all input) per step and rank; on one "
          "machine the 'nodes' share memory, so step times show the cost of quantizing, not "
          "the saving of a slow inter-node link")
