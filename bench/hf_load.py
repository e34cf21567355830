"""Benchmark: start a sharded run from a Hugging Face checkpoint, per rank time and peak RSS.

A Llama-3-shaped model (untied head; about 250M parameters, a 1 GB fp32 ``model.safetensors``
set written by ``save_pretrained``) on 2 and 4 gloo CPU ranks, three ways, each a fresh job:

* ``shardckpt``: the model built on the meta device, ``ZeroEngine``, ``load_hf`` (each rank reads
  only its own byte ranges);
* ``from_pretrained``: what users do today: ``transformers``' ``from_pretrained`` on every rank
  (a whole copy each), then ``ZeroEngine`` shards it;
* ``fsdp2``: FSDP2's own path: the model on meta, ``fully_shard`` per decoder layer and the root,
  rank 0 reads the whole state dict, ``set_model_state_dict(full_state_dict=True,
  broadcast_from_rank0=True)`` (skipped, with the reason, where it does not run).

Time: from after the process group is up to the model ready, the slowest rank (for shardckpt,
also split into ``ZeroEngine`` construction, which materializes one unit at a time to initialize
it, and ``load_hf`` itself, each with its own peak in ``--json``). Peak RSS: each
rank's high-water mark (``VmHWM``, reset after imports and start-up where the kernel allows, so
it covers the load plus the process's baseline, which is reported too). The files are read once
before the jobs so that every side starts from a warm page cache.

    python bench/hf_load.py [--params 250M] [--ranks 2,4] [--threads 1] [--workdir DIR] [--json]

Prints a table and the ratios against the targets (memory per rank below one full copy; faster
than ``from_pretrained``). Nothing here asserts.
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

from shardckpt.training.launch import free_port

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

SIDES = ("shardckpt", "from_pretrained", "fsdp2")


def hf_config(params: int) -> dict[str, Any]:
    vocab, h, inter, heads, kv = 32000, 1024, 2816, 16, 8
    layer = 2 * h * h + 2 * h * (h // heads * kv) + 3 * h * inter + 2 * h
    layers = max(1, round((params - 2 * vocab * h - h) / layer))
    return {"vocab_size": vocab, "hidden_size": h, "intermediate_size": inter,
            "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv,
            "tie_word_embeddings": False}


def write_model(folder: Path, params: int) -> int:
    import torch
    import transformers

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**hf_config(params)))
    model.save_pretrained(folder, max_shard_size="300MB")
    return sum(p.numel() for p in model.parameters())


def _status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key):
            return int(line.split()[1]) * 1024
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _reset_peak() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def _load(side: str, folder: str, world: int, phases: dict[str, Any]) -> Any:
    import torch

    t0 = time.perf_counter()
    if side == "shardckpt":
        from shardckpt.runtime import ZeroEngine
        from shardckpt.runtime.init import skip_weight_init
        from shardckpt.training.hf_load import load_hf
        from shardckpt.runtime.models.llama import LLAMA_POLICY, LlamaConfig, LlamaForCausalLM

        cfg = LlamaConfig.from_hf_config(json.loads(Path(folder, "config.json").read_text()))
        with torch.device("meta"):
            model = LlamaForCausalLM(cfg)
        phases["build_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        engine = ZeroEngine(model, policy=LLAMA_POLICY, init_fn=skip_weight_init)
        phases.update(construct_s=time.perf_counter() - t0, construct_peak=_status("VmHWM:"),
                      reset=_reset_peak())
        t0 = time.perf_counter()
        load_hf(engine, folder)
        phases.update(load_s=time.perf_counter() - t0, load_peak=_status("VmHWM:"))
        return engine
    import transformers
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    if side == "from_pretrained":
        from shardckpt.runtime import ZeroEngine

        model = transformers.LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32)
        return ZeroEngine(model, policy=LlamaDecoderLayer)
    import torch.distributed as dist
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    config = transformers.AutoConfig.from_pretrained(folder)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    full: dict[str, Any] = {}
    if dist.get_rank() == 0:
        for f in sorted(Path(folder).glob("*.safetensors")):
            full.update(load_file(str(f)))
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True,
                                                               broadcast_from_rank0=True))
    return model


def rank_main(side: str, rank: int, world: int, folder: str, port: int, threads: int,
              out: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    result: dict[str, Any] = {"side": side, "rank": rank}
    try:
        import torch
        import torch.distributed as dist
        # Every side's imports happen here, outside the timing (start-up is not loading).
        import safetensors.torch  # noqa: F401
        import torch.distributed.checkpoint.state_dict  # noqa: F401
        import torch.distributed.fsdp  # noqa: F401
        import transformers.models.llama.modeling_llama  # noqa: F401

        import shardckpt.runtime.engine  # noqa: F401
        import shardckpt.runtime.init  # noqa: F401
        import shardckpt.runtime.models.llama  # noqa: F401
        import shardckpt.storage  # noqa: F401
        import shardckpt.training.hf_load  # noqa: F401

        torch.set_num_threads(threads)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world, timeout=datetime.timedelta(seconds=3600))
        result["baseline_rss"] = _status("VmRSS:")
        result["rss_reset"] = _reset_peak()
        dist.barrier()
        t0 = time.perf_counter()
        phases: dict[str, Any] = {}
        model = _load(side, folder, world, phases)
        dist.barrier()
        result.update(seconds=time.perf_counter() - t0, peak_rss=_status("VmHWM:"), ok=True,
                      phases=phases)
        if "construct_peak" in phases:  # the whole run's peak, not the one since the reset
            result["peak_rss"] = max(phases["construct_peak"], phases["load_peak"])
        del model
        dist.destroy_process_group()
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        result.update(ok=False, error=f"{type(exc).__name__}: {str(exc)[:300]}",
                      tb=traceback.format_exc()[-3000:])
    Path(out, f"{side}-{rank}.json").write_text(json.dumps(result))
    os._exit(0)


def run_side(side: str, world: int, folder: str, threads: int) -> dict[str, Any]:
    ctx = multiprocessing.get_context("spawn")
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="hf-load-") as out:
        procs = [ctx.Process(target=rank_main, args=(side, r, world, folder, port, threads, out))
                 for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(3600)
            if p.is_alive():
                p.kill()
        ranks = []
        for r in range(world):
            path = Path(out, f"{side}-{r}.json")
            ranks.append(json.loads(path.read_text()) if path.exists()
                         else {"ok": False, "error": "no result (crashed)"})
    failed = [r for r in ranks if not r.get("ok")]
    if failed:
        return {"side": side, "ranks": world, "ok": False, "error": failed[0].get("error")}
    return {"side": side, "ranks": world, "ok": True,
            "seconds": max(r["seconds"] for r in ranks),
            "peak_rss_mb": [round(r["peak_rss"] / 1e6) for r in ranks],
            "baseline_rss_mb": [round(r["baseline_rss"] / 1e6) for r in ranks],
            "rss_reset": all(r["rss_reset"] for r in ranks),
            "phases": [r["phases"] for r in ranks]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", default="250M")
    ap.add_argument("--ranks", default="2,4")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    params = int(float(args.params.rstrip("MmBb")) * (1e9 if args.params[-1] in "Bb" else 1e6))
    with tempfile.TemporaryDirectory(prefix="hf-bench-", dir=args.workdir) as tmp:
        folder = Path(tmp, "model")
        n = write_model(folder, params)
        file_bytes = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
        for f in folder.glob("*.safetensors"):  # warm the page cache for every side alike
            with open(f, "rb") as fh:
                while fh.read(1 << 24):
                    pass
        rows = [run_side(side, int(w), str(folder), args.threads)
                for w in args.ranks.split(",") for side in SIDES]
    for row in rows:
        base = next((r for r in rows if r["side"] == "from_pretrained" and r["ranks"] == row["ranks"]
                     and r["ok"]), None)
        if row["ok"]:
            row["peak_vs_full_copy"] = round(max(row["peak_rss_mb"]) * 1e6 / file_bytes, 2)
            row["load_mb_vs_full_copy"] = round(max(p - b for p, b in zip(
                row["peak_rss_mb"], row["baseline_rss_mb"], strict=False)) * 1e6 / file_bytes, 2)
            if base:
                row["time_vs_from_pretrained"] = round(row["seconds"] / base["seconds"], 2)
    if args.json:
        print(json.dumps({"params": n, "file_bytes": file_bytes, "rows": rows}, indent=2))
        return
    print(f"{n / 1e6:.0f}M parameters, {file_bytes / 1e9:.2f} GB of safetensors")
    print(f"{'side':<16}{'ranks':>6}{'seconds':>10}{'peak RSS MB/rank':>26}{'load/full copy':>16}"
          f"{'time vs today':>15}")
    for r in rows:
        if not r["ok"]:
            print(f"{r['side']:<16}{r['ranks']:>6}   failed: {r['error']}")
            continue
        print(f"{r['side']:<16}{r['ranks']:>6}{r['seconds']:>10.2f}{str(r['peak_rss_mb']):>26}"
              f"{r['load_mb_vs_full_copy']:>16}{r.get('time_vs_from_pretrained', ''):>15}")


if __name__ == "__main__":
    sys.exit(main())
