"""Ed25519 signatures over a manifest's canonical bytes (format 1.4; docs/FORMAT.md section 16).

A signed manifest ends with two members, in this order and with exactly these bytes around them::

    ..., "signature": {"algorithm": "ed25519", "key_id": "SHA256:<43>", "value": "<88 base64>"},
     "manifest_crc32c": "<8 hex>"
    }

The **signed bytes** are :data:`DOMAIN` followed by the manifest's bytes, as stored, from the first
byte up to and excluding the ``"`` that opens the ``"signature"`` key: every member before it (every
file's size, CRC32Cs and ``sha256`` or ``blake3`` digest, ``extras.step``, the save id), byte for
byte, so that no re-serialization is involved. The checksum member after it covers the signature too (section 3.8),
so a reader of 1.1-1.3 still reads a signed manifest, ignoring the unknown member. The **key id** is
the key's OpenSSH fingerprint, as ``ssh-keygen -l`` prints it: ``SHA256:`` and the unpadded
base64 of the SHA-256 of the public key's OpenSSH wire form.

Keys are parsed from the bytes of OpenSSH or PEM files by the ``cryptography`` package (imported
here only when a key is used); this module reads no file.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
from dataclasses import dataclass, field
from typing import Any
from collections.abc import Mapping, Sequence

from shardckpt.errors import ConfigError, TrustError
from shardckpt.format.integrity import CHECKSUM_FIELD, crc32c

SIGNATURE_FIELD = "signature"
ALGORITHM = "ed25519"
#: Prefixed to the covered bytes before signing, so that a shardckpt signature means nothing else.
DOMAIN = b"shardckpt manifest signature v1\n"
#: The same for the provenance file of a consolidation (``shardckpt_consolidated.json``).
CONSOLIDATION_DOMAIN = b"shardckpt consolidation signature v1\n"
_TAIL = re.compile(rb'"signature": \{"algorithm": "ed25519", "key_id": "(SHA256:[A-Za-z0-9+/]{43})", '
                   rb'"value": "([A-Za-z0-9+/]{86}==)"\},\n "manifest_crc32c": "[0-9a-f]{8}"\n\}\Z')
_MARK = b'"signature": {'


def key_id(public_raw: bytes) -> str:
    """The OpenSSH fingerprint of the raw 32-byte Ed25519 public key ``public_raw``."""
    name = b"ssh-ed25519"
    wire = len(name).to_bytes(4, "big") + name + len(public_raw).to_bytes(4, "big") + public_raw
    return "SHA256:" + base64.b64encode(hashlib.sha256(wire).digest()).decode().rstrip("=")


@dataclass(frozen=True)
class PublicKey:
    """An Ed25519 public key a reader trusts."""

    raw: bytes = field(repr=False)
    key_id: str = ""
    source: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "key_id", key_id(self.raw))


@dataclass(frozen=True)
class SigningKey:
    """An Ed25519 private key a writer signs with (raw 32 bytes; picklable, never printed)."""

    raw: bytes = field(repr=False)
    source: str = ""

    @property
    def public(self) -> PublicKey:
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
        from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

        pub = Ed25519PrivateKey.from_private_bytes(self.raw).public_key()
        return PublicKey(pub.public_bytes(Encoding.Raw, PublicFormat.Raw), source=self.source)

    def sign(self, data: bytes) -> bytes:
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

        return Ed25519PrivateKey.from_private_bytes(self.raw).sign(data)


def private_key_from(data: bytes, source: str, password: bytes | None = None) -> SigningKey:
    """The Ed25519 private key in ``data`` (OpenSSH ``BEGIN OPENSSH PRIVATE KEY`` or PEM PKCS#8)."""
    from cryptography.hazmat.primitives import serialization as ser
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    try:
        loader = ser.load_ssh_private_key if b"OPENSSH PRIVATE KEY" in data else ser.load_pem_private_key
        key = loader(data, password)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"{source}: not an OpenSSH or PEM private key ({e})") from e
    if not isinstance(key, Ed25519PrivateKey):
        raise ConfigError(f"{source}: a {type(key).__name__}; shardckpt signs with Ed25519 keys "
                          "(ssh-keygen -t ed25519)")
    return SigningKey(key.private_bytes(ser.Encoding.Raw, ser.PrivateFormat.Raw, ser.NoEncryption()),
                      source)


