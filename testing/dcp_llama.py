"""The tiny Llama under FSDP2 and under ``ZeroEngine``, saving and loading each other's
checkpoints: the rank functions of ``integration/test_dcp_interop.py`` (module level, so that
spawn can import them).

Every run continues from the same state with the same global batches, so the global mean losses
of the next steps agree across runtimes, world sizes and meshes (``ROWS`` rows per step, split
evenly over 2 or 3 ranks; over 4, each rank takes one row, and 4-rank runs compare with 4-rank
runs). A job that loads writes what it holds (a ``ZeroEngine`` saves, FSDP2 writes its gathered
state as safetensors) for the test to compare bit for bit.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from testing.fsdp2_dcp import full_state
from testing.models import BETAS, LR, TINY, WD, tiny_llama, tiny_loss, two_groups

LLAMA_STEPS, NEXT_STEPS, ROWS = 2, 2, 6
#: The parameters the frozen runs train with requires_grad=False (optimizer: the trained ones).
FROZEN = r"model\.layers\.0\.mlp\..*"


def global_rows(step: int, rank: int, world: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(500 + step)
    rows = torch.randint(0, TINY["vocab_size"], (ROWS, 8), generator=g)
    per = ROWS // world
    return rows[rank * per:(rank + 1) * per]


def mean_loss(forward: Any, opt: Any, step: int, rank: int, world: int) -> float:
    import torch.distributed as dist

    tokens = global_rows(step, rank, world)
    loss = tiny_loss(forward(tokens), tokens, 1)
    loss.backward()
    opt.step()
    opt.zero_grad()
    mean = loss.detach().clone()
    dist.all_reduce(mean)
    return float(mean) / world


def next_losses(forward: Any, opt: Any, rank: int, world: int) -> list[float]:
    return [mean_loss(forward, opt, s, rank, world)
            for s in range(LLAMA_STEPS, LLAMA_STEPS + NEXT_STEPS)]


def freeze(model: Any) -> Any:
    import re

    for name, p in model.named_parameters():
        if re.fullmatch(FROZEN, name):
            p.requires_grad_(False)
    return model


def fsdp2_llama(world: int, seed: int, hsdp: bool = False, frozen: bool = False,
                wd: float = WD, lr: float = LR) -> tuple[Any, Any]:
    """FSDP2 tiny Llama (one unit per decoder layer; HSDP on a (2, world/2) mesh), AdamW in two
    groups of its trained parameters."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from shardckpt.runtime.models.llama import LlamaDecoderLayer

    mesh = (init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
            if hsdp else init_device_mesh("cpu", (world,)))
    model = tiny_llama(seed=seed)
    if frozen:
        freeze(model)
    for m in model.modules():
        if isinstance(m, LlamaDecoderLayer):
            fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(two_groups(model.named_parameters(), wd), lr=lr, betas=BETAS,
                            foreach=False)
    return model, opt


def engine_llama(pm: Any, frozen: bool = False) -> tuple[Any, Any]:
    """ZeroEngine tiny Llama (other init, lr 1.0: all must come from a checkpoint)."""
    from shardckpt.runtime import ShardedAdamW, ZeroEngine, decay_param_groups
    from shardckpt.runtime.models.llama import LLAMA_POLICY

    model = tiny_llama(seed=7)
    engine = ZeroEngine(freeze(model) if frozen else model, policy=LLAMA_POLICY, process_mesh=pm)
    return engine, ShardedAdamW(engine, decay_param_groups(engine, WD), lr=1.0)


def save_fsdp2(model: Any, opt: Any, root: str, name: str, rank: int, stock: bool = True) -> None:
    """Save with stock DCP (``root/name``) and through ShardckptWriter (``root/name-chunked``);
    write the gathered state (``root/name-reference.{safetensors,json}``)."""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from shardckpt.interop.dcp.storage import ShardckptWriter

    msd, osd = get_state_dict(model, opt)
    if stock:
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=f"{root}/{name}")
    dcp.save({"model": msd, "optim": osd}, storage_writer=ShardckptWriter(f"{root}/{name}-chunked"))
    flat, groups = full_state(model, opt)
    if rank == 0:
        save_file(flat, f"{root}/{name}-reference.safetensors")
        Path(root, f"{name}-reference.json").write_text(json.dumps(groups))


def fsdp2_llama_job(rank: int, world: int, root: str) -> dict[str, list[float]]:
    """FSDP2 Llama (tied head) trained LLAMA_STEPS, saved as ``llama``, continued NEXT_STEPS;
    the same with the FROZEN parameters frozen, saved as ``frozen``."""
    out = {}
    for name, frozen in (("llama", False), ("frozen", True)):
        model, opt = fsdp2_llama(world, 0, frozen=frozen)
        for s in range(LLAMA_STEPS):
            mean_loss(model, opt, s, rank, world)
        save_fsdp2(model, opt, root, name, rank)
        out[name] = next_losses(model, opt, rank, world)
    return out


def engine_job(rank: int, world: int, ckpts: list[tuple[str, str]]) -> dict[str, list[float]]:
    """For each (ckpt, mode): a ZeroEngine loads flat groups (``mode="flat"``) or chunked tensors
    (``"chunked"``), saves what it holds to ``<ckpt>-resaved``, continues; losses by mode."""
    from shardckpt.runtime import init_distributed
    from shardckpt.training.chunked_load import load_chunked
    from shardckpt.training.save_load import load, save

    pm, out = init_distributed(timeout_s=60), {}
    for ckpt, mode in ckpts:
        engine, opt = engine_llama(pm)
        (load if mode == "flat" else load_chunked)(engine, ckpt)
        save(engine, f"{ckpt}-resaved")
        out[mode] = next_losses(engine, opt, rank, world)
    return out


