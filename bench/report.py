"""Run the benchmarks and write a report: ``docs/benchmarks.md`` plus PNG plots in ``docs/bench/``.

    python bench/report.py [--quick] [--out docs] [--workdir DIR] [--results FILE]

Each benchmark runs as its own subprocess with ``--json``, one after the other (so they do not
disturb each other). The numbers collected are written to ``WORKDIR/results.json``; ``--results``
renders a report from such a file without running anything. ``--quick`` uses small sizes and few
repetitions (a few minutes on a 2-core machine): its numbers show the shape, not the final figures.
The S3 benchmark (``bench/s3.py``, through ``report_s3.py``) starts a local Ceph RGW, or moto's S3
where Ceph is not installed; the report names the server.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

from report_plots import PLOT_TITLES, PLOTS, machine_line, md_table, pairs  # noqa: E402
from report_run import machine_info, run_json, torchrun_speedup  # noqa: E402
from report_s3 import S3_TITLE, plot_s3, run_s3, s3_note, s3_table, s3_targets  # noqa: E402

# What each mode runs. Sizes in GB: checkpoint bytes for reshard, fp32 weights for consolidate.
PLANS: dict[str, dict[str, Any]] = {
    "full": {
        "sizes": [0.25, 0.5, 1.0, 2.0, 4.0], "reshard_reps": 3, "consolidate_reps": 3, "startup_reps": 10,
        "save_load": ["--params", "125M", "--reps", "7", "--ranks", "4"], "load_ranks": [1, 2, 4],
        "train_ranks": [2, 4], "train": [],
        "torchrun_procs": [1, 2, 4], "torchrun_params": "250M", "torchrun_reps": 3,
    },
    "quick": {
        "sizes": [0.25, 0.5], "reshard_reps": 2, "consolidate_reps": 1, "startup_reps": 5,
        "save_load": ["--params", "10M", "--reps", "2", "--ranks", "2", "--settle", "0.5"],
        "load_ranks": [1, 2],
        "train_ranks": [2, 4],
        "train": ["--layers", "2", "--hidden", "256", "--intermediate", "512", "--heads", "4",
                  "--kv-heads", "2", "--vocab", "4096", "--seq", "64", "--steps", "3"],
        "torchrun_procs": [1, 2], "torchrun_params": "80M", "torchrun_reps": 2,
    },
}
RESHARD_TARGET_SIZES = (0.5, 1.0, 2.0)


def collect(mode: str, work: str) -> dict[str, Any]:
    plan = PLANS[mode]
    py = sys.executable
    sizes = ",".join(str(s) for s in plan["sizes"])
    out: dict[str, Any] = {"mode": mode, "plan": plan, "seconds": {}}

    def stage(name: str, fn):
        t = time.perf_counter()
        out[name] = fn()
        out["seconds"][name] = round(time.perf_counter() - t, 1)

    stage("startup", lambda: run_json([py, str(HERE / "startup.py"), "--reps", str(plan["startup_reps"]),
                                       "--json"]))
    stage("reshard", lambda: run_json([py, str(HERE / "reshard.py"), "--sizes", sizes, "--reps",
                                       str(plan["reshard_reps"]), "--workdir",
                                       os.path.join(work, "reshard"), "--json"]))
    shutil.rmtree(os.path.join(work, "reshard"), ignore_errors=True)
    stage("consolidate", lambda: run_json([py, str(HERE / "consolidate.py"), "--sizes", sizes,
                                           "--reps", str(plan["consolidate_reps"]), "--workdir",
                                           os.path.join(work, "consolidate"), "--json"]))
    stage("save_load", lambda: {str(k): run_json([py, str(HERE / "save_load.py"), *plan["save_load"],
                                                  "--load-ranks", str(k), "--workdir",
                                                  os.path.join(work, f"save-load-{k}"), "--json"])
                                for k in plan["load_ranks"]})
    stage("train_step", lambda: {str(r): run_json([py, str(HERE / "train_step.py"), "--ranks", str(r),
                                                   *plan["train"], "--json"])
                                 for r in plan["train_ranks"]})
    stage("torchrun", lambda: torchrun_speedup(work, plan))
    stage("s3", lambda: run_s3(mode, run_json))
    return out


# --------------------------------------------------------------------------------------------
# the pure part: numbers -> tables, verdicts, plots


def _met(value: float, op: str, bound: float) -> bool:
    return value >= bound if op == ">=" else value <= bound


def targets(res: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per ratio with a target: name, value, target, met, and why where not met."""
    out: list[dict[str, Any]] = []

    def add(name: str, value: float, op: str, bound: float, why: str = "", beside: str = "") -> None:
        met = _met(value, op, bound)
        out.append({"name": name, "value": round(value, 3), "target": f"{op} {bound:g}", "met": met,
                    "beside": beside, "why": "" if met else why})

    sizes = res.get("plan", {}).get("sizes") or []
    for requested, row in zip(sizes, res.get("reshard", {}).get("rows", []), strict=False):
        if float(requested) not in RESHARD_TARGET_SIZES:
            continue
        startup = row["reshard_s"] - row["reshard_in_process_s"]
        why = (f"end to end the interpreter's start-up and imports ({startup:.2f} s) are "
               f"{startup / row['reshard_s']:.0%} of the {row['reshard_s']:.2f} s run")
        if row["ratio_in_process"] < 0.9:
            why += f"; the reshard alone ({row['ratio_in_process']:.3f}) is also under the target here"
        add(f"reshard {requested:g} GB vs cp -r + sync (speed)", row["ratio"], ">=", 0.9, why,
            beside=f"in-process {row['ratio_in_process']:.3f}")
    for requested, row in zip(sizes, res.get("consolidate", {}).get("rows", []), strict=False):
        why = (f"the call takes {row['shardckpt_call_s']:.3f} s against DCP's {row['dcp_call_s']:.3f} s "
               f"at this size")
        beside = f"whole command {row['ratio']:.3f}"
        if "durable_call_ratio" in row:
            beside += f"; vs DCP's call + fsync {row['durable_call_ratio']:.3f}"
            why += (f"; DCP leaves its output in the page cache ({row['dcp_durable_call_s']:.3f} s "
                    "with an fsync of each file, as shardckpt makes its own durable)")
        add(f"consolidate {requested:g} GB vs DCP library call (speed)", row["call_ratio"], ">=", 2.0,
            why, beside=beside)
        if "disk_ratio" in row:
            add(f"consolidate {requested:g} GB vs the disk's limit (speed)", row["disk_ratio"], ">=", 0.8,
                f"{row['shardckpt_call_s']:.3f} s against {row['limit_call_s']:.3f} s to read the weights' "
                "bytes once, write them once and fsync")
    startup = res.get("startup", {})
    for row in startup.get("rows", []):
        if row["command"] in ("shardckpt --help", "shardckpt inspect CKPT"):
            add(f"`{row['command']}` start-up (time, s)", row["median_s"], "<=", 0.25,
                f"median of {startup.get('reps')} whole-process runs; `python -c pass` takes "
                f"{startup.get('floor_s', 0):.3f} s here")
    runs = res.get("save_load", {})
    if runs:
        # Save-side ratios from the first run (every run saves the same way); load per world size.
        first = runs[sorted(runs, key=int)[0]]
        r = first["ratios"]
        sec = first["seconds"]
        small = f"{first['params'] / 1e6:.0f}M-parameter model, {first['reps']} repetition(s)"
        add("save vs DCP (speed)", r["save_vs_dcp"], ">=", 1.0,
            f"{sec['save_shardckpt']:.3f} s against DCP's {sec['save_dcp']:.3f} s ({small})")
        add("save vs raw write (speed)", r["save_vs_raw"], ">=", 0.8,
            f"{sec['save_shardckpt']:.3f} s against {sec['save_raw']:.3f} s for the raw write (each "
            f"rank's shard bytes written to one file, no metadata or checksums; {small})")
        add("async save blocking vs sync save (time)", r["async_blocking_vs_sync"], "<=", 0.1,
            f"{sec['ckpt_async_blocking']:.3f} s blocking of a {sec['ckpt_sync']:.3f} s sync save "
            f"({small})")
        for k in sorted(runs, key=int):
            s = runs[k]["seconds"]
            add(f"load on {k} rank(s) vs DCP (speed)", runs[k]["ratios"]["load_vs_dcp"], ">=", 1.0,
                f"{s['load_shardckpt']:.3f} s against DCP's {s['load_dcp']:.3f} s ({small})")
    for ranks, rows in sorted(res.get("train_step", {}).items(), key=lambda kv: int(kv[0])):
        for row in rows:
            if row["side"] != "shardckpt":
                continue
            add(f"train step {ranks} ranks {row['precision']} vs FSDP2 (time)", row["ratio"], "<=", 1.0,
                f"{row['median_s']:.3f} s a step; paired steps give {row['paired_ratio']:.3f} "
                "(the ranks share the machine's cores)",
                beside=f"paired {row['paired_ratio']:.3f}")
    for name, value, op, bound, why, beside in s3_targets(res.get("s3")):
        add(name, value, op, bound, why, beside)
    return out