def public_key_from(data: bytes, source: str) -> PublicKey:
    """The Ed25519 public key in ``data``: an OpenSSH ``ssh-ed25519 AAAA...`` line, a PEM public
    key, or a private key file (its public half)."""
    from cryptography.hazmat.primitives import serialization as ser
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    if b"PRIVATE KEY" in data:
        return private_key_from(data, source).public
    try:
        key = (ser.load_pem_public_key(data) if data.lstrip().startswith(b"-----")
               else ser.load_ssh_public_key(data.strip()))
    except (ValueError, TypeError, ser.UnsupportedAlgorithm) as e:  # type: ignore[attr-defined]
        raise ConfigError(f"{source}: not an OpenSSH or PEM public key ({e})") from e
    if not isinstance(key, Ed25519PublicKey):
        raise ConfigError(f"{source}: a {type(key).__name__}; shardckpt trusts Ed25519 keys only")
    return PublicKey(key.public_bytes(ser.Encoding.Raw, ser.PublicFormat.Raw), source=source)


def seal_signed(doc: Mapping[str, Any], key: SigningKey, domain: bytes = DOMAIN) -> bytes:
    """Encode ``doc`` (``indent=1``) with the signature, then the checksum, as its last members."""
    body = {k: v for k, v in doc.items() if k not in (CHECKSUM_FIELD, SIGNATURE_FIELD)}
    raw = json.dumps(body, indent=1, allow_nan=False).encode()
    head = raw[:raw.rindex(b"}")].rstrip()
    covered = head + (b"\n " if head.endswith(b"{") else b",\n ")
    value = base64.b64encode(key.sign(domain + covered))
    member = (b'"signature": {"algorithm": "ed25519", "key_id": "%s", "value": "%s"},\n '
              % (key.public.key_id.encode(), value))
    return covered + member + b'"%s": "%08x"\n}' % (CHECKSUM_FIELD.encode(), crc32c(covered + member))


def signature_of(raw: bytes) -> tuple[bytes, str, bytes] | None:
    """(covered bytes, key id, signature) of a signed manifest's bytes; None when its bytes do not
    end with a signature member as :func:`seal_signed` writes it (unsigned)."""
    at = raw.rfind(_MARK)
    if at < 0:
        return None
    m = _TAIL.match(raw, at)
    if m is None:
        return None
    return raw[:at], m.group(1).decode(), base64.b64decode(m.group(2))


def check_signature(raw: bytes, doc: Mapping[str, Any], trusted: Sequence[PublicKey], source: str,
                    domain: bytes = DOMAIN) -> str:
    """The key id that signed manifest bytes ``raw`` (parsed as ``doc``), if it is one of
    ``trusted`` and the signature holds; else :class:`TrustError` saying which of unsigned,
    unknown key or bytes that do not match."""
    from cryptography.exceptions import InvalidSignature
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    found = signature_of(raw)
    member = doc.get(SIGNATURE_FIELD)
    if found is None:
        what = "a signature member not in the form shardckpt writes" if member is not None else "no signature"
        raise TrustError(f"{source}: unsigned: {what}; refused (trust requires a signed checkpoint)")
    covered, kid, value = found
    if member != {"algorithm": ALGORITHM, "key_id": kid, "value": base64.b64encode(value).decode()}:
        raise TrustError(f"{source}: bytes do not match: the signature member differs from the JSON's")
    key = next((k for k in trusted if k.key_id == kid), None)
    if key is None:
        raise TrustError(f"{source}: signed by an unknown key {kid}; trusted: "
                         f"{', '.join(k.key_id for k in trusted) or 'none'}")
    try:
        Ed25519PublicKey.from_public_bytes(key.raw).verify(value, domain + covered)
    except InvalidSignature:
        raise TrustError(f"{source}: bytes do not match the signature of key {kid}; the manifest "
                         "was changed after it was signed") from None
    return kid
