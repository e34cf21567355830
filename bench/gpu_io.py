"""Checkpoint I/O on one device against DCP and the disk: one prepared run, same state for all.

    python bench/gpu_io.py [--device cuda|cpu] [--small] [--reps 3] [--out FILE]
                           [--workdir DIR] [--budget-s 230] [--json]

One process, world 1. The state is the built-in Llama (about 0.30 B parameters, ``LLAMA_300M`` of
``bench/gpu_check.py``; ``--small``: a tiny one) under a ``ZeroEngine`` + ``ShardedAdamW`` after
one training step: fp32 masters and two AdamW moments, about 3.6 GB, on the device. Every variant
moves those same tensors (DCP gets them as a flat ``{"state": {group.kind: tensor}}`` dict of the
engine's own device shards, so its planner sees plain tensors at world 1). Each figure is the
median of ``--reps`` runs; every rate is state bytes / seconds, so they compare as the same work.

* ``ours_sync_save`` / ``ours_load``: ``Checkpointer.save`` (sync) and ``Checkpointer.load`` into
  the device shards (zeroed first; bit-equality checked after);
* ``ours_async_save``: ``Checkpointer(async_save=True)``: the first ``save()``'s blocking time
  (pinned staging allocated there today), later ones', the staging rate, the total;
* ``dcp_save_t1`` / ``dcp_save_t8`` / ``dcp_load``: ``dcp.save`` with ``FileSystemWriter``
  (``thread_count`` 1 and 8) and ``dcp.load`` with ``FileSystemReader``;
* ``dcp_async_save``: ``dcp.async_save`` (default writer) through a ``cpu:gloo,cuda:nccl`` group
  (gloo alone on CPU); ``dcp_async_pinned``: the same with ``DefaultStager(StagingOptions(...))``,
  options probed from all on down to pinned memory alone; each refusal is recorded as a result;
* ``dcp_sc_save`` / ``dcp_sc_load``: ``dcp.save``/``dcp.load`` through ``ShardckptWriter`` /
  ``ShardckptReader``;
* ``disk_1`` / ``disk_8``: the plain disk with 1 and 8 streams (16 MiB writes + fsync; reads after
  ``POSIX_FADV_DONTNEED``, which the kernel may ignore: read rates may include page-cache hits);
* ``pinned_copy``: a plain device-to-pinned-host copy of the state's byte count (the staging limit);
* ``ours_local_async``: the node-local tier of a ``Checkpointer(async_save=True)`` (in
  ``/dev/shm`` where it has room): what ``save()`` blocks and when its files, written from the
  device shards in the background, are (``local_async_blocked_s`` at the top level).

Every part is guarded: an error is recorded under ``errors`` and the next part runs; a part whose
estimate no longer fits ``--budget-s`` is recorded as skipped. The table goes to stdout (the JSON
too with ``--json``); ``--out`` gets the JSON, with the ratios at its top level
(``save_vs_disk_8``, ``load_vs_disk_8``, ``save_vs_dcp_best``, ``load_vs_dcp_best``,
``first_async_blocked_s``, ...). DCP's best is the faster of its ``FileSystemWriter`` settings.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
import _disk_limit  # noqa: E402
import gpu_check as chk  # noqa: E402

SCHEMA = "shardckpt-gpu-io/1"
SIZES = {"full": dict(model=chk.LLAMA_300M, seq=256, batch=1),
         "small": dict(model=chk.LLAMA_SMALL, seq=16, batch=1)}
#: Rough seconds of each part per repetition on one H200 at the full size (budget check).
ESTIMATE_S = {"pinned_copy": 3, "disk_1": 6, "disk_8": 4, "ours_sync_save": 5, "ours_load": 8,
              "ours_async_save": 5, "dcp_save_t1": 6, "dcp_save_t8": 5, "dcp_load": 4,
              "dcp_async_save": 7, "dcp_async_pinned": 7, "dcp_sc_save": 5, "dcp_sc_load": 5,
              "ours_local_async": 5}


class Bench:
    """The state, the groups, the timings and the JSON record of one run."""

    def __init__(self, args: argparse.Namespace) -> None:
        import torch
        import torch.distributed as dist

        from shardckpt.training.launch import free_port, rank_env

        self.args, self.start = args, time.perf_counter()
        self.ctx = chk.Ctx(argparse.Namespace(small=args.small, device=args.device,
                                              workdir=args.workdir))
        cuda = self.ctx.cuda
        os.environ.update(rank_env(0, 1, free_port()))
        self.pm = self.ctx.pm()  # NCCL on CUDA (the project's own set-up), gloo on CPU
        # DCP's async save needs a CPU backend: its own world-1 group with both
        self.group = dist.new_group(backend="cpu:gloo,cuda:nccl" if cuda else "gloo")
        sz = SIZES["small" if args.small else "full"]
        cfg = chk.llama_config(sz["model"], sz["seq"])
        self.engine, opt = chk.zero_engine(self.ctx, cfg, pm=self.pm)
        tokens = chk.token_batches(cfg, sz["seq"], sz["batch"], 1, self.ctx.device)[0]
        chk.train_step(self.ctx, self.engine, opt, tokens)  # the AdamW moments exist, not zero
        self.shards = {f"{g}.{k}": t for g, kinds in self.engine.local_shards().items()
                       for k, t in kinds.items()}
        self.ref = {k: t.detach().clone() for k, t in self.shards.items()}
        self.nbytes = sum(t.numel() * t.element_size() for t in self.shards.values())
        self.root = self.ctx.workdir("io")
        self.rec: dict[str, Any] = {
            "schema": SCHEMA, "command": " ".join(["python", "bench/gpu_io.py", *sys.argv[1:]]),
            "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "environment": {"torch": torch.__version__, "cuda": torch.version.cuda,
                            "device": torch.cuda.get_device_name(0) if cuda else "cpu",
                            "workdir": self.root, "workdir_fs": chk.fs_type(self.root),
                            "dcp_group_backend": str(dist.get_backend(self.group))},
            "settings": {"model": sz["model"], "params": sum(p.numel for p in self.engine.layout.params),
                         "state_bytes": self.nbytes, "tensors": len(self.shards), "reps": args.reps,
                         "state": "fp32 masters + AdamW moments (ZeRO-3, world 1) on the device",
                         "rates": "GB/s = state bytes / seconds, the same work for every variant",
                         "page_cache": "not dropped (needs root); files get POSIX_FADV_DONTNEED "
                                       "before each read, so read rates may include cache hits"},
            "parts": {}, "errors": {}, "skipped": {}}

    # -------------------------------------------------------------------- plumbing

    def dir(self, name: str) -> str:
        return os.path.join(self.root, name)

    def part(self, name: str, fn: Callable[[Bench], dict[str, Any]]) -> None:
        """Run one part unless the budget is spent; record its result or its error."""
        elapsed = time.perf_counter() - self.start
        need = 1 if self.args.small else ESTIMATE_S[name] * self.args.reps
        if elapsed + need > self.args.budget_s:
            self.rec["skipped"][name] = (f"{elapsed:.0f} s of --budget-s {self.args.budget_s:.0f} "
                                         f"used; this part needs about {need} s")
            chk.log(f"{name}: skipped")
            return
        chk.log(f"{name} ...")
        self.reset_pinned_peak()
        t0 = time.perf_counter()
        try:
            out = fn(self)
            out["pinned_host_peak_bytes"] = self.pinned_peak()
            self.rec["parts"][name] = out
        except Exception as exc:  # noqa: BLE001 - recorded; the next part runs
            self.rec["errors"][name] = chk.error_record(exc)
            chk.log(f"  {name}: {type(exc).__name__}: {str(exc)[:300]}")
            self.restore()
        chk.log(f"{name}: {time.perf_counter() - t0:.1f} s")
        self.ctx.free()
        self.free_pinned()
        chk.write_json(self.rec, self.args.out)

    def free_pinned(self) -> None:
        """Return the pinned blocks cached by torch's host allocator, so that no part starts
        with another's pinned memory (the first async save would otherwise reuse it)."""
        import torch

        empty = getattr(torch._C, "_host_emptyCache", None)
        if self.ctx.cuda and empty is not None:
            empty()

    def reset_pinned_peak(self) -> None:
        import torch

        if self.ctx.cuda and hasattr(torch.cuda, "reset_peak_host_memory_stats"):
            torch.cuda.reset_peak_host_memory_stats()

    def pinned_peak(self) -> int | None:
        import torch

        if not self.ctx.cuda or not hasattr(torch.cuda, "host_memory_stats"):
            return None
        return int(torch.cuda.host_memory_stats().get("allocated_bytes.peak", 0))

    def timed(self, fn: Callable[[], Any]) -> float:
        self.ctx.sync()
        t0 = time.perf_counter()
        fn()
        self.ctx.sync()
        return time.perf_counter() - t0

    def zero(self) -> None:
        """Zero the destination shards, so that a load that does nothing shows."""
        import torch

        with torch.no_grad():
            for t in self.shards.values():
                t.zero_()
        self.ctx.sync()

    def restore(self) -> None:
        import torch

        with torch.no_grad():
            for k, t in self.shards.items():
                t.copy_(self.ref[k])
        self.ctx.sync()

    def equal(self) -> bool:
        import torch

        return all(torch.equal(self.ref[k], t) for k, t in self.shards.items())

    def loads(self, folder: str, fn: Callable[[], Any]) -> dict[str, Any]:
        """``--reps`` timed loads of ``folder`` by ``fn``, each into zeroed shards, after
        POSIX_FADV_DONTNEED; checks the state is back bit for bit."""
        times = []
        for _ in range(self.args.reps):
            self.zero()
            advised = chk._fadvise_dontneed(folder)
            times.append(self.timed(fn))
        same = self.equal()
        self.restore()
        return self.summary(times, bit_equal_after=same, fadvise_dontneed=advised)

    def saves(self, name: str, fn: Callable[[str], Any]) -> dict[str, Any]:
        """``--reps`` timed saves by ``fn(folder)``, each into a fresh folder (the previous one
        removed before the clock starts); the last one stays for the load."""
        folder, times = self.dir(name), []
        for _ in range(self.args.reps):
            shutil.rmtree(folder, ignore_errors=True)
            times.append(self.timed(lambda: fn(folder)))
        return self.summary(times, bytes_written=chk._dir_bytes(folder))

    def summary(self, times: list[float], **more: Any) -> dict[str, Any]:
        med = chk.median(times)
        return {"s": [round(x, 4) for x in times], "median_s": round(med, 4),
                "gbs": chk.rate(self.nbytes, med), **more}

    def dcp_state(self) -> dict[str, Any]:
        return {"state": dict(self.shards)}