def engine_save_job(rank: int, world: int, root: str) -> list[float]:
    """ZeroEngine, LLAMA_STEPS steps, saved as ``zero``; then NEXT_STEPS more."""
    from shardckpt.runtime import ShardedAdamW, ZeroEngine, decay_param_groups, init_distributed
    from shardckpt.runtime.models.llama import LLAMA_POLICY
    from shardckpt.training.save_load import save

    engine = ZeroEngine(tiny_llama(), policy=LLAMA_POLICY,
                        process_mesh=init_distributed(timeout_s=60))
    opt = ShardedAdamW(engine, decay_param_groups(engine, WD), lr=LR, betas=BETAS)
    for s in range(LLAMA_STEPS):
        mean_loss(engine, opt, s, rank, world)
    save(engine, f"{root}/zero")
    return next_losses(engine, opt, rank, world)


def fsdp2_load(rank: int, world: int, src: str, out: str, via: str = "reader",
               hsdp: bool = False, save_as: tuple[str, str] | None = None) -> dict[str, Any]:
    """FSDP2 (other init, other lr) loads ``src`` through ShardckptReader (``via="reader"``) or
    with stock ``dcp.load`` (``"export"``), writes its gathered state to ``out``, saves it with
    :func:`save_fsdp2` to ``save_as`` = (root, name) if given, continues."""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from shardckpt.interop.dcp.storage import ShardckptReader

    model, opt = fsdp2_llama(world, 3, hsdp, wd=0.3, lr=0.5)
    mean_loss(model, opt, 99, rank, world)  # optimizer state exists and differs
    msd, osd = get_state_dict(model, opt)
    sd = {"model": msd, "optim": osd}
    dcp.load(sd, **({"storage_reader": ShardckptReader(src)} if via == "reader"
                    else {"checkpoint_id": src}))
    set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    flat, groups = full_state(model, opt)
    if rank == 0:
        save_file(flat, out)
    if save_as is not None:
        save_fsdp2(model, opt, *save_as, rank, stock=not hsdp)
    return {"groups": groups, "losses": next_losses(model, opt, rank, world)}


def fsdp2_from_flat_job(rank: int, world: int, root: str) -> dict[str, Any]:
    """FSDP2 loads ``zero`` through ShardckptReader (``"reader"``; then also saves it as
    ``fsdp2-3``), and again its DCP export ``zero-exported`` with stock ``dcp.load``
    (``"export"``); results by way."""
    return {via: fsdp2_load(rank, world, src, f"{root}/fsdp2-loaded-{via}.safetensors", via,
                            save_as=(root, "fsdp2-3") if via == "reader" else None)
            for via, src in (("reader", f"{root}/zero"), ("export", f"{root}/zero-exported"))}


def two_ranks_job(rank: int, world: int, root: str, zroot: str) -> dict[str, Any]:
    """At 2 ranks: FSDP2 loads the 3-rank ZeroEngine checkpoint ``root/flat-resaved``;
    ZeroEngine loads the 3-rank FSDP2 checkpoint (imported as ``zroot/fsdp2-3-flat``);
    ZeroEngine with FROZEN frozen loads the FSDP2 ``root/frozen`` checkpoint imported
    (``frozen-flat``) and as saved through ShardckptWriter (``frozen-chunked``). Each ZeroEngine
    saves what it loaded (``<ckpt>-resaved``), continues, saves again (``<ckpt>-after``)."""
    from shardckpt.runtime import init_distributed
    from shardckpt.training.chunked_load import load_chunked
    from shardckpt.training.save_load import load, save

    out = {"fsdp2": fsdp2_load(rank, world, f"{root}/flat-resaved",
                               f"{root}/fsdp2-2-loaded.safetensors")["losses"]}
    pm = init_distributed(timeout_s=60)
    for name, ckpt, frozen in (("zero", f"{zroot}/fsdp2-3-flat", False),
                               ("frozen", f"{root}/frozen-flat", True),
                               ("frozen-chunked", f"{root}/frozen-chunked", True)):
        engine, opt = engine_llama(pm, frozen)
        (load_chunked if name == "frozen-chunked" else load)(engine, ckpt)
        save(engine, f"{ckpt}-resaved")
        out[name] = next_losses(engine, opt, rank, world)
        save(engine, f"{ckpt}-after")
    return out


def hsdp_job(rank: int, world: int, root: str) -> dict[str, Any]:
    """At 4 ranks: ZeroEngine with replicate 2 loads ``zero``, saves ``zero-hsdp``, continues;
    FSDP2 on a (2, 2) mesh loads ``zero-hsdp``, saves through ShardckptWriter
    (``fsdp2-hsdp-chunked``), continues; ZeroEngine with replicate 2 loads that, saves
    ``fsdp2-hsdp-chunked-resaved``, continues."""
    from shardckpt.runtime import init_distributed
    from shardckpt.training.chunked_load import load_chunked
    from shardckpt.training.save_load import load, save

    pm = init_distributed(timeout_s=60, replicate=2)
    engine, opt = engine_llama(pm)
    load(engine, f"{root}/zero")
    save(engine, f"{root}/zero-hsdp")
    out = {"zero": next_losses(engine, opt, rank, world)}
    out["fsdp2"] = fsdp2_load(rank, world, f"{root}/zero-hsdp", f"{root}/fsdp2-hsdp.safetensors",
                              hsdp=True, save_as=(root, "fsdp2-hsdp"))["losses"]
    engine, opt = engine_llama(pm)
    load_chunked(engine, f"{root}/fsdp2-hsdp-chunked")
    save(engine, f"{root}/fsdp2-hsdp-chunked-resaved")
    out["zero-again"] = next_losses(engine, opt, rank, world)
    return out
