"""Benchmark: the plan a torchrun job of the offline tools splits, at scale.

A Llama of 70B parameters (80 blocks) with AdamW state, resharded from 1024 to 768 ranks by 64
processes: the time every process spends planning (the reshard plan, each target file's bytes, the
split by bytes), and how far each process's bytes read and written are from the mean.

    python bench/dist_plan.py [--params 70e9] [--src 1024] [--dst 768] [--procs 64] [--reps 3]

Nothing here asserts; tests/test_dist_tools.py holds the balance to 5%.
"""

from __future__ import annotations

import argparse
import statistics
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", type=float, default=70e9)
    ap.add_argument("--units", type=int, default=80)
    ap.add_argument("--src", type=int, default=1024)
    ap.add_argument("--dst", type=int, default=768)
    ap.add_argument("--procs", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()

    from shardckpt.checkpoint.writer import CheckpointWriter
    from shardckpt.format.layout import Mesh
    from shardckpt.tools.reshard import target_spec
    from shardckpt.tools.split import balance, shard_bytes
    from shardckpt.storage import Storage
    from shardckpt.tools.synth import synth_spec

    spec = synth_spec(int(args.params), args.src, 1, args.units, 100, 0)
    writer = CheckpointWriter(Storage("memory://dist-plan"), spec)
    m = writer.manifest([])  # what the plan reads of a manifest (its files do not matter here)
    times = []
    for _ in range(args.reps):
        t0 = time.perf_counter()
        dspec, plans = target_spec(m, Mesh.for_world(args.dst))
        per_shard = shard_bytes(dspec, plans)
        parts = balance([r + w for r, w in per_shard], args.procs)
        times.append(time.perf_counter() - t0)
    reads = [sum(per_shard[i][0] for i in p) for p in parts]
    writes = [sum(per_shard[i][1] for i in p) for p in parts]
    print(f"{args.params / 1e9:g}B params, {args.src} -> {args.dst} ranks, {args.procs} processes")
    print(f"planning: median {statistics.median(times):.3f} s over {args.reps} runs")
    for what, xs in (("read", reads), ("written", writes)):
        mean = statistics.mean(xs)
        print(f"bytes {what} per process: mean {mean / 1e9:.2f} GB, min {min(xs) / mean - 1:+.3%}, "
              f"max {max(xs) / mean - 1:+.3%}")


if __name__ == "__main__":
    main()
