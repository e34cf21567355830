"""The whole-file CRC32C derived from per-chunk CRCs equals a direct pass (bit-identical)."""

from __future__ import annotations

import crc32c as ref
from hypothesis import given, settings
from hypothesis import strategies as st

from shardckpt.storage import writer as w


@settings(max_examples=200, deadline=None)
@given(data=st.binary(max_size=3000), chunk=st.integers(1, 700))
def test_crc_of_chunks_matches_direct(data: bytes, chunk: int) -> None:
    crcs = [ref.crc32c(data[i:i + chunk]) for i in range(0, len(data), chunk)]
    assert w.crc32c_of_chunks(crcs, chunk, len(data)) == ref.crc32c(data)


@settings(max_examples=200, deadline=None)
@given(a=st.binary(max_size=2000), b=st.binary(max_size=2000))
def test_combine_matches_direct(a: bytes, b: bytes) -> None:
    assert w.crc32c_combine(ref.crc32c(a), ref.crc32c(b), len(b)) == ref.crc32c(a + b)


@settings(max_examples=100, deadline=None)
@given(data=st.binary(max_size=5000), chunk=st.integers(1, 1500),
       cuts=st.lists(st.integers(0, 5000), max_size=6))
def test_stream_writer_crc(tmp_path_factory, data: bytes, chunk: int, cuts: list[int]) -> None:
    from shardckpt.storage import Storage

    root = tmp_path_factory.mktemp("crc")
    s = Storage(str(root))
    bounds = sorted({0, len(data), *(c for c in cuts if c <= len(data))})
    with s.writer("f.bin", chunk) as wr:
        for lo, hi in zip(bounds, bounds[1:]):
            wr.write(data[lo:hi])
        assert wr.crc == ref.crc32c(data)
        size, crc, chunks = wr.close()
    assert size == len(data) and crc == ref.crc32c(data)
    assert list(chunks) == [ref.crc32c(data[i:i + chunk]) for i in range(0, len(data), chunk)]
    assert (root / "f.bin").read_bytes() == data


def test_large_chunk_sizes() -> None:
    import os

    data = os.urandom(3 * (1 << 20) + 12345)
    for chunk in (1 << 20, 4 << 20, 65536, 1000003):
        crcs = [ref.crc32c(data[i:i + chunk]) for i in range(0, len(data), chunk)]
        assert w.crc32c_of_chunks(crcs, chunk, len(data)) == ref.crc32c(data)