# ========================================================================= the parts


def pinned_copy(b: Bench) -> dict[str, Any]:
    return chk.pinned_copy_limit(b.ctx, b.nbytes, reps=b.args.reps)


def disk(b: Bench, n: int) -> dict[str, Any]:
    runs = [_disk_limit.streams(b.dir(f"disk-{n}"), b.nbytes, n) for _ in range(b.args.reps)]
    w = chk.median([r["write_fsync_s"] for r in runs])
    r = chk.median([r["read_s"] for r in runs])
    return {"streams": n, "write_s": [round(x["write_fsync_s"], 4) for x in runs],
            "read_s": [round(x["read_s"], 4) for x in runs], "write_median_s": round(w, 4),
            "read_median_s": round(r, 4), "write_gbs": chk.rate(b.nbytes, w),
            "read_gbs": chk.rate(b.nbytes, r), "fadvise_dontneed": runs[-1]["fadvise_dontneed"],
            "what": "16 MiB os.write + fsync per stream, one file each; 16 MiB readinto after "
                    "POSIX_FADV_DONTNEED (reads may include page-cache hits)"}


def ours_sync_save(b: Bench) -> dict[str, Any]:
    from shardckpt.training.checkpointer import Checkpointer

    def save(folder: str) -> None:
        Checkpointer(folder, b.engine, keep_last=None).save(1)

    return b.saves("ours-sync", save)


