"""``verify``: re-read every file of a checkpoint and list every problem."""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any
from collections.abc import Callable, Mapping, Sequence

from shardckpt.errors import (
    ShardckptError, StorageError,
)
from shardckpt.format.chunked import ROLE as CHUNKS_ROLE
from shardckpt.format.manifest import (
    FROZEN_ROLE, FileEntry, Manifest, buffer_slots, chunked_slots, frozen_slots, shard_slots,
)
from shardckpt.checkpoint.job import Job
from shardckpt.checkpoint.reader import as_storage, check_header, read_manifest
from shardckpt.checkpoint.references import RunFiles
from shardckpt.checkpoint.trust import Trust, trusted_keys
from shardckpt.storage import NotFoundError, Storage, crc32c, iter_file_chunks, ChunkHasher

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FileReport:
    path: str
    size: int
    ok: bool
    problems: tuple[str, ...]

    def to_doc(self) -> list[Any]:
        return [self.path, self.size, self.ok, list(self.problems)]

    @classmethod
    def from_doc(cls, doc: Sequence[Any]) -> FileReport:
        path, size, ok, problems = doc
        return cls(path, size, ok, tuple(problems))


@dataclass(frozen=True)
class VerifyResult:
    """What :func:`verify` found. True exactly when every check held.

    ``problems`` lists every problem: the manifest's (then ``manifest`` is None and there are
    no reports), then each file's, in manifest order.
    """

    url: str
    manifest: Manifest | None
    reports: tuple[FileReport, ...]
    problems: tuple[str, ...]

    @property
    def ok(self) -> bool:
        return self.manifest is not None and not self.problems

    def __bool__(self) -> bool:
        return self.ok


def manifest_or_error(storage: Storage, trust: Trust | None = None) -> Manifest | ShardckptError:
    """:func:`read_manifest` of ``storage``, or the error that gave (a finding of ``verify``);
    ``trust``: it must be signed by one of those keys (:mod:`shardckpt.checkpoint.trust`)."""
    try:
        return read_manifest(storage, trusted_keys(trust))
    except ShardckptError as e:
        return e


def verify(location: str | Storage, storage_options: Mapping[str, Any] | None = None,
           workers: int = 4, progress: Callable[[int], None] | None = None,
           manifest: Manifest | ShardckptError | None = None,
           job: Job | None = None, digests: bool = False, trust: Trust | None = None) -> VerifyResult:
    """Check every file against the manifest: presence, size, whole and per-chunk CRC32C, header.

    Never stops at the first problem. ``progress(nbytes)`` is called as bytes are checked.
    Memory is bounded by the chunk size times ``workers``. ``manifest``: the manifest already
    read by the caller (:func:`manifest_or_error`: or the error that gave), so that it is not
    read twice.

    Every process of ``job`` (one process alone: a job of one) calls it and checks its share of
    the files (balanced by bytes); the processes must have read the same manifest, and every
    process gets every file's report, in manifest order.

    ``digests``: also each file's digest (SHA-256 or BLAKE3, format 1.4 or 1.5; a file without one is a problem).
    ``trust``: the manifest must be signed by one of these keys (else that is the one problem
    reported), and digests are checked.
    """
    job = job or Job.single()
    storage = as_storage(location, storage_options)
    given = manifest if trust is None else None  # a trusted check reads the bytes it checks
    m = job.open(lambda: given if given is not None else manifest_or_error(storage, trust),
                 lambda m: "" if isinstance(m, ShardckptError) else m.save_id, storage.url,
                 "verify: reading the manifest")
    if isinstance(m, ShardckptError):
        return VerifyResult(storage.url, None, (), (str(m),))
    mine = [m.files[i] for i in job.share([f.size for f in m.files])]
    digests = digests or trust is not None
    _, parts = job.gather(lambda: _check_files(storage, m, mine, workers, progress, digests),
                          lambda reports: [r.to_doc() for r in reports], "verify: checking the files")
    found = {r.path: r for part in parts for r in map(FileReport.from_doc, part)}
    reports = tuple(found[f.path] for f in m.files)
    return VerifyResult(storage.url, m, reports, tuple(p for r in reports for p in r.problems))


