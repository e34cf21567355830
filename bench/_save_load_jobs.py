"""Rank-side jobs of bench/save_load.py, run by ``shardckpt.training.launch.launch`` (one process per rank).

``save_job`` (N ranks, 4 by default) builds the same Llama twice on the meta device, each
materializing only its shards: a ``ZeroEngine`` + ``ShardedAdamW`` (unit-by-unit init) and an
FSDP2 copy (``fully_shard`` per decoder layer and the root on a CPU ``DeviceMesh``, gloo,
``to_empty``) + ``torch.optim.AdamW``. Each takes one training step so that the Adam moments
exist. Then, for every repetition, in an order rotated by one each time, it times:

* ``shardckpt``: ``save(engine, dir)``; ``digests``: the same with a digest per file computed as
  it is written (``CheckpointSpec.digests = True``: BLAKE3 where it imports); ``signed``: the
  same, and the manifest signed (Ed25519, a key made for the run);
* ``dcp``: ``dcp.save({"model": get_model_state_dict, "optim": get_optimizer_state_dict},
  checkpoint_id=dir)`` with the default ``FileSystemWriter`` (one file per rank, fsync on);
* ``raw``: each rank writes the bytes of its engine shards (masters and moments) sequentially to
  a file of its own, then fsyncs it: the disk's limit for the same bytes;
* ``sync`` / ``async``: ``Checkpointer(...).save(step)`` without and with ``async_save``; the
  async one is timed until ``save`` returns (blocking) and until ``wait`` returns (total);
* ``dcp_sc``: the same ``dcp.save`` of the FSDP2 model with ``shardckpt.interop.dcp.storage.ShardckptWriter``
  (CRC32C of every byte, create-only manifest); ``dcp_async`` / ``dcp_sc_async``:
  ``dcp.async_save`` with ``FileSystemWriter`` / ``ShardckptWriter``, timed until it returns.

Every timed save starts with its target removed, the deletion synced and left to settle, and
the page cache dropped (when /proc/sys/vm/drop_caches is writable); it runs between two
barriers: the time is the slowest rank's. ``load_job`` (M ranks, 2 by default) builds both
models again on M ranks with another seed and times ``load(engine, dir)`` against ``dcp.load``
+ ``set_*_state_dict`` of the last checkpoints, each from a dropped cache. Both jobs return a
SHA-256 of the whole fp32 weights (gathered), so the parent can check that the 4→2 loads gave
back what was saved.
"""

from __future__ import annotations

import glob
import hashlib
import os
import shutil
import time
from typing import Any
from collections.abc import Callable

from _disk_limit import drop_page_cache as drop_caches  # noqa: F401 (recovery.py imports it from here)

SAVE_VARIANTS = ("shardckpt", "dcp", "raw", "sync", "async", "dcp_sc", "dcp_async", "dcp_sc_async",
                 "digests", "signed")
LOAD_VARIANTS = ("shardckpt", "dcp", "dcp_sc")


def _rotated(variants: tuple[str, ...], rep: int) -> list[str]:
    """The order of repetition ``rep``: a shuffle seeded by ``rep`` (the same on every rank), so
    that each variant moves and has other neighbours from one repetition to the next (a plain
    rotation kept every variant right after the same one: ``digests`` always followed DCP's
    async save, and a save right after one runs slower here: 1.08 and 1.80 s after DCP's async
    saves, 1.01 s after the raw write, against 0.54-1.07 s for the plain save)."""
    import random

    order = list(variants)
    random.Random(rep).shuffle(order)
    return order


def _remove(*patterns: str) -> None:
    for pat in patterns:
        for p in glob.glob(pat):
            shutil.rmtree(p) if os.path.isdir(p) else os.unlink(p)


def _dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(path) for f in fs)


def _timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    """Seconds from one barrier to the next around ``fn()``: the slowest rank's time."""
    import torch.distributed as dist

    dist.barrier()
    t = time.perf_counter()
    out = fn()
    dist.barrier()
    return time.perf_counter() - t, out


