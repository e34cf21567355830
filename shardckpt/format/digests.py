"""SHA-256 digests of a checkpoint's files, as the manifest records them (format 1.4).

A file's digest is not the SHA-256 of its bytes in order but the SHA-256 of the concatenated
SHA-256 digests of its ``chunk_size`` chunks (the same chunks that carry a CRC32C each; the last
may be short; a file of no bytes has no chunk, so its digest is the SHA-256 of nothing). Each chunk
is hashed on its own, so a writer that writes chunks out of order or on several threads (positioned
writes) hashes each chunk where its CRC32C is computed and combines the chunk digests at the end,
in chunk order; a whole-file SHA-256 would need the bytes in order. docs/FORMAT.md section 16.
Pure; no I/O.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable

#: The member of a ``files`` entry that holds the digest: 64 lowercase hex digits.
DIGEST_FIELD = "sha256"
#: First format version whose manifests may carry digests and a signature.
DIGESTS_VERSION = (1, 4)
_HEX64 = re.compile(r"[0-9a-f]{64}\Z")


def is_digest(v: object) -> bool:
    return isinstance(v, str) and _HEX64.match(v) is not None


def combine(chunk_digests: Iterable[bytes]) -> str:
    """The file digest (hex) from its chunks' raw SHA-256 digests, in chunk order."""
    h = hashlib.sha256()
    for d in chunk_digests:
        h.update(d)
    return h.hexdigest()


def digest_of(data: bytes | memoryview, chunk_size: int) -> str:
    """The file digest of ``data`` held whole (tests, small files)."""
    view = memoryview(data).cast("B")
    return combine(hashlib.sha256(view[i:i + chunk_size]).digest()
                   for i in range(0, len(view), chunk_size))
