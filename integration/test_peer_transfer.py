"""Files from one rank's directory to another rank over gloo (``training/peer_copy``): to the
receiver's disk, or straight into its memory (the spans it names), every chunk's CRC32C checked
on arrival; a bad transfer is reported at the end and the ones after it still arrive whole.

One launch, 2 ranks: rank 0 holds the files, rank 1 takes them in this order: one whose bytes
do not match its entry (into memory), one rank 0 does not have, one into memory with a gap, an
overlap and a piece reaching the end, and one to disk. Then, hostile peers in the same launch
(:func:`_hostile`): a reported path that leaves the step and a FIFO in the sender's place are
refused; a receiver asking for absurd spans and a rank announcing an absurd message length get
one clear error before anything is allocated; a sender that dies in the middle of a file leaves
no staged file and no open descriptor behind at the receiver.
"""

from __future__ import annotations

import json
import random

import pytest

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
    _pipelined(rank, root, out)
    _hostile(rank, root, out)
    return out


#: (ring buffers, bytes a buffer, bytes a message): one buffer of one chunk; two of two chunks;
#: many of one chunk, each window sent as two messages
RINGS = [(1, CS, 1 << 20), (2, 2 * CS, 1 << 20), (16, CS, 48)]
#: byte ranges of the file: straddling windows, overlapping, to the end; and their targets
#: (0: a memoryview; 1, 2: a uint8 tensor at a byte offset, 2 twice)
PIPED = [((3, 10), 0, 0), ((30, 230), 1, 0), ((100, 150), 2, 10), ((500, SIZE), 2, 100)]


def _pipelined(rank: int, root: str, out: dict) -> None:
    """The peer stream into memory through the read pipeline's ring: rings of 1, 2 and 16
    buffers, targets of both kinds; a flipped bit; a worker thread that dies (a target too small
    for its bytes), then a transfer that still goes through."""
    import os

    import torch

    from shardckpt.storage import IOConfig, Storage
    from shardckpt.training import peer_copy, peer_pipe
    from shardckpt.training.peer_copy import receive_into, send_file

    here = os.path.join(root, f"r{rank}", "piped")
    os.makedirs(here)
    storage = Storage(here)
    good = _data(4)
    damaged = bytearray(good)
    damaged[300] ^= 1
    if rank == 0:
        for name, data in (("good", good), ("bad", bytes(damaged))):
            with open(os.path.join(here, name), "wb") as f:
                f.write(data)
    rings = []
    real = peer_pipe.host_ring

    def spy(cfg, nbytes, pinned):
        rings.append(real(cfg, nbytes, pinned))
        return rings[-1]

    peer_pipe.host_ring = spy
    cases = [("good", b, n, piece) for b, n, piece in RINGS]
    cases += [("bad", 2, 2 * CS, 1 << 20), ("good", 2, CS, 1 << 20), ("good", 2, CS, 1 << 20)]
    for i, (name, buffers, nbytes, piece) in enumerate(cases):
        peer_copy.PIECE = piece
        entry = _entry(name, good)
        if rank == 0:
            out.setdefault("piped_sent", []).append(_error(lambda e=entry: send_file(storage, e, 1, None)))
            continue
        view, t1, t2 = bytearray(7), torch.zeros(200, dtype=torch.uint8), torch.zeros(200, dtype=torch.uint8)
        targets = [memoryview(view), (t1, 0), (t2, 0)]
        pieces = [(a, b, targets[k] if k == 0 else (targets[k][0], off)) for (a, b), k, off in PIPED]
        if i == len(cases) - 2:  # a target 3 bytes long for 200: its copy fails in a worker
            pieces.append((30, 230, (torch.zeros(3, dtype=torch.uint8), 0)))
        got = None
        try:
            got = receive_into(storage, entry, CS, 0, None, pieces, IOConfig(buffers, nbytes, 3))
        except Exception as e:  # noqa: BLE001 - what the test inspects
            got = f"raised {type(e).__name__}: {e}"
        out.setdefault("piped", []).append({
            "problem": got, "made": rings[-1].made, "buffers": buffers,
            "bytes": [bytes(view).hex(), t1.numpy().tobytes().hex(), t2.numpy().tobytes().hex()]})
    peer_copy.PIECE = 64 << 20


def _error(fn) -> str | None:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - what the test inspects
        return f"{type(e).__name__}: {e}"
    return None


