"""Files from one rank's directory to another rank over gloo (``training/peer_copy``): to the
receiver's disk, or straight into its memory (the spans it names), every chunk's CRC32C checked
on arrival; a bad transfer is reported at the end and the ones after it still arrive whole.

One launch, 2 ranks: rank 0 holds the files, rank 1 takes them in this order: one whose bytes
do not match its entry (into memory), one rank 0 does not have, one into memory with a gap, an
overlap and a piece reaching the end, and one to disk.
"""

from __future__ import annotations

import random

from testing.ranks import run_ranks

CS = 64
SIZE = CS * 9 + 17  # a short last chunk


def _data(seed: int) -> bytes:
    return bytes(random.Random(seed).randrange(256) for _ in range(SIZE))


def _entry(path: str, data: bytes):
    from shardckpt.format.integrity import crc32c
    from shardckpt.format.manifest import FileEntry

    chunks = tuple(crc32c(data[i:i + CS]) for i in range(0, len(data), CS))
    return FileEntry(path, "shard", len(data), 0, crc32c(data), chunks, 0)


def job(rank: int, world: int, root: str) -> dict:
    import os

    from shardckpt.checkpoint.tiers import Transfer
    from shardckpt.storage import Storage
    from shardckpt.training.peer_copy import run_transfers

    here = os.path.join(root, f"r{rank}")
    os.makedirs(here, exist_ok=True)
    storage = Storage(here)
    good, other = _data(1), _data(2)
    entries = {"bad": _entry("bad", good), "missing": _entry("missing", good),
               "into": _entry("into", good), "disk": _entry("disk", other)}
    if rank == 0:
        damaged = bytearray(good)
        damaged[300] ^= 1
        for name, data in (("bad", bytes(damaged)), ("into", good), ("disk", other)):
            with open(os.path.join(here, name), "wb") as f:
                f.write(data)
    ranges = [(3, 10), (60, 130), (100, 140), (500, SIZE)]  # a gap, an overlap, to the end
    targets = [bytearray(b - a) for a, b in ranges]
    into = {"bad": [(0, SIZE, memoryview(bytearray(SIZE)))], "missing": [],
            "into": [(a, b, memoryview(t)) for (a, b), t in zip(ranges, targets, strict=True)]}
    plan = [Transfer(p, 0, 1) for p in ("bad", "missing", "into", "disk")]
    out: dict = {}
    try:
        out["received"] = run_transfers(plan, rank, storage, entries, CS, None, into=into)
    except Exception as e:  # noqa: BLE001 - what the test inspects
        out["error"] = f"{type(e).__name__}: {e}"
    out["targets"] = [bytes(t).hex() for t in targets]
    out["files"] = sorted(os.listdir(here))
    if rank == 1 and "disk" in out["files"]:
        with open(os.path.join(here, "disk"), "rb") as f:
            out["disk"] = f.read().hex()
    return out


def test_transfers_check_every_chunk_and_stay_in_step_after_a_bad_one(tmp_path):
    sender, receiver = (r.value for r in run_ranks(job, 2, args=(str(tmp_path),), timeout_s=120))
    assert "error" not in sender and sender["received"] == 0
    err = receiver["error"]
    assert err.startswith("IntegrityError: peer copy: 2 file(s) not taken"), err
    # the damaged chunk is named (bytes 256..320 hold byte 300), and the missing file
    assert "bad (from rank 0): bytes [256, 320) fail their CRC32C check" in err, err
    assert "offers" in err and "missing" in err and "-1 bytes" in err, err
    # after both, the file into memory arrived whole: each target its bytes, overlap included
    good = _data(1)
    ranges = [(3, 10), (60, 130), (100, 140), (500, SIZE)]
    assert receiver["targets"] == [good[a:b].hex() for a, b in ranges]
    # and the file to disk is there, whole, under its name (nothing else: no partial, no "into")
    assert receiver["files"] == ["disk"] and receiver["disk"] == _data(2).hex()