def _prepare(rank: int, cleanup: Callable[[], None], settle_s: float) -> bool:
    """Rank 0 removes the target, lets the disk settle and drops the cache; the others wait.

    The root file system may be mounted with ``discard``: deleting 1.5 GB right before a timed
    write slows that write, so the deletion is synced and followed by a pause first.
    """
    import torch.distributed as dist

    dropped = True
    if rank == 0:
        cleanup()
        os.sync()
        time.sleep(settle_s)
        dropped = drop_caches()
    dist.barrier()
    return dropped


# ------------------------------------------------------------------------------ models


def _config(cfg: dict[str, Any]) -> Any:
    from shardckpt.runtime.models.llama import LlamaConfig

    return LlamaConfig(**cfg)


def _tokens(cfg: Any, rank: int) -> Any:
    import torch

    return torch.randint(0, cfg.vocab_size, (1, 16), generator=torch.Generator().manual_seed(rank))


def build_engine(cfg: Any, pm: Any, seed: int) -> tuple[Any, Any]:
    import torch

    from shardckpt.runtime import ShardedAdamW, ZeroEngine, decay_param_groups
    from shardckpt.runtime.models.llama import LLAMA_POLICY, LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    engine = ZeroEngine(model, policy=LLAMA_POLICY, process_mesh=pm, init_seed=seed, stage=3)
    return engine, ShardedAdamW(engine, decay_param_groups(engine, 0.1), lr=1e-3)


def build_fsdp(cfg: Any, world: int, rank: int, seed: int) -> tuple[Any, Any]:
    """FSDP2 on CPU: shard on the meta device, ``to_empty``, then fill only the local shards."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from shardckpt.runtime.models.llama import LlamaForCausalLM

    mesh = init_device_mesh("cpu", (world,))
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    gen = torch.Generator().manual_seed(seed * 1000 + rank)
    with torch.no_grad():
        for name, p in model.named_parameters():
            local = p.to_local()
            if "norm" in name:
                local.fill_(1.0)
            else:
                local.normal_(0.0, cfg.initializer_range, generator=gen)
        model.model.rotary_emb.reset_parameters()  # a non-persistent buffer: not in checkpoints
    decay = [p for p in model.parameters() if p.ndim >= 2]
    plain = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": plain, "weight_decay": 0.0}], lr=1e-3)
    return model, opt


def train_step(model: Any, opt: Any, cfg: Any, rank: int) -> None:
    from shardckpt.runtime.models.llama import causal_lm_loss

    tokens = _tokens(cfg, rank)
    causal_lm_loss(model(tokens), tokens).backward()
    opt.step()
    opt.zero_grad()


def dcp_state(model: Any, opt: Any) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    return {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}


def engine_digest(engine: Any, rank: int) -> str | None:
    """SHA-256 of every whole fp32 master, by FQN (collective; the digest on rank 0)."""
    full = engine.gather_full_params()
    if rank != 0:
        return None
    h = hashlib.sha256()
    for fqn in sorted(full):
        h.update(fqn.encode())
        h.update(full[fqn].detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def fsdp_digest(model: Any, rank: int) -> str | None:
    """SHA-256 of every whole parameter of the FSDP2 model (collective; the digest on rank 0)."""
    h = hashlib.sha256()
    for fqn, p in sorted(model.named_parameters()):
        full = p.full_tensor()
        if rank == 0:
            h.update(fqn.encode())
            h.update(full.detach().contiguous().numpy().tobytes())
    return h.hexdigest() if rank == 0 else None


def raw_write(engine: Any, path: str) -> int:
    """Write this rank's shard bytes (masters and moments) sequentially, then fsync."""
    n = 0
    with open(path, "wb") as f:
        for kinds in engine.local_shards().values():
            for t in kinds.values():
                n += f.write(t.detach().numpy().data)
        f.flush()
        os.fsync(f.fileno())
    return n


# -------------------------------------------------------------------------------- jobs


