"""Shared benchmark helpers: run a command while sampling the RSS of its whole process tree."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import threading
import time
from typing import Any
from collections.abc import Sequence

import psutil


#: The ``shardckpt`` command as users run it: the console script installed beside this
#: interpreter, else ``python -m shardckpt`` (which runs the same entry point).
_SCRIPT = os.path.join(os.path.dirname(sys.executable), "shardckpt")
SHARDCKPT = [_SCRIPT] if os.access(_SCRIPT, os.X_OK) else [sys.executable, "-m", "shardckpt"]


def ensure_bytecode() -> None:
    """Write the ``.pyc`` files of shardckpt and its CLI, as an installed package has them, so a
    timed command does not compile its sources (with ``PYTHONDONTWRITEBYTECODE`` set, an editable
    checkout would otherwise compile them again in every process)."""
    import compileall

    import shardckpt
    import shardckpt.cli

    for pkg in (shardckpt, shardckpt.cli):
        for path in pkg.__path__:
            compileall.compile_dir(path, quiet=1)


def run_measured(cmd: Sequence[str], env: dict[str, str] | None = None) -> tuple[float, int]:
    """Run ``cmd``; return (wall seconds, peak RSS in bytes summed over the process tree)."""
    dt, peak, _ = _run(cmd, env, False)
    return dt, peak


def run_measured_json(cmd: Sequence[str], env: dict[str, str] | None = None) -> tuple[float, int, Any]:
    """:func:`run_measured` of a command that prints JSON; also returns the parsed output."""
    dt, peak, out = _run(cmd, env, True)
    return dt, peak, json.loads(out)


def _run(cmd: Sequence[str], env: dict[str, str] | None, capture: bool) -> tuple[float, int, bytes]:
    t0 = time.perf_counter()
    proc = subprocess.Popen(list(cmd), env={**os.environ, **(env or {})},
                            stdout=subprocess.PIPE if capture else subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    peak = 0
    stop = threading.Event()

    def sample() -> None:
        nonlocal peak
        try:
            root = psutil.Process(proc.pid)
        except psutil.NoSuchProcess:
            return
        while not stop.is_set():
            total = 0
            try:
                for p in [root, *root.children(recursive=True)]:
                    try:
                        total += p.memory_info().rss
                    except psutil.NoSuchProcess:
                        pass
            except psutil.NoSuchProcess:
                break
            peak = max(peak, total)
            time.sleep(0.01)

    th = threading.Thread(target=sample, daemon=True)
    th.start()
    out, err = proc.communicate()
    dt = time.perf_counter() - t0
    stop.set()
    th.join()
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}): {err.decode()[-2000:]}")
    return dt, peak, out or b""


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs)


def drop_tree(path: str) -> None:
    subprocess.run(["rm", "-rf", path], check=True)


def dir_bytes(path: str) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            total += os.path.getsize(os.path.join(root, f))
    return total