def ours_load(b: Bench) -> dict[str, Any]:
    from shardckpt.training.checkpointer import Checkpointer

    ck = Checkpointer(b.dir("ours-sync"), b.engine, keep_last=None)
    url = ck.manager.url_for(1)
    return b.loads(b.dir("ours-sync"), lambda: ck.load(url))


def _staging_bytes(ck: Any) -> int | None:
    got = getattr(ck, "staging_bytes", None)
    if isinstance(got, int):
        return got
    staging = getattr(ck, "_staging", None) or {}
    return sum(t.numel() * t.element_size() for kinds in staging.values()
               for t in kinds.values() if t is not None)


def _async_saves(b: Bench, ck: Any, after: Callable[[int], None] = lambda step: None
                 ) -> list[dict[str, Any]]:
    """``reps + 1`` timed saves of the async ``ck`` (the first apart: it may allocate): how long
    ``save()`` blocks, when the shards may change again (``staged_after_s``, noted by a thread
    of its own) and when the save is committed; ``after(step)`` once each is."""
    saves = []
    for step in range(1, b.args.reps + 2):
        b.ctx.sync()
        t0 = time.perf_counter()
        ck.save(step)
        blocked = time.perf_counter() - t0
        staged = chk._staged_watch(ck)() - t0
        ck.wait()
        saves.append({"step": step, "blocked_s": round(blocked, 5), "staged_after_s": round(staged, 4),
                      "staging_gbs": chk.rate(b.nbytes, max(staged - blocked, 1e-9)),
                      "committed_after_s": round(time.perf_counter() - t0, 4)})
        after(step)
    return saves