def _digest_save(engine: Any, url: str, sign: bool) -> Any:
    """``save(engine, url)`` with digests (and, ``sign``, a signature by a key made here)."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat

    from shardckpt.format.signing import SigningKey
    from shardckpt.training.save_load import begin_save

    key = None
    if sign:
        raw = Ed25519PrivateKey.generate().private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption())
        key = SigningKey(raw)
    job = begin_save(engine, url, signing_key=key)
    job.spec.digests = True
    return job.run()


def save_job(cfg_doc: dict[str, Any], work: str, reps: int, settle_s: float,
             variants: tuple[str, ...] = SAVE_VARIANTS) -> dict[str, Any]:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from torch.distributed.checkpoint import FileSystemWriter

    from shardckpt.training.checkpointer import Checkpointer
    from shardckpt.interop.dcp.storage import ShardckptWriter
    from shardckpt.runtime import init_distributed
    from shardckpt.training.save_load import save

    pm = init_distributed()
    rank, world = pm.rank, pm.world_size
    cfg = _config(cfg_doc)
    t = time.perf_counter()
    engine, opt = build_engine(cfg, pm, seed=0)
    train_step(engine, opt, cfg, rank)
    fsdp = fopt = None
    if any(v.startswith("dcp") for v in variants):
        fsdp, fopt = build_fsdp(cfg, world, rank, seed=0)
        train_step(fsdp, fopt, cfg, rank)
    setup_s = time.perf_counter() - t
    digest, fsdp_sha = engine_digest(engine, rank), fsdp_digest(fsdp, rank) if fsdp else None

    ours, theirs, raw = (os.path.join(work, d) for d in ("shardckpt", "dcp", "raw"))
    dcp_sc, dcp_as, dcp_sc_as = (os.path.join(work, d) for d in ("dcp-sc", "dcp-async", "dcp-sc-async"))
    run_sync, run_async = os.path.join(work, "run-sync"), os.path.join(work, "run-async")
    if rank == 0:
        os.makedirs(raw, exist_ok=True)
    ck_sync = Checkpointer(run_sync, engine, keep_last=None, async_save=False)
    ck_async = Checkpointer(run_async, engine, keep_last=None, async_save=True)
    dist.barrier()
    t0 = time.perf_counter()
    if "async" in variants:
        ck_async.save(0)  # the first save of a run also allocates the staging buffers: timed apart
    first_blocking = time.perf_counter() - t0
    ck_async.wait()
    times: dict[str, list[float]] = {v: [] for v in variants}
    times["async_total"] = []
    cpu: dict[str, list[float]] = {v: [] for v in ("shardckpt", "digests", "signed")}  # all threads
    cold, nbytes = True, {"raw": 0}
    for rep in range(reps):
        step = rep + 1
        for v in _rotated(variants, rep):
            if v in ("digests", "signed"):
                target = os.path.join(work, v)
                cold &= _prepare(rank, lambda t=target: _remove(t), settle_s)
                c0 = time.process_time()
                dt, m = _timed(lambda t=target, s=v == "signed": _digest_save(engine, t, s))
                cpu[v].append(time.process_time() - c0)
                nbytes[v] = m.total_bytes
            elif v == "shardckpt":
                cold &= _prepare(rank, lambda: _remove(ours), settle_s)
                c0 = time.process_time()
                dt, m = _timed(lambda: save(engine, ours))
                cpu[v].append(time.process_time() - c0)
                nbytes["shardckpt"] = m.total_bytes
            elif v == "dcp":
                cold &= _prepare(rank, lambda: _remove(theirs), settle_s)
                dt, _ = _timed(lambda: dcp.save(dcp_state(fsdp, fopt), checkpoint_id=theirs))
                if rank == 0:
                    nbytes["dcp"] = _dir_bytes(theirs)
            elif v == "dcp_sc":
                cold &= _prepare(rank, lambda: _remove(dcp_sc), settle_s)
                dt, _ = _timed(lambda: dcp.save(dcp_state(fsdp, fopt), storage_writer=ShardckptWriter(dcp_sc)))
                if rank == 0:
                    nbytes["dcp_sc"] = _dir_bytes(dcp_sc)
            elif v in ("dcp_async", "dcp_sc_async"):
                target = dcp_as if v == "dcp_async" else dcp_sc_as
                cold &= _prepare(rank, lambda t=target: _remove(t), settle_s)
                writer = FileSystemWriter(target) if v == "dcp_async" else ShardckptWriter(target)
                dist.barrier()
                t0 = time.perf_counter()
                fut = dcp.async_save(dcp_state(fsdp, fopt), storage_writer=writer)
                dt = time.perf_counter() - t0  # this rank's blocking time
                fut.result()
                dist.barrier()
            elif v == "raw":
                cold &= _prepare(rank, lambda: _remove(os.path.join(raw, "*")), settle_s)
                dt, n = _timed(lambda: raw_write(engine, os.path.join(raw, f"rank-{rank:05d}.bin")))
                nbytes["raw"] = n  # this rank's; the parent sums
            elif v == "sync":
                cold &= _prepare(rank, lambda: _remove(os.path.join(run_sync, "step-*")), settle_s)
                dt, _ = _timed(lambda s=step: ck_sync.save(s))
            else:
                cold &= _prepare(rank, lambda: _remove(os.path.join(run_async, "step-*")), settle_s)
                dist.barrier()
                t0 = time.perf_counter()
                ck_async.save(step)
                dt = time.perf_counter() - t0  # this rank's blocking time; the parent takes the max
                ck_async.wait()
                dist.barrier()
                times["async_total"].append(time.perf_counter() - t0)
            times[v].append(dt)
    ck_async.close()
    return {"rank": rank, "times": times, "cpu": cpu, "bytes": nbytes, "cold": cold, "setup_s": setup_s,
            "first_async_blocking_s": first_blocking, "digest": digest, "fsdp_digest": fsdp_sha,
            "params": sum(p.numel for p in engine.layout.params)}


def load_job(cfg_doc: dict[str, Any], work: str, reps: int, settle_s: float) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    from shardckpt.interop.dcp.storage import ShardckptReader
    from shardckpt.runtime import init_distributed
    from shardckpt.training.save_load import load

    pm = init_distributed()
    rank, world = pm.rank, pm.world_size
    cfg = _config(cfg_doc)
    engine, _opt = build_engine(cfg, pm, seed=1)  # another seed: a load that did nothing shows
    fsdp, fopt = build_fsdp(cfg, world, rank, seed=1)
    dcp_state(fsdp, fopt)  # AdamW's state is created here, once (ShardedAdamW's at construction)
    ours, theirs = os.path.join(work, "shardckpt"), os.path.join(work, "dcp")

    def dcp_load(reader: Any = None) -> None:
        sd = dcp_state(fsdp, fopt)
        if reader is None:
            dcp.load(sd, checkpoint_id=theirs)
        else:
            dcp.load(sd, storage_reader=reader)
        set_model_state_dict(fsdp, sd["model"])
        set_optimizer_state_dict(fsdp, fopt, optim_state_dict=sd["optim"])

    times: dict[str, list[float]] = {v: [] for v in LOAD_VARIANTS}
    cold, read = True, 0
    for rep in range(reps):
        for v in _rotated(LOAD_VARIANTS, rep):
            cold &= _prepare(rank, lambda: None, settle_s)
            if v == "shardckpt":
                dt, res = _timed(lambda: load(engine, ours))
                read = res.bytes_read
            elif v == "dcp":
                dt, _ = _timed(dcp_load)
            else:
                dt, _ = _timed(lambda: dcp_load(ShardckptReader(os.path.join(work, "dcp-sc"))))
            times[v].append(dt)
    dcp_load()  # untimed: the weights each DCP reader gives back, checked by the parent
    fsdp_fs = fsdp_digest(fsdp, rank)
    dcp_load(ShardckptReader(os.path.join(work, "dcp-sc")))
    fsdp_sc = fsdp_digest(fsdp, rank)
    return {"rank": rank, "times": times, "cold": cold, "bytes_read": read,
            "digest": engine_digest(engine, rank), "fsdp_digest": fsdp_fs, "fsdp_sc_digest": fsdp_sc}
