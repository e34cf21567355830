"""``bench/train_step.py --offload``: the model size for ``--params``, the disk's bandwidth, and
the report of memory and time against what offloading moves."""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

#: Bytes written and read back to measure the offload directory's disk.
PROBE_BYTES = 1 << 30


def layers_for(args: argparse.Namespace) -> int:
    """Decoder layers that bring the Llama of ``args`` closest to ``args.params`` parameters
    (embedding tied to the head)."""
    h, i = args.hidden, args.intermediate
    kv = h * args.kv_heads // args.heads
    per_layer = 2 * h * h + 2 * h * kv + 3 * h * i + 2 * h
    return max(1, round((args.params - args.vocab * h - h) / per_layer))


def disk_bandwidth(directory: str, nbytes: int = PROBE_BYTES) -> tuple[float, float]:
    """(write, read) GB/s of ``nbytes`` in 16 MiB pieces: written then fsynced, dropped from
    the page cache (``POSIX_FADV_DONTNEED``), read back."""
    path = Path(directory, f".bandwidth-probe-{os.getpid()}")
    piece = os.urandom(16 << 20)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        t0 = time.perf_counter()
        for off in range(0, nbytes, len(piece)):
            os.pwrite(fd, piece, off)
        os.fsync(fd)
        write = nbytes / (time.perf_counter() - t0) / 1e9
        os.posix_fadvise(fd, 0, nbytes, os.POSIX_FADV_DONTNEED)
        t0 = time.perf_counter()
        for off in range(0, nbytes, len(piece)):
            os.pread(fd, len(piece), off)
        read = nbytes / (time.perf_counter() - t0) / 1e9
    finally:
        os.close(fd)
        path.unlink()
    return write, read


def print_offload(rows: list[dict], args: argparse.Namespace) -> None:
    """Per precision: peak RSS saved against what should leave memory (the master copy and the
    moments, 12Ψ/N bytes with AdamW, minus the streaming window of three groups' state and the
    host gradient copies), and the step time overhead against the bytes moved (nvme: the state
    read and written once each) and the disk's bandwidth."""
    disk = disk_bandwidth(args.offload_dir) if args.offload == "nvme" else None
    for off, res in zip(rows[::2], rows[1::2], strict=False):
        saved = [b - a for a, b in zip(off["peak_rss_mb"], res["peak_rss_mb"], strict=False)]
        state = max(off["offloaded_bytes"]) / 1e6
        window = (3 if off["side"] == "nvme" else 0) * 12 * off["largest_shard"] / 1e6
        grads = (off["grad_copy_bytes"] or 4 * off["largest_shard"]) / 1e6
        # cpu on a CPU "device": the host copy of the masters comes on top of the device's
        expect = state - window - grads if off["side"] == "nvme" else -state / 3 - grads
        extra = off["median_s"] - res["median_s"]
        print(f"{off['precision']}: offload {off['side']} peak RSS lower by "
              f"{'/'.join(f'{m:.0f}' for m in saved)} MB/rank; offloaded state (12Ψ/N: master "
              f"copy + moments) {state:.0f} MB/rank, streaming window {window:.0f} MB, host "
              f"gradient copies {grads:.0f} MB: expected {expect:.0f} MB lower; "
              f"step {res['median_s']:.2f} -> {off['median_s']:.2f} s ({extra:+.2f} s)")
        if disk is not None:
            moved = 2 * state / 1e3
            print(f"  nvme: {moved:.2f} GB read + written per step per rank; disk {disk[0]:.2f} "
                  f"GB/s write, {disk[1]:.2f} GB/s read (fsync, cache dropped): at least "
                  f"{state / 1e3 * (1 / disk[0] + 1 / disk[1]):.2f} s of I/O per rank uncached"
                  + (f"; overhead {moved / extra:.2f} GB/s moved" if extra > 0 else ""))