def ours_async_save(b: Bench) -> dict[str, Any]:
    """``reps + 1`` async saves with one Checkpointer: the first apart (it may allocate)."""
    from shardckpt.training.checkpointer import Checkpointer

    folder = b.dir("ours-async")
    shutil.rmtree(folder, ignore_errors=True)
    ck = Checkpointer(folder, b.engine, async_save=True, keep_last=None)
    try:
        saves = _async_saves(b, ck, lambda step: shutil.rmtree(
            os.path.join(folder, f"step-{step - 1:08d}"), ignore_errors=True))
        staging_bytes = _staging_bytes(ck)
    finally:
        ck.close()
    later = saves[1:]
    total = chk.median([s["committed_after_s"] for s in later])
    return {"saves": saves, "first_blocked_s": saves[0]["blocked_s"],
            "later_blocked_s": chk.median([s["blocked_s"] for s in later]),
            "staging_gbs": chk.median([s["staging_gbs"] for s in later]),
            "total_median_s": total, "total_gbs": chk.rate(b.nbytes, total),
            "staging_bytes": staging_bytes}


def _local_root(b: Bench) -> str:
    """Where the node-local tier goes: ``/dev/shm`` where it has room for three copies of the
    state (two kept steps and a spare), else the work directory."""
    shm = "/dev/shm"
    try:
        st = os.statvfs(shm)
        if os.path.isdir(shm) and st.f_bavail * st.f_frsize > 3 * b.nbytes:
            return tempfile.mkdtemp(prefix="gpu-io-local-", dir=shm)
    except OSError:
        pass
    return tempfile.mkdtemp(prefix="gpu-io-local-", dir=b.root)


def ours_local_async(b: Bench) -> dict[str, Any]:
    """``reps + 1`` saves to the node-local tier of an async Checkpointer (its files written from
    the device shards in the background): the time ``save()`` blocks, and when the files are
    written (``staged_after_s``: what the next update waits for at most); the first apart."""
    from shardckpt.checkpoint.tiers import LocalTier
    from shardckpt.training.checkpointer import Checkpointer

    root = _local_root(b)
    ck = Checkpointer(b.dir("ours-local-async"), b.engine, async_save=True, keep_last=None,
                      local=LocalTier(path=root, every=1, keep=2, peers=0, ranks_per_node=1),
                      durable_every=10 ** 9, max_staging_bytes=0)
    try:
        saves = _async_saves(b, ck)
    finally:
        ck.close()
        shutil.rmtree(root, ignore_errors=True)
    later = saves[1:]
    written = chk.median([s["staged_after_s"] for s in later])
    return {"saves": saves, "where": root, "first_blocked_s": saves[0]["blocked_s"],
            "later_blocked_s": chk.median([s["blocked_s"] for s in later]),
            "written_median_s": written, "written_gbs": chk.rate(b.nbytes, written)}