def targets_table(rows: list[dict[str, Any]]) -> str:
    return md_table(["ratio", "value", "target", "met", "beside it", "why not met"],
                    [[t["name"], t["value"], t["target"], "yes" if t["met"] else "**no**", t["beside"],
                      t["why"]] for t in rows])


def plot_tables(res: dict[str, Any]) -> dict[str, str]:
    """The table under each plot, by plot name."""
    tables: dict[str, str] = {}
    sizes = res.get("plan", {}).get("sizes") or []
    rs = res.get("reshard", {}).get("rows", [])
    cs = res.get("consolidate", {}).get("rows", [])
    tables["throughput"] = (
        md_table(["size GB (asked)", "checkpoint GB", "reshard GB/s", "cp -r + sync GB/s", "ratio",
                  "in-process ratio"],
                 [[s, r["size_gb"], r["reshard_gbps"], r["copy_gbps"], r["ratio"], r["ratio_in_process"]]
                  for s, r in zip(sizes, rs, strict=False)])
        + "\n\n" +
        md_table(["fp32 weights GB", "shardckpt GB/s", "DCP GB/s", "ratio (command)",
                  "shardckpt call s", "DCP call s", "ratio (library call)"],
                 [[r["weights_gb"], r["shardckpt_gbps"], r["dcp_gbps"], r["ratio"], r["shardckpt_call_s"],
                   r["dcp_call_s"], r["call_ratio"]] for r in cs])
        + "\n\n" +
        md_table(["fp32 weights GB", "shardckpt call s", "disk limit s", "disk GB/s", "of the disk's limit"],
                 [[r["weights_gb"], r["shardckpt_call_s"], r.get("limit_call_s", ""), r.get("limit_gbps", ""),
                   r.get("disk_ratio", "")] for r in cs]))
    tables["rss"] = (
        md_table(["checkpoint GB", "reshard MB", "cp -r MB"],
                 [[r["size_gb"], r["reshard_peak_rss_mb"], r["copy_peak_rss_mb"]] for r in rs])
        + "\n\n" +
        md_table(["fp32 weights GB", "shardckpt consolidate MB", "DCP consolidate MB"],
                 [[r["weights_gb"], r["shardckpt_peak_rss_mb"], r["dcp_peak_rss_mb"]] for r in cs]))
    runs = res.get("save_load", {})
    tables["load"] = md_table(
        ["load ranks", "shardckpt s", "DCP s", "DCP + shardckpt reader s", "ratio vs DCP (speed)",
         "weights equal"],
        [[int(k), v["seconds"]["load_shardckpt"], v["seconds"]["load_dcp"], v["seconds"]["load_dcp_sc"],
          v["ratios"]["load_vs_dcp"], v["load_correct"]["shardckpt"]]
         for k, v in sorted(runs.items(), key=lambda kv: int(kv[0]))])
    if runs:
        first = runs[sorted(runs, key=int)[0]]
        sec, gb = first["seconds"], first["gbps"]
        tables["load"] += "\n\nSave side (" + f"{first['ranks']} ranks, {first['params'] / 1e6:.1f}M params):\n\n" + \
            md_table(["variant", "s", "GB/s"],
                     [["shardckpt save", sec["save_shardckpt"], gb["save_shardckpt"]],
                      ["DCP save", sec["save_dcp"], gb["save_dcp"]],
                      ["raw write", sec["save_raw"], gb["save_raw"]],
                      ["shardckpt sync save", sec["ckpt_sync"], ""],
                      ["shardckpt async save, blocking", sec["ckpt_async_blocking"], ""]])
    tables["train"] = md_table(
        ["ranks", "precision", "shardckpt s", "FSDP2 s", "ratio", "paired ratio"],
        [[int(k), a["precision"], a["median_s"], b["median_s"], a["ratio"], a["paired_ratio"]]
         for k, rows in sorted(res.get("train_step", {}).items(), key=lambda kv: int(kv[0]))
         for a, b in pairs(rows)])
    tr = res.get("torchrun", {})
    tables["torchrun"] = md_table(["processes", "command s", "speed-up", "GB/s", "reshard alone s",
                                   "speed-up (reshard alone)"],
                                  [[r["procs"], r["seconds"], r["speedup"], r["gbps"], r["in_process_s"],
                                    r["in_process_speedup"]] for r in tr.get("rows", [])])
    return tables