def _check_files(storage: Storage, m: Manifest, files: Sequence[FileEntry], workers: int,
                 progress: Callable[[int], None] | None, digests: bool = False) -> list[FileReport]:
    """The report of each of ``files``, checked over ``workers`` threads."""
    expected = {"shard": shard_slots(m.components, m.mesh, m.version, m.frozen),
                "buffers": buffer_slots(m.components)}
    if m.frozen:
        expected[FROZEN_ROLE] = frozen_slots(m.components, m.mesh)
    expected.update({f.path: chunked_slots(m, f.path) for f in m.files if f.role == CHUNKS_ROLE})
    where_is = RunFiles(storage)  # a reference is read (and checked) where it lies

    def check(entry: FileEntry) -> FileReport:
        url = where_is.url_of(entry.path)
        problems: list[str] = []
        try:
            actual = where_is.size(entry.path)
        except NotFoundError:
            return FileReport(entry.path, entry.size, False, (f"{url}: missing{where_is.missing_note(entry)}",))
        except ShardckptError as e:
            return FileReport(entry.path, entry.size, False, (str(e),))
        if actual != entry.size:
            what = "truncated" if actual < entry.size else "extended"
            problems.append(f"{url}: {what}: {actual} bytes, the manifest records {entry.size}")
        crc, i, head = 0, 0, b""
        bad_chunks = []
        hasher = ChunkHasher(m.chunk_size, entry.algorithm) if digests else None
        try:
            where, below = where_is.locate(entry.path)
            for data in iter_file_chunks(where, below, m.chunk_size, limit=entry.size):
                crc = crc32c(data, crc)
                if hasher is not None:
                    hasher.update(memoryview(data).cast("B"))
                if i < len(entry.chunk_crc32c) and crc32c(data) != entry.chunk_crc32c[i]:
                    bad_chunks.append(i)
                if len(head) < 8 + entry.header_size:
                    head += data[: 8 + entry.header_size - len(head)]
                i += 1
                if progress:
                    progress(len(data))
        except StorageError as e:
            problems.append(str(e))
            return FileReport(entry.path, entry.size, False, tuple(problems))
        if bad_chunks:
            spans = ", ".join(f"[{c * m.chunk_size}, {min(entry.size, (c + 1) * m.chunk_size)})"
                              for c in bad_chunks[:5])
            problems.append(f"{url}: {len(bad_chunks)} chunk(s) fail their CRC32C check (bytes {spans}"
                            f"{', ...' if len(bad_chunks) > 5 else ''}); the file is corrupted")
        elif actual == entry.size and crc != entry.crc32c:
            problems.append(f"{url}: whole-file CRC32C {crc:08x} differs from the recorded {entry.crc32c:08x}")
        if hasher is not None:
            problems += digest_problems(url, entry, hasher.hexdigest())
        problems += check_header(url, entry, head, actual,
                                  expected.get(entry.path if entry.role == CHUNKS_ROLE else entry.role))
        return FileReport(entry.path, entry.size, not problems, tuple(problems))

    with ThreadPoolExecutor(max(1, workers)) as pool:
        return list(pool.map(check, files))


def digest_problems(url: str, entry: FileEntry, got: str) -> list[str]:
    """What ``verify --digests`` says of ``entry`` whose bytes have digest ``got``."""
    if entry.digest is None:
        return [f"{url}: no digest recorded (written without digests; `shardckpt sign` adds them)"]
    if got != entry.digest:
        return [f"{url}: {entry.algorithm} digest {got[:16]}... differs from the recorded "
                f"{entry.digest[:16]}...; the bytes were changed"]
    return []
