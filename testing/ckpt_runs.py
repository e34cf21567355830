"""Several scenarios of different world sizes in one launch of :func:`testing.ranks.run_ranks`.

A launch costs a spawn, a ``torch`` import and a process group per rank; a test module whose
scenarios run one after another on 1 to N ranks launches N ranks once and moves them from one
default process group to the next::

    def job(rank: int, world: int, root: str) -> dict:      # launched on 3 ranks
        store = coordinator()
        out = {"three": scenario_a()}                       # the launcher's group, 3 ranks
        if new_world(store, "two", 2, rank):                # ranks 0 and 1: a group of 2 is next
            init_distributed(timeout_s=3.0)                 # (or dist.init_process_group)
            out["two"] = scenario_b()
        return out

:func:`new_world` destroys this process's default group (if any) and, for the ranks of the next
world, points the torchrun variables at a fresh port, which rank 0 picks and hands out through
the launcher's store (it outlives every group: a group that broke, or that this rank was never
part of, does not stop the next one). A scenario whose results must survive a rank that raises
or dies writes them with :func:`record`; the test reads them with :func:`records`.
"""

from __future__ import annotations

import datetime
import json
import os
from typing import Any

from shardckpt.training.launch import free_port, rank_env

__all__ = ["coordinator", "new_world", "record", "records"]

_PREFIX = "ckpt_runs/"


def coordinator(timeout_s: float = 300.0) -> Any:
    """A client of the launcher's store (``MASTER_ADDR``/``MASTER_PORT``, hosted by rank 0 for
    the whole launch); call it on every rank before :func:`new_world` changes those variables.
    The launch needs ``init_process_group=True`` (the launcher hosts the store then)."""
    import torch.distributed as dist

    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), None, False,
                         timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False)


def new_world(store: Any, name: str, world: int, rank: int) -> bool:
    """Leave the current default group; if ``rank < world``, set ``RANK``, ``WORLD_SIZE``,
    ``MASTER_PORT`` (and the rest of torchrun's variables) for the new group ``name`` of
    ``world`` ranks and return True (the caller initializes it). ``name`` is new each time."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    if rank == 0:
        store.set(_PREFIX + name, str(free_port()))
    if rank >= world:
        return False
    port = int(store.get(_PREFIX + name).decode())
    os.environ.update(rank_env(rank, world, port))
    return True


def flip_bit(folder: str, prefix: str, back: int = 100) -> str:
    """Flip the low bit of the byte ``back`` bytes before the end of the first file below
    ``folder`` whose name starts with ``prefix`` (its size still checks out, its checksums do
    not); its path."""
    path = next(os.path.join(d, f) for d, _, fs in os.walk(folder) for f in fs if f.startswith(prefix))
    with open(path, "r+b") as f:
        f.seek(-back, os.SEEK_END)
        b = f.read(1)
        f.seek(-back, os.SEEK_END)
        f.write(bytes([b[0] ^ 1]))
    return path


def record(root: str, name: str, rank: int, value: Any) -> None:
    """Write ``value`` (JSON) as ``name``'s record of ``rank`` under ``root``, atomically."""
    path = os.path.join(root, f"{name}-{rank}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(value, f)
    os.replace(path + ".tmp", path)


def records(root: str, name: str, ranks: range) -> list[Any]:
    """The records of ``ranks`` (None for a rank that wrote none)."""
    out = []
    for r in ranks:
        path = os.path.join(root, f"{name}-{r}.json")
        if os.path.exists(path):
            with open(path) as f:
                out.append(json.load(f))
        else:
            out.append(None)
    return out