def render_markdown(res: dict[str, Any], meta: dict[str, Any], images: dict[str, str]) -> str:
    quick = res.get("mode") == "quick"
    tables = plot_tables(res)
    trows = targets(res)
    met = sum(t["met"] for t in trows)
    lines = [
        "# Benchmarks" + (" (quick run)" if quick else ""),
        "",
        f"- Machine: {machine_line(meta)}; Python {meta['machine'].get('python', '')}",
        f"- Date: {meta['date']}",
        f"- Command: `{meta['command']}`",
        f"- Wall time of the whole run: {meta.get('wall_s', 0):.0f} s",
        "",
    ]
    if quick:
        lines += ["This is a **quick** run: small sizes, few repetitions, small models. Fixed costs "
                  "(interpreter start-up, process groups, metadata) weigh far more than at real sizes, "
                  "so read it for the shape of the curves; run `python bench/report.py` (without "
                  "`--quick`) for the figures the targets are meant for.", ""]
    lines += ["Speed ratios are shardckpt's speed over the other's (higher is better); time ratios "
              "are shardckpt's time over the other's (lower is better).", "",
              f"## Targets ({met} of {len(trows)} met)", "", targets_table(trows), ""]
    tr = res.get("torchrun", {})
    notes = {
        "throughput": "Reshard: checkpoint bytes read and written per second, the whole command (with "
                      "interpreter start-up) and the reshard alone (in-process). Consolidate: fp32 weight "
                      "bytes per second; a shardckpt checkpoint holds about 3x that (master + moments).",
        "rss": "Peak resident memory of each command. shardckpt's reshard reads through bounded "
               "buffers (`--buffer`, 32 MB by default).",
        "load": "Saved once per run on the same ranks, then loaded on the number of ranks shown "
                "(resharding on load); medians of the repetitions.",
        "train": "Llama-shaped model; ratio of median step times; the paired ratio is the median of the "
                 "ratios of back-to-back steps, robust to a neighbour slowing a stretch of steps.",
        "torchrun": (f"One synthetic checkpoint ({tr.get('params', '')} parameters, "
                     f"{tr.get('bytes', 0) / 1e9:.2f} GB) resharded {tr.get('from', '')} -> {tr.get('to', '')} "
                     "ranks by `torchrun --standalone --nproc_per_node K -m shardckpt reshard`: the "
                     "whole command (with torchrun's and the interpreters' start-up) and the reshard "
                     f"alone as the job reports it; the processes share "
                     f"{meta['machine'].get('cpus')} CPUs and one disk."),
    }
    for i, name in enumerate(PLOTS, 1):
        lines += [f"## {i}. {PLOT_TITLES[name]}", ""]
        if name in images:
            lines += [f"![{PLOT_TITLES[name]}]({images[name]})", ""]
        lines += [notes[name], "", tables[name], ""]
    if "s3" in res:
        lines += [f"## {len(PLOTS) + 1}. {S3_TITLE}", ""]
        if "s3" in images:
            lines += [f"![{S3_TITLE}]({images['s3']})", ""]
        lines += [s3_note(res["s3"]), "", s3_table(res["s3"]), ""]
    stages = res.get("seconds", {})
    if stages:
        lines += ["## Time per benchmark", "",
                  md_table(["benchmark", "s"], [[k, v] for k, v in stages.items()]), ""]
    return "\n".join(lines)