def _hostile(rank: int, root: str, out: dict) -> None:
    import json
    import os

    import torch
    import torch.distributed as dist

    from shardckpt.checkpoint.collective import all_gather_bytes, broadcast_bytes
    from shardckpt.checkpoint.tiers import Transfer
    from shardckpt.storage import Storage
    from shardckpt.training import peer_copy
    from shardckpt.training.peer_copy import SPANS, run_transfers, send_file

    here = os.path.join(root, f"r{rank}", "step")
    os.makedirs(here)
    storage = Storage(here)
    good = _data(1)
    entries = {"../escaped": _entry("../escaped", good), "fifo": _entry("fifo", good),
               "disk": _entry("disk", good)}
    if rank == 0:
        for name in ("../escaped", "disk"):
            with open(os.path.join(here, name), "wb") as f:
                f.write(good)
        os.mkfifo(os.path.join(here, "fifo"))
    # a reported path that leaves the step, a FIFO where the file should be
    plan = [Transfer("../escaped", 0, 1), Transfer("fifo", 0, 1)]
    out["hostile"] = _error(lambda: run_transfers(plan, rank, storage, entries, CS, None))
    out["escaped"] = os.path.exists(os.path.join(root, f"r{rank}", "escaped"))
    # a receiver that asks for 2^40 spans, then for a span of 2^40 bytes
    for count, lengths in ((1 << 40, []), (2, [1 << 40, 5])):
        if rank == 0:
            out.setdefault("spans", []).append(_error(lambda: send_file(storage, entries["disk"], 1, None)))
        else:
            dist.recv(torch.zeros(1, dtype=torch.int64), 0)
            for msg in ([SPANS], [count], lengths):
                if msg:
                    dist.send(torch.tensor(msg, dtype=torch.int64), 0)
    # a rank that announces 2^50 bytes to an all-gather, then -1 bytes in a broadcast
    if rank == 0:
        out["gather"] = _error(lambda: all_gather_bytes(b"hi"))
        dist.broadcast(torch.tensor([-1], dtype=torch.int64), src=0)
    else:
        dist.all_gather([torch.zeros(1, dtype=torch.int64) for _ in range(2)],
                        torch.tensor([1 << 50], dtype=torch.int64))
        out["broadcast"] = _error(lambda: broadcast_bytes(None, 0))
    _secret(rank, root, out)
    if rank == 1:
        with open(os.path.join(root, "rank1.json"), "w") as f:  # rank 1 dies below
            json.dump(out, f)
    # rank 1 sends a file of 4 pieces and dies after the first: rank 0 keeps nothing of it
    peer_copy.PIECE = 64
    if rank == 1:
        with open(os.path.join(here, "cut"), "wb") as f:
            f.write(bytes(256))
        real = dist.send

        def send_then_die(tensor, to, *args, **kwargs):
            real(tensor, to, *args, **kwargs)
            if tensor.numel() == 64:
                os._exit(3)
        dist.send = send_then_die
    cut = [Transfer("cut", 1, 0)]
    out["cut"] = _error(lambda: run_transfers(cut, rank, storage, {"cut": _entry("cut", bytes(256))}, CS, None))
    out["after_cut"] = sorted(os.listdir(here))
    fds = (os.path.join("/proc/self/fd", fd) for fd in os.listdir("/proc/self/fd"))
    out["open_below"] = [p for p in (os.readlink(f) for f in fds if os.path.islink(f)) if p.startswith(root)]


def _secret(rank: int, root: str, out: dict) -> None:
    """With SHARDCKPT_JOB_SECRET alike on both ranks a copy and an agreement go through; with
    rank 1's secret another, rank 1 refuses the offer, rank 0 the answer, and the agreement
    fails on both, each naming the other."""
    import os

    from shardckpt.checkpoint.collective import agree
    from shardckpt.checkpoint.job_secret import SECRET_VARIABLE
    from shardckpt.checkpoint.tiers import Transfer
    from shardckpt.storage import Storage
    from shardckpt.training.peer_copy import run_transfers

    good = _data(3)
    for case, secret in (("same", "s3cret"), ("other", "s3cret" if rank == 0 else "other")):
        here = os.path.join(root, f"r{rank}", case)
        os.makedirs(here)
        if rank == 0:
            with open(os.path.join(here, "f"), "wb") as f:
                f.write(good)
        os.environ[SECRET_VARIABLE] = secret
        try:
            out[f"secret_{case}_copy"] = _error(lambda h=here: run_transfers(
                [Transfer("f", 0, 1)], rank, Storage(h), {"f": _entry("f", good)}, CS, None))
            out[f"secret_{case}_agree"] = _error(lambda: agree(lambda: rank, "an agreement"))
        finally:
            del os.environ[SECRET_VARIABLE]
        out[f"secret_{case}_files"] = sorted(os.listdir(here))


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    root = tmp_path_factory.mktemp("peers")
    results = run_ranks(job, 2, args=(str(root),), timeout_s=120)
    assert results[1].exitcode == 3, results[1]  # rank 1 died in the middle of its last file
    return root, results[0].value, results[1]


