"""Sign a consolidation (Hugging Face output) and check one (docs/FORMAT.md section 16.1).

A consolidation has no manifest; its provenance file, ``shardckpt_consolidated.json``, is what is
signed. :func:`sign_consolidation` reads every other file of the folder once, records its digest
(:mod:`shardckpt.format.digests`, chunks of :data:`CHUNK_SIZE`) under ``blake3`` in the
provenance (``sha256`` where the ``blake3`` package is not importable; either is checked), and replaces the provenance (one atomic put) with one signed as a manifest is, under
its own domain separator. It runs after the consolidation committed (its index written): in
between, the folder is unsigned, and a trusted check refuses it. :func:`check_consolidation`
refuses, naming which: an unsigned provenance, an unknown key, changed bytes (of the provenance or
of any file), a file the signature does not list, a listed file that is missing.
"""

from __future__ import annotations

import json
from typing import Any
from collections.abc import Mapping

from shardckpt.errors import NotFoundError, TrustError
from shardckpt.format.digests import ALGORITHMS, algorithm_for
from shardckpt.format.manifest import DEFAULT_CHUNK_SIZE
from shardckpt.format.signing import CONSOLIDATION_DOMAIN, SIGNATURE_FIELD, check_signature, seal_signed
from shardckpt.storage import Storage, iter_file_chunks, hash_chunks
from shardckpt.checkpoint.reader import as_storage
from shardckpt.checkpoint.trust import Trust, signing_key, trusted_keys
from shardckpt.tools.consolidate import PROVENANCE


CHUNK_SIZE = DEFAULT_CHUNK_SIZE
_CHECKSUM = "manifest_crc32c"


def is_consolidation(url: str, storage_options: Mapping[str, Any] | None = None) -> bool:
    """Whether ``url`` holds a consolidation (a provenance file and no manifest)."""
    storage = as_storage(url, storage_options)
    return storage.exists(PROVENANCE) and not storage.exists("manifest.json")


def _digests(storage: Storage, algorithm: str) -> dict[str, str]:
    names = sorted(n for n in storage.list_sizes("") if n != PROVENANCE)
    return {n: hash_chunks(iter_file_chunks(storage, n, CHUNK_SIZE), CHUNK_SIZE, algorithm) for n in names}


def sign_consolidation(url: str | Storage, key: Any, storage_options: Mapping[str, Any] | None = None) -> str:
    """Sign the committed consolidation at ``url`` with ``key`` (a private key file or key);
    returns the key id."""
    signer = signing_key(key)
    assert signer is not None
    storage = as_storage(url, storage_options)
    try:
        doc = json.loads(storage.read(PROVENANCE))
    except NotFoundError:
        raise TrustError(f"{storage.url}: no {PROVENANCE}; not a committed consolidation, not signed") from None
    doc = {k: v for k, v in doc.items() if k not in (*ALGORITHMS, "chunk_size", SIGNATURE_FIELD, _CHECKSUM)}
    alg = algorithm_for(True)
    doc.update({"chunk_size": CHUNK_SIZE, alg: _digests(storage, alg)})
    storage.put(PROVENANCE, seal_signed(doc, signer, CONSOLIDATION_DOMAIN))
    return signer.public.key_id


def check_consolidation(url: str | Storage, trust: Trust,
                        storage_options: Mapping[str, Any] | None = None) -> str:
    """The key id that signed the consolidation at ``url``, if one of ``trust``'s and every file
    matches; else :class:`TrustError` naming which."""
    keys = trusted_keys(trust)
    assert keys is not None
    storage = as_storage(url, storage_options)
    source = storage.url_of(PROVENANCE)
    raw = storage.read_limited(PROVENANCE, 64 << 20)
    try:
        doc = json.loads(raw)
    except ValueError as e:
        raise TrustError(f"{source}: bytes do not match: not JSON ({e})") from None
    kid = check_signature(raw, doc, keys, source, CONSOLIDATION_DOMAIN)
    algs = [a for a in ALGORITHMS if a in doc]
    signed = doc.get(algs[0]) if len(algs) == 1 else None
    if not isinstance(signed, dict) or doc.get("chunk_size") != CHUNK_SIZE:
        raise TrustError(f"{source}: bytes do not match: no digests in the form shardckpt signs "
                         f"(one of {', '.join(ALGORITHMS)}; found {algs or 'none'})")
    found = _digests(storage, algs[0])
    for name in sorted(set(found) | set(signed)):
        if name not in signed:
            raise TrustError(f"{storage.url_of(name)}: bytes do not match: a file the signature does not list")
        if found.get(name) != signed[name]:
            what = "missing" if name not in found else "its digest differs from the signed one"
            raise TrustError(f"{storage.url_of(name)}: bytes do not match: {what}")
    return kid


def trusted_consolidation(url: str, storage_options: Mapping[str, Any] | None, trust: Trust) -> str | None:
    """``verify --trust`` of ``url`` if it is a consolidation: the line to print (else None:
    verify it as a checkpoint); :class:`TrustError` if it fails."""
    if not is_consolidation(url, storage_options):
        return None
    return f"ok: {url}: consolidation signed by {check_consolidation(url, trust, storage_options)}"