def write_report(res: dict[str, Any], meta: dict[str, Any], out: Path) -> Path:
    img_dir = out / "bench"
    img_dir.mkdir(parents=True, exist_ok=True)
    images = {}
    for name, fn in PLOTS.items():
        path = img_dir / f"{name}.png"
        fn(res, meta, path)
        images[name] = f"bench/{path.name}"
    if "s3" in res:
        plot_s3(res, meta, img_dir / "s3.png")
        images["s3"] = "bench/s3.png"
    md = out / "benchmarks.md"
    kept = hand_written(md)
    body = render_markdown(res, meta, images)
    if kept:  # under the page's own title: the report is its last section
        body = body.replace("# Benchmarks", "# The full report", 1)
    md.write_text(kept + body)
    return md


#: The line above which ``benchmarks.md`` is written by hand; a new report replaces only what follows.
GENERATED = "<!-- bench/report.py writes everything below this line and keeps what is above it -->"


def hand_written(md: Path) -> str:
    """What an existing ``md`` holds above :data:`GENERATED`, with the line ('' if none)."""
    text = md.read_text() if md.exists() else ""
    return text[:text.index(GENERATED) + len(GENERATED)] + "\n\n" if GENERATED in text else ""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small sizes, few repetitions (minutes)")
    ap.add_argument("--out", default="docs", help="where benchmarks.md and bench/*.png go")
    ap.add_argument("--workdir", default=None, help="scratch space for checkpoints (default: a temp dir)")
    ap.add_argument("--results", default=None, help="render this results.json instead of running")
    args = ap.parse_args()
    if args.results:
        saved = json.loads(Path(args.results).read_text())
        res, meta = saved["results"], saved["meta"]
    else:
        mode = "quick" if args.quick else "full"
        own = args.workdir is None
        work = args.workdir or tempfile.mkdtemp(prefix="shardckpt-report-")
        os.makedirs(work, exist_ok=True)
        shown = ["python", "bench/report.py", *(["--quick"] if args.quick else [])]
        meta = {"machine": machine_info(), "command": shlex.join(shown),
                "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}
        t = time.perf_counter()
        try:
            res = collect(mode, work)
        finally:
            meta["wall_s"] = round(time.perf_counter() - t, 1)
        results_path = Path(work, "results.json")
        results_path.write_text(json.dumps({"meta": meta, "results": res}, indent=2))
        print(f"numbers: {results_path}")
        if own:
            for p in Path(work).iterdir():
                if p.name != "results.json":
                    shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink()
    md = write_report(res, meta, Path(args.out))
    print(f"report: {md}")


if __name__ == "__main__":
    main()
