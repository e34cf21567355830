"""Write the golden checkpoint of chunked tensors (format 1.2) in ``tests/golden/v1_2_chunked/``:
``torch.distributed.checkpoint.save`` from 2 gloo ranks through :class:`shardckpt.interop.dcp.storage.ShardckptWriter`
(run once; commit the files as-is; it refuses to overwrite them).

    python tests/golden/make_golden_chunked.py [DST]

The values are a pure function of :func:`golden_state`, so a fresh copy holds the same tensors;
only ``save_id``, ``created_at`` and the checksums that depend on them differ. It prints what
``tests/test_dcp_golden.py`` hard-codes.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
DST = HERE / "v1_2_chunked"
RANKS, CHUNK = 2, 4096


def golden_state(world: int | None = None) -> dict[str, Any]:
    """The saved values: with ``world``, as DTensors on a 1-D mesh of that size; else plain."""
    import torch

    full = {
        "w": torch.arange(30, dtype=torch.float32).reshape(6, 5) / 4,      # Shard(0): 3 + 3 rows
        "v": (torch.arange(24, dtype=torch.float32).reshape(4, 6) / 8).to(torch.bfloat16),  # Shard(1)
        "i": torch.arange(5, dtype=torch.int32) * 3,                       # Shard(0): 3 + 2
        "s": torch.tensor(7, dtype=torch.int64),                           # replicated scalar
    }
    sd: dict[str, Any] = {"t": full, "meta": {"lr": 0.5, "name": "golden"}}
    if world is None:
        return sd
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    place = {"w": Shard(0), "v": Shard(1), "i": Shard(0), "s": Replicate()}
    sd["t"] = {k: distribute_tensor(t, mesh, [place[k]]) for k, t in full.items()}
    return sd


def _save(rank: int, world: int, dst: str) -> None:
    import torch.distributed.checkpoint as dcp

    from shardckpt.interop.dcp.storage import ShardckptWriter

    dcp.save(golden_state(world), storage_writer=ShardckptWriter(dst, chunk_size=CHUNK,
                                                                 extras={"step": 3}))


def main() -> None:
    sys.path.insert(0, str(HERE.parent.parent))
    from testing.ranks import run_distributed

    from shardckpt.checkpoint.reader import CheckpointReader

    dst = Path(sys.argv[1]) if len(sys.argv) > 1 else DST
    if dst.exists():
        sys.exit(f"{dst} exists; the golden checkpoint is written once and never regenerated")
    run_distributed(_save, RANKS, args=(str(dst),))
    m = CheckpointReader(str(dst)).manifest
    print("save_id", m.save_id)
    for f in m.files:
        print("file", f.path, f.size, f"{f.crc32c:08x}")
    raw = (dst / "manifest.json").read_bytes()
    import crc32c

    print("manifest", len(raw), f"{crc32c.crc32c(raw):08x}")


if __name__ == "__main__":
    main()
