"""Cryptographic digests of a checkpoint's files, as the manifest records them (format 1.4, 1.5).

A file's digest is not the hash of its bytes in order but the hash of the concatenated digests of
its ``chunk_size`` chunks (the same chunks that carry a CRC32C each; the last may be short; a file
of no bytes has no chunk, so its digest is the hash of nothing). Each chunk is hashed on its own,
so a writer that writes chunks out of order or on several threads (positioned writes) hashes each
chunk where its CRC32C is computed and combines the chunk digests at the end, in chunk order; a
whole-file hash would need the bytes in order. docs/FORMAT.md section 16.

Two algorithms, the same tree shape: SHA-256 (``hashlib``; member ``sha256``, from 1.4) and
BLAKE3 (the ``blake3`` package; member ``blake3``, from 1.5), 2.5 times as fast a core. A manifest
uses one for all its files. Pure; no I/O.
"""

from __future__ import annotations

import hashlib
import logging
import re
from collections.abc import Iterable, Mapping
from functools import cache
from typing import Any

from shardckpt.errors import ConfigError

log = logging.getLogger(__name__)

SHA256 = "sha256"
BLAKE3 = "blake3"
#: The members of a ``files`` entry that may hold its digest (64 lowercase hex digits), each
#: named for its algorithm, with the first format version that has it.
ALGORITHMS: dict[str, tuple[int, int]] = {SHA256: (1, 4), BLAKE3: (1, 5)}
#: First format version whose manifests may carry digests and a signature.
DIGESTS_VERSION = ALGORITHMS[SHA256]
#: First format version whose file entries may carry ``blake3``.
BLAKE3_VERSION = ALGORITHMS[BLAKE3]
#: Names a file entry member may not have: digests of algorithms shardckpt does not use (a
#: manifest naming one was written by something else and is refused, not read without it).
FOREIGN = frozenset(hashlib.algorithms_guaranteed | {"blake2", "xxh3", "xxh64", "xxh128", "crc64"}) - set(ALGORITHMS)
_HEX64 = re.compile(r"[0-9a-f]{64}\Z")


def is_digest(v: object) -> bool:
    return isinstance(v, str) and _HEX64.match(v) is not None


def digest_member(entry: Mapping[str, Any]) -> tuple[str, str | None, tuple[str, str] | None]:
    """(algorithm, digest or None, problem) of a file entry's JSON object: at most one member of
    :data:`ALGORITHMS`, none of :data:`FOREIGN`; a problem is (member, what is wrong)."""
    named = [k for k in entry if k in ALGORITHMS or k in FOREIGN]
    if not named:
        return SHA256, None, None
    if len(named) > 1 or named[0] not in ALGORITHMS:
        return SHA256, None, (named[-1], f"digest members {named}; a file entry carries at most "
                              f"one, {' or '.join(ALGORITHMS)}")
    if not is_digest(entry[named[0]]):
        return SHA256, None, (named[0], "expected 64 lowercase hex digits")
    return named[0], entry[named[0]], None


@cache
def blake3_available() -> bool:
    try:
        import blake3  # noqa: F401
    except ImportError:
        return False
    return True


def new_hash(algorithm: str) -> Any:
    """A fresh hash object of ``algorithm`` (``update``, ``digest``, ``hexdigest``)."""
    if algorithm == SHA256:
        return hashlib.sha256()
    if algorithm == BLAKE3:
        from blake3 import blake3
        # one thread a chunk: chunks are hashed on the threads that write them
        return blake3(max_threads=1)
    raise ValueError(f"unknown digest algorithm {algorithm!r}")


@cache
def _default() -> str:
    if blake3_available():
        log.info("file digests: BLAKE3 (manifest format %d.%d)", *BLAKE3_VERSION)
        return BLAKE3
    log.info("file digests: SHA-256; the blake3 package is not importable (install it: BLAKE3 "
             "costs a save about half as much CPU)")
    return SHA256


def algorithm_for(choice: bool | str) -> str:
    """The algorithm a save with ``digests=choice`` uses: ``True`` the best one installed (BLAKE3
    where the ``blake3`` package imports, else SHA-256; said once in the log), or the one named."""
    if choice is True:
        return _default()
    if choice == BLAKE3 and not blake3_available():
        raise ConfigError("digests='blake3': the blake3 package is not importable (pip install blake3)")
    if isinstance(choice, str) and choice in ALGORITHMS:
        return choice
    raise ConfigError(f"digests={choice!r}: expected True, False, {SHA256!r} or {BLAKE3!r}")


def recorded_algorithm(files: Iterable[Any]) -> str | None:
    """The algorithm of the digests the file entries ``files`` record (a parsed manifest's files
    use one), or None where none records a digest."""
    return next((f.algorithm for f in files if f.digest is not None), None)


def combine(chunk_digests: Iterable[bytes], algorithm: str = SHA256) -> str:
    """The file digest (hex) from its chunks' raw digests, in chunk order."""
    h = new_hash(algorithm)
    for d in chunk_digests:
        h.update(d)
    return str(h.hexdigest())


def digest_of(data: bytes | memoryview, chunk_size: int, algorithm: str = SHA256) -> str:
    """The file digest of ``data`` held whole (tests, small files)."""
    view = memoryview(data).cast("B")

    def one(piece: memoryview) -> bytes:
        h = new_hash(algorithm)
        h.update(piece)
        return bytes(h.digest())

    return combine((one(view[i:i + chunk_size]) for i in range(0, len(view), chunk_size)), algorithm)
