"""A torchtitan-like DCP state and the helpers the single-process DCP suites
(``tests/test_dcp_import.py``, ``tests/test_dcp_streams.py``) save, load and compare it with."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp


def state(seed: int) -> dict[str, Any]:
    """A torchtitan-like layout: model, optimizer (AdamW after one step), scheduler, train state."""
    g = torch.Generator().manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Linear(5, 2)).to(torch.bfloat16)
    for p in model.parameters():
        p.data = torch.randn(p.shape, generator=g).to(p.dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3 * (seed + 1))
    model(torch.randn(4, 3, generator=g).to(torch.bfloat16)).float().pow(2).sum().backward()
    opt.step()
    return {"model": model.state_dict(), "optimizer": opt.state_dict(),
            "lr_scheduler": {"last_epoch": 3 + seed, "lrs": [0.5, 0.25 * seed]},
            "train_state": {"step": torch.tensor(7 + seed), "tokens": 1000 + seed},
            "extra": {"scale": torch.arange(6, dtype=torch.float32).reshape(2, 3) + seed}}


def dcp_save(sd: dict[str, Any], path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(sd, checkpoint_id=str(path))


def dcp_load(path: Path | None = None, reader: Any = None) -> dict[str, Any]:
    sd = state(1)  # other values everywhere: everything compared below was loaded
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if reader is not None:
            dcp.load(sd, storage_reader=reader)
        else:
            dcp.load(sd, checkpoint_id=str(path))
    return sd


def flat(sd: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(sd, dict):
        return {k: v for key, val in sd.items() for k, v in flat(val, f"{prefix}{key}.").items()}
    if isinstance(sd, (list, tuple)) and not all(isinstance(x, (int, float, str)) for x in sd):
        return {k: v for i, val in enumerate(sd) for k, v in flat(val, f"{prefix}{i}.").items()}
    return {prefix[:-1]: sd}


def assert_same(a: dict[str, Any], b: dict[str, Any]) -> None:
    fa, fb = flat(a), flat(b)
    assert set(fa) == set(fb)
    for k in fa:
        x, y = fa[k], fb[k]
        if isinstance(x, torch.Tensor):
            assert isinstance(y, torch.Tensor) and x.dtype == y.dtype and x.shape == y.shape, k
            assert torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8)), k
        else:
            assert x == y, k


def metadata(path: Path) -> Any:
    from shardckpt.interop.dcp.source import read_dcp_metadata
    from shardckpt.storage import Storage

    return read_dcp_metadata(Storage(str(path)))
