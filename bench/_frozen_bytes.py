"""Bytes a fine-tuning save writes when the frozen base is referenced, not rewritten.

    python bench/_frozen_bytes.py [--dim 512] [--layers 4] [--rank 16]

A frozen base (``layers`` linear layers of ``dim`` x ``dim``, fp32) and a trainable low-rank
adapter (``dim`` x ``rank`` and ``rank`` x ``dim``, AdamW), saved twice by the ``Checkpointer`` in
one process, the adapter trained in between. The figure, :func:`frozen_bytes_over_full`, is the
bytes the second save wrote (every file under its save directory, and its manifest) over the
bytes of the first, a full save of the same state; the first save writes the frozen files the
second references. Counted from the files on disk, not from the manifests.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from typing import Any


def _written(ckpt: str) -> int:
    """Bytes of every file below the checkpoint directory ``ckpt`` (its save directories and
    its manifest): what the save that made it wrote."""
    total = 0
    for here, _, names in os.walk(ckpt):
        total += sum(os.path.getsize(os.path.join(here, n)) for n in names)
    return total


def measure(dim: int = 512, layers: int = 4, rank: int = 16) -> dict[str, Any]:
    """Save a frozen base with a small adapter twice; the bytes each save wrote."""
    import torch
    from torch import nn

    from shardckpt.runtime import ShardedAdamW, ZeroEngine, decay_param_groups
    from shardckpt.runtime.mesh import ProcessMesh
    from shardckpt.training.checkpointer import Checkpointer

    class Tuned(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.base = nn.Sequential(*(nn.Linear(dim, dim) for _ in range(layers)))
            self.down = nn.Linear(dim, rank, bias=False)
            self.up = nn.Linear(rank, dim, bias=False)
            self.base.requires_grad_(False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.base(x)
            return h + self.up(self.down(h))

    torch.manual_seed(0)
    engine = ZeroEngine(Tuned(), process_mesh=ProcessMesh.single())
    opt = ShardedAdamW(engine, decay_param_groups(engine, 0.0), lr=1e-3)
    shards = engine.local_shards()
    frozen = sum(t.numel() * t.element_size() for g in engine.layout.groups if not g.requires_grad
                 for t in shards[g.name].values())
    with tempfile.TemporaryDirectory(prefix="shardckpt-frozen-") as root:
        ckpt = Checkpointer(os.path.join(root, "run"), engine, keep_last=2)
        sizes = []
        for step in (1, 2):
            x = torch.randn(4, dim, generator=torch.Generator().manual_seed(step))
            engine(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            ckpt.save(step)
            sizes.append(_written(ckpt.manager.url_for(step)))
        ckpt.close()
    state = sum(t.numel() * t.element_size() for kinds in shards.values() for t in kinds.values())
    return {"full_bytes": sizes[0], "second_bytes": sizes[1], "frozen_state_bytes": frozen,
            "state_bytes": state, "frozen_share": frozen / state, "ratio": sizes[1] / sizes[0]}


def frozen_bytes_over_full() -> float:
    """Bytes written by the second save over the bytes of a full save (target: at most 0.1)."""
    return float(measure()["ratio"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--rank", type=int, default=16)
    a = ap.parse_args()
    print(json.dumps(measure(a.dim, a.layers, a.rank), indent=1))


if __name__ == "__main__":
    main()
