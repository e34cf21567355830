"""Benchmark: the cost of the HSDP replica check (shardckpt.checkpoint.replica_check) at save.

A Llama-shaped model (125M parameters by default: masters and AdamW moments) on an HSDP mesh
of ``--replicate`` x (ranks / replicate) gloo CPU ranks (2 x 2 by default), one training step,
then, interleaved (order alternated each repetition), each from a dropped page cache after the
previous copy was removed: ``save`` with the replica check (the default) and without it
(``begin_save(..., check_replicas=False)``). Also measured on their own: the CRC32C pass of a
rank that writes nothing (``ReplicaCheck.take``), and the bytes of the verdict all-gather
(every rank's report, counted from the wire: ``all_gather`` wrapped). CPU seconds (every thread
of every rank) beside the wall clock: on a machine shared with other jobs the latter swings.

    python bench/replica_check.py [--params 125M] [--reps 5] [--ranks 4] [--replicate 2]

Prints medians (seconds) as JSON. Nothing here asserts.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _save_load_jobs as jobs  # noqa: E402
from common import drop_tree, median  # noqa: E402
from save_load import llama_config  # noqa: E402
from shardckpt.format.quantities import parse_count  # noqa: E402

VARIANTS = ("checked", "unchecked")


def _gathered_bytes(fn: Any) -> tuple[Any, int]:
    """``fn()`` and the bytes every ``all_gather`` in it received (outputs summed)."""
    import torch.distributed as dist

    seen = [0]
    real = dist.all_gather

    def counting(out: list[Any], t: Any, *a: Any, **k: Any) -> Any:
        seen[0] += sum(o.numel() * o.element_size() for o in out)
        return real(out, t, *a, **k)

    dist.all_gather = counting
    try:
        return fn(), seen[0]
    finally:
        dist.all_gather = real


def job(cfg_doc: dict[str, Any], work: str, reps: int, settle_s: float, replicate: int) -> dict[str, Any]:
    from shardckpt.checkpoint.replica_check import ReplicaCheck
    from shardckpt.format.layout import Mesh
    from shardckpt.runtime import init_distributed
    from shardckpt.runtime.mesh import ProcessMesh
    from shardckpt.training.device_save import ShardBytes
    from shardckpt.training.save_load import begin_save

    pm = init_distributed()
    hsdp = ProcessMesh.from_process_group(Mesh.hsdp(replicate, pm.world_size // replicate))
    cfg = jobs._config(cfg_doc)
    engine, opt = jobs.build_engine(cfg, hsdp, seed=0)
    jobs.train_step(engine, opt, cfg, pm.rank)
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    cpu: dict[str, list[float]] = {v: [] for v in VARIANTS}  # every thread of this rank
    cold = True
    for rep in range(reps):
        for v in VARIANTS if rep % 2 == 0 else VARIANTS[::-1]:
            url = os.path.join(work, v)
            cold &= jobs._prepare(pm.rank, lambda u=url: jobs._remove(u), settle_s)
            c0 = time.process_time()
            dt, _ = jobs._timed(lambda u=url, c=v == "checked": begin_save(engine, u, check_replicas=c).run())
            cpu[v].append(time.process_time() - c0)
            times[v].append(dt)
    # the check's parts alone: a non-writer's CRC pass, and the verdict exchange's bytes
    job_ = begin_save(engine, os.path.join(work, "parts"))
    check = job_.replicas
    assert check is not None
    t = time.perf_counter()
    ReplicaCheck(check.spec, pm.rank, ShardBytes(engine.local_shards())).take("x" * 25)
    crc_s = time.perf_counter() - t
    _, gathered = _gathered_bytes(lambda: check.compare("x" * 25, [], "bench", None))
    state = sum(t.numel() * t.element_size() for kinds in engine.local_shards().values()
                for t in kinds.values())
    return {"times": times, "cpu": cpu, "cold": cold, "crc_s": crc_s, "gathered": gathered, "state_bytes": state,
            "writes": check.produce is None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", default="125M")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--replicate", type=int, default=2)
    ap.add_argument("--settle", type=float, default=2.0)
    ap.add_argument("--workdir", default=None)
    args = ap.parse_args()
    from shardckpt.training.launch import launch

    cfg = llama_config(parse_count(args.params))
    work = args.workdir or tempfile.mkdtemp(prefix="shardckpt-bench-replica-")
    out = launch(job, args.ranks, (cfg, work, args.reps, args.settle, args.replicate), timeout_s=3600)
    drop_tree(work)
    slowest = {v: [max(r["times"][v][i] for r in out) for i in range(args.reps)] for v in VARIANTS}
    sec = {v: median(x) for v, x in slowest.items()}
    cpu = {v: median([sum(r["cpu"][v][i] for r in out) for i in range(args.reps)]) for v in VARIANTS}
    print(json.dumps({
        "ranks": args.ranks, "mesh": f"{args.replicate} x {args.ranks // args.replicate}",
        "reps": args.reps, "cold_cache": all(r["cold"] for r in out),
        "shard_bytes_per_rank": out[0]["state_bytes"],
        "save_s": {v: round(s, 3) for v, s in sec.items()},
        "per_rep_s": {v: [round(x, 3) for x in xs] for v, xs in slowest.items()},
        "checked_vs_unchecked": round(sec["checked"] / sec["unchecked"], 3),
        "cpu_s_all_ranks": {v: round(c, 3) for v, c in cpu.items()},
        "cpu_s_per_rank": {v: [round(median(r["cpu"][v]), 3) for r in out] for v in VARIANTS},
        "crc_pass_s_non_writer": [round(r["crc_s"], 3) for r in out if not r["writes"]],
        "verdict_gather_bytes_per_rank": out[0]["gathered"],
    }, indent=2))


if __name__ == "__main__":
    main()