def dcp_save(b: Bench, threads: int) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    def save(folder: str) -> None:
        dcp.save(b.dcp_state(), storage_writer=FileSystemWriter(folder, thread_count=threads),
                 process_group=b.group)

    return {"thread_count": threads, **b.saves(f"dcp-t{threads}", save)}


def dcp_load(b: Bench) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    best = max(("dcp-t8", "dcp-t1"), key=lambda d: os.path.exists(os.path.join(b.dir(d), ".metadata")))
    folder = b.dir(best)

    def load() -> None:
        dcp.load(b.dcp_state(), storage_reader=FileSystemReader(folder), process_group=b.group)

    return {"from": best, **b.loads(folder, load)}


def _async_one(b: Bench, folder: str, stager: Any) -> dict[str, float]:
    """One ``dcp.async_save``: seconds until it returns, until staged, until written."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    shutil.rmtree(folder, ignore_errors=True)
    kw = {"async_stager": stager} if stager is not None else {}
    b.ctx.sync()
    t0 = time.perf_counter()
    res = dcp.async_save(b.dcp_state(), storage_writer=FileSystemWriter(folder),
                         process_group=b.group, **kw)
    blocked = time.perf_counter() - t0
    staging = getattr(res, "staging_completion", None)
    upload = getattr(res, "upload_completion", res)
    staged = blocked
    if staging is not None:
        staging.result()
        staged = time.perf_counter() - t0
    upload.result()
    return {"blocked_s": round(blocked, 5), "staged_after_s": round(staged, 4),
            "done_after_s": round(time.perf_counter() - t0, 4)}


def _async_series(b: Bench, folder: str, stager: Any) -> dict[str, Any]:
    runs = [_async_one(b, folder, stager) for _ in range(b.args.reps + (stager is not None))]
    later = runs[1:] if stager is not None else runs  # a stager's first save allocates
    return {"runs": runs, "first_blocked_s": runs[0]["blocked_s"],
            "blocked_median_s": chk.median([r["blocked_s"] for r in later]),
            "done_median_s": chk.median([r["done_after_s"] for r in later])}


def dcp_async_save(b: Bench) -> dict[str, Any]:
    return _async_series(b, b.dir("dcp-async"), None)


#: StagingOptions(use_pinned_memory, use_shared_memory, use_async_staging, use_non_blocking_copy)
STAGER_PROBES = ((True, True, True, True), (True, False, True, True), (True, False, False, True),
                 (True, False, False, False))


def dcp_async_pinned(b: Bench) -> dict[str, Any]:
    """DCP's pinned-memory stager: the first option set that works, each refusal recorded."""
    try:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    except ImportError as exc:
        return {"available": False, "why": f"{type(exc).__name__}: {exc}"}
    probes: list[dict[str, Any]] = []
    for opts in STAGER_PROBES:
        options = dict(zip(("use_pinned_memory", "use_shared_memory", "use_async_staging",
                            "use_non_blocking_copy"), opts, strict=True))
        stager = None
        try:
            stager = DefaultStager(StagingOptions(*opts))
            out = _async_series(b, b.dir("dcp-async-pinned"), stager)
            return {"available": True, "options": options, "refused": probes, **out}
        except Exception as exc:  # noqa: BLE001 - a refusal is a result
            probes.append({"options": options, "error": f"{type(exc).__name__}: {str(exc)[:500]}"})
            b.restore()
        finally:
            if stager is not None and hasattr(stager, "close"):
                stager.close()
    return {"available": True, "works": False, "refused": probes}


def dcp_sc_save(b: Bench) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp

    from shardckpt.interop.dcp.storage import ShardckptWriter

    def save(folder: str) -> None:
        dcp.save(b.dcp_state(), storage_writer=ShardckptWriter(folder), process_group=b.group)

    return b.saves("dcp-sc", save)


def dcp_sc_load(b: Bench) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp

    from shardckpt.interop.dcp.storage import ShardckptReader

    folder = b.dir("dcp-sc")

    def load() -> None:
        dcp.load(b.dcp_state(), storage_reader=ShardckptReader(folder), process_group=b.group)

    return b.loads(folder, load)


