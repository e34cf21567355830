"""Benchmark: how long the offline commands take to start, against the interpreter's own floor.

Whole-process wall time of ``shardckpt --help``, ``shardckpt inspect`` of a small local checkpoint
and ``shardckpt verify`` of it, each run ``--reps`` times interleaved with ``python -c pass`` (the
floor no Python command can beat), after one warm-up run each. Prints min / median / max and the
median over the floor.

    python bench/startup.py [--reps 10] [--workdir DIR] [--json]

Nothing here asserts; the import checks live in tests/test_startup.py.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import SHARDCKPT, ensure_bytecode  # noqa: E402

EXE = list(SHARDCKPT)


def wall(cmd: list[str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    ensure_bytecode()
    work = tempfile.mkdtemp(prefix="startup-", dir=args.workdir)
    try:
        ckpt = os.path.join(work, "ckpt")
        subprocess.run([*EXE, "synth", ckpt, "--params", "2M", "--ranks", "4"], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        commands = {
            "python -c pass": [sys.executable, "-c", "pass"],
            "shardckpt --help": [*EXE, "--help"],
            "shardckpt inspect CKPT": [*EXE, "inspect", ckpt],
            "shardckpt verify CKPT": [*EXE, "verify", ckpt],
        }
        times: dict[str, list[float]] = {name: [] for name in commands}
        for cmd in commands.values():  # warm-up: page cache, .pyc files
            wall(cmd)
        for _ in range(args.reps):
            for name, cmd in commands.items():
                times[name].append(wall(cmd))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    floor = sorted(times["python -c pass"])[len(times["python -c pass"]) // 2]
    rows = []
    for name, xs in times.items():
        xs = sorted(xs)
        med = xs[len(xs) // 2]
        rows.append({"command": name, "min_s": xs[0], "median_s": med, "max_s": xs[-1],
                     "over_floor": med / floor})
    if args.json:
        print(json.dumps({"reps": args.reps, "floor_s": floor, "command": EXE, "rows": rows}, indent=2))
        return
    print(f"whole-process wall time, median of {args.reps} interleaved runs")
    print(f"{'command':<26} {'min s':>7} {'median s':>9} {'max s':>7} {'x floor':>8}")
    for r in rows:
        print(f"{r['command']:<26} {r['min_s']:7.3f} {r['median_s']:9.3f} {r['max_s']:7.3f} "
              f"{r['over_floor']:8.2f}")


if __name__ == "__main__":
    main()
