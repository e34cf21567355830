"""The running part of ``bench/report.py``: the machine, the commands, the torchrun benchmark."""

from __future__ import annotations

import json
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
TORCHRUN_FROM, TORCHRUN_TO = 64, 16


def machine_info() -> dict[str, Any]:
    """CPU model, logical CPU count and RAM, read from /proc where there is one."""
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    ram_gib = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                ram_gib = round(int(line.split()[1]) * 1024 / 2**30, 1)
                break
    except OSError:
        pass
    return {"cpu": model, "cpus": os.cpu_count(), "ram_gib": ram_gib,
            "python": platform.python_version(), "os": platform.system()}


def parse_json_output(text: str) -> Any:
    """The JSON document a ``--json`` run printed (anything before it is skipped)."""
    starts = [i for i in (text.find("{"), text.find("[")) if i >= 0]
    if not starts:
        raise ValueError("no JSON in the output")
    return json.loads(text[min(starts):])


def run_json(cmd: list[str], timeout: float = 3600) -> Any:
    print("+", shlex.join(cmd), flush=True)
    t = time.perf_counter()
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    if p.returncode != 0:
        raise RuntimeError(f"{shlex.join(cmd)} failed ({p.returncode}):\n{p.stderr[-4000:]}")
    print(f"  {time.perf_counter() - t:.1f} s", flush=True)
    return parse_json_output(p.stdout)


def run_timed(cmd: list[str], timeout: float = 3600) -> float:
    print("+", shlex.join(cmd), flush=True)
    t = time.perf_counter()
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    dt = time.perf_counter() - t
    if p.returncode != 0:
        raise RuntimeError(f"{shlex.join(cmd)} failed ({p.returncode}):\n{p.stderr[-4000:]}")
    print(f"  {dt:.1f} s", flush=True)
    return dt


def torchrun_speedup(work: str, plan: dict[str, Any]) -> dict[str, Any]:
    """Wall time of ``torchrun -m shardckpt reshard`` against its process count, one checkpoint."""
    src, dst = os.path.join(work, "torchrun-src"), os.path.join(work, "torchrun-dst")
    shutil.rmtree(src, ignore_errors=True)
    run_timed([sys.executable, "-m", "shardckpt", "synth", src, "--params", plan["torchrun_params"],
               "--ranks", str(TORCHRUN_FROM), "--units", "8"])
    nbytes = sum(f.stat().st_size for f in Path(src).rglob("*") if f.is_file())
    torchrun = [sys.executable, "-m", "torch.distributed.run"]
    seconds: dict[int, list[float]] = {k: [] for k in plan["torchrun_procs"]}
    inner: dict[int, list[float]] = {k: [] for k in plan["torchrun_procs"]}
    try:
        for _ in range(plan["torchrun_reps"]):
            for k in plan["torchrun_procs"]:  # interleaved across repetitions
                shutil.rmtree(dst, ignore_errors=True)
                t = time.perf_counter()
                out = run_json([*torchrun, "--standalone", "--nproc_per_node", str(k), "-m", "shardckpt",
                                "reshard", src, dst, "--to", str(TORCHRUN_TO), "--json"])
                seconds[k].append(time.perf_counter() - t)
                inner[k].append(out["seconds"])  # what the job reports: without start-up
    finally:
        shutil.rmtree(dst, ignore_errors=True)
        shutil.rmtree(src, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in seconds.items()}
    med_in = {k: statistics.median(v) for k, v in inner.items()}
    k0 = plan["torchrun_procs"][0]
    return {"params": plan["torchrun_params"], "from": TORCHRUN_FROM, "to": TORCHRUN_TO,
            "bytes": nbytes, "reps": plan["torchrun_reps"],
            "rows": [{"procs": k, "seconds": round(med[k], 3), "speedup": round(med[k0] / med[k], 3),
                      "gbps": round(nbytes / 1e9 / med[k], 3), "in_process_s": round(med_in[k], 3),
                      "in_process_speedup": round(med_in[k0] / med_in[k], 3)}
                     for k in plan["torchrun_procs"]]}