def test_transfers_check_every_chunk_and_stay_in_step_after_a_bad_one(ranks):
    _, sender, receiver = ranks
    receiver = json.loads((ranks[0] / "rank1.json").read_text())
    assert "error" not in sender and sender["received"] == 0
    err = receiver["error"]
    assert err.startswith("IntegrityError: peer copy: 2 file(s) not taken"), err
    # the damaged chunk is named (bytes 256..320 hold byte 300), and the missing file
    assert "bad (from rank 0): chunk 4 (bytes [256, 320)) fails its CRC32C check" in err, err
    assert "offers" in err and "missing" in err and "-1 bytes" in err, err
    # after both, the file into memory arrived whole: each target its bytes, overlap included
    good = _data(1)
    ranges = [(3, 10), (60, 130), (100, 140), (500, SIZE)]
    assert receiver["targets"] == [good[a:b].hex() for a, b in ranges]
    # and the file to disk is there, whole, under its name (nothing else: no partial, no "into")
    assert receiver["files"] == ["disk"] and receiver["disk"] == _data(2).hex()


def test_into_memory_through_the_ring_is_bit_exact_bounded_and_checked(ranks):
    root, sender, _ = ranks
    receiver = json.loads((root / "rank1.json").read_text())
    assert sender["piped_sent"] == [None] * 6  # every stream ended on both sides
    good = _data(4)
    want = [bytearray(7), bytearray(200), bytearray(200)]
    for (a, b), k, off in PIPED:
        want[k][off:off + b - a] = good[a:b]
    *rings, bad, dying, after = receiver["piped"]
    for case in [*rings, after]:  # rings of 1, 2 and 16 buffers; and after a worker died
        assert case["problem"] is None, case
        assert case["bytes"] == [w.hex() for w in want]
        assert 1 <= case["made"] <= case["buffers"]  # the ring, whatever the file's size
    # the flipped bit: the file, the peer and the chunk named
    assert ("piped/bad (from rank 0): chunk 4 (bytes [256, 320)) fails its CRC32C check"
            in bad["problem"][0]), bad
    # a worker that dies: an error once the stream is over (the sender not left waiting)
    assert dying["problem"].startswith("raised RuntimeError"), dying


def test_a_reported_path_outside_the_step_and_a_fifo_are_refused(ranks):
    root, _, _ = ranks
    receiver = json.loads((root / "rank1.json").read_text())
    err = receiver["hostile"]
    assert err.startswith("IntegrityError: peer copy: 2 file(s) not taken"), err
    assert "offers '../escaped', a path that leaves the step" in err, err
    assert "offers" in err and "fifo with -1 bytes" in err, err
    assert not receiver["escaped"] and not (root / "r1" / "escaped").exists()


def test_sizes_a_peer_announces_are_checked_before_allocating(ranks):
    root, sender, _ = ranks
    receiver = json.loads((root / "rank1.json").read_text())
    many, huge = sender["spans"]
    assert many.startswith(f"IntegrityError: peer copy: rank 1 asks for {1 << 40} spans"), many
    assert huge.startswith(f"IntegrityError: peer copy: rank 1 asks for a span of {1 << 40} bytes"), huge
    for what, err in (("all_gather_bytes", sender["gather"]), ("broadcast_bytes", receiver["broadcast"])):
        assert err.startswith(f"CollectiveError: {what}: rank"), err
        assert "refused before allocating it" in err, err
    assert f"announces a message of {1 << 50} bytes" in sender["gather"]
    assert "announces a message of -1 bytes" in receiver["broadcast"]


def test_a_cut_stream_leaves_no_partial_file_and_no_open_descriptor(ranks):
    _, receiver, _ = ranks
    assert receiver["cut"] is not None  # the sender died in the middle of the file
    assert receiver["after_cut"] == ["disk", "fifo"]  # rank 0's own files: no "cut", no partial
    assert receiver["open_below"] == []


def test_a_job_secret_authenticates_peer_streams_and_agreements(ranks):
    root, sender, _ = ranks
    receiver = json.loads((root / "rank1.json").read_text())
    for r in (sender, receiver):  # the same secret: as without one
        assert r["secret_same_copy"] is None and r["secret_same_agree"] is None, r
    assert receiver["secret_same_files"] == ["f"]
    # another secret on rank 1: nothing is taken, and each side says why
    assert "the offer of rank 0 fails its authentication" in receiver["secret_other_copy"]
    assert "the answer of rank 1 fails its authentication" in sender["secret_other_copy"]
    assert receiver["secret_other_files"] == []
    assert "rank(s) [1] in an agreement fail their authentication" in sender["secret_other_agree"]
    assert "rank(s) [0] in an agreement fail their authentication" in receiver["secret_other_agree"]
