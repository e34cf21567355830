"""The pure parts of the HSDP replica check: chunk CRCs of a file a replica would write, from its
data alone, equal what the writer records; mismatches name the rank, file, chunk and tensors.
(The check across real ranks: integration/test_replica_check.py.)"""

from __future__ import annotations

import os
import random

import pytest

from shardckpt.checkpoint.replica_check import (
    data_chunk_crcs, describe, file_chunk_crcs, mismatches, writer_rank,
)
from shardckpt.format.layout import Mesh
from shardckpt.format.manifest import FileEntry, TensorSlot
from shardckpt.storage.writer import StreamWriter


class _Null:
    def write(self, view: memoryview) -> None: ...

    def close(self, size: int) -> None: ...

    def abort(self) -> None: ...


def _written_chunks(header: bytes, data: bytes, chunk: int) -> tuple[int, ...]:
    w = StreamWriter(_Null, "mem://x", chunk)
    w.write(header)
    w.write(data)
    return w.close()[2]


@pytest.mark.parametrize("seed", range(6))
def test_file_chunk_crcs_from_data_pieces_equal_the_writers(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(60):
        chunk = rng.choice([1, 3, 8, 16, 64, 100, 4096])
        # header shorter, as long as, longer than a chunk; none; data empty or not
        header = os.urandom(rng.choice([0, 1, 8, 16, 64, 65, 200, rng.randrange(300)]))
        data = os.urandom(rng.randrange(0, 700))
        cuts = sorted(rng.sample(range(len(data) + 1), min(4, len(data) + 1)))
        pieces = [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)], strict=True)]
        crcs, n = data_chunk_crcs(pieces, len(header), chunk)
        assert n == len(data)
        got = file_chunk_crcs(header, crcs, n, chunk)
        assert tuple(got) == _written_chunks(header, data, chunk), (chunk, len(header), len(data))


def test_the_writer_of_each_shard_is_its_replica_shard_mod_r() -> None:
    # rank = replica * S + shard; shard s is written by replica s % R
    assert [writer_rank(Mesh.hsdp(2, 2), s) for s in range(2)] == [0, 3]
    assert [writer_rank(Mesh.hsdp(3, 4), s) for s in range(4)] == [0, 5, 10, 3]


def test_a_mismatch_names_ranks_file_chunk_and_tensors() -> None:
    chunk = 16
    slots = {"shard": [TensorSlot("g0.master", "float32", (8,), 0, 32),
                       TensorSlot("g0.exp_avg", "float32", (8,), 32, 64)]}
    # 8 + 8 bytes of header, 64 of data: chunks of 16 bytes, data from byte 16
    good = [1, 2, 3, 4, 5]
    entry = FileEntry("sid/shard-00001-of-00002.safetensors", "shard", 80, 8, 0, good, 1)
    assert mismatches(1, 1, {"shard": good}, [entry], chunk, slots) == []
    found = mismatches(1, 1, {"shard": [1, 2, 9, 4, 5]}, [entry], chunk, slots)
    assert found == [{"rank": 1, "shard": 1, "file": entry.path, "chunks": 1,
                      "shown": [{"chunk": 2, "bytes": [32, 48], "tensors": ["g0.master"]}]}]
    text = describe(found, "file:///run/step-00000002", Mesh.hsdp(2, 2))
    for part in ("step-00000002: not committed", "silent data corruption", "ranks 1, 3",
                 "shard-00001-of-00002.safetensors: rank 1", "rank 3, which wrote it",
                 "chunk 2 (bytes 32-48: g0.master)", "previous checkpoint stays the latest"):
        assert part in text, (part, text)
    # a chunk across two tensors names both; more chunks than shown are counted
    bad = mismatches(1, 1, {"shard": [0, 0, 0, 0, 0]}, [entry], chunk, slots)[0]
    assert bad["chunks"] == 5 and bad["shown"][0]["tensors"] == ["(header)"]
    assert "and 1 more" in describe([bad], "u", Mesh.hsdp(2, 2))
    # a replica's file shorter than the writer's differs in the chunks it lacks
    assert mismatches(1, 1, {"shard": good[:3]}, [entry], chunk, slots)[0]["chunks"] == 2
