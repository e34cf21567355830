"""Signing on S3: `sign` replaces the manifest with one conditional PUT (If-Match), and a trusted
read of a signed checkpoint refuses an object changed after signing."""

from __future__ import annotations

from pathlib import Path

import pytest

from shardckpt.checkpoint.reader import CheckpointReader
from shardckpt.checkpoint.verify import verify
from shardckpt.errors import TrustError
from shardckpt.storage import Storage
from shardckpt.tools.sign import sign_checkpoint
from shardckpt.tools.synth import synthesize

pytestmark = [pytest.mark.s3]


def _keys(d: Path) -> tuple[str, str]:
    from cryptography.hazmat.primitives import serialization as ser
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    k = Ed25519PrivateKey.generate()
    (d / "k").write_bytes(k.private_bytes(ser.Encoding.PEM, ser.PrivateFormat.OpenSSH, ser.NoEncryption()))
    (d / "k.pub").write_bytes(k.public_key().public_bytes(ser.Encoding.OpenSSH, ser.PublicFormat.OpenSSH))
    return str(d / "k"), str(d / "k.pub")


def test_sign_and_trusted_read_on_s3(moto_server, s3_bucket, tmp_path: Path) -> None:  # noqa: ANN001
    bucket = s3_bucket(moto_server)
    key, pub = _keys(tmp_path)
    url = f"{bucket.url}/run/step-00000100"
    m = synthesize(url, 3000, 2, units=1, step=100, chunk_size=4096, storage_options=bucket.storage_options)
    with pytest.raises(TrustError, match="unsigned"):
        CheckpointReader(url, bucket.storage_options, trust=pub)
    sign_checkpoint(url, key, bucket.storage_options)
    assert verify(url, bucket.storage_options, trust=pub).ok
    r = CheckpointReader(url, bucket.storage_options, trust=pub)
    assert r.read_state(0, *next(iter(r.slots)).rsplit(".", 1)).nbytes
    storage = Storage(url, bucket.storage_options)
    shard = m.files[0].path
    data = bytearray(storage.read(shard))
    data[-1] ^= 1
    storage.put(shard, bytes(data))
    with pytest.raises(TrustError, match="bytes do not match"):
        CheckpointReader(url, bucket.storage_options, trust=pub).read_state(0, *next(iter(r.slots)).rsplit(".", 1))
