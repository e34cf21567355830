"""Start N local processes as torchrun would (gloo on 127.0.0.1), for the demo and examples.

Each child gets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``
and ``MASTER_PORT``, runs ``target(*args)`` and reports a JSON-serializable result through a
file (JSON, never a serialized Python object). The parent waits at most ``timeout_s``; if any rank fails, the
others are given a short grace period and then killed, and one error names the failed ranks.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import socket
import tempfile
import time
import traceback
from typing import Any, Callable, Sequence

from shardckpt.errors import CollectiveError


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _child(rank: int, world: int, port: int, target: Callable[..., Any], args: tuple, out: str,
           threads: int) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      OMP_NUM_THREADS=str(threads))
    try:
        import torch

        torch.set_num_threads(threads)
        value = target(*args)
        doc = {"ok": True, "value": value}
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        doc = {"ok": False, "error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()}
    with open(out + ".tmp", "w") as f:
        json.dump(doc, f)
    os.replace(out + ".tmp", out)
    try:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - exiting anyway
        pass
    os._exit(0 if doc["ok"] else 1)


def launch(target: Callable[..., Any], world_size: int, args: Sequence[Any] = (),
           timeout_s: float = 600.0, threads: int = 1) -> list[Any]:
    """Run ``target(*args)`` on ``world_size`` local ranks; return each rank's result."""
    ctx = mp.get_context("spawn")
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="shardckpt-launch-") as tmp:
        outs = [os.path.join(tmp, f"rank-{r}.json") for r in range(world_size)]
        procs = [ctx.Process(target=_child, args=(r, world_size, port, target, tuple(args), outs[r], threads))
                 for r in range(world_size)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout_s
        failed_at = None
        while time.monotonic() < deadline and any(p.is_alive() for p in procs):
            if failed_at is None and any(p.exitcode not in (None, 0) for p in procs):
                failed_at = time.monotonic()
            if failed_at is not None and time.monotonic() - failed_at > 30:
                break
            time.sleep(0.05)
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(5)
        results, failures = [], {}
        for r, path in enumerate(outs):
            try:
                with open(path) as f:
                    doc = json.load(f)
            except (OSError, ValueError):
                doc = {"ok": False, "error": f"exited with code {procs[r].exitcode} without a result"}
            if doc["ok"]:
                results.append(doc["value"])
            else:
                failures[r] = doc["error"]
                results.append(None)
        if failures:
            first = min(failures)
            raise CollectiveError(f"{len(failures)} of {world_size} ranks failed; rank {first}: "
                                  f"{failures[first]}", failures)
        return results
