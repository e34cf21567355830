"""Loading Hugging Face weights into an engine, under its first documented import path: ``load_hf``
is in :mod:`shardckpt.training.hf_load`, ``skip_weight_init`` in :mod:`shardckpt.runtime.init`."""

from __future__ import annotations

from shardckpt.runtime.init import skip_weight_init
from shardckpt.training.hf_load import HFLoadResult, load_hf

__all__ = ["HFLoadResult", "load_hf", "skip_weight_init"]
