"""Start N local processes as torchrun would (gloo on 127.0.0.1), for the demo and examples.

Each child gets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``
and ``MASTER_PORT``, runs ``target(*args)`` and reports a JSON-serializable result through a
file (JSON, never a serialized Python object). The parent waits at most ``timeout_s``; if any rank fails, the
others are given a short grace period and then killed, and one error names the failed ranks.

The primitives underneath (:func:`free_port`, :func:`rank_env`, :func:`join_all`) are the ones
every local launcher of the project uses: the test launcher (``testing/ranks.py``) and the
training-step benchmark.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import socket
import tempfile
import time
import traceback
from multiprocessing.connection import wait
from typing import Any
from collections.abc import Callable, Sequence

from shardckpt.errors import CollectiveError

#: The rendezvous address of every local launch.
LOOPBACK = "127.0.0.1"
#: How long the other ranks may keep running after one rank failed, in :func:`launch`.
FAILURE_GRACE_S = 30.0


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((LOOPBACK, 0))
        return int(s.getsockname()[1])


def rank_env(rank: int, world_size: int, port: int) -> dict[str, str]:
    """The variables torchrun sets for ``rank`` of a one-node job rendezvousing on ``port``."""
    return dict(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR=LOOPBACK, MASTER_PORT=str(port))


def join_all(procs: Sequence[Any], timeout_s: float,
             failure_grace_s: float | None = None) -> list[int]:
    """Wait until every process in ``procs`` has exited, for at most ``timeout_s`` (and, with
    ``failure_grace_s``, at most that long after the first one exits with an error); then end
    the ones still running (terminate, kill after 5 s). Returns the indices of those."""
    deadline = time.monotonic() + timeout_s
    failed = False
    while True:
        alive = [p for p in procs if p.is_alive()]
        now = time.monotonic()
        if not alive or now >= deadline:
            break
        if failure_grace_s is not None and not failed and any(
                p.exitcode not in (None, 0) for p in procs):
            failed = True
            deadline = min(deadline, now + failure_grace_s)
        wait([p.sentinel for p in alive], timeout=max(0.0, deadline - now))
    hung = [i for i, p in enumerate(procs) if p.is_alive()]
    for i in hung:
        procs[i].terminate()
    for i in hung:
        procs[i].join(5)
        if procs[i].is_alive():
            procs[i].kill()
            procs[i].join()
    return hung


def _child(rank: int, world: int, port: int, target: Callable[..., Any], args: tuple, out: str,
           threads: int) -> None:
    os.environ.update(rank_env(rank, world, port), OMP_NUM_THREADS=str(threads))
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
        join_all(procs, timeout_s, failure_grace_s=FAILURE_GRACE_S)
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
