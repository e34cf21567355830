"""Each rank's RNG states (Python, numpy, torch CPU and CUDA) as JSON data, and back: what a
Trainer checkpoint keeps per rank (:mod:`shardckpt.integrations.transformers`), never pickled."""

from __future__ import annotations

import random
from typing import Any
from collections.abc import Mapping

__all__ = ["rng_state", "set_rng_state"]


def rng_state() -> dict[str, Any]:
    """This process's RNG states as JSON data."""
    import numpy as np
    import torch

    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    out: dict[str, Any] = {
        "python": [version, list(internal), gauss],
        "numpy": [kind, [int(k) for k in keys], int(pos), int(has_gauss), float(cached)],
        "torch_cpu": torch.get_rng_state().tolist(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["torch_cuda"] = torch.cuda.get_rng_state().tolist()
    return out


def set_rng_state(state: Mapping[str, Any]) -> None:
    import numpy as np
    import torch

    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(torch.tensor(state["torch_cpu"], dtype=torch.uint8))
    if "torch_cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(torch.tensor(state["torch_cuda"], dtype=torch.uint8))
