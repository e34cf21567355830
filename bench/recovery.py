"""Benchmark: the node-local tier (with peer copies) against the durable tier alone.

4 gloo ranks on 2 simulated nodes (2 ranks a node, ``{node}`` directories below ``/dev/shm``,
tmpfs), a Llama-shaped ``ZeroEngine`` + ``ShardedAdamW`` with at least 1 GB of state (fp32
masters and two Adam moments), one launch. Times, as the slowest rank's (between barriers),
median of ``--reps``:

* blocking time of a save: ``Checkpointer(local=LocalTier(...)).save(step)`` (returns once each
  rank's files are on its node; the peer copies and the node commits go on in the background,
  their total is reported too) against ``Checkpointer(durable).save(step)`` (sync: written,
  fsynced and committed);
* the same local save from a ``Checkpointer(async_save=True)``: the time ``save()`` blocks (the
  node files are written in the background) and, until ``wait_staged()`` returns, the most the
  optimizer's next update waits for that write (with no forward and backward to overlap it here);
* recovery, from a fresh ``Checkpointer`` (its process group made beforehand) until the first
  training step can start: ``resume()`` from the local tier with every node intact ("local"),
  with node 1's copy of the newest step gone so that its ranks fetch their files from node 0
  over the process group ("peers"; put back afterwards), and from the durable tier alone
  ("durable"). What is the same for every tier is left out: process start-up and model
  construction (``setup_s``) and the first step itself (``step_s``; ``--json`` gives the ratios
  with it, ``*_with_first_step``). Every resume's state is checked: the SHA-256 of each rank's
  shards after it equals the one saved.
* the cost of a job secret (``SHARDCKPT_JOB_SECRET``: every peer-stream message and every
  agreement authenticated with HMAC-SHA256): the background part of the local save (its peer
  copies and node commits) and the recovery from peers, each with the secret set on every rank
  and without, in the same launch; ``secret_over_plain`` gives the two ratios.

The durable tier is a local directory on disk (``--durable dir``, default; ``--workdir``) or
moto's S3 server on loopback (``--durable s3``, ``testing/s3servers.MotoServer``). The page cache
is dropped before each durable save and each recovery when ``/proc/sys/vm/drop_caches`` is
writable (``cold_cache`` says whether it was); tmpfs is memory and is not dropped.

    python bench/recovery.py [--params 100M] [--reps 3] [--durable dir|s3] [--workdir DIR] [--json]

Prints one JSON line: ``local_save_over_durable_save``, ``local_async_save_over_durable_save``,
``local_recovery_over_durable``,
``peer_recovery_over_durable``, ``secret_over_plain``, ``frozen_bytes_over_full`` (from ``bench/_frozen_bytes.py``,
null where it is absent), ``over_floor`` (the local save, local and peer recovery over the least
this machine allows for each, measured in the same launch by ``bench/_tmpfs_floor.py``) and
``floor_over_durable`` (those limits over the durable tier's times: the best ratio to the durable
tier any implementation could show here), with ``--json`` every figure besides. Nothing here asserts.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))


def _digest(engine: Any) -> str:
    import torch

    h = hashlib.sha256()
    for g, kinds in sorted(engine.local_shards().items()):
        for k, t in sorted(kinds.items()):
            h.update(f"{g}.{k}".encode())
            h.update(t.detach().contiguous().view(torch.uint8).numpy().data)
    return h.hexdigest()


def _barrier_timed(fn: Any) -> tuple[float, Any]:
    import torch.distributed as dist

    dist.barrier()
    t = time.perf_counter()
    out = fn()
    dist.barrier()
    return time.perf_counter() - t, out


def job(cfg_doc: dict[str, Any], local_root: str, durable: str, storage_options: dict[str, Any] | None,
        reps: int) -> dict[str, Any]:
    import torch.distributed as dist

    from _save_load_jobs import _config, build_engine, drop_caches, train_step
    from shardckpt.checkpoint.tiers import LocalTier
    from shardckpt.runtime import init_distributed
    from shardckpt.training.checkpointer import Checkpointer

    logging.basicConfig(level=logging.WARNING)
    t0 = time.perf_counter()
    pm = init_distributed(timeout_s=600)
    rank = pm.rank
    cfg = _config(cfg_doc)
    engine, opt = build_engine(cfg, pm, seed=0)
    train_step(engine, opt, cfg, rank)
    state = sum(t.numel() * t.element_size() for kinds in engine.local_shards().values()
                for t in kinds.values())
    tier = LocalTier(path=os.path.join(local_root, "node{node}"), every=1, keep=2, peers=1,
                     ranks_per_node=2)
    setup_s = time.perf_counter() - t0
    out: dict[str, Any] = {"state_bytes": state, "setup_s": setup_s, "cold": True,
                           "save": {"durable": [], "local": [], "local_total": [],
                                    "local_total_secret": [], "local_async": [],
                                    "local_async_written": []},
                           "recovery": {"local": [], "peers": [], "durable": [], "peers_secret": []},
                           "resume_only": {"local": [], "peers": [], "durable": [], "peers_secret": []},
                           "step_s": [], "fetched": [], "tiers": [], "exact": True}

    def cold() -> None:
        if rank == 0:
            out["cold"] &= drop_caches()
        dist.barrier()

    plain = Checkpointer(durable, engine, keep_last=2, storage_options=storage_options)
    tiered = Checkpointer(durable, engine, keep_last=2, storage_options=storage_options,
                          local=tier, durable_every=10 ** 9)
    # async: the node files written in the background (a tier of its own; no durable save is
    # due in it, so no staging buffer is allocated for one)
    tier_async = LocalTier(path=os.path.join(local_root, "async", "node{node}"), every=1, keep=2,
                           peers=1, ranks_per_node=2)
    background = Checkpointer(durable, engine, keep_last=2, storage_options=storage_options,
                              local=tier_async, durable_every=10 ** 9, async_save=True,
                              max_staging_bytes=0)
    step = 10
    for _ in range(reps):
        step += 1
        cold()
        dt, _ = _barrier_timed(lambda s=step: plain.save(s))
        out["save"]["durable"].append(dt)
        dt, _ = _barrier_timed(lambda s=step: tiered.save(s))
        out["save"]["local"].append(dt)
        dt2, _ = _barrier_timed(tiered.wait)
        out["save"]["local_total"].append(dt + dt2)
        dt, _ = _barrier_timed(lambda s=step: background.save(s))
        out["save"]["local_async"].append(dt)
        dt2, _ = _barrier_timed(background.wait_staged)  # what the next update waits at most
        out["save"]["local_async_written"].append(dt + dt2)
        background.wait()
        step += 1
        plain.save(step)  # the durable tier holds the newest step too (not timed)
        with job_secret():
            dt, _ = _barrier_timed(lambda s=step: tiered.save(s))
            dt2, _ = _barrier_timed(tiered.wait)
        out["save"]["local_total_secret"].append(dt + dt2)
    saved = _digest(engine)
    tiered.close()
    background.close()
    plain.close()
    newest = f"step-{step:08d}"
    modes = ["local", "peers", "durable", "peers_secret"]
    for rep in range(reps):
        for mode in modes[rep % 4:] + modes[:rep % 4]:
            lost = os.path.join(local_root, "node1", newest)
            kept = os.path.join(local_root, "node1-kept")
            if mode.startswith("peers") and rank == 2:  # node 1 lost its copy of the newest step
                os.rename(lost, kept)
            cold()
            ckpt = Checkpointer(durable, engine, storage_options=storage_options,
                                local=None if mode == "durable" else tier,
                                durable_every=None if mode == "durable" else 10 ** 9)
            with job_secret(mode.endswith("secret")):
                t_resume, got = _barrier_timed(ckpt.resume)
            digest = _digest(engine)
            t_step, _ = _barrier_timed(lambda: train_step(engine, opt, cfg, rank))
            out["recovery"][mode].append(t_resume + t_step)
            out["resume_only"][mode].append(t_resume)
            out["step_s"].append(t_step)
            last = ckpt.last_resume or {"tier": "durable", "fetched": 0}
            out["tiers"].append([mode, last["tier"], got])
            out["fetched"].append([mode, last["fetched"]])
            out["exact"] &= digest == saved and got == step
            ckpt.close()
            if mode.startswith("peers") and rank == 2:  # back as it was: each mode measures what it says
                shutil.rmtree(lost)
                os.rename(kept, lost)
            dist.barrier()
    out["floor"] = machine_floor(local_root, newest, rank, reps)
    return out


def machine_floor(local_root: str, step_name: str, rank: int, reps: int) -> dict[str, list[float]]:
    """The least the local save and resumes do on this machine (:mod:`_tmpfs_floor`), from this
    rank's shard file of the newest local step."""
    from _tmpfs_floor import floors  # type: ignore[import-not-found]

    from shardckpt.checkpoint.reader import read_manifest
    from shardckpt.storage import Storage

    node_dir = os.path.join(local_root, f"node{rank // 2}")
    here = Storage(os.path.join(node_dir, step_name))
    files = [e for e in read_manifest(here).files if e.role == "shard"]
    entry = next(e for e in files if e.index == rank)
    sent = next((e for e in files if e.index == rank + 2), None) if rank < 2 else None
    return floors(here.full(entry.path), node_dir, rank, 2, reps,
                  here.full(sent.path) if sent is not None else None)


