"""shardckpt: sharded checkpoints for ZeRO-3 / FSDP training.

The package is grouped by layer, lowest first; a layer imports only those below it:

- :mod:`shardckpt.format` — the on-disk format: layout math, the manifest, chunked tensors,
  safetensors headers. Pure; no I/O.
- :mod:`shardckpt.storage` — bytes: the backend for a URL (local, S3, any fsspec), checked ranged
  reads, streaming writes, retries, the commit and writer leases.
- :mod:`shardckpt.checkpoint` — one checkpoint as files: writing, reading, verifying, tensor
  pieces, run directories and ``latest``, the ranks' agreement. No torch at import.
- :mod:`shardckpt.interop` — Hugging Face, DCP and DeepSpeed in and out.
- :mod:`shardckpt.tools` — the offline tools (reshard, consolidate, diff, clean, inspect, estimate,
  synth) and their ``torchrun`` form. No torch at import.
- :mod:`shardckpt.training` — the training-loop side: save/load from a running job, the Checkpointer.
- :mod:`shardckpt.runtime` — the ZeRO-1/2/3 engine.
- :mod:`shardckpt.watch` — ``shardckpt watch``, the pipeline service.
- :mod:`shardckpt.integrations` — Hugging Face Trainer, Lightning and torchtitan glue.
- :mod:`shardckpt.hf` — ``transformers`` models and state dicts streamed from any checkpoint.
- :mod:`shardckpt.demo` — ``shardckpt demo``: the whole stack on local disk.

``tests/test_layers.py`` holds every module to this order.

The names most programs need are importable from here (lazily: ``import shardckpt`` costs nothing).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    "Checkpointer": "training.checkpointer",
    "LocalTier": "checkpoint.tiers",
    "CheckpointReader": "checkpoint.reader",
    "verify": "checkpoint.verify",
    "consolidate": "tools.consolidate",
    "diff": "tools.diff",
    "reshard": "tools.reshard",
    "synthesize": "tools.synth",
    "ShardckptReader": "interop.dcp.storage",
    "ShardckptWriter": "interop.dcp.storage",
    "DcpCheckpointer": "interop.dcp.checkpointer",
}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from shardckpt.checkpoint.reader import CheckpointReader as CheckpointReader
    from shardckpt.checkpoint.tiers import LocalTier as LocalTier
    from shardckpt.checkpoint.verify import verify as verify
    from shardckpt.interop.dcp.checkpointer import DcpCheckpointer as DcpCheckpointer
    from shardckpt.interop.dcp.storage import ShardckptReader as ShardckptReader
    from shardckpt.interop.dcp.storage import ShardckptWriter as ShardckptWriter
    from shardckpt.tools.consolidate import consolidate as consolidate
    from shardckpt.tools.diff import diff as diff
    from shardckpt.tools.reshard import reshard as reshard
    from shardckpt.tools.synth import synthesize as synthesize
    from shardckpt.training.checkpointer import Checkpointer as Checkpointer


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"shardckpt.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'shardckpt' has no attribute {name!r}")
