"""Helper for the benchmarks: what the disk allows for a job that reads N bytes and writes them once.

    python bench/_disk_limit.py SRC DST_FILE NBYTES [--timing FILE]

(:func:`streams` is the other limit the benchmarks quote: N parallel writers and readers.)

Reads NBYTES from SRC in 16 MiB ``readinto`` calls, writes them to DST_FILE and fsyncs it: the
least work any tool does to move the same bytes, with the page cache as warm as the tool's own run
finds it. Writeback is started every 8 MiB (``sync_file_range``, as shardckpt's writer does) so the
disk writes while the copy reads, and the final fsync waits only for the tail. Where SRC is a
shardckpt checkpoint, the bytes read are those a consolidation of its
weights reads (every shard file's ``master`` ranges, then the buffers file's data, in file order);
otherwise the first NBYTES of the files under SRC, sorted by path. ``--timing FILE`` records the
seconds of the copy alone (interpreter start excluded, the ranges planned before), as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import time

BLOCK = 16 << 20
KICK = 8 << 20


def _sync_file_range():
    """libc's ``sync_file_range`` (Linux), or None."""
    try:
        import ctypes

        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
    return fn


def sources(root: str) -> list[tuple[str, int, int | None]]:
    """(path, start, end or None for the whole file) of what to read, in order."""
    if os.path.exists(os.path.join(root, "manifest.json")):
        from shardckpt.checkpoint.reader import CheckpointReader

        r = CheckpointReader(root)
        out: list[tuple[str, int, int | None]] = []
        for e in sorted(r.manifest.files, key=lambda e: e.path):
            path = os.path.join(root, e.path)
            if e.role == "shard":
                out += [(path, e.data_start + s.begin, e.data_start + s.end)
                        for s in r.slots.values() if s.name.endswith(".master")]
            elif e.role == "buffers":
                out.append((path, e.data_start, e.size))
        return out
    paths = []
    for d, _, names in os.walk(root):
        paths += [os.path.join(d, n) for n in names if n.endswith((".safetensors", ".bin"))]
    return [(p, 0, None) for p in sorted(paths)]


def copy(src: list[tuple[str, int, int | None]], dst: str, nbytes: int) -> int:
    buf = memoryview(bytearray(BLOCK))
    left, written, kicked = nbytes, 0, 0
    kick = _sync_file_range()
    with open(dst, "wb", buffering=0) as w:
        for path, start, end in src:
            with open(path, "rb", buffering=0) as f:
                f.seek(start)
                todo = left if end is None else min(left, end - start)
                while todo > 0:
                    n = f.readinto(buf[:min(BLOCK, todo)])
                    if not n:
                        break
                    w.write(buf[:n])
                    left -= n
                    todo -= n
                    written += n
                    if kick is not None and written - kicked >= KICK:
                        kick(w.fileno(), kicked, written - kicked, 2)  # SYNC_FILE_RANGE_WRITE
                        kicked = written
            if left <= 0:
                break
        os.fsync(w.fileno())
    return nbytes - left


def _advise_dontneed(path: str) -> bool:
    if not hasattr(os, "posix_fadvise"):
        return False
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return True


def drop_page_cache() -> bool:
    """Write back and drop the page cache; False where this process may not (not root)."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def _settle(settle_s: float) -> bool:
    """What the benchmarks do before each timed save and load of a tool: write back, pause
    ``settle_s``, drop the page cache (False where it cannot be dropped)."""
    os.sync()
    time.sleep(settle_s)
    return drop_page_cache()


def streams(folder: str, nbytes: int, n: int, settle_s: float | None = None) -> dict[str, object]:
    """The disk's limit with ``n`` parallel streams: ``n`` threads each write ``nbytes / n`` to a
    file of their own in 16 MiB ``os.write`` calls (which release the GIL) and fsync it; then,
    after ``POSIX_FADV_DONTNEED`` on every file, each thread reads its file back in 16 MiB
    ``readinto`` calls. Seconds and GB/s of each phase (the read may include page-cache hits
    where the kernel keeps pages despite the advice). The files are removed.

    ``settle_s``: measured as the benchmarks measure the tools themselves (``_save_load_jobs``):
    before the write and again before the read, everything is written back, the disk is left
    ``settle_s`` seconds and the page cache is dropped where this process may (``cold`` says
    whether it was both times), so the read comes from the disk."""
    from concurrent.futures import ThreadPoolExecutor

    os.makedirs(folder, exist_ok=True)
    paths = [os.path.join(folder, f"stream-{i:02d}.bin") for i in range(n)]
    sizes = [nbytes // n + (1 if i < nbytes % n else 0) for i in range(n)]
    block = os.urandom(BLOCK)

    def write(i: int) -> None:
        fd = os.open(paths[i], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            left = sizes[i]
            while left > 0:
                left -= os.write(fd, block[:min(BLOCK, left)])
            os.fsync(fd)
        finally:
            os.close(fd)

    def read(i: int) -> int:
        buf, got = memoryview(bytearray(BLOCK)), 0
        with open(paths[i], "rb", buffering=0) as f:
            while (k := f.readinto(buf)):
                got += k
        return got

    cold = settle_s is not None
    try:
        with ThreadPoolExecutor(n) as pool:
            if settle_s is not None:
                cold &= _settle(settle_s)
            t0 = time.perf_counter()
            list(pool.map(write, range(n)))
            write_s = time.perf_counter() - t0
            advised = all([_advise_dontneed(p) for p in paths])
            if settle_s is not None:
                cold &= _settle(settle_s)
            t0 = time.perf_counter()
            got = sum(pool.map(read, range(n)))
            read_s = time.perf_counter() - t0
    finally:
        for p in paths:
            if os.path.exists(p):
                os.remove(p)
    if got != nbytes:
        raise RuntimeError(f"{folder}: read {got} of {nbytes} bytes back")
    return {"streams": n, "bytes": nbytes, "write_fsync_s": write_s, "read_s": read_s,
            "write_gbs": nbytes / write_s / 1e9, "read_gbs": nbytes / read_s / 1e9,
            "fadvise_dontneed": advised, "cold": cold}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("src")
    ap.add_argument("dst")
    ap.add_argument("nbytes", type=int)
    ap.add_argument("--timing", default=None)
    args = ap.parse_args()
    src = sources(args.src)
    t0 = time.perf_counter()
    moved = copy(src, args.dst, args.nbytes)
    seconds = time.perf_counter() - t0
    if moved < args.nbytes:
        raise SystemExit(f"{args.src}: only {moved} of {args.nbytes} bytes to read")
    if args.timing:
        with open(args.timing, "w") as f:
            json.dump({"seconds": seconds, "bytes": moved}, f)


if __name__ == "__main__":
    main()
