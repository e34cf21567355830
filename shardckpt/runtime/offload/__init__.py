"""ZeRO-Offload / ZeRO-Infinity: optimizer state and step in host memory (``"cpu"``) or in local
files (``"nvme"``), an option of :class:`~shardckpt.runtime.engine.ZeroEngine`.

- :mod:`~shardckpt.runtime.offload.config` — the validated settings (``offload_optimizer``, a
  mode or an :class:`OffloadConfig`, ``offload_dir``, ``offload_overlap_step``);
- :mod:`~shardckpt.runtime.offload.store` — :class:`OffloadStore`: the masters and state off the
  device, the host step group by group, and when it runs;
- :mod:`~shardckpt.runtime.offload.pipeline` — the step's pipeline: gradients in, step, weights
  out, group by group through a ring of two host slots;
- :mod:`~shardckpt.runtime.offload.host_step` — the host update on a pool of threads, slice by
  slice (the resident run's bits), or torch's fused CPU AdamW (opt-in, not bit-exact);
- :mod:`~shardckpt.runtime.offload.windows` — the ``"nvme"`` windows: read ahead, written back;
- :mod:`~shardckpt.runtime.offload.files` — the ``"nvme"`` files and :class:`OffloadedShard`, how
  checkpoints read and write them;
- :mod:`~shardckpt.runtime.offload.master` — the fp32 master kept in the store alone when the
  compute dtype is narrower;
- :mod:`~shardckpt.runtime.offload.attach` — the store between a sharded optimizer and its
  engine (the engine's reduction listener).

Same bits and same checkpoints as a resident run.
"""

from __future__ import annotations

from shardckpt.runtime.offload.config import MODES, OffloadConfig, check_offload
from shardckpt.runtime.offload.files import OffloadedShard, OffloadSnapshot
from shardckpt.runtime.offload.store import OffloadStore

__all__ = ["MODES", "OffloadConfig", "OffloadSnapshot", "OffloadStore", "OffloadedShard",
           "check_offload"]
