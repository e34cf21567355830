"""Helper for bench/consolidate.py: the torch.distributed.checkpoint (DCP) side.

    python bench/_dcp_consolidate_worker.py save DIR --params P --units U --ranks N [--seed S]
    python bench/_dcp_consolidate_worker.py consolidate IN OUT MAPPING.json [--threads T]

``save`` runs a gloo process group of N CPU ranks. Each rank holds an FSDP2-style shard
(``Shard(0)`` on a 1-D mesh, ``torch.chunk`` sizes) of every parameter of ``synth.llama_params``,
as a DTensor filled from ``synth.values(seed, fqn, "master", ...)``, plus the persistent buffer
replicated (a plain tensor, deduplicated by DCP), then calls ``dcp.save`` with
``HuggingFaceStorageWriter(save_distributed=True)``: one ``shard-0000r-model-00001-of-00001``
file per rank, each with its ``DCP_SHARDING_INFO``. Tied aliases are left out, as shardckpt does.

``consolidate`` is what the benchmark times: one fresh process that imports torch and calls
``consolidate_safetensors_files(IN, OUT, fqn_to_index_mapping, num_threads)``; ``--timing FILE``
also records the seconds of that call alone (without interpreter start and imports), and of the
call followed by an fsync of every file it wrote (``seconds_durable``): DCP leaves its output in
the page cache, shardckpt fsyncs its own.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time


def _shard_rows(n: int, world: int, rank: int) -> tuple[int, int]:
    """Rows [a, b) of dim 0 that rank holds under torch.chunk (what FSDP2's Shard(0) uses)."""
    c = -(-n // world) if n else 0
    a = min(n, rank * c)
    return a, min(n, a + c)


def _save_rank(rank: int, args: argparse.Namespace, port: int) -> None:
    import numpy as np
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from shardckpt.tools.synth import llama_params, values

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=args.ranks)
    try:
        mesh = init_device_mesh("cpu", (args.ranks,))
        infos, buffers, _aliases = llama_params(args.params, args.units)
        state: dict[str, object] = {}
        for p in infos:
            shape = tuple(p.shape)
            row = math.prod(shape[1:])
            a, b = _shard_rows(shape[0], args.ranks, rank)
            local = torch.from_numpy(values(args.seed, p.fqn, "master", a * row, b * row)).reshape((b - a, *shape[1:]))
            stride = tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))
            state[p.fqn] = DTensor.from_local(local, mesh, [Shard(0)], run_check=False,
                                              shape=torch.Size(shape), stride=stride)
        for buf in buffers:  # replicated on every rank, as a persistent buffer is under FSDP
            n = math.prod(buf.shape)
            v = (1.0 / (10000.0 ** (np.arange(n, dtype=np.float32) / max(1, n)))).astype(np.float32)
            state[buf.fqn] = torch.from_numpy(v).reshape(buf.shape)
        writer = dcp.HuggingFaceStorageWriter(args.dir, save_distributed=True)
        dcp.save(state, storage_writer=writer)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def save(args: argparse.Namespace) -> None:
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.makedirs(args.dir, exist_ok=True)
    mp.start_processes(_save_rank, args=(args, port), nprocs=args.ranks, start_method="spawn")


def consolidate(args: argparse.Namespace) -> None:
    from torch.distributed.checkpoint._consolidate_hf_safetensors import consolidate_safetensors_files

    with open(args.mapping) as f:
        mapping = json.load(f)
    os.makedirs(args.out, exist_ok=True)
    t = time.perf_counter()
    consolidate_safetensors_files(args.inp, args.out, mapping, num_threads=args.threads)
    secs = time.perf_counter() - t
    for name in os.listdir(args.out):  # as durable as shardckpt's output: every file fsynced
        fd = os.open(os.path.join(args.out, name), os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    durable = time.perf_counter() - t
    if args.timing:
        with open(args.timing, "w") as f:
            json.dump({"seconds": secs, "seconds_durable": durable}, f)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("save")
    s.add_argument("dir")
    s.add_argument("--params", type=int, required=True)
    s.add_argument("--units", type=int, required=True)
    s.add_argument("--ranks", type=int, default=4)
    s.add_argument("--seed", type=int, default=0)
    c = sub.add_parser("consolidate")
    c.add_argument("inp")
    c.add_argument("out")
    c.add_argument("mapping")
    c.add_argument("--threads", type=int, default=1)
    c.add_argument("--timing", default=None, help="write {\"seconds\": ...} of the call alone here")
    args = ap.parse_args()
    {"save": save, "consolidate": consolidate}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
