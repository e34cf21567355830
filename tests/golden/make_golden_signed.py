"""Write the golden signed checkpoint of format 1.4 (SHA-256 digests, Ed25519 signature) in
``tests/golden/v1_4_signed/``: :func:`shardckpt.tools.synth.synthesize` of 3000 parameters on 2
shard ranks, signed with a key made here, whose public half is kept as ``v1_4_signed/key.pub``
(the private half is thrown away). Run once, with a shardckpt that writes SHA-256 digests as 1.4
(the one before BLAKE3, 1.5); commit the files as-is; it refuses to overwrite them.

    python tests/golden/make_golden_signed.py [DST]

``tests/test_digest_formats.py`` checks that the checkpoint still verifies and that its signature
still checks: checkpoints signed before BLAKE3 keep their trust.
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
DST = HERE / "v1_4_signed"
STEP, CHUNK = 100, 4096


def main(dst: Path) -> None:
    from cryptography.hazmat.primitives import serialization as ser
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from shardckpt.format.signing import SigningKey
    from shardckpt.tools.synth import synthesize

    if dst.exists():
        sys.exit(f"{dst} exists; not overwritten")
    key = Ed25519PrivateKey.generate()
    raw = key.private_bytes(ser.Encoding.Raw, ser.PrivateFormat.Raw, ser.NoEncryption())
    m = synthesize(str(dst / f"step-{STEP:08d}"), 3000, 2, units=1, step=STEP, chunk_size=CHUNK,
                   signing_key=SigningKey(raw, "golden"))
    assert m.version == (1, 4), m.version
    (dst / "key.pub").write_bytes(key.public_key().public_bytes(ser.Encoding.OpenSSH, ser.PublicFormat.OpenSSH))
    print(f"wrote {dst}: format {m.version[0]}.{m.version[1]}, {len(m.files)} files")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else DST)
