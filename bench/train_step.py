"""Benchmark: a training step of shardckpt's ZeRO-3 against FSDP2 (``fully_shard``) on gloo ranks.

A Llama-shaped model (about 100M parameters by default: 12 layers, hidden 768, vocab 32000, the
embedding tied to the head) on 2 CPU ranks, one thread each. Both sides shard it the same way
(each decoder layer a unit, then the root), start from the same weights (seed 0; shardckpt
initializes on the meta device unit by unit, FSDP2 shards an eager model) and read the same
batches (``TokenBatches`` over the synthetic corpus); AdamW (torch's single-tensor code on both
sides, the CPU default), lr 3e-4, weight decay 0.1 on matrices. Each side runs in its own pair
of processes with its own process group, so its peak RSS is its own; a baton in a ``TCPStore``
lets exactly one side step at a time, alternating ``A B B A A B ...`` step by step (interleaved,
so drift on a shared machine hits both alike). shardckpt runs in its default mode (prefetch on,
backend reduce-scatter, not deterministic).

Per precision (fp32; bf16 compute with fp32 reduce, fp32 masters on both sides):

* median step time over ``--steps`` steps after ``--warmup`` (the slower rank of each step; a
  barrier before and after), and the ratio shardckpt / FSDP2 (target: at most 1.0);
* peak RSS per rank while stepping (``VmHWM`` after resetting it through ``/proc/self/clear_refs``
  once the model is built; the lifetime peak if the kernel refuses);
* elements sent per step, counted by wrapping the ``torch.distributed`` collectives in one extra
  step (logical volume: all-gather output, reduce-scatter input, twice an all-reduce; bytes over
  the dtype moved: parameters in the compute dtype, gradients in fp32), against 3Ψ with Ψ the
  parameter count (shardckpt pads each flat group to a multiple of 16·S elements; its root unit,
  like FSDP2's, stays gathered from forward to backward, so both send 3Ψ minus the root);
* the last loss of each side (same weights and batches: they agree closely).

    python bench/train_step.py [--precisions fp32,bf16] [--steps 7] [--warmup 1] [--ranks 2]
                               [--batch 4] [--seq 256] [--layers 12] [--hidden 768]
                               [--intermediate 2048] [--vocab 32000] [--json]

Prints a table of medians and ratios. Nothing here asserts.

``--offload cpu|nvme`` runs shardckpt alone instead, ZeRO-3 with the optimizer offloaded against
the resident optimizer, interleaved as above (``--offload-dir`` for ``nvme``, default a temporary
directory): peak RSS per rank of each, the optimizer bytes per rank that left memory
((4 + 8)·Ψ/N: the fp32 master copy and two Adam moments) and the step time overhead; for
``nvme`` the bytes read and written per step (twice the offloaded state) over that overhead, to
set against the disk's bandwidth, measured once on ``--offload-dir`` (``bench/_offload_report.py``).
``--overlap-step`` runs each group's host step during backward (``offload_overlap_step``);
``--params P`` sizes the model to about ``P`` parameters by its number of layers.

``--zeropp`` runs shardckpt alone instead, ZeRO-3 with and without each ZeRO++ option side by
side, on ``--ranks`` (default 4) ranks as nodes of ``--ranks-per-node`` (default 2): bytes per
step in-node and cross-node, and step time (``bench/_zeropp_jobs.py``; a smaller default model:
4 layers, hidden 512, vocab 8000).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import _offload_report
from shardckpt.training.launch import LOOPBACK, free_port, join_all, rank_env

SIDES = ("shardckpt", "fsdp2")
#: The longest a measured run may take (the rendezvous store waits as long).
JOIN_TIMEOUT_S = 3600.0
COLLECTIVES = {"all_gather_single": ("all_gather", 0, 1),
               "all_gather_into_tensor": ("all_gather", 0, 1),
               "reduce_scatter_single": ("reduce_scatter", 1, 1),
               "reduce_scatter_tensor": ("reduce_scatter", 1, 1),
               "all_reduce": ("all_reduce", 0, 2),
               "all_to_all_single": ("all_to_all", 1, 1)}


def sides(args: argparse.Namespace) -> tuple[str, str]:
    """The two sides compared; the second is the baseline of the ratios."""
    return (args.offload, "resident") if args.offload else SIDES


def schedule(args: argparse.Namespace) -> list[tuple[str, int]]:
    """(side, step) per turn: A B, B A, A B, ...; the last step of each side counts bytes."""
    turns = []
    pair = sides(args)
    for k in range(args.warmup + args.steps + 1):
        for side in (pair if k % 2 == 0 else pair[::-1]):
            turns.append((side, k))
    return turns


# ------------------------------------------------------------------------------ rank side


def build(side: str, args: argparse.Namespace, rank: int, world: int) -> tuple[Any, Any, int]:
    """(forward callable, optimizer, parameter count) of one side on this rank."""
    import torch

    from shardckpt.runtime.models.llama import (LLAMA_POLICY, LlamaConfig, LlamaDecoderLayer,
                                         LlamaForCausalLM)

    cfg = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden,
                      intermediate_size=args.intermediate, num_hidden_layers=args.layers,
                      num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                      max_position_embeddings=max(256, args.seq))
    bf16 = args.precision == "bf16"
    if side in ("shardckpt", "resident", "cpu", "nvme"):
        from shardckpt.runtime import (MixedPrecisionPolicy, ShardedAdamW, ZeroEngine,
                                       decay_param_groups)
        from shardckpt.runtime.mesh import ProcessMesh

        with torch.device("meta"):
            model = LlamaForCausalLM(cfg)
        engine = ZeroEngine(model, policy=LLAMA_POLICY,
                            process_mesh=ProcessMesh.from_process_group(), init_seed=0,
                            mixed_precision=MixedPrecisionPolicy() if bf16 else None,
                            offload_optimizer=side if side in ("cpu", "nvme") else None,
                            offload_dir=args.offload_dir if side == "nvme" else None,
                            offload_overlap_step=args.overlap_step and side in ("cpu", "nvme"))
        opt = ShardedAdamW(engine, decay_param_groups(engine, 0.1), lr=3e-4)
        return engine, opt, sum(spec.numel for spec in engine.layout.params)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    psi = sum(p.numel() for p in model.parameters())
    kwargs: dict[str, Any] = {"mesh": init_device_mesh("cpu", (world,))}
    if bf16:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                   reduce_dtype=torch.float32)
    for m in model.modules():
        if isinstance(m, LlamaDecoderLayer):
            fully_shard(m, **kwargs)
    fully_shard(model, **kwargs)
    named = list(model.named_parameters())
    nodecay = [p for n, p in named if p.ndim < 2 or "norm" in n or n.endswith(".bias")]
    decay = [p for n, p in named if not (p.ndim < 2 or "norm" in n or n.endswith(".bias"))]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": nodecay, "weight_decay": 0.0}], lr=3e-4)
    return model, opt, psi


class Wire:
    """Counts the logical volume of the ``torch.distributed`` collectives, by type, in bytes."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self.dist, self.bytes = dist, {}
        self.real = {name: getattr(dist, name) for name in COLLECTIVES if hasattr(dist, name)}

    def __enter__(self) -> Wire:
        for name, fn in self.real.items():
            setattr(self.dist, name, self._wrap(name, fn))
        return self

    def __exit__(self, *exc: Any) -> None:
        for name, fn in self.real.items():
            setattr(self.dist, name, fn)

    def _wrap(self, name: str, fn: Any) -> Any:
        op, index, factor = COLLECTIVES[name]

        def counted(*args: Any, **kwargs: Any) -> Any:
            t = args[index] if len(args) > index else kwargs["input" if index else "output"]
            self.bytes[op] = self.bytes.get(op, 0) + factor * t.numel() * t.element_size()
            return fn(*args, **kwargs)
        return counted