@contextmanager
def job_secret(on: bool = True) -> Iterator[None]:
    """``SHARDCKPT_JOB_SECRET`` set in this rank's environment meanwhile (``on``)."""
    from shardckpt.checkpoint.job_secret import SECRET_VARIABLE

    if on:
        os.environ[SECRET_VARIABLE] = "bench secret"
    try:
        yield
    finally:
        os.environ.pop(SECRET_VARIABLE, None)


def _median(xs: list[float]) -> float:
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2


def _slowest(results: list[dict[str, Any]], *keys: str) -> list[float]:
    def pick(r: dict[str, Any]) -> list[float]:
        v: Any = r
        for k in keys:
            v = v[k]
        return v
    return [max(pick(r)[i] for r in results) for i in range(len(pick(results[0])))]


def frozen_ratio() -> float | None:
    try:
        from _frozen_bytes import frozen_bytes_over_full  # type: ignore[import-not-found]
    except ImportError:
        return None
    return float(frozen_bytes_over_full())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", default="100M", help="model size (at least 1 GB of state: 84M)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--durable", choices=("dir", "s3"), default="dir")
    ap.add_argument("--workdir", default=None, help="where the durable directory goes (disk)")
    ap.add_argument("--shm", default="/dev/shm", help="where the local tier goes (tmpfs)")
    ap.add_argument("--json", action="store_true", help="every figure, not only the ratios")
    args = ap.parse_args()
    from save_load import llama_config

    from shardckpt.format.quantities import parse_count
    from shardckpt.training.launch import launch

    cfg = llama_config(parse_count(args.params, "--params"))
    work = args.workdir or tempfile.mkdtemp(prefix="shardckpt-recovery-")
    local_root = tempfile.mkdtemp(prefix="shardckpt-recovery-", dir=args.shm)
    server: Any = None
    options: dict[str, Any] | None = None
    try:
        if args.durable == "s3":
            from testing.s3servers import MotoServer

            server = MotoServer().start()
            durable = f"s3://{server.create_bucket('recovery')}/run"
            options = server.storage_options()
        else:
            durable = os.path.join(work, "durable")
        t = time.perf_counter()
        results = launch(job, 4, (cfg, local_root, durable, options, args.reps), timeout_s=3600)
        wall = time.perf_counter() - t
    finally:
        shutil.rmtree(local_root, ignore_errors=True)
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
        if server is not None:
            server.stop()
    sec = {f"save_{k}": _median(_slowest(results, "save", k))
           for k in ("durable", "local", "local_total", "local_total_secret", "local_async",
                     "local_async_written")}
    sec.update({f"recovery_{k}": _median(_slowest(results, "recovery", k))
                for k in ("local", "peers", "durable", "peers_secret")})
    sec.update({f"resume_only_{k}": _median(_slowest(results, "resume_only", k))
                for k in ("local", "peers", "durable", "peers_secret")})
    sec.update({f"floor_{k}": _median(_slowest(results, "floor", k)) for k in ("write", "read", "peer")})
    line = {
        "local_save_over_durable_save": round(sec["save_local"] / sec["save_durable"], 3),
        "local_async_save_over_durable_save": round(sec["save_local_async"] / sec["save_durable"], 4),
        "local_recovery_over_durable": round(sec["resume_only_local"] / sec["resume_only_durable"], 3),
        "peer_recovery_over_durable": round(sec["resume_only_peers"] / sec["resume_only_durable"], 3),
        "secret_over_plain": {
            "local_save_background": round(sec["save_local_total_secret"] / sec["save_local_total"], 3),
            "peer_recovery": round(sec["resume_only_peers_secret"] / sec["resume_only_peers"], 3)},
        "frozen_bytes_over_full": frozen_ratio(),
        # how far each is from what this machine allows (:mod:`_tmpfs_floor`), and how far the
        # machine's limit itself is from the durable tier's time
        "over_floor": {"local_save": round(sec["save_local"] / sec["floor_write"], 3),
                       "local_recovery": round(sec["resume_only_local"] / sec["floor_read"], 3),
                       "peer_recovery": round(sec["resume_only_peers"] / sec["floor_peer"], 3)},
        "floor_over_durable": {"save": round(sec["floor_write"] / sec["save_durable"], 3),
                               "local_recovery": round(sec["floor_read"] / sec["resume_only_durable"], 3),
                               "peer_recovery": round(sec["floor_peer"] / sec["resume_only_durable"], 3)},
    }
    if args.json:
        r0 = results[0]
        line.update({
            "durable": args.durable, "state_bytes": sum(r["state_bytes"] for r in results),
            "reps": args.reps, "cold_cache": all(r["cold"] for r in results),
            "exact": all(r["exact"] for r in results), "tiers": r0["tiers"], "fetched": r0["fetched"],
            "seconds": {k: round(v, 3) for k, v in sec.items()},
            "step_s": round(_median(_slowest(results, "step_s")), 3),
            "local_recovery_over_durable_with_first_step":
                round(sec["recovery_local"] / sec["recovery_durable"], 3),
            "peer_recovery_over_durable_with_first_step":
                round(sec["recovery_peers"] / sec["recovery_durable"], 3),
            "per_rep_s": {k: [round(x, 3) for x in _slowest(results, *k.split("."))]
                          for k in ("save.durable", "save.local", "save.local_async",
                                    "save.local_async_written", "resume_only.local",
                                    "resume_only.peers", "resume_only.durable", "save.local_total",
                                    "save.local_total_secret", "resume_only.peers_secret")},
            "setup_s": round(max(r["setup_s"] for r in results), 1), "wall_s": round(wall, 1),
        })
    print(json.dumps(line))


if __name__ == "__main__":
    main()