PARTS: dict[str, Callable[[Bench], dict[str, Any]]] = {
    # the first async save first: no pinned memory cached in this process yet
    "ours_async_save": ours_async_save, "ours_sync_save": ours_sync_save, "ours_load": ours_load,
    "pinned_copy": pinned_copy, "disk_8": lambda b: disk(b, 8),
    "dcp_save_t1": lambda b: dcp_save(b, 1), "dcp_save_t8": lambda b: dcp_save(b, 8),
    "dcp_load": dcp_load, "dcp_async_save": dcp_async_save, "dcp_async_pinned": dcp_async_pinned,
    "dcp_sc_save": dcp_sc_save, "dcp_sc_load": dcp_sc_load, "disk_1": lambda b: disk(b, 1),
    "ours_local_async": ours_local_async}

# ======================================================================= the summary


def _get(rec: dict[str, Any], part: str, key: str) -> Any:
    return rec["parts"].get(part, {}).get(key)


def summarize(rec: dict[str, Any]) -> None:
    """The top-level figures and ratios (None where a part did not run)."""
    g = lambda part, key="gbs": _get(rec, part, key)  # noqa: E731
    save, load = g("ours_sync_save"), g("ours_load")
    dcp_saves = [x for x in (g("dcp_save_t1"), g("dcp_save_t8")) if x]
    dcp_save_best = max(dcp_saves) if dcp_saves else None
    rec.update({
        "save_gbs": save, "load_gbs": load, "dcp_save_best_gbs": dcp_save_best,
        "dcp_load_gbs": g("dcp_load"), "disk_8_write_gbs": g("disk_8", "write_gbs"),
        "disk_8_read_gbs": g("disk_8", "read_gbs"),
        "save_vs_disk_8": chk.ratio(save, g("disk_8", "write_gbs")),
        "load_vs_disk_8": chk.ratio(load, g("disk_8", "read_gbs")),
        "save_vs_dcp_best": chk.ratio(save, dcp_save_best),
        "load_vs_dcp_best": chk.ratio(load, g("dcp_load")),
        "save_vs_dcp_sc": chk.ratio(save, g("dcp_sc_save")),
        "load_vs_dcp_sc": chk.ratio(load, g("dcp_sc_load")),
        "first_async_blocked_s": g("ours_async_save", "first_blocked_s"),
        "later_async_blocked_s": g("ours_async_save", "later_blocked_s"),
        "dcp_async_blocked_s": g("dcp_async_save", "blocked_median_s"),
        "dcp_async_pinned_blocked_s": g("dcp_async_pinned", "blocked_median_s"),
        "staging_gbs": g("ours_async_save", "staging_gbs"),
        "pinned_copy_gbs": g("pinned_copy"),
        "staging_vs_pinned_copy": chk.ratio(g("ours_async_save", "staging_gbs"), g("pinned_copy")),
        "staging_bytes": g("ours_async_save", "staging_bytes"),
        "local_async_blocked_s": g("ours_local_async", "later_blocked_s"),
        "peak_pinned_host_bytes": max([p.get("pinned_host_peak_bytes") or 0
                                       for p in rec["parts"].values()], default=0) or None,
        "loads_bit_equal": {k: p["bit_equal_after"] for k, p in rec["parts"].items()
                            if "bit_equal_after" in p}})


