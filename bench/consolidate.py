"""Benchmark: `shardckpt consolidate --dtype fp32` against torch.distributed.checkpoint's
`consolidate_safetensors_files`, on the same Llama-shaped fp32 weights.

DCP side: a gloo group of N CPU ranks (default 4) holds FSDP2-style `Shard(0)` DTensors and saves
them with `HuggingFaceStorageWriter(save_distributed=True)` (one safetensors file per rank); then
`torch.distributed.checkpoint._consolidate_hf_safetensors.consolidate_safetensors_files` is timed in
a fresh process. shardckpt side: `shardckpt synth --ranks N` (fp32 master + two Adam moments), then
`shardckpt consolidate --dtype fp32` is timed in a fresh process. Both sides hold identical tensors
(`synth.values`), and the output is split into the same files. Weights only are compared: DCP's HF
writer handles model weights, not optimizer state (shardckpt reads only the `master` state here).

Same run, interleaved, median of several repetitions; peak RSS summed over each command's process
tree. Repeated at two sizes (GB of fp32 weights) to show how time and memory grow with size.
Correctness is checked once per size: both outputs hold the same tensors, bit for bit.

    python bench/consolidate.py [--sizes 2.0,0.5] [--reps 3] [--ranks 4] [--workdir DIR] [--json]

The disk's own limit for the same bytes is measured in the same run, interleaved: reading the
weights' byte count from the checkpoint's files once, writing it once and fsyncing
(bench/_disk_limit.py). Prints a table of ratios (DCP time / shardckpt time, disk time /
shardckpt time). Nothing here asserts.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import shlex
import shutil
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import SHARDCKPT, ensure_bytecode, drop_tree, median, run_measured  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "_dcp_consolidate_worker.py")
LIMIT = os.path.join(HERE, "_disk_limit.py")


def weight_bytes(params: int, units: int) -> int:
    from shardckpt.tools.synth import llama_params

    infos, buffers, _ = llama_params(params, units)
    return 4 * (sum(math.prod(p.shape) for p in infos) + sum(math.prod(b.shape) for b in buffers))


def index_mapping(src: str) -> dict[str, int]:
    """fqn -> output file index (1-based) of shardckpt's plan, so both sides split files alike."""
    from shardckpt.checkpoint.reader import CheckpointReader
    from shardckpt.tools.consolidate_plan import plan_consolidation

    plan = plan_consolidation(CheckpointReader(src).manifest, "fp32")
    return {t.name: i + 1 for i, f in enumerate(plan.files) for t in f.tensors}


