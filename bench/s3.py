"""Benchmark: shardckpt on a real S3 server (a local Ceph RGW) against plain s3fs copies.

Starts Ceph RGW with `testing/s3servers.CephServer` (``--server moto``: moto's S3 in this
process, where Ceph is not installed), synthesizes a checkpoint of about
``--size`` GB (fp32 master + two AdamW moments, ``--units`` blocks) straight to S3 for each
``FROM:TO`` geometry, then times, in fresh processes, interleaved, median of ``--reps``:

* ``shardckpt reshard s3://… s3://… --to TO`` against a streaming s3fs copy of the same objects
  through the same server (``fs.open(src, "rb")`` → ``fs.open(dst, "wb")``, 8 MiB blocks,
  ``--copy-threads`` objects at a time); a server-side ``fs.copy`` is timed for reference only
  (no byte passes through the client there);
* ``shardckpt consolidate s3://… DIR --dtype fp32`` (S3 → local) against the faster of
  ``fs.get`` and a streaming s3fs download of the same objects to a local directory, each followed
  by an fsync of every file (consolidate fsyncs its output before it writes the index, so the
  copy is made as durable); the same downloads left in the page cache are timed and compared too
  ("vs cached").
* save and load, for geometries of at most ``--save-ranks-max`` source ranks: one process per
  rank writes its shard from memory to S3 (manifest committed once all are written) and reads
  it back with checked ranged reads, against each process uploading (reading) the same bytes as
  one object with plain s3fs (``bench/s3_save_load.py``); the time is the job's, from a barrier
  the processes pass with their data ready, without interpreter start-up.

ratio = the plain copy's time / shardckpt's time for the same checkpoint (for reshard, which moves
every byte like the copy, that is the throughput ratio; consolidate reads the ``master`` state
only, in chunk-rounded ranged GETs). Targets: ratio >= 0.8, peak RSS (summed over each command's
process tree) < 512 MB. Deleted objects are garbage collected (``radosgw-admin gc process``)
between runs so the memstore OSD does not fill. Nothing asserts.

    python bench/s3.py [--size 1.0] [--geometries 16:4,64:16] [--reps 3] [--server ceph|moto]
                       [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, ROOT)
from common import SHARDCKPT, drop_tree, median, run_measured  # noqa: E402

BLOCK = 8 << 20


def _fs(endpoint: str) -> Any:
    import s3fs

    return s3fs.S3FileSystem(skip_instance_cache=True, client_kwargs={"endpoint_url": endpoint})


def _fsync_tree(root: str) -> None:
    """fsync every file below ``root`` and its directories: what shardckpt does to its output."""
    for d, _, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(d, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fd = os.open(d, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def copy_main(mode: str, src: str, dst: str, threads: int) -> None:
    """The plain-s3fs side, run in its own process: credentials from the AWS environment.

    ``stream``: S3 -> S3 through this process; ``server``: server-side ``fs.copy``;
    ``get``: ``fs.get`` to a local directory; ``download``: ``fs.open(rb)`` -> local file;
    ``get+fsync`` and ``download+fsync``: the same, then every file made durable.
    """
    fs = _fs(os.environ["AWS_ENDPOINT_URL"])
    durable = mode.endswith("+fsync")
    mode = mode.removesuffix("+fsync")
    if mode == "get":
        fs.get(f"{src}/", f"{dst}/", recursive=True)
        if durable:
            _fsync_tree(dst)
        return
    keys = fs.find(src)

    def one(key: str) -> None:
        rel = os.path.relpath(key, src)
        if mode == "server":
            fs.copy(key, f"{dst}/{rel}")
            return
        if mode == "download":
            os.makedirs(os.path.dirname(os.path.join(dst, rel)), exist_ok=True)
            out: Any = open(os.path.join(dst, rel), "wb")
        else:
            out = fs.open(f"{dst}/{rel}", "wb", block_size=BLOCK)
        with fs.open(key, "rb", block_size=BLOCK, cache_type="none") as r, out as w:
            for _ in range(1 << 20):  # bounded: one block per iteration
                data = r.read(BLOCK)
                if not data:
                    break
                w.write(data)

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(one, keys))
    if durable and mode == "download":
        _fsync_tree(dst)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", type=float, default=1.0, help="checkpoint size in GB")
    ap.add_argument("--geometries", default="16:4,64:16", help="FROM:TO rank pairs, comma separated")
    ap.add_argument("--units", type=int, default=8, help="transformer blocks of the synthetic model")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--copy-threads", type=int, default=4)
    ap.add_argument("--save-ranks-max", type=int, default=16,
                    help="save and load only for geometries of at most this many source ranks")
    ap.add_argument("--server", choices=("ceph", "moto"), default="ceph")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    from testing.s3servers import CephServer, MotoServer

    state = tempfile.mkdtemp(prefix="shardckpt-bench-ceph-")
    work = tempfile.mkdtemp(prefix="shardckpt-bench-s3-")
    server = (CephServer(state_dir=state) if args.server == "ceph" else MotoServer()).start()
    results = []
    try:
        for geo in args.geometries.split(","):
            a, b = (int(x) for x in geo.split(":"))
            results.append(run(server, state, work, args, a, b))
    finally:
        server.stop()
        drop_tree(work)
    if args.json:
        print(json.dumps(results, indent=2))
        return
    where = "Ceph RGW on 127.0.0.1 (memstore)" if args.server == "ceph" else "moto on 127.0.0.1"
    for res in results:
        print(f"\n{where}: synthetic checkpoint {res['size_gb']} GB, "
              f"{res['from']} ranks x {args.units} blocks ({res['slot_mb']:.2f} MB per slot), "
              f"median of {args.reps}, interleaved; GB/s = checkpoint GB per second")
        print(f"{'operation':<40} {'median s':>9} {'GB/s':>7} {'ratio':>6} {'vs cached':>10} "
              f"{'peak RSS MB':>12}")
        for r in res["rows"]:
            ratio = f"{r['ratio']:.2f}" if r.get("ratio") is not None else ""
            cached = f"{r['ratio_page_cache']:.2f}" if r.get("ratio_page_cache") is not None else ""
            print(f"{r['name']:<40} {r['seconds']:>9.2f} {r['gbps']:>7.3f} {ratio:>6} {cached:>10} "
                  f"{r['peak_rss_mb']:>12.0f}")
        print("ratio = fastest plain s3fs copy's time / shardckpt's time (same checkpoint, same server), "
              "the copy made as durable as shardckpt's result (local files fsynced, as consolidate "
              "does); vs cached = against a download left in the page cache")


def run(server: Any, state: str, work: str, args: argparse.Namespace, from_ranks: int,
        to_ranks: int) -> dict[str, Any]:
    env = {"AWS_ENDPOINT_URL": server.endpoint_url, "AWS_ACCESS_KEY_ID": server.key,
           "AWS_SECRET_ACCESS_KEY": server.secret, "AWS_DEFAULT_REGION": "us-east-1",
           "PYTHONPATH": ROOT}
    bucket = server.create_bucket("bench")
    fs = server.filesystem()
    exe = list(SHARDCKPT)
    me = [sys.executable, os.path.abspath(__file__)]
    src = f"s3://{bucket}/src"
    params = int(args.size * 1e9 / 12)  # fp32 master + two fp32 AdamW moments

    def gc() -> None:
        if args.server != "ceph":
            return
        subprocess.run(["radosgw-admin", "-c", os.path.join(state, "ceph.conf"), "gc", "process",
                        "--include-all"], check=False, capture_output=True, timeout=300)

    def clear(prefix: str) -> None:
        fs.invalidate_cache()
        if fs.exists(f"{bucket}/{prefix}"):
            fs.rm(f"{bucket}/{prefix}", recursive=True)

    t0 = time.perf_counter()
    run_measured([*exe, "synth", src, "--params", str(params), "--ranks", str(from_ranks),
                  "--units", str(args.units)], env)
    synth_s = time.perf_counter() - t0
    fs.invalidate_cache()
    nbytes = sum(fs.du(f"{bucket}/src", total=False).values())
    from shardckpt.checkpoint.reader import CheckpointReader
    from shardckpt.format.manifest import shard_slots

    m = CheckpointReader(src, {"key": server.key, "secret": server.secret,
                               "client_kwargs": {"endpoint_url": server.endpoint_url}}).manifest
    slots = shard_slots(m.components, m.mesh)
    slot_mb = sum(x.end - x.begin for x in slots) / len(slots) / 1e6

    s3s3 = {
        "reshard S3->S3 (shardckpt)": lambda i: [*exe, "reshard", src, f"s3://{bucket}/rs{i}",
                                                  "--to", str(to_ranks)],
        "streaming s3fs copy S3->S3": lambda i: [*me, "_copy", "stream", f"{bucket}/src",
                                                  f"{bucket}/cp{i}", str(args.copy_threads)],
        "server-side fs.copy S3->S3 (reference)": lambda i: [*me, "_copy", "server", f"{bucket}/src",
                                                              f"{bucket}/sc{i}", str(args.copy_threads)],
    }
    s3local = {
        "consolidate S3->local (shardckpt)": lambda i: [*exe, "consolidate", src,
                                                         os.path.join(work, f"hf{i}"), "--dtype", "fp32"],
        "s3fs fs.get S3->local": lambda i: [*me, "_copy", "get", f"{bucket}/src",
                                            os.path.join(work, f"get{i}"), str(args.copy_threads)],
        "streaming s3fs download S3->local": lambda i: [*me, "_copy", "download", f"{bucket}/src",
                                                        os.path.join(work, f"dl{i}"), str(args.copy_threads)],
        "s3fs fs.get S3->local + fsync": lambda i: [*me, "_copy", "get+fsync", f"{bucket}/src",
                                                    os.path.join(work, f"gets{i}"), str(args.copy_threads)],
        "streaming download S3->local + fsync": lambda i: [*me, "_copy", "download+fsync", f"{bucket}/src",
                                                           os.path.join(work, f"dls{i}"),
                                                           str(args.copy_threads)],
    }
    cases = {**s3s3, **s3local}
    times: dict[str, list[float]] = {k: [] for k in cases}
    rss: dict[str, list[int]] = {k: [] for k in cases}
    for rep in range(args.reps):
        for name, cmd in cases.items():  # interleaved
            dt, peak = run_measured(cmd(rep), env)
            times[name].append(dt)
            rss[name].append(peak)
            for prefix in (f"rs{rep}", f"cp{rep}", f"sc{rep}"):
                clear(prefix)
            for d in (f"hf{rep}", f"get{rep}", f"dl{rep}", f"gets{rep}", f"dls{rep}"):
                drop_tree(os.path.join(work, d))
            gc()  # deleted RGW objects stay in the memstore OSD until collected
    # ratio: against the fastest plain copy with the same durability as shardckpt's result (S3
    # objects are durable once uploaded; local files once fsynced); ratio_cached: against a download
    # left in the page cache, for reference
    best = {"reshard S3->S3 (shardckpt)": ["streaming s3fs copy S3->S3"],
            "consolidate S3->local (shardckpt)": ["s3fs fs.get S3->local + fsync",
                                                  "streaming download S3->local + fsync"]}
    cached = {"consolidate S3->local (shardckpt)": ["s3fs fs.get S3->local", "streaming s3fs download S3->local"]}
    rows = []
    for name in cases:
        t = median(times[name])
        ratio = ratio_cached = None
        if name in best:
            ratio = min(median(times[b]) for b in best[name]) / t
        if name in cached:
            ratio_cached = min(median(times[b]) for b in cached[name]) / t
        rows.append({"name": name, "seconds": round(t, 3), "gbps": round(nbytes / 1e9 / t, 3),
                     "ratio": None if ratio is None else round(ratio, 3),
                     "ratio_page_cache": None if ratio_cached is None else round(ratio_cached, 3),
                     "peak_rss_mb": round(max(rss[name]) / 1e6, 1),
                     "all_seconds": [round(x, 3) for x in times[name]]})
    if from_ranks <= args.save_ranks_max:
        rows += save_load_rows(bucket, src, from_ranks, args.reps, env, clear, gc)
    clear("src")
    server.delete_bucket(bucket)
    gc()
    return {"server": args.server, "from": from_ranks, "to": to_ranks, "size_gb": round(nbytes / 1e9, 3), "slot_mb": slot_mb,
            "synth_s": round(synth_s, 2), "synth_gbps": round(nbytes / 1e9 / synth_s, 3), "rows": rows}


def save_load_rows(bucket: str, src: str, ranks: int, reps: int, env: dict[str, str],
                   clear: Any, gc: Any) -> list[dict[str, Any]]:
    """Save and load by ``ranks`` processes, shardckpt against plain s3fs, interleaved; median
    of ``reps`` of the job's own time (``bench/s3_save_load.py``)."""
    from common import run_measured_json

    job = [sys.executable, os.path.join(HERE, "s3_save_load.py")]
    cases = {"save S3 (shardckpt)": ("shardckpt", "save", "sv"),
             "s3fs upload per rank (save peer)": ("s3fs", "save", "ps"),
             "load S3 (shardckpt)": ("shardckpt", "load", "sv"),
             "s3fs read per rank (load peer)": ("s3fs", "load", "ps")}
    times: dict[str, list[float]] = {k: [] for k in cases}
    rss: dict[str, list[int]] = {k: [] for k in cases}
    nbytes: dict[str, int] = {}
    for rep in range(reps):
        for name, (side, op, prefix) in cases.items():  # each load reads what its save wrote
            _, peak, out = run_measured_json([*job, side, op, src, f"s3://{bucket}/{prefix}{rep}",
                                              str(ranks)], env)
            times[name].append(out["seconds"])
            rss[name].append(peak)
            nbytes[name] = out["bytes"]
        for prefix in (f"sv{rep}", f"ps{rep}"):
            clear(prefix)
        gc()
    peer = {"save S3 (shardckpt)": "s3fs upload per rank (save peer)",
            "load S3 (shardckpt)": "s3fs read per rank (load peer)"}
    rows = []
    for name in cases:
        t = median(times[name])
        ratio = median(times[peer[name]]) / t if name in peer else None
        rows.append({"name": name, "seconds": round(t, 3), "gbps": round(nbytes[name] / 1e9 / t, 3),
                     "ratio": None if ratio is None else round(ratio, 3), "ratio_page_cache": None,
                     "peak_rss_mb": round(max(rss[name]) / 1e6, 1), "ranks": ranks,
                     "all_seconds": [round(x, 3) for x in times[name]]})
    return rows


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_copy":
        copy_main(sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]))
    else:
        main()
