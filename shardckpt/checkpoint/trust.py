"""Which keys a reader trusts, and the checks a trusted read makes (docs/FORMAT.md section 16).

``trust`` (``CheckpointReader``, ``load``, ``verify``, ``ShardckptReader``, watch) is one or more
public keys: a path or comma-separated paths of OpenSSH (``id_ed25519.pub``) or PEM files, or
:class:`~shardckpt.format.signing.PublicKey` objects. A trusted read refuses, with one
:class:`~shardckpt.errors.TrustError` naming which:

* a manifest that is unsigned, signed by a key not trusted, or whose bytes do not match its
  signature (:func:`check_manifest`);
* a signed manifest whose ``extras.step`` is not the step its directory names (an older signed
  manifest replayed under a newer step), or that names a file without a digest;
* a file whose bytes do not match its signed digest (:class:`TrustedFiles`, once per file, before
  the first read of it: one more sequential read of each file the reader opens).
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Sequence

from shardckpt.errors import ConfigError, TrustError
from shardckpt.format.manifest import FileEntry, Manifest
from shardckpt.format.signing import (
    PublicKey, SigningKey, check_signature, private_key_from, public_key_from,
)
from shardckpt.storage import Storage, iter_file_chunks, hash_chunks
from shardckpt.checkpoint.references import RunFiles

#: What ``trust=`` takes.
Trust = str | PublicKey | SigningKey | Sequence[str | PublicKey | SigningKey]
_STEP_DIR = re.compile(r"step-([0-9]{1,20})\Z")


def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read(1 << 20)
    except OSError as e:
        raise ConfigError(f"{path}: cannot read the key file ({e.strerror or e})") from e


def signing_key(key: str | SigningKey | None) -> SigningKey | None:
    """The key a writer signs with: a path of an OpenSSH or PEM Ed25519 private key file, or a
    :class:`SigningKey` (None: the writer does not sign)."""
    if key is None or isinstance(key, SigningKey):
        return key
    if isinstance(key, str):
        return private_key_from(_read(key), key)
    raise ConfigError(f"signing_key: a {type(key).__name__}; expected a key file's path")


def trusted_keys(trust: Trust | None) -> tuple[PublicKey, ...] | None:
    """The public keys ``trust`` names (None: no trust check)."""
    if trust is None:
        return None
    items = trust.split(",") if isinstance(trust, str) else [trust] if not isinstance(trust, Sequence) else trust
    out: list[PublicKey] = []
    for k in items:
        if isinstance(k, PublicKey):
            out.append(k)
        elif isinstance(k, SigningKey):
            out.append(k.public)
        elif isinstance(k, str) and k.strip():
            out.append(public_key_from(_read(k.strip()), k.strip()))
        else:
            raise ConfigError(f"trust: {k!r} is not a public key file's path")
    if not out:
        raise ConfigError("trust: no key given; name at least one public key file")
    return tuple(out)


def check_manifest(raw: bytes, m: Manifest, url: str, keys: Sequence[PublicKey]) -> str:
    """The key id that signed manifest ``raw`` (parsed: ``m``) of the checkpoint at ``url``;
    else :class:`TrustError` (see the module's list)."""
    kid = check_signature(raw, json.loads(raw), keys, url)
    step_dir = _STEP_DIR.match(url.rstrip("/").rpartition("/")[2])
    step = m.extras.get("step")
    if step_dir is not None and step != int(step_dir.group(1)):
        raise TrustError(f"{url}: bytes do not match: signed for step {step}, found under "
                         f"{step_dir.group(0)} (an older signed manifest replayed?); refused")
    bare = [f.path for f in m.files if f.digest is None]
    if bare:
        raise TrustError(f"{url}: the signature covers no digest of {len(bare)} file(s) "
                         f"({', '.join(bare[:3])}); refused")
    return kid


def file_digest(files: RunFiles, entry: FileEntry, chunk_size: int) -> str:
    """The digest (:mod:`shardckpt.format.digests`) of ``entry``'s bytes as stored now."""
    where, below = files.locate(entry.path)
    return hash_chunks(iter_file_chunks(where, below, chunk_size, limit=entry.size + 1), chunk_size,
                       entry.algorithm)


class TrustedFiles:
    """Checks each file of a trusted checkpoint against its signed digest, once, before its first
    read (thread-safe; the outcome is remembered, failures included)."""

    def __init__(self, storage: Storage, m: Manifest) -> None:
        self.files, self.manifest = RunFiles(storage), m
        self._done: dict[str, TrustError | None] = {}
        self._lock = threading.Lock()

    def check(self, entry: FileEntry) -> None:
        with self._lock:
            if entry.path not in self._done:
                got = file_digest(self.files, entry, self.manifest.chunk_size)
                self._done[entry.path] = None if got == entry.digest else TrustError(
                    f"{self.files.url_of(entry.path)}: bytes do not match the signed digest "
                    f"({entry.algorithm} {got[:16]}..., signed {str(entry.digest)[:16]}...); refused")
            err = self._done[entry.path]
        if err is not None:
            raise err
