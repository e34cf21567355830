"""Tiny checkpoints for tests: pure manifests built from a spec, small synthetic checkpoints on
disk."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from shardckpt.checkpoint.writer import CheckpointSpec, shard_file_name
from shardckpt.format.manifest import (
    VERSION, FileEntry, Manifest, buffer_slots, shard_slots, to_json,
)
from shardckpt.format.safetensors_header import build_header
from shardckpt.tools.synth import synth_spec, synthesize

TINY_PARAMS = 3000  # d=8, ff=24, V=256: ~3.8k elements, ~24 KB per shard at 2 ranks


def manifest_from_spec(spec: CheckpointSpec, save_id: str = "20250101T000000Z-0123abcd",
                       rank_files: int = 0, seed: int = 0) -> Manifest:
    """A valid manifest for ``spec`` without writing anything: sizes from the real headers,
    checksums random (parsing cannot check them)."""
    rnd = random.Random(seed)
    S = spec.mesh.shard_degree
    slots = shard_slots(spec.components, spec.mesh)
    bslots = buffer_slots(spec.components)

    def entry(path: str, role: str, index: int | None, header: bytes, data: int) -> FileEntry:
        size = len(header) + data
        n_chunks = -(-size // spec.chunk_size)
        return FileEntry(path, role, size, len(header) - 8, rnd.getrandbits(32),
                         tuple(rnd.getrandbits(32) for _ in range(n_chunks)), index)

    files = []
    for r in range(S):
        h = build_header(slots, {"format": "shardckpt", "shard": str(r)})
        files.append(entry(shard_file_name(save_id, r, S), "shard", r, h, slots[-1].end if slots else 0))
    if bslots:
        files.append(entry(f"{save_id}/buffers.safetensors", "buffers", None,
                           build_header(bslots), bslots[-1].end))
    for r in range(rank_files):
        files.append(entry(f"{save_id}/rank-{r:05d}.safetensors", "rank", r, build_header([]), 0))
    return Manifest(VERSION, save_id, "2025-01-01T00:00:00Z", spec.mesh, spec.chunk_size,
                    dict(spec.components), spec.optimizer, dict(spec.extras),
                    dict(spec.per_rank_state), tuple(files))


def manifest_doc_of_tiny() -> dict[str, Any]:
    """The JSON document of a small valid manifest (2 shards, buffers, one rank file), to mutate."""
    return json.loads(to_json(manifest_from_spec(synth_spec(TINY_PARAMS, 2), rank_files=1)))


def make_ckpt(root: Path, name: str = "ckpt", ranks: int = 2, chunk_size: int | None = 4096,
              seed: int = 1) -> tuple[str, Manifest]:
    path = str(root / name)
    return path, synthesize(path, TINY_PARAMS, ranks, seed=seed, chunk_size=chunk_size)


def make_run_dir(run: Path, steps: tuple[int, ...] = (100, 200)) -> Path:
    """A run directory with one committed tiny checkpoint per step, ``run/step-%08d`` (2 ranks,
    seeded by the step), and no ``latest``; returns ``run``."""
    for s in steps:
        synthesize(str(run / f"step-{s:08d}"), TINY_PARAMS, 2, step=s, seed=s)
    return run


def flat_state(ckpt: str, fqn: str, kind: str) -> Any:
    """One parameter's ``kind`` state, assembled shard by shard from a flat-group checkpoint."""
    import numpy as np
    import torch

    from shardckpt.checkpoint.reader import CheckpointReader

    r = CheckpointReader(ckpt)
    lay = r.manifest.components["model"].layout
    p = next(q for q in lay.params if q.fqn == fqn)
    g = lay.group(p.group)
    parts = []
    for s in range(r.manifest.mesh.shard_degree):
        lo, hi = lay.shard_range(g, s)
        a, b = max(lo, p.offset), min(hi, p.offset + p.numel)
        if a < b:
            parts.append(np.frombuffer(bytes(r.read_state(s, g.name, kind, a - lo, b - lo)), np.float32))
    return torch.from_numpy(np.concatenate(parts).reshape(p.shape))
