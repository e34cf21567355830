"""Optimizer offload (``"cpu"``, ``"nvme"``) on real gloo process groups: masters and moments
bit for bit equal to the resident run at stages 1, 2 and 3, and checkpoints saved and loaded
with offload on or off. One shared job per world size (1, 2) runs every case; a report is a
list of problems (empty = pass).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist

from testing.ranks import case_suite, check_case

pytestmark = pytest.mark.slow

TINY = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=1)


def _tokens(step: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, TINY["vocab_size"], (2, 8), generator=g)


def _shared_dir(pm: Any, name: str) -> Path:
    """A directory every rank names alike (rank 0 picks it), empty at the start."""
    box = [tempfile.mkdtemp(prefix=f"shardckpt-offload-{name}-") if pm.rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return Path(box[0])


def _build(pm: Any, stage: int, mode: str | None, where: Path | None):
    from shardckpt.runtime import ShardedAdamW, ZeroEngine, decay_param_groups
    from shardckpt.runtime.llama import LLAMA_POLICY, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    kw: dict[str, Any] = {}
    if mode is not None:
        kw["offload_optimizer"] = mode
    if mode == "nvme":
        kw["offload_dir"] = where
    engine = ZeroEngine(LlamaForCausalLM(LlamaConfig(**TINY)), policy=LLAMA_POLICY,
                        process_mesh=pm, stage=stage, deterministic=True, **kw)
    opt = ShardedAdamW(engine, decay_param_groups(engine, 0.1), lr=1e-2, betas=(0.9, 0.95))
    return engine, opt


def _train(engine: Any, opt: Any, steps: range, rank: int) -> None:
    from shardckpt.runtime.llama import causal_lm_loss

    for s in steps:
        tokens = _tokens(s, rank)
        causal_lm_loss(engine(tokens), tokens).backward()
        opt.step()
        opt.zero_grad()


def _state(engine: Any) -> dict[tuple[str, str], torch.Tensor]:
    out = {}
    for g, kinds in engine.local_shards().items():
        for k, t in kinds.items():
            if not isinstance(t, torch.Tensor):  # an offload file
                host = torch.empty(t.shape, dtype=t.dtype)
                t.read_into(host)
                t = host
            out[g, k] = t.clone()
    return out


def _diff(a: dict, b: dict, what: str) -> list[str]:
    if a.keys() != b.keys():
        return [f"{what}: kinds {sorted(a)} vs {sorted(b)}"]
    return [f"{what}: {k} differs" for k in a if not torch.equal(a[k], b[k])]


def case_parity(pm: Any) -> list[str]:
    """Stages 1-3: cpu and nvme offload give the resident run's masters and moments."""
    where = Path(tempfile.mkdtemp(prefix="shardckpt-offload-parity-"))
    problems = []
    try:
        for stage in (1, 2, 3):
            engine, opt = _build(pm, stage, None, None)
            _train(engine, opt, range(3), pm.rank)
            want = _state(engine)
            for mode in ("cpu", "nvme"):
                engine, opt = _build(pm, stage, mode, where)
                _train(engine, opt, range(3), pm.rank)
                problems += _diff(want, _state(engine), f"stage {stage} {mode}")
                engine.close()
        if os.listdir(where):
            problems.append(f"left in the offload directory: {os.listdir(where)}")
    finally:
        shutil.rmtree(where, ignore_errors=True)
    return problems


def case_checkpoint(pm: Any) -> list[str]:
    """Save from nvme-offloaded state, load with offload on and off; save from a resident run
    and load into an offloaded one; training on gives the same bits."""
    from shardckpt.training.save_load import load, save

    root = _shared_dir(pm, "ckpt")
    problems = []
    try:
        src, opt = _build(pm, 3, "nvme", root / f"off-src-{pm.rank}")
        _train(src, opt, range(2), pm.rank)
        save(src, str(root / "from-nvme"))
        ref, ref_opt = _build(pm, 2, None, None)
        _train(ref, ref_opt, range(2), pm.rank)
        save(ref, str(root / "resident"))
        _train(src, opt, range(2, 3), pm.rank)
        after = _state(src)
        for url, mode, stage in (("from-nvme", None, 2), ("from-nvme", "cpu", 1),
                                 ("resident", "nvme", 3)):
            dst, dst_opt = _build(pm, stage, mode, root / f"off-dst-{pm.rank}")
            load(dst, str(root / url))
            problems += _diff(_state(ref), _state(dst), f"{url} into {mode} at load")
            _train(dst, dst_opt, range(2, 3), pm.rank)
            if url == "from-nvme":
                problems += _diff(after, _state(dst), f"{url} into {mode} after a step")
            dst.close()
        src.close()
    finally:
        dist.barrier()
        if pm.rank == 0:
            shutil.rmtree(root, ignore_errors=True)
    return problems


CASES: dict[str, Callable] = {"parity": case_parity, "checkpoint": case_checkpoint}


def cases_for(world: int) -> list[str]:
    return list(CASES)


reports = case_suite(__name__, CASES, cases_for, [1, 2], timeout_s=240, pg_timeout_s=150,
                     case_pg_timeout_s=120)


def test_offload_cpu_and_nvme_bit_exact_at_every_stage(reports):
    check_case(reports, "parity")


def test_checkpoints_with_offload_on_or_off_bit_for_bit(reports):
    check_case(reports, "checkpoint")