def print_table(rec: dict[str, Any]) -> None:
    s = rec["settings"]
    print(f"{rec['environment']['device']}: {s['params'] / 1e6:.0f}M-param Llama, state "
          f"{s['state_bytes'] / 1e9:.3f} GB ({s['tensors']} tensors), median of {s['reps']}; "
          f"{rec['environment']['workdir_fs']} at {rec['environment']['workdir']}")
    print(f"{'variant':<44} {'median s':>9} {'GB/s':>7}")
    rows = [("save  shardckpt Checkpointer (sync)", "ours_sync_save", "median_s", "gbs"),
            ("load  shardckpt Checkpointer.load -> device", "ours_load", "median_s", "gbs"),
            ("save  DCP FileSystemWriter thread_count=1", "dcp_save_t1", "median_s", "gbs"),
            ("save  DCP FileSystemWriter thread_count=8", "dcp_save_t8", "median_s", "gbs"),
            ("load  DCP FileSystemReader", "dcp_load", "median_s", "gbs"),
            ("save  DCP via ShardckptWriter", "dcp_sc_save", "median_s", "gbs"),
            ("load  DCP via ShardckptReader", "dcp_sc_load", "median_s", "gbs"),
            ("disk  1 stream write+fsync", "disk_1", "write_median_s", "write_gbs"),
            ("disk  1 stream read (after DONTNEED)", "disk_1", "read_median_s", "read_gbs"),
            ("disk  8 streams write+fsync", "disk_8", "write_median_s", "write_gbs"),
            ("disk  8 streams read (after DONTNEED)", "disk_8", "read_median_s", "read_gbs"),
            ("copy  device -> pinned host", "pinned_copy", "median_s", "gbs"),
            ("async shardckpt: total until committed", "ours_async_save", "total_median_s", "total_gbs"),
            ("async shardckpt: first save() blocked", "ours_async_save", "first_blocked_s", None),
            ("async shardckpt: later save() blocked", "ours_async_save", "later_blocked_s", None),
            ("async shardckpt: staging", "ours_async_save", None, "staging_gbs"),
            ("async dcp.async_save blocked", "dcp_async_save", "blocked_median_s", None),
            ("async dcp.async_save + pinned stager blocked", "dcp_async_pinned", "blocked_median_s", None),
            ("async local tier: later save() blocked", "ours_local_async", "later_blocked_s", None),
            ("async local tier: files written", "ours_local_async", "written_median_s", "written_gbs")]
    for label, part, sk, gk in rows:
        why = "error" if part in rec["errors"] else "skipped" if part in rec["skipped"] else "-"
        sec = _get(rec, part, sk) if sk else None
        gbs = _get(rec, part, gk) if gk else None
        sec_s = f"{sec:.4g}" if isinstance(sec, float) else why
        print(f"{label:<44} {sec_s:>9} {gbs if gbs is not None else '':>7}")
    for key in ("save_vs_disk_8", "load_vs_disk_8", "save_vs_dcp_best", "load_vs_dcp_best",
                "save_vs_dcp_sc", "load_vs_dcp_sc", "staging_vs_pinned_copy",
                "first_async_blocked_s", "later_async_blocked_s", "staging_bytes",
                "peak_pinned_host_bytes", "loads_bit_equal"):
        print(f"{key:<44} {rec.get(key)}")
    for part, err in rec["errors"].items():
        print(f"error in {part}: {err['type']}: {err['message'][:200]}")
    print("read rates may include page-cache hits (POSIX_FADV_DONTNEED only; caches not dropped)")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--small", action="store_true", help="a tiny model: tests the script")
    ap.add_argument("--reps", type=int, default=3, help="runs per figure (the median is kept)")
    ap.add_argument("--out", help="write the JSON here (rewritten after each part)")
    ap.add_argument("--workdir", help="where the files go (default: the temporary directory, "
                                      "or ./.gpu-check-tmp if that is tmpfs)")
    ap.add_argument("--budget-s", type=float, default=230.0,
                    help="skip a part whose estimate no longer fits (default 230)")
    ap.add_argument("--only", help="comma-separated parts (default: all)")
    ap.add_argument("--json", action="store_true", help="print the JSON after the table")
    args = ap.parse_args(argv)
    args.only = [p for p in PARTS if p in args.only.split(",")] if args.only else list(PARTS)
    return args


def main(argv: list[str] | None = None) -> int:
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    args = parse_args(argv)
    import torch
    import torch.distributed as dist

    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_io: no CUDA device; nothing was run (--device cpu runs it on CPU)",
              file=sys.stderr)
        return 2
    b = Bench(args)
    try:
        for name in args.only:
            b.part(name, PARTS[name])
    finally:
        shutil.rmtree(b.root, ignore_errors=True)
        b.engine.close()
        if dist.is_initialized():
            dist.destroy_process_group()
    b.rec["elapsed_s"] = round(time.perf_counter() - b.start, 2)
    summarize(b.rec)
    chk.write_json(b.rec, args.out)
    print_table(b.rec)
    if args.json:
        print(json.dumps(b.rec, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
