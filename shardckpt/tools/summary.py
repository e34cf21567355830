"""A checkpoint described as plain data (what `shardckpt inspect` prints). Pure."""

from __future__ import annotations

from typing import Any

from shardckpt.checkpoint.thin import components_held
from shardckpt.format.dtypes import itemsize
from shardckpt.format.manifest import Manifest
from shardckpt.format.records import param_groups, run_extras


def summarize(m: Manifest, url: str = "") -> dict[str, Any]:
    """Format version, mesh, step, what it holds (``holds``: weights, optimizer state or thinned,
    buffers, ...), components (groups, every parameter with its shape, dtype, unit and group, bytes
    per state kind), files."""
    source = url or "manifest.json"
    extras = run_extras(m, source)
    components: dict[str, Any] = {}
    for name, c in m.components.items():
        kinds: dict[str, dict[str, int]] = {}
        groups = []
        for g in c.layout.groups:
            for kind, dtype in c.states[g.name]:
                k = kinds.setdefault(kind, {"elements": 0, "bytes": 0})
                k["elements"] += g.numel
                k["bytes"] += g.padded_numel * itemsize(dtype)
            groups.append({"name": g.name, "unit": g.unit, "dtype": g.dtype,
                           "requires_grad": g.requires_grad, "params": len(g.params),
                           "numel": g.numel, "padded_numel": g.padded_numel,
                           "states": [k for k, _ in c.states[g.name]]})
        units = {g.name: g for g in c.layout.groups}
        params = [{"fqn": p.fqn, "shape": list(p.shape), "dtype": p.dtype, "numel": p.numel,
                   "group": p.group, "unit": units[p.group].unit,
                   "requires_grad": units[p.group].requires_grad} for p in c.layout.params]
        components[name] = {
            "parameters": len(c.layout.params),
            "params": params,
            "elements": sum(p.numel for p in c.layout.params),
            "trainable_elements": sum(g.numel for g in c.layout.groups if g.requires_grad),
            "groups": groups,
            "state_kinds": kinds,
            "aliases": dict(c.aliases),
            "buffers": [{"fqn": b.fqn, "shape": list(b.shape), "dtype": b.dtype} for b in c.buffers],
        }
    return {
        "url": url,
        "format_version": f"{m.version[0]}.{m.version[1]}",
        "save_id": m.save_id,
        "created_at": m.created_at,
        "mesh": {name: size for name, size in m.mesh.axes},
        "world_size": m.mesh.world_size,
        "step": extras.step,
        "extras": dict(m.extras),
        "optimizer": None if m.optimizer is None else {
            "name": m.optimizer.name,
            "param_groups": [{"params": len(pg.params), "hparams": dict(pg.hparams), "step": pg.step}
                             for pg in param_groups(m.optimizer, source)],
        },
        "per_rank_state": dict(m.per_rank_state),
        "holds": components_held(m),
        "components": components,
        "chunked": None if m.chunked is None else _chunked(m),
        "files": [{"path": f.path, "role": f.role, "size": f.size, "crc32c": f"{f.crc32c:08x}"}
                  for f in m.files],
        "total_bytes": m.total_bytes,
    }


def _chunked(m: Manifest) -> dict[str, Any]:
    """Chunked tensors (shape, dtype, chunks) and blobs (sizes only: their bytes are opaque)."""
    assert m.chunked is not None
    tensors = [{"fqn": t.fqn, "shape": list(t.shape), "dtype": t.dtype, "numel": t.numel,
                "bytes": t.nbytes, "chunks": len(t.chunks)} for t in m.chunked.tensors.values()]
    return {
        "tensors": tensors,
        "elements": sum(t["numel"] for t in tensors),
        "tensor_bytes": sum(t["bytes"] for t in tensors),
        "blobs": [{"key": b.key, "bytes": b.nbytes} for b in m.chunked.blobs.values()],
    }

