"""``ShardckptTrainer(consolidate_every=K)``: every K-th save of the process is also written as the
usual Hugging Face model folder (``model-*.safetensors`` + index + ``config.json``), for evaluation
harnesses that open a folder with ``from_pretrained``. Rank 0 consolidates the committed
checkpoint (:func:`shardckpt.tools.consolidate.consolidate`, streamed, bounded memory) into
``<consolidate_dir>/checkpoint-<step>`` (default ``<run>/hf``), in the dtype of the model's
parameters, as ``save_pretrained`` writes; the other ranks go on training.
"""

from __future__ import annotations

import logging
from typing import Any
from collections.abc import Mapping

from shardckpt.errors import ConfigError

log = logging.getLogger(__name__)

__all__ = ["check_every", "consolidate_step"]


def check_every(every: Any) -> int | None:
    """``consolidate_every``, checked: None (never) or an int >= 1."""
    if every is None:
        return None
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ConfigError(f"consolidate_every: {every!r}; expected an integer >= 1 (every K-th "
                          "save is also consolidated) or None")
    return every


def consolidate_step(url: str, dst: str, model: Any, storage_options: Mapping[str, Any]) -> str:
    """Consolidate the committed checkpoint ``url`` into ``dst`` (replacing an earlier one: a
    resumed run saves a step again); returns ``dst``."""
    from shardckpt.tools.consolidate import consolidate

    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    r = consolidate(url, dst, dtype=dtype, storage_options=storage_options, overwrite=True)
    log.info("consolidated %s -> %s (%d tensors, %s)", url, r.url, r.tensors, r.dtype)
    if not r.has_config:
        log.warning("%s: no config.json (the model has no Hugging Face config); pass a model "
                    "with .config, or consolidate again with --copy-from MODEL_FOLDER", r.url)
    return r.url