def reset_peak_rss() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def peak_rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def rank_main(side: str, rank: int, args: argparse.Namespace, port: int, baton_port: int,
              out_dir: str) -> None:
    os.environ.update(rank_env(rank, args.ranks, port))
    result: dict[str, Any] = {"side": side, "rank": rank}
    try:
        import torch
        import torch.distributed as dist

        from shardckpt.runtime.data import SyntheticCorpus, TokenBatches
        from shardckpt.runtime.models.llama import causal_lm_loss

        torch.set_num_threads(args.threads)
        timeout = datetime.timedelta(seconds=JOIN_TIMEOUT_S)
        baton = dist.TCPStore(LOOPBACK, baton_port, is_master=False, timeout=timeout)
        dist.init_process_group("gloo", init_method=f"tcp://{LOOPBACK}:{port}", rank=rank,
                                world_size=args.ranks, timeout=timeout)
        forward, opt, psi = build(side, args, rank, args.ranks)
        data = TokenBatches(SyntheticCorpus(args.vocab, seed=1), seq_len=args.seq,
                            micro_batch=args.batch, rank=rank, world_size=args.ranks)
        result.update(psi=psi, rss_reset=reset_peak_rss(), times=[])
        for t, (who, k) in enumerate(schedule(args)):
            if who != side:
                continue
            baton.wait([f"go/{t}"])
            tokens = data.batch(k)
            counting = k == args.warmup + args.steps
            dist.barrier()
            t0 = time.perf_counter()
            with Wire() if counting else contextlib.nullcontext() as wire:
                loss = causal_lm_loss(forward(tokens), tokens)
                loss.backward()
                opt.step()
                opt.zero_grad()
            dist.barrier()
            dt = time.perf_counter() - t0
            if counting:
                result.update(wire=wire.bytes, loss=float(loss.detach()))
            elif k >= args.warmup:
                result["times"].append(dt)
            if baton.add(f"done/{t}", 1) == args.ranks:
                baton.set(f"go/{t + 1}", "1")
        store = getattr(opt, "_offload", None)
        result.update(peak_rss=peak_rss_bytes(), ok=True,
                      offloaded_bytes=store.state_bytes if store is not None else 0,
                      largest_shard=max((n for n in getattr(store, "sizes", {}).values()),
                                        default=0),
                      grad_copy_bytes=sum(t.nbytes for t in getattr(store, "_grads", {}).values()))
        if hasattr(forward, "close"):
            forward.close()
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        result.update(ok=False, error=f"{type(exc).__name__}: {exc}", tb=traceback.format_exc())
    Path(out_dir, f"{side}-{rank}.json").write_text(json.dumps(result))
    os._exit(0)


