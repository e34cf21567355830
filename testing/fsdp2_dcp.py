"""shardckpt as DCP's storage layer under real FSDP2: the model and the rank functions of
``integration/test_dcp_fsdp2.py`` (reused by ``test_dcp_interop.py`` and ``test_dcp_s3.py``).

A tiny FSDP2 model whose dimensions do not divide by 2, 3 or 4 (uneven shards), AdamW over two
param groups, and a tensor-parallel ``Shard(1)`` DTensor beside them. The saving job writes the
full reference state (gathered with ``get_state_dict(full_state_dict=True)``) as safetensors; the
loading jobs compare everything they loaded with it bit for bit. The rank functions are module
level so that spawn can import them.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import torch
from torch import nn

TP_SHAPE = (5, 7)
STEPS = 3


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 6)
        self.l1 = nn.Linear(6, 10)
        self.l2 = nn.Linear(10, 5)
        self.norm = nn.LayerNorm(5)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.norm(self.l2(torch.relu(self.l1(self.emb(tokens)))))


def batch(step: int, rank: int) -> torch.Tensor:
    return torch.randint(0, 11, (2, 4), generator=torch.Generator().manual_seed(1000 * step + rank))


def build(world: int, seed: int, hsdp: bool = False) -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if hsdp:
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(seed)
    model = Tiny()
    for m in (model.l1, model.l2):
        fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)
    decay = [p for n, p in model.named_parameters() if p.ndim > 1]
    rest = [p for n, p in model.named_parameters() if p.ndim <= 1]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": rest, "weight_decay": 0.0}],
                            lr=1e-2 if seed == 0 else 0.5, betas=(0.9, 0.95), foreach=False)
    return model, opt, mesh


def train_step(model: nn.Module, opt: torch.optim.Optimizer, step: int, rank: int) -> float:
    loss = model(batch(step, rank)).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return float(loss.detach())


def tp_tensor(world: int, seed: int) -> Any:
    """A ``Shard(1)`` DTensor on a 1-D mesh (tensor-parallel column split)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    full = torch.arange(TP_SHAPE[0] * TP_SHAPE[1], dtype=torch.float32).reshape(TP_SHAPE) * (seed + 1)
    return distribute_tensor(full, init_device_mesh("cpu", (world,)), [Shard(1)])


def state(model: nn.Module, opt: torch.optim.Optimizer, world: int, seed: int) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd, "tp": {"w": tp_tensor(world, seed)}}


def full_state(model: nn.Module, opt: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], list]:
    """Every weight and optimizer state, gathered whole (collective; complete on every rank)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    flat = {f"model.{k}": v.clone() for k, v in msd.items()}
    for fqn, st in osd["state"].items():
        for kind, v in st.items():
            flat[f"optim.{fqn}.{kind}"] = torch.as_tensor(v).clone()
    groups = [{k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items()}
              for g in osd["param_groups"]]
    return flat, groups


def save_job(rank: int, world: int, root: str, ref: str, opts: dict | None = None) -> dict[str, Any]:
    """Train ``STEPS`` steps, save to ``root`` (sync, then async to a second URL), write the
    reference below local directory ``ref``."""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file

    from shardckpt.interop.dcp.storage import ShardckptWriter

    model, opt, _ = build(world, 0)
    for s in range(STEPS):
        train_step(model, opt, s, rank)
    sd = state(model, opt, world, 0)
    dcp.save(sd, storage_writer=ShardckptWriter(f"{root}/ck", opts, extras={"step": STEPS}))
    dcp.async_save(sd, storage_writer=ShardckptWriter(f"{root}/ck-async", opts)).result()
    flat, groups = full_state(model, opt)
    if rank == 0:
        flat["tp.w"] = tp_tensor(world, 0).full_tensor()
        save_file(flat, f"{ref}/reference.safetensors")
        Path(ref, "reference.json").write_text(json.dumps(groups))
    else:
        tp_tensor(world, 0).full_tensor()
    return {"next_loss": train_step(model, opt, STEPS, rank)}


def load_job(rank: int, world: int, url: str, ref: str, hsdp: bool = False,
             opts: dict | None = None, save_to: str | None = None) -> dict[str, Any]:
    """Fresh model and optimizer (other seed, other lr), load, compare with the reference, train.
    With ``save_to``, save what was loaded there (from this world size) first."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    from shardckpt.interop.dcp.storage import ShardckptReader

    model, opt, _ = build(world, 1, hsdp)
    train_step(model, opt, 99, rank)  # optimizer state exists and differs from the checkpoint's
    sd = state(model, opt, world, 1)
    dcp.load(sd, storage_reader=ShardckptReader(url, opts))
    set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    if save_to is not None:
        from shardckpt.interop.dcp.storage import ShardckptWriter

        dcp.save(state(model, opt, world, 1) | {"tp": sd["tp"]},
                 storage_writer=ShardckptWriter(save_to, opts))
    return compare_with_reference(model, opt, sd, ref, rank)


def compare_with_reference(model: Any, opt: Any, sd: dict[str, Any], ref: str, rank: int) -> dict[str, Any]:
    """What a loaded model and optimizer (and the "tp" tensor of ``sd``) hold that differs, bit for
    bit, from the reference saved in ``ref``; whether the param groups agree; the next step's loss."""
    from safetensors.torch import load_file

    flat, groups = full_state(model, opt)
    flat["tp.w"] = sd["tp"]["w"].full_tensor()
    want = load_file(f"{ref}/reference.safetensors")
    differ = sorted(k for k in want if k not in flat or flat[k].dtype != want[k].dtype
                    or not torch.equal(flat[k].reshape(-1).view(torch.uint8),
                                       want[k].reshape(-1).view(torch.uint8)))
    differ += sorted(k for k in flat if k not in want)
    same_groups = groups == json.loads(Path(ref, "reference.json").read_text())
    return {"differ": differ, "groups": same_groups, "loss": train_step(model, opt, STEPS, rank)}


def kill_job(rank: int, world: int, root: str, opts: dict | None = None) -> dict[str, Any]:
    """Save a good checkpoint, then a second one during which rank 1 is SIGKILLed mid-write."""
    import torch.distributed.checkpoint as dcp

    from shardckpt.interop.dcp.storage import ShardckptWriter

    model, opt, _ = build(world, 0)
    train_step(model, opt, 0, rank)
    dcp.save(state(model, opt, world, 0), storage_writer=ShardckptWriter(f"{root}/good", opts))
    train_step(model, opt, 1, rank)
    sd = state(model, opt, world, 0)
    if rank == 1:
        writer = ShardckptWriter(f"{root}/killed", opts)
        real = writer._write

        def dying(attempt: Any, items: list, planner: Any) -> Any:
            def resolve(item: Any, _orig: Any = planner.resolve_data, _n: list = [0]) -> Any:
                _n[0] += 1
                if _n[0] == 3:  # some bytes of this rank's file are written, not all
                    os.kill(os.getpid(), signal.SIGKILL)
                return _orig(item)
            planner.resolve_data = resolve
            return real(attempt, items, planner)
        writer._write = dying  # type: ignore[method-assign]
    else:
        writer = ShardckptWriter(f"{root}/killed", opts)
    dcp.save(sd, storage_writer=writer)
    return {}