def outputs_equal(a: str, b: str) -> tuple[bool, str]:
    """Both consolidated dirs hold the same tensor names, dtypes, shapes and bytes."""
    from safetensors import safe_open

    maps = []
    for d in (a, b):
        with open(os.path.join(d, "model.safetensors.index.json")) as f:
            maps.append(json.load(f)["weight_map"])
    if set(maps[0]) != set(maps[1]):
        only = sorted(set(maps[0]) ^ set(maps[1]))
        return False, f"tensor names differ: {only[:5]}"
    handles: dict[str, object] = {}

    def get(d: str, fname: str):
        key = os.path.join(d, fname)
        if key not in handles:
            handles[key] = safe_open(key, framework="np")
        return handles[key]

    for name in sorted(maps[0]):
        x = get(a, maps[0][name]).get_tensor(name)
        y = get(b, maps[1][name]).get_tensor(name)
        if x.dtype != y.dtype or x.shape != y.shape:
            return False, f"{name}: {x.dtype}{x.shape} vs {y.dtype}{y.shape}"
        if x.tobytes() != y.tobytes():
            return False, f"{name}: bytes differ"
    return True, f"{len(maps[0])} tensors"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="2.0,0.5", help="GB of fp32 weights (a shardckpt checkpoint is ~3x)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--ranks", type=int, default=4, help="world size that wrote both checkpoints")
    ap.add_argument("--units", type=int, default=8, help="transformer blocks")
    ap.add_argument("--dcp-threads", type=int, default=1,
                    help="num_threads of consolidate_safetensors_files (parallel over output files)")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--keep", action="store_true", help="keep the source checkpoints in --workdir")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    ensure_bytecode()
    own_work = args.workdir is None
    work = args.workdir or tempfile.mkdtemp(prefix="shardckpt-bench-")
    os.makedirs(work, exist_ok=True)
    exe = list(SHARDCKPT)
    rows = []
    try:
        for size_gb in (float(s) for s in args.sizes.split(",")):
            params = int(size_gb * 1e9 / 4)
            nbytes = weight_bytes(params, args.units)
            src = os.path.join(work, f"shardckpt-{size_gb}")
            dcp_in = os.path.join(work, f"dcp-{size_gb}")
            if not os.path.exists(os.path.join(src, "manifest.json")):
                drop_tree(src)
                run_measured([*exe, "synth", src, "--params", str(params), "--ranks", str(args.ranks),
                              "--units", str(args.units)])
            if not os.path.isdir(dcp_in) or not os.listdir(dcp_in):
                drop_tree(dcp_in)
                run_measured([sys.executable, WORKER, "save", dcp_in, "--params", str(params),
                              "--units", str(args.units), "--ranks", str(args.ranks)])
            mapping = os.path.join(work, f"mapping-{size_gb}.json")
            with open(mapping, "w") as f:
                json.dump(index_mapping(src), f)
            sides = ("dcp", "ours", "limit")
            times: dict[str, list[float]] = {w: [] for w in sides}
            rss: dict[str, list[int]] = {w: [] for w in sides}
            calls: dict[str, list[float]] = {w: [] for w in sides}  # the library call alone
            cpu: dict[str, list[float]] = {w: [] for w in sides}    # user + system CPU seconds
            durable: list[float] = []  # DCP's call, then an fsync of each file it wrote
            equal, detail = None, ""
            for rep in range(args.reps):
                order = sides if rep % 2 == 0 else sides[::-1]  # interleaved, alternating
                for which in order:
                    dst = os.path.join(work, f"out-{which}")
                    drop_tree(dst)
                    os.sync()
                    timing = os.path.join(work, f"timing-{which}.json")
                    if which == "dcp":
                        cmd = [sys.executable, WORKER, "consolidate", dcp_in, dst, mapping,
                               "--threads", str(args.dcp_threads), "--timing", timing]
                    elif which == "limit":  # the disk: read the weights' bytes once, write, fsync
                        os.makedirs(dst)
                        cmd = [sys.executable, LIMIT, src, os.path.join(dst, "limit.bin"), str(nbytes),
                               "--timing", timing]
                    else:  # exec: the shell is replaced, so the tree measured is shardckpt alone
                        ours = shlex.join([*exe, "consolidate", src, dst, "--dtype", "fp32", "--json"])
                        cmd = ["sh", "-c", f"exec {ours} > {shlex.quote(timing)}"]
                    before = resource.getrusage(resource.RUSAGE_CHILDREN)
                    dt, peak = run_measured(cmd)
                    after = resource.getrusage(resource.RUSAGE_CHILDREN)
                    cpu[which].append(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime)
                    times[which].append(dt)
                    rss[which].append(peak)
                    with open(timing) as f:
                        got = json.load(f)
                    calls[which].append(got["seconds"])
                    if which == "dcp":
                        durable.append(got["seconds_durable"])
                if rep == 0:
                    equal, detail = outputs_equal(os.path.join(work, "out-dcp"), os.path.join(work, "out-ours"))
                for which in order:
                    drop_tree(os.path.join(work, f"out-{which}"))
            limit_call = median(calls["limit"])
            t_dcp, t_ours = median(times["dcp"]), median(times["ours"])
            rows.append({
                "weights_gb": round(nbytes / 1e9, 3),
                "dcp_s": round(t_dcp, 3), "shardckpt_s": round(t_ours, 3),
                "ratio": round(t_dcp / t_ours, 3),
                "dcp_gbps": round(nbytes / 1e9 / t_dcp, 3), "shardckpt_gbps": round(nbytes / 1e9 / t_ours, 3),
                "dcp_cpu_s": round(median(cpu["dcp"]), 3), "shardckpt_cpu_s": round(median(cpu["ours"]), 3),
                "dcp_call_s": round(median(calls["dcp"]), 3), "shardckpt_call_s": round(median(calls["ours"]), 3),
                "call_ratio": round(median(calls["dcp"]) / median(calls["ours"]), 3),
                "dcp_durable_call_s": round(median(durable), 3),
                "durable_call_ratio": round(median(durable) / median(calls["ours"]), 3),
                "limit_s": round(median(times["limit"]), 3), "limit_call_s": round(limit_call, 3),
                "limit_gbps": round(nbytes / 1e9 / limit_call, 3),
                "disk_ratio": round(limit_call / median(calls["ours"]), 3),
                "dcp_peak_rss_mb": round(max(rss["dcp"]) / 1e6, 1),
                "shardckpt_peak_rss_mb": round(max(rss["ours"]) / 1e6, 1),
                "outputs_equal": equal, "equal_detail": detail,
            })
            for small in (mapping, *(os.path.join(work, f"timing-{w}.json") for w in ("dcp", "ours"))):
                os.remove(small)
            if not args.keep:
                drop_tree(src)
                drop_tree(dcp_in)
    finally:
        if own_work:
            shutil.rmtree(work, ignore_errors=True)
    result = {"ranks": args.ranks, "units": args.units, "reps": args.reps, "dcp_threads": args.dcp_threads,
              "rows": rows}
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(f"consolidate fp32 weights: DCP consolidate_safetensors_files vs shardckpt consolidate --dtype fp32 "
          f"({args.ranks} ranks, median of {args.reps}, interleaved)")
    print(f"{'weights GB':>10} {'DCP s':>8} {'shardckpt s':>12} {'ratio':>6} {'DCP GB/s':>9} "
          f"{'ours GB/s':>10} {'DCP RSS MB':>11} {'ours RSS MB':>12} {'outputs equal':>14}")
    for r in rows:
        print(f"{r['weights_gb']:>10} {r['dcp_s']:>8} {r['shardckpt_s']:>12} {r['ratio']:>6} {r['dcp_gbps']:>9} "
              f"{r['shardckpt_gbps']:>10} {r['dcp_peak_rss_mb']:>11} {r['shardckpt_peak_rss_mb']:>12} "
              f"{'yes' if r['outputs_equal'] else 'no':>14}")
    print("library call alone, timed inside the same processes (no interpreter start, no imports); "
          "CPU s = user + system of the whole process; disk = reading the weights' bytes once, writing "
          "them once, fsync (bench/_disk_limit.py), and its ratio to shardckpt's call:")
    print(f"{'weights GB':>10} {'DCP call s':>11} {'ours call s':>12} {'ratio':>6} {'DCP+fsync s':>12} "
          f"{'ratio':>6} {'DCP CPU s':>10} {'ours CPU s':>11} {'disk s':>7} {'of disk':>8}")
    for r in rows:
        print(f"{r['weights_gb']:>10} {r['dcp_call_s']:>11} {r['shardckpt_call_s']:>12} {r['call_ratio']:>6} "
              f"{r['dcp_durable_call_s']:>12} {r['durable_call_ratio']:>6} "
              f"{r['dcp_cpu_s']:>10} {r['shardckpt_cpu_s']:>11} {r['limit_call_s']:>7} {r['disk_ratio']:>8}")
    for r in rows:
        print(f"{r['weights_gb']} GB: outputs equal: {'yes' if r['outputs_equal'] else 'no'} ({r['equal_detail']})")


if __name__ == "__main__":
    main()