# ---------------------------------------------------------------------------- parent side


def run_precision(args: argparse.Namespace) -> dict[str, list[dict[str, Any]]]:
    import torch.distributed as dist

    baton_port = free_port()
    baton = dist.TCPStore(LOOPBACK, baton_port, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=JOIN_TIMEOUT_S))
    ctx = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="train-step-") as out:
        procs = [ctx.Process(target=rank_main, args=(side, r, args, port, baton_port, out))
                 for side, port in ((s, free_port()) for s in sides(args))
                 for r in range(args.ranks)]
        for p in procs:
            p.start()
        baton.set("go/0", "1")
        join_all(procs, JOIN_TIMEOUT_S)
        results: dict[str, list[dict[str, Any]]] = {s: [] for s in sides(args)}
        for side in sides(args):
            for r in range(args.ranks):
                path = Path(out, f"{side}-{r}.json")
                res = json.loads(path.read_text()) if path.exists() else {
                    "ok": False, "error": "no result (crashed)"}
                if not res.get("ok"):
                    raise RuntimeError(f"{side} rank {r} failed: {res.get('error')}\n"
                                       f"{res.get('tb', '')}")
                results[side].append(res)
    return results


def summarize(args: argparse.Namespace, results: dict[str, list[dict[str, Any]]]) -> list[dict]:
    rows = []
    compute = 2 if args.precision == "bf16" else 4
    for side in sides(args):
        ranks = results[side]
        per_step = [max(ts) for ts in zip(*(r["times"] for r in ranks), strict=False)]
        wire = ranks[0]["wire"]
        elements = sum(b // (compute if op == "all_gather" else 4) for op, b in wire.items())
        psi = ranks[0]["psi"]
        rows.append({"precision": args.precision, "side": side,
                     "median_s": statistics.median(per_step),
                     "steps_s": per_step, "peak_rss_mb": [r["peak_rss"] / 1e6 for r in ranks],
                     "rss_during_steps": all(r["rss_reset"] for r in ranks), "params": psi,
                     "elements": elements, "elements_by_op": wire, "vs_3psi": elements / (3 * psi),
                     "loss": ranks[0]["loss"],
                     "offloaded_bytes": [r["offloaded_bytes"] for r in ranks],
                     "largest_shard": max(r.get("largest_shard", 0) for r in ranks),
                     "grad_copy_bytes": max(r.get("grad_copy_bytes", 0) for r in ranks)})
    base = rows[1]
    for row in rows:
        row["ratio"] = row["median_s"] / base["median_s"]
        # Interleaved steps pair up (same batch, back to back): the median of their ratios
        # is robust to a noisy neighbour slowing a stretch of steps of both sides.
        row["paired_ratio"] = statistics.median(
            a / b for a, b in zip(row["steps_s"], base["steps_s"], strict=False))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--precisions", default="fp32,bf16")
    ap.add_argument("--steps", type=int, default=7, help="timed steps per side and precision")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads per rank")
    ap.add_argument("--batch", type=int, default=4, help="sequences per rank")
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--intermediate", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--zeropp", action="store_true",
                    help="shardckpt ZeRO-3 with and without each ZeRO++ option, side by side")
    ap.add_argument("--ranks-per-node", type=int, default=2, help="--zeropp: ranks per node")
    ap.add_argument("--offload", choices=("cpu", "nvme"),
                    help="shardckpt ZeRO-3 with the optimizer offloaded against resident")
    ap.add_argument("--offload-dir", help="--offload nvme: the directory (default: a temp dir)")
    ap.add_argument("--overlap-step", action="store_true",
                    help="--offload: each group's host step during backward")
    ap.add_argument("--params", type=float, help="about this many parameters (sets --layers)")
    args = ap.parse_args()
    if args.params:
        args.layers = _offload_report.layers_for(args)
    if args.offload == "nvme" and not args.offload_dir:
        args.offload_dir = tempfile.mkdtemp(prefix="train-step-offload-")
    if args.zeropp:
        import _zeropp_jobs

        given = {a.split("=")[0] for a in sys.argv[1:]}
        for flag, value in (("--ranks", 4), ("--layers", 4), ("--hidden", 512),
                            ("--intermediate", 1376), ("--heads", 8), ("--kv-heads", 4),
                            ("--vocab", 8000)):
            if flag not in given:
                setattr(args, flag[2:].replace("-", "_"), value)
        _zeropp_jobs.main(args)
        return
    rows = []
    for precision in args.precisions.split(","):
        args.precision = precision
        rows += summarize(args, run_precision(args))
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    psi = rows[0]["params"]
    print(f"train step: Llama {psi / 1e6:.1f}M params ({args.layers} layers, hidden {args.hidden},"
          f" vocab {args.vocab}), {args.ranks} gloo ranks x {args.threads} thread, "
          f"{args.batch}x{args.seq} tokens per rank; median of {args.steps} steps after "
          f"{args.warmup} warm-up, interleaved")
    print(f"{'precision':>9} {'side':>10} {'median s':>9} {'ratio':>6} {'paired':>7} {'min s':>7} "
          f"{'max s':>7} {'peak RSS MB/rank':>17} {'elements/step':>14} {'/3Ψ':>6} "
          f"{'last loss':>10}")
    for r in rows:
        rss = "/".join(f"{m:.0f}" for m in r["peak_rss_mb"])
        print(f"{r['precision']:>9} {r['side']:>10} {r['median_s']:>9.3f} {r['ratio']:>6.3f} "
              f"{r['paired_ratio']:>7.3f} {min(r['steps_s']):>7.3f} {max(r['steps_s']):>7.3f} "
              f"{rss:>17} {r['elements']:>14,} {r['vs_3psi']:>6.3f} {r['loss']:>10.4f}")
    if args.offload:
        _offload_report.print_offload(rows, args)
    if not all(r["rss_during_steps"] for r in rows):
        print("note: /proc/self/clear_refs refused; peak RSS is over the whole process life")
    print("ratio: median step time over the second side's (FSDP2's, target <= 1.0; with "
          "--offload the resident optimizer's); paired: median over steps of "
          "the ratio of back-to-back steps; elements: logical volume (all-gather output, "
          "reduce-scatter input, 2x all-reduce) per step, over 3Ψ")


if __name__ == "__main__":
    main()
