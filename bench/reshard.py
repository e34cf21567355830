"""Benchmark: `shardckpt reshard --from 64 --to 16` against a plain copy (`cp -r` + sync).

Same run, interleaved, median of several repetitions; peak RSS summed over each command's process
tree. Repeated at two sizes (about 2 GB and 0.5 GB) to show memory does not grow with size. Also
times the reshard plan of a 70B-parameter Llama layout (80 blocks) from 1024 to 768 ranks.

    python bench/reshard.py [--sizes 2.0,0.5] [--reps 3] [--workdir DIR]

Prints a table of ratios (reshard throughput / copy throughput), for the whole command and for the
reshard itself as it reports its time (``--json``), without the interpreter's start-up (about
0.3 s, most of a 0.5 GB run). Nothing here asserts.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import SHARDCKPT, ensure_bytecode, dir_bytes, drop_tree, median, run_measured, run_measured_json  # noqa: E402


def plan_70b_seconds() -> tuple[float, int]:
    from shardckpt.format.layout import Mesh, ParamInfo, build_layout
    from shardckpt.format.reshard_plan import plan_reshard

    d, ff, vocab, kv = 8192, 28672, 128256, 1024
    infos = [ParamInfo("model.embed_tokens.weight", (vocab, d), "bfloat16", True, "")]
    for i in range(80):
        u = f"model.layers.{i}"
        for name, shape in (("input_layernorm.weight", (d,)), ("self_attn.q_proj.weight", (d, d)),
                            ("self_attn.k_proj.weight", (kv, d)), ("self_attn.v_proj.weight", (kv, d)),
                            ("self_attn.o_proj.weight", (d, d)), ("post_attention_layernorm.weight", (d,)),
                            ("mlp.gate_proj.weight", (ff, d)), ("mlp.up_proj.weight", (ff, d)),
                            ("mlp.down_proj.weight", (d, ff))):
            infos.append(ParamInfo(f"{u}.{name}", shape, "bfloat16", True, u))
    infos += [ParamInfo("model.norm.weight", (d,), "bfloat16", True, ""),
              ParamInfo("lm_head.weight", (vocab, d), "bfloat16", True, "")]
    src = build_layout(infos, Mesh.for_world(1024))
    dst = src.with_mesh(Mesh.for_world(768))
    times = []
    for _ in range(3):
        t = time.perf_counter()
        plan = plan_reshard(src, dst)
        times.append(time.perf_counter() - t)
    return median(times), len(plan.copies)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="2.0,0.5", help="checkpoint sizes in GB")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--from-ranks", type=int, default=64)
    ap.add_argument("--to-ranks", type=int, default=16)
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    ensure_bytecode()
    work = args.workdir or tempfile.mkdtemp(prefix="shardckpt-bench-")
    exe = list(SHARDCKPT)
    rows = []
    for size_gb in (float(s) for s in args.sizes.split(",")):
        src = os.path.join(work, f"src-{size_gb}")
        params = int(size_gb * 1e9 / 12)  # fp32 master + two fp32 Adam moments
        if not os.path.exists(os.path.join(src, "manifest.json")):
            drop_tree(src)
            run_measured([*exe, "synth", src, "--params", str(params), "--ranks", str(args.from_ranks),
                          "--units", "8"])
        nbytes = dir_bytes(src)
        ours, inner, copy, rss_ours, rss_copy = [], [], [], [], []
        for _ in range(args.reps):
            for which in ("copy", "reshard"):  # interleaved
                dst = os.path.join(work, f"dst-{which}")
                drop_tree(dst)
                subprocess_sync()
                if which == "copy":
                    dt, rss = run_measured(["sh", "-c", f"cp -r '{src}' '{dst}' && sync"])
                    copy.append(dt)
                    rss_copy.append(rss)
                else:
                    dt, rss, out = run_measured_json([*exe, "reshard", src, dst, "--from",
                                                      str(args.from_ranks), "--to", str(args.to_ranks),
                                                      "--json"])
                    ours.append(dt)
                    inner.append(out["seconds"])
                    rss_ours.append(rss)
                drop_tree(dst)
        rows.append({
            "size_gb": round(nbytes / 1e9, 3),
            "reshard_s": round(median(ours), 3), "copy_s": round(median(copy), 3),
            "reshard_gbps": round(nbytes / 1e9 / median(ours), 3),
            "copy_gbps": round(nbytes / 1e9 / median(copy), 3),
            "ratio": round(median(copy) / median(ours), 3),
            "reshard_in_process_s": round(median(inner), 3),
            "ratio_in_process": round(median(copy) / median(inner), 3),
            "reshard_peak_rss_mb": round(max(rss_ours) / 1e6, 1),
            "copy_peak_rss_mb": round(max(rss_copy) / 1e6, 1),
        })
    plan_s, copies = plan_70b_seconds()
    result = {"from": args.from_ranks, "to": args.to_ranks, "reps": args.reps, "rows": rows,
              "plan_70b_1024_to_768_s": round(plan_s, 3), "plan_70b_copies": copies}
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(f"reshard --from {args.from_ranks} --to {args.to_ranks} vs cp -r + sync "
          f"(median of {args.reps}, interleaved)")
    print(f"{'size GB':>8} {'reshard s':>10} {'copy s':>8} {'reshard GB/s':>13} {'copy GB/s':>10} "
          f"{'ratio':>6} {'in-process s':>13} {'ratio':>6} {'peak RSS MB':>12} {'cp RSS MB':>10}")
    for r in rows:
        print(f"{r['size_gb']:>8} {r['reshard_s']:>10} {r['copy_s']:>8} {r['reshard_gbps']:>13} "
              f"{r['copy_gbps']:>10} {r['ratio']:>6} {r['reshard_in_process_s']:>13} "
              f"{r['ratio_in_process']:>6} {r['reshard_peak_rss_mb']:>12} {r['copy_peak_rss_mb']:>10}")
    print("ratio = copy time / reshard time (the whole command); in-process = the time the reshard "
          "itself reports (--json), without the interpreter's start-up and imports")
    print(f"plan 70B (80 blocks) 1024 -> 768 ranks: {plan_s:.3f} s, {copies} copies")


def subprocess_sync() -> None:
    os.sync()


if __name__ == "__main__":
    main()
