"""Helper for the benchmarks: what the disk allows for a job that reads N bytes and writes them once.

    python bench/_disk_limit.py SRC_DIR DST_FILE NBYTES [--timing FILE]

Reads the first NBYTES of the files under SRC_DIR (sorted by path, ``manifest.json`` and indexes
left out) in 16 MiB ``readinto`` calls, writes them to DST_FILE and fsyncs it: the least work any
tool does to move the same bytes, with the page cache as warm as the tool's own run finds it.
``--timing FILE`` records the seconds of the copy alone (interpreter start excluded), as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import time

BLOCK = 16 << 20


def sources(root: str) -> list[str]:
    out = []
    for d, _, names in os.walk(root):
        out += [os.path.join(d, n) for n in names if n.endswith((".safetensors", ".bin"))]
    return sorted(out)


def copy(src: list[str], dst: str, nbytes: int) -> int:
    buf = memoryview(bytearray(BLOCK))
    left = nbytes
    with open(dst, "wb", buffering=0) as w:
        for path in src:
            with open(path, "rb", buffering=0) as f:
                while left > 0:
                    n = f.readinto(buf[:min(BLOCK, left)])
                    if not n:
                        break
                    w.write(buf[:n])
                    left -= n
            if left <= 0:
                break
        os.fsync(w.fileno())
    return nbytes - left


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("src")
    ap.add_argument("dst")
    ap.add_argument("nbytes", type=int)
    ap.add_argument("--timing", default=None)
    args = ap.parse_args()
    t0 = time.perf_counter()
    moved = copy(sources(args.src), args.dst, args.nbytes)
    seconds = time.perf_counter() - t0
    if moved < args.nbytes:
        raise SystemExit(f"{args.src}: only {moved} of {args.nbytes} bytes to read")
    if args.timing:
        with open(args.timing, "w") as f:
            json.dump({"seconds": seconds, "bytes": moved}, f)


if __name__ == "__main__":
    main()
