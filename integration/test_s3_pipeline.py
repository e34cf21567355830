"""Object stores through the pipelined paths, on moto and on Ceph RGW: a stream batch's ranged
reads all in flight, and reshard's unchanged source ranges copied by the server
(``UploadPartCopy``, :mod:`shardckpt.storage.s3copy`).

Everything runs in this process (no process launches): a reshard and a consolidate from S3
give the bytes of the same work on a local disk, with some of the reshard's bytes copied by the
server; a copy the server refuses (its source replaced since it was read) falls back to
uploading the checked bytes; a part that fails in the middle of an upload, or a part's thread
that dies, ends in an error with nothing committed and the multipart upload aborted. Reshard
streams the next target file while one completes its upload, and a failure of either (a part
that fails, a writer's thread that dies) commits nothing and leaves no upload open.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
from pathlib import Path
from typing import Any

import pytest
import s3fs

from shardckpt.checkpoint.verify import verify
from shardckpt.errors import StorageError
from shardckpt.storage import MIN_COPY, S3Upload, Storage, copy_source_for, sourced
from shardckpt.tools.consolidate import consolidate
from shardckpt.tools.reshard import reshard
from shardckpt.tools.synth import synthesize

pytestmark = [pytest.mark.s3, pytest.mark.timeout(300)]

MiB = 1 << 20
PARAMS, RANKS, UNITS = 6_000_000, 2, 1  # source slots of about 6 MB: above the 5 MiB copy minimum


def _payload(n: int, seed: int) -> bytes:
    out = bytearray()
    block = hashlib.sha256(str(seed).encode()).digest() * 2048  # 64 KiB
    while len(out) < n:
        out += block
        block = block[1:] + block[:1]
    return bytes(out[:n])


def _data(location: str, read: Any) -> dict[str, bytes]:
    """Each file of a checkpoint by role and index: its bytes after the header (the header names
    the save, so it differs between two runs)."""
    m = json.loads(read(location, "manifest.json"))
    return {f"{f['role']}-{f.get('index')}": read(location, f["path"])[8 + f["header_size"]:]
            for f in m["files"]}


def test_reshard_and_consolidate_from_s3_are_bit_exact_and_copy_unchanged_ranges_server_side(
        s3_server: Any, s3_bucket: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    b = s3_bucket(s3_server)
    so, fs = b.storage_options, b.filesystem()
    synthesize(f"{b.url}/src", PARAMS, ranks=RANKS, units=UNITS, storage_options=so)
    local = tmp_path / "local"
    synthesize(str(local / "src"), PARAMS, ranks=RANKS, units=UNITS)
    reshard(str(local / "src"), str(local / "rs"), to=1)
    consolidate(str(local / "src"), str(local / "hf"), dtype="float32")

    with caplog.at_level(logging.INFO, logger="shardckpt.storage.s3upload"):
        reshard(f"{b.url}/src", f"{b.url}/rs", to=1, storage_options=so, dst_storage_options=so)
    copied = [r.getMessage() for r in caplog.records if "copied by the server" in r.getMessage()]
    assert copied, "no range of at least 5 MiB was copied server-side"
    assert int(copied[0].split(": ")[-1].split(" of ")[0]) >= MIN_COPY

    def read(location: str, rel: str) -> bytes:
        if location.startswith("s3://"):
            return fs.cat_file(f"{location[5:]}/{rel}")
        return (Path(location) / rel).read_bytes()

    assert _data(f"{b.url}/rs", read) == _data(str(local / "rs"), read)
    assert verify(f"{b.url}/rs", storage_options=so).ok  # the target's CRCs match what it holds

    consolidate(f"{b.url}/src", str(tmp_path / "hf"), dtype="float32", storage_options=so)
    names = sorted(os.listdir(local / "hf"))
    got = sorted(os.listdir(tmp_path / "hf"))
    assert got == names
    for n in names:
        if n != "shardckpt_consolidated.json":
            assert (tmp_path / "hf" / n).read_bytes() == (local / "hf" / n).read_bytes(), n


def _upload(storage: Storage, rel: str) -> S3Upload:
    return S3Upload(storage.backend, storage.full(rel), storage.url_of(rel))  # type: ignore[arg-type]


def _open_uploads(fs: Any, bucket: str) -> list[str]:
    resp = fs.call_s3("list_multipart_uploads", Bucket=bucket)
    return [u["Key"] for u in resp.get("Uploads", [])]


def test_a_copy_tops_up_the_pending_part_and_a_refused_copy_uploads_the_bytes(
        s3_server: Any, s3_bucket: Any) -> None:
    b = s3_bucket(s3_server)
    storage, fs = Storage(b.url, b.storage_options), b.filesystem()
    source = _payload(12 * MiB, 1)
    fs.pipe(f"{b.name}/source.bin", source)
    head, tail = _payload(MiB, 2), b"tail"
    etags: dict[str, str | None] = {}
    src = copy_source_for(storage, "source.bin", MiB, 11 * MiB, etags)
    assert src is not None and copy_source_for(storage, "source.bin", 0, MIN_COPY - 1, etags) is None

    # copied: 1 MiB pending + 4 MiB of the range's head make a valid first part, the rest is copied
    up = _upload(storage, "copied.bin")
    for piece in (head, sourced(memoryview(source)[MiB:11 * MiB], src), tail):
        up.write(memoryview(piece).cast("B"))
    up.close(len(head) + 10 * MiB + len(tail))
    assert up.copied == 10 * MiB - (MIN_COPY - MiB) and up.copy_refused is None
    assert fs.cat_file(f"{b.name}/copied.bin") == head + source[MiB:11 * MiB] + tail

    # refused: the source was replaced since its ETag was taken; the bytes in hand go up instead
    fs.pipe(f"{b.name}/source.bin", _payload(12 * MiB, 3))
    up = _upload(storage, "refused.bin")
    up.write(memoryview(sourced(memoryview(source)[MiB:11 * MiB], src)).cast("B"))
    up.close(10 * MiB)
    assert up.copied == 0 and up.copy_refused is not None
    assert fs.cat_file(f"{b.name}/refused.bin") == source[MiB:11 * MiB]
    assert _open_uploads(fs, b.name) == []


def test_a_part_that_fails_in_the_middle_commits_nothing_and_aborts_the_upload(
        moto_server: Any, s3_bucket: Any, fault_proxy: Any) -> None:
    proxy = fault_proxy(moto_server)
    b = s3_bucket(moto_server, via=proxy)
    storage = Storage(b.url, {**b.storage_options, "shardckpt_deadline_s": 2})
    direct = moto_server.filesystem()
    source = _payload(12 * MiB, 4)
    direct.pipe(f"{b.name}/source.bin", source)
    src = copy_source_for(storage, "source.bin", 0, 12 * MiB, {})
    proxy.add_rule("internal_error", method="PUT", query=r"(^|&)partNumber=2(&|$)")
    with pytest.raises(StorageError, match="part 2"):
        with storage.writer("out.bin", MiB) as w:
            w.write(_payload(8 * MiB, 5))       # part 1: uploaded
            w.write(sourced(memoryview(source), src))  # part 2: a copy that fails for good
            w.write(_payload(8 * MiB, 6))
            w.close()
    direct.invalidate_cache()
    assert not direct.exists(f"{b.name}/out.bin")
    assert _open_uploads(direct, b.name) == []


def test_a_part_thread_that_dies_is_an_error_not_a_hang(
        moto_server: Any, s3_bucket: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    b = s3_bucket(moto_server)
    storage, fs = Storage(b.url, b.storage_options), b.filesystem()
    source = _payload(6 * MiB, 7)
    fs.pipe(f"{b.name}/source.bin", source)
    src = copy_source_for(storage, "source.bin", 0, 6 * MiB, {})

    def dies(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("a part's thread died")
    monkeypatch.setattr("shardckpt.storage.s3upload.copy_part", dies)
    with pytest.raises(RuntimeError, match="died"):
        with storage.writer("out.bin", MiB) as w:
            w.write(sourced(memoryview(source), src))
            for seed in range(8, 12):  # more parts than are ever in flight: a write sees the death
                w.write(_payload(8 * MiB, seed))
            w.close()
    fs.invalidate_cache()
    assert not fs.exists(f"{b.name}/out.bin")
    assert _open_uploads(fs, b.name) == []


# ------------------------------------------------------- reshard: files written while one completes

WAIT_S = 60  # only ends a hold that nothing releases (files written one after the other)


def _hold_first_completion(monkeypatch: pytest.MonkeyPatch, die: bool = False) -> list[bool]:
    """Hold target file 0's completing request (its CompleteMultipartUpload, or its PUT) until a
    request for target file 1 has been made; the result: whether one was. With ``die``, file
    1's first request raises instead (its writer's thread dies). Uploads call s3fs's
    ``call_s3`` on the writing thread: holding it holds that thread only."""
    real = s3fs.S3FileSystem.call_s3
    other = threading.Event()
    held: list[bool] = []

    def call(self: Any, method: str, *args: Any, **kwargs: Any) -> Any:
        key = kwargs.get("Key", "")
        if "shard-00001-of-00002" in key:
            other.set()
            if die:
                raise RuntimeError("a writer thread died")
        if ("shard-00000-of-00002" in key and method in ("complete_multipart_upload", "put_object")
                and not held):
            held.append(other.wait(WAIT_S))
        return real(self, method, *args, **kwargs)

    monkeypatch.setattr(s3fs.S3FileSystem, "call_s3", call)
    return held


def test_reshard_streams_the_next_file_while_one_completes_bit_exact(
        moto_server: Any, s3_bucket: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    b = s3_bucket(moto_server)
    so, fs = b.storage_options, b.filesystem()
    synthesize(f"{b.url}/src", 1_600_000, ranks=4, units=1, storage_options=so)  # 10 MB targets
    synthesize(str(tmp_path / "src"), 1_600_000, ranks=4, units=1)
    reshard(str(tmp_path / "src"), str(tmp_path / "rs"), to=2)
    held = _hold_first_completion(monkeypatch)
    reshard(f"{b.url}/src", f"{b.url}/rs", to=2, storage_options=so, dst_storage_options=so)
    monkeypatch.undo()
    assert held == [True], "file 1 was not written while file 0 completed"

    def read(location: str, rel: str) -> bytes:
        if location.startswith("s3://"):
            return fs.cat_file(f"{location[5:]}/{rel}")
        return (Path(location) / rel).read_bytes()

    assert _data(f"{b.url}/rs", read) == _data(str(tmp_path / "rs"), read)
    assert _open_uploads(fs, b.name) == []


@pytest.mark.parametrize("fault", ["a part fails", "a writer thread dies"])
def test_a_file_that_fails_while_another_completes_commits_nothing(
        moto_server: Any, s3_bucket: Any, fault_proxy: Any, monkeypatch: pytest.MonkeyPatch,
        fault: str) -> None:
    proxy = fault_proxy(moto_server)
    b = s3_bucket(moto_server, via=proxy)
    so = {**b.storage_options, "shardckpt_deadline_s": 2}
    direct = moto_server.filesystem()
    synthesize(f"{b.url}/src", 1_600_000, ranks=4, units=1, storage_options=b.storage_options)
    if fault == "a part fails":
        proxy.add_rule("internal_error", method="PUT", path=r"shard-00001-of-00002")
    held = _hold_first_completion(monkeypatch, die=fault == "a writer thread dies")
    with pytest.raises((StorageError, RuntimeError)) as got:
        reshard(f"{b.url}/src", f"{b.url}/rs", to=2, storage_options=so, dst_storage_options=so)
    monkeypatch.undo()
    assert held == [True]  # the failure came while file 0 was completing
    assert ("died" in str(got.value)) == (fault == "a writer thread dies"), got.value
    direct.invalidate_cache()
    assert not direct.exists(f"{b.name}/rs/manifest.json")
    assert [k for k in direct.find(f"{b.name}/rs") if "shard-" in k] == []
    assert _open_uploads(direct, b.name) == []
