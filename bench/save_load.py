"""Benchmark: shardckpt save/load against torch.distributed.checkpoint (DCP) with FSDP2, and
against a raw sequential write with fsync of the same bytes and the disk's 8-stream limit
(`_disk_limit.streams`); async save's blocking time.

A Llama-shaped model (about 125M parameters by default: 1.5 GB of fp32 masters and AdamW
moments) on 4 gloo CPU ranks. shardckpt side: ``ZeroEngine`` + ``ShardedAdamW``; DCP side: the
same model under FSDP2 (``fully_shard``) + ``torch.optim.AdamW``; both take one step. Then, in
the same run, interleaved (order rotated each repetition), each after the previous copy was
deleted, synced and left to settle (``--settle`` seconds: the disk may be mounted with
``discard``) and from a dropped page cache: shardckpt ``save``, ``dcp.save`` (default
``FileSystemWriter``: one file per rank, fsync), a raw sequential write + fsync of each rank's
shard bytes, and ``Checkpointer.save`` sync and async. Then a 2-rank job loads the 4-rank
checkpoints (reshard 4→2): shardckpt ``load`` against ``dcp.load`` + ``set_model_state_dict`` /
``set_optimizer_state_dict``. Correctness is checked once: the weights after the 4→2 loads
equal the saved ones (SHA-256 of the gathered whole weights, both sides). Rank jobs live in
``_save_load_jobs.py``. The disk's 8-stream limit is measured the same way: its write and its
read each start synced, settled and from a dropped page cache.

    python bench/save_load.py [--params 125M] [--reps 7] [--ranks 4] [--load-ranks 2] [--settle 2]
                                [--workdir DIR] [--keep] [--json] [--digests-only]

``digests`` and ``signed``: shardckpt ``save`` with a digest per file (BLAKE3 where the package
imports, else SHA-256) computed as it is written, and with the manifest signed too;
``--digests-only`` times those two and the plain save alone (no DCP, no load) and prints their
ratios to it, in wall-clock time and in CPU seconds (every thread of every rank): on a machine
whose CPUs are the limit the two ratios meet.

Prints medians (seconds, GB/s) and the ratios the issue sets targets for. Nothing here asserts.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _disk_limit  # noqa: E402
import _save_load_jobs as jobs  # noqa: E402
from common import drop_tree, median  # noqa: E402
from shardckpt.format.quantities import parse_count  # noqa: E402

TARGETS = {"save_vs_disk_8": (">=", 0.9), "load_vs_disk_8": (">=", 0.9), "save_vs_dcp": (">=", 1.0), "save_vs_raw": (">=", 0.8), "load_vs_dcp": (">=", 1.0),
           "async_blocking_vs_sync": ("<=", 0.10), "dcp_writer_vs_fs": (">=", 1.0),
           "dcp_reader_vs_fs": (">=", 1.0), "dcp_async_blocking_vs_fs": ("<=", 1.0),
           "digests_vs_plain": (">=", 0.85), "signed_vs_plain": (">=", 0.85)}
DIGEST_VARIANTS = ("shardckpt", "digests", "signed")


def llama_config(params: int) -> dict[str, object]:
    """A Llama shape (untied-head count, GQA off) near ``params`` parameters: GPT-2-small-like
    widths (vocab 32000, hidden 768, 12 heads) from 60M up, a narrower one below."""
    if params >= 60_000_000:
        vocab, h, inter, heads = 32000, 768, 2048, 12
    else:
        vocab, h, inter, heads = 8192, 256, 688, 4
    layer = 4 * h * h + 3 * h * inter + 2 * h
    layers = max(1, round((params - vocab * h - h) / layer))
    return {"vocab_size": vocab, "hidden_size": h, "intermediate_size": inter,
            "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": heads}


def per_rep_max(results: list[dict], key: str) -> list[float]:
    """The slowest rank's time of each repetition."""
    return [max(r["times"][key][i] for r in results) for i in range(len(results[0]["times"][key]))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", default="125M", help="model size (e.g. 125M, 10M)")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--ranks", type=int, default=4, help="ranks that save")
    ap.add_argument("--load-ranks", type=int, default=2, help="ranks that load (reshard)")
    ap.add_argument("--settle", type=float, default=2.0,
                    help="seconds to pause after deleting the previous copy, before each timed run")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--keep", action="store_true", help="keep the checkpoints written")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--digests-only", action="store_true",
                    help="time the plain, digests and signed saves only (no DCP, no load)")
    args = ap.parse_args()
    from shardckpt.training.launch import launch

    cfg = llama_config(parse_count(args.params, "--params"))
    work = args.workdir or tempfile.mkdtemp(prefix="shardckpt-bench-")
    os.makedirs(work, exist_ok=True)
    t = time.perf_counter()
    if args.digests_only:
        digests_only(cfg, work, args)
        return
    saved = launch(jobs.save_job, args.ranks, (cfg, work, args.reps, args.settle), timeout_s=3600)
    loaded = launch(jobs.load_job, args.load_ranks, (cfg, work, args.reps, args.settle), timeout_s=3600)
    wall = time.perf_counter() - t
    # the disk's parallel limit for the same bytes: 8 streams, 16 MiB writes + fsync, then reads;
    # each phase prepared as the tools' runs are (written back, settled, the page cache dropped)
    state_bytes = 12 * saved[0]["params"]
    disk8 = [_disk_limit.streams(os.path.join(work, "disk-8"), state_bytes, 8, args.settle)
             for _ in range(args.reps)]
    if not args.keep:
        drop_tree(work)

    s0, l0 = saved[0], loaded[0]
    nb = {"shardckpt": s0["bytes"]["shardckpt"], "dcp": s0["bytes"]["dcp"],
          "digests": s0["bytes"]["digests"], "signed": s0["bytes"]["signed"],
          "raw": sum(r["bytes"]["raw"] for r in saved), "dcp_sc": s0["bytes"]["dcp_sc"]}
    sec = {f"save_{v}": median(per_rep_max(saved, v))
           for v in ("shardckpt", "dcp", "raw", "dcp_sc", "digests", "signed")}
    for v in jobs.LOAD_VARIANTS:
        sec[f"load_{v}"] = median(per_rep_max(loaded, v))
    sec["dcp_async_blocking"] = median(per_rep_max(saved, "dcp_async"))
    sec["dcp_sc_async_blocking"] = median(per_rep_max(saved, "dcp_sc_async"))
    sec["ckpt_sync"] = median(per_rep_max(saved, "sync"))
    sec["ckpt_async_blocking"] = median(per_rep_max(saved, "async"))
    sec["ckpt_async_total"] = median(per_rep_max(saved, "async_total"))
    # GB/s of the same work for every variant: the model state (fp32 masters + two moments, 12 bytes
    # a parameter). On disk DCP also holds the tied head again (lm_head.weight), shardckpt pads.
    state = 12 * s0["params"]
    gbps = {k: state / v / 1e9 for k, v in sec.items() if k.startswith(("save_", "load_"))}
    disk_gbps = {k: nb[k.split("_", 1)[1]] / v / 1e9 for k, v in sec.items()
                 if k.startswith(("save_", "load_"))}
    gbps["disk_8_write"] = state / median([d["write_fsync_s"] for d in disk8]) / 1e9
    gbps["disk_8_read"] = state / median([d["read_s"] for d in disk8]) / 1e9
    ratios = {"save_vs_disk_8": gbps["save_shardckpt"] / gbps["disk_8_write"],
              "load_vs_disk_8": gbps["load_shardckpt"] / gbps["disk_8_read"],
              "save_vs_dcp": gbps["save_shardckpt"] / gbps["save_dcp"],
              "save_vs_raw": gbps["save_shardckpt"] / gbps["save_raw"],
              "load_vs_dcp": gbps["load_shardckpt"] / gbps["load_dcp"],
              "async_blocking_vs_sync": sec["ckpt_async_blocking"] / sec["ckpt_sync"],
              "dcp_writer_vs_fs": gbps["save_dcp_sc"] / gbps["save_dcp"],
              "dcp_reader_vs_fs": gbps["load_dcp_sc"] / gbps["load_dcp"],
              "dcp_async_blocking_vs_fs": sec["dcp_sc_async_blocking"] / sec["dcp_async_blocking"],
              "digests_vs_plain": gbps["save_digests"] / gbps["save_shardckpt"],
              "signed_vs_plain": gbps["save_signed"] / gbps["save_shardckpt"]}
    met = {k: (v >= TARGETS[k][1] if TARGETS[k][0] == ">=" else v <= TARGETS[k][1])
           for k, v in ratios.items()}
    result = {
        "params": s0["params"], "config": cfg, "ranks": args.ranks, "load_ranks": args.load_ranks,
        "reps": args.reps, "settle_s": args.settle,
        "cold_cache": all(r["cold"] for r in saved + loaded) and all(d["cold"] for d in disk8),
        "state_bytes": state, "disk_bytes": nb, "seconds": {k: round(v, 3) for k, v in sec.items()},
        "gbps": {k: round(v, 3) for k, v in gbps.items()},
        "disk_gbps": {k: round(v, 3) for k, v in disk_gbps.items()},
        "ratios": {k: round(v, 3) for k, v in ratios.items()},
        "targets": {k: f"{op} {x}" for k, (op, x) in TARGETS.items()}, "met": met,
        "load_correct": {"shardckpt": s0["digest"] == l0["digest"],
                         "dcp": s0["fsdp_digest"] == l0["fsdp_digest"],
                         "dcp_sc": s0["fsdp_digest"] == l0["fsdp_sc_digest"]},
        "first_async_blocking_s": round(max(r["first_async_blocking_s"] for r in saved), 3),
        "setup_s": round(max(r["setup_s"] for r in saved), 1), "wall_s": round(wall, 1),
        "per_rep_s": {**{f"save_{v}": [round(x, 3) for x in per_rep_max(saved, v)]
                         for v in (*jobs.SAVE_VARIANTS, "async_total")},
                      **{f"load_{v}": [round(x, 3) for x in per_rep_max(loaded, v)]
                         for v in jobs.LOAD_VARIANTS}},
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print_table(result)


def digests_only(cfg: dict, work: str, args: argparse.Namespace) -> None:
    """The plain, digests and signed saves alone, interleaved; medians and ratios."""
    from shardckpt.training.launch import launch

    saved = launch(jobs.save_job, args.ranks, (cfg, work, args.reps, args.settle, DIGEST_VARIANTS),
                   timeout_s=3600)
    if not args.keep:
        drop_tree(work)
    sec = {v: median(per_rep_max(saved, v)) for v in DIGEST_VARIANTS}
    # CPU seconds (every thread of every rank): what the save costs where CPUs, not the disk, are
    # the limit, as on a machine shared by other jobs, where wall-clock times swing tenfold
    cpu = {v: median([sum(r["cpu"][v][i] for r in saved) for i in range(args.reps)]) for v in DIGEST_VARIANTS}
    result = {"params": saved[0]["params"], "ranks": args.ranks, "reps": args.reps,
              "cold_cache": all(r["cold"] for r in saved), "disk_bytes": saved[0]["bytes"],
              "seconds": {k: round(v, 3) for k, v in sec.items()},
              "per_rep_s": {v: [round(x, 3) for x in per_rep_max(saved, v)] for v in DIGEST_VARIANTS},
              "cpu_s": {k: round(v, 3) for k, v in cpu.items()},
              "ratios": {"digests_vs_plain": round(sec["shardckpt"] / sec["digests"], 3),
                         "signed_vs_plain": round(sec["shardckpt"] / sec["signed"], 3),
                         "digests_vs_plain_cpu": round(cpu["shardckpt"] / cpu["digests"], 3)},
              "targets": {k: f"{TARGETS[k][0]} {TARGETS[k][1]}" for k in ("digests_vs_plain", "signed_vs_plain")}}
    print(json.dumps(result, indent=2))


def print_table(r: dict) -> None:
    sec, gb, dgb, nb = r["seconds"], r["gbps"], r["disk_gbps"], r["disk_bytes"]
    cache = "cold page cache (dropped before each)" if r["cold_cache"] else "WARM page cache (could not drop)"
    print(f"save on {r['ranks']} ranks, load on {r['load_ranks']} (reshard), {r['params'] / 1e6:.1f}M-param "
          f"Llama: {r['state_bytes'] / 1e9:.3f} GB of fp32 masters + AdamW moments; median of "
          f"{r['reps']}, interleaved; {cache}")
    print(f"{'variant':<34} {'disk GB':>7} {'s':>7} {'GB/s':>6} {'disk GB/s':>9}")
    n2 = f"{r['ranks']}->{r['load_ranks']}"
    rows = [("save  shardckpt save()", "save_shardckpt"), ("save  DCP dcp.save() (FSDP2)", "save_dcp"),
            ("save  raw sequential write+fsync", "save_raw"), (f"load  shardckpt load() {n2}", "load_shardckpt"),
            (f"load  DCP dcp.load() {n2}", "load_dcp"),
            ("save  dcp.save(ShardckptWriter)", "save_dcp_sc"),
            ("save  shardckpt, digests", "save_digests"), ("save  shardckpt, signed", "save_signed"),
            (f"load  dcp.load(ShardckptReader) {n2}", "load_dcp_sc")]
    for label, key in rows:
        print(f"{label:<34} {nb[key.split('_', 1)[1]] / 1e9:>7.3f} {sec[key]:>7.3f} {gb[key]:>6.2f} {dgb[key]:>9.2f}")
    for label, key in (("Checkpointer sync save", "ckpt_sync"),
                       ("Checkpointer async save: blocking", "ckpt_async_blocking"),
                       ("Checkpointer async save: total", "ckpt_async_total")):
        print(f"{label:<34} {nb['shardckpt'] / 1e9:>7.3f} {sec[key]:>7.3f}")
    print(f"{'  (first async save, allocating)':<34} {'':>7} {r['first_async_blocking_s']:>7.3f}")
    print(f"{'dcp.async_save blocking, FS writer':<34} {nb['dcp'] / 1e9:>7.3f} {sec['dcp_async_blocking']:>7.3f}")
    print(f"{'dcp.async_save blocking, shardckpt':<34} {nb['dcp_sc'] / 1e9:>7.3f} {sec['dcp_sc_async_blocking']:>7.3f}")
    print("GB/s: model state bytes / s (the same work for all); disk GB/s: bytes written / s")
    print(f"{'ratio':<42} {'value':>6} {'target':>8} {'met':>4}")
    print(f"{'disk, 8 streams: write+fsync / read':<34} {'':>7} {'':>7} "
          f"{gb['disk_8_write']:>6.2f} / {gb['disk_8_read']:.2f} GB/s")
    labels = {"save_vs_disk_8": "save GB/s, shardckpt / disk 8 streams",
              "load_vs_disk_8": f"load {r['ranks']}->{r['load_ranks']} GB/s, shardckpt / disk 8 str.",
              "save_vs_dcp": "save GB/s, shardckpt / DCP",
              "save_vs_raw": "save GB/s, shardckpt / raw write",
              "load_vs_dcp": f"load {r['ranks']}->{r['load_ranks']} GB/s, shardckpt / DCP",
              "async_blocking_vs_sync": "async save blocking / sync save",
              "dcp_writer_vs_fs": "dcp.save GB/s, ShardckptWriter / FS",
              "dcp_reader_vs_fs": f"dcp.load {r['ranks']}->{r['load_ranks']} GB/s, Shardckpt / FS",
              "dcp_async_blocking_vs_fs": "dcp.async_save blocking, ours / FS",
              "digests_vs_plain": "save GB/s, with digests / without",
              "signed_vs_plain": "save GB/s, signed / without digests"}
    for k, label in labels.items():
        print(f"{label:<42} {r['ratios'][k]:>6.3f} {r['targets'][k]:>8} {'yes' if r['met'][k] else 'NO':>4}")
    ok = r["load_correct"]
    print(f"weights after the {r['ranks']}->{r['load_ranks']} load equal the saved ones (SHA-256): "
          f"shardckpt {'yes' if ok['shardckpt'] else 'NO'}, DCP {'yes' if ok['dcp'] else 'NO'}, "
          f"DCP via ShardckptReader {'yes' if ok['dcp_sc'] else 'NO'}")


if __name__ == "__main__":
    main()
