"""``shardckpt sign``: sign a committed checkpoint's manifest (format 1.4, docs/FORMAT.md section 16).

Every file is read once: its chunks' CRC32C must hold (a damaged file is never signed), and its
digest is computed (or, where the manifest records one, must be the recorded one). The algorithm
is the one of the digests the manifest records, else BLAKE3 where the ``blake3`` package imports
(format 1.5), else SHA-256 (1.4). The manifest is then written again with every digest and the
signature, and replaces the one there
only if that is still unchanged (:func:`shardckpt.storage.commit.replace`: on S3 a PUT with
``If-Match``): a reader sees the old manifest or the signed one, never a mix.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any
from collections.abc import Mapping

from shardckpt.errors import IntegrityError, TrustError
from shardckpt.format.digests import ALGORITHMS, algorithm_for, recorded_algorithm
from shardckpt.format.manifest import MANIFEST_NAME, MAX_MANIFEST_BYTES, FileEntry, Manifest, to_json
from shardckpt.format.manifest_parse import parse
from shardckpt.format.signing import SigningKey
from shardckpt.storage import crc32c, iter_file_chunks
from shardckpt.storage import commit as _commit
from shardckpt.storage import ChunkHasher
from shardckpt.checkpoint.reader import as_storage
from shardckpt.checkpoint.references import RunFiles
from shardckpt.checkpoint.trust import signing_key as load_key

log = logging.getLogger(__name__)


def _digest(files: RunFiles, entry: FileEntry, chunk_size: int, algorithm: str) -> str:
    """``entry``'s ``algorithm`` digest, each chunk's CRC32C checked on the way."""
    where, below = files.locate(entry.path)
    h, i, size = ChunkHasher(chunk_size, algorithm), 0, 0
    url = files.url_of(entry.path)
    for data in iter_file_chunks(where, below, chunk_size, limit=entry.size + 1):
        size += len(data)
        if i >= len(entry.chunk_crc32c) or crc32c(data) != entry.chunk_crc32c[i]:
            raise IntegrityError(f"{url}: chunk {i} fails its CRC32C check (or the file is longer "
                                 "than recorded); not signed")
        h.update(memoryview(data).cast("B"))
        i += 1
    if size != entry.size:
        raise IntegrityError(f"{url}: {size} bytes, the manifest records {entry.size}; not signed")
    got = h.hexdigest()
    if entry.digest is not None and got != entry.digest:
        raise TrustError(f"{url}: bytes do not match the recorded {algorithm} digest; not signed")
    return got


def sign_checkpoint(url: str, key: str | SigningKey,
                    storage_options: Mapping[str, Any] | None = None) -> Manifest:
    """Sign the committed checkpoint at ``url`` with ``key`` (a private key file's path, OpenSSH
    or PEM Ed25519); returns the signed manifest. Signing again (another key) replaces the
    signature."""
    signer = load_key(key)
    assert signer is not None
    storage = as_storage(url, storage_options)
    old = storage.read_limited(MANIFEST_NAME, MAX_MANIFEST_BYTES)
    m = parse(old, storage.url_of(MANIFEST_NAME))
    files = RunFiles(storage)
    alg = recorded_algorithm(m.files) or algorithm_for(True)
    entries = tuple(replace(f, digest=_digest(files, f, m.chunk_size, alg), algorithm=alg) for f in m.files)
    signed = replace(m, version=max(m.version, ALGORITHMS[alg]), files=entries)
    data = to_json(signed, signer)
    parse(data, storage.url_of(MANIFEST_NAME))  # never write what could not be read back
    _commit.replace(storage, data, old, m.save_id)
    log.info("signed %s with %s", storage.url, signer.public.key_id)
    return signed
