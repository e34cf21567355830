"""The two digest algorithms of format 1.4 and 1.5 (docs/FORMAT.md section 16): a checkpoint
signed with SHA-256 digests before BLAKE3 (golden, 1.4) still verifies and its signature still
checks; ``shardckpt sign`` keeps the algorithm a manifest records and picks BLAKE3 otherwise; a
manifest that mixes algorithms, names two in one entry, names one shardckpt does not use, or has
BLAKE3 under 1.4, is refused with one error naming the file."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from shardckpt.checkpoint.reader import CheckpointReader
from shardckpt.checkpoint.trust import TrustedFiles, trusted_keys
from shardckpt.checkpoint.verify import verify
from shardckpt.errors import ManifestError, TrustError
from shardckpt.format.digests import BLAKE3, BLAKE3_VERSION, DIGESTS_VERSION, SHA256
from shardckpt.format.integrity import seal
from shardckpt.format.manifest import MANIFEST_NAME
from shardckpt.format.manifest_parse import parse
from shardckpt.storage import Storage
from shardckpt.tools.sign import sign_checkpoint
from shardckpt.tools.synth import synthesize

GOLDEN = Path(__file__).parent / "golden" / "v1_4_signed"
CHUNK = 4096


@pytest.fixture()
def golden(tmp_path: Path) -> tuple[str, str]:
    """(a copy of the golden 1.4 signed checkpoint, its public key file)."""
    shutil.copytree(GOLDEN, tmp_path / "golden")
    return str(tmp_path / "golden" / "step-00000100"), str(tmp_path / "golden" / "key.pub")


def _keypair(d: Path) -> tuple[str, str]:
    from cryptography.hazmat.primitives import serialization as ser
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    k = Ed25519PrivateKey.generate()
    (d / "k").write_bytes(k.private_bytes(ser.Encoding.PEM, ser.PrivateFormat.OpenSSH, ser.NoEncryption()))
    (d / "k.pub").write_bytes(k.public_key().public_bytes(ser.Encoding.OpenSSH, ser.PublicFormat.OpenSSH))
    return str(d / "k"), str(d / "k.pub")


def test_a_signed_sha256_checkpoint_of_format_1_4_keeps_verifying(golden):
    url, pub = golden
    r = CheckpointReader(url, trust=pub)
    assert r.manifest.version == DIGESTS_VERSION and {f.algorithm for f in r.manifest.files} == {SHA256}
    for shard in range(r.manifest.mesh.shard_degree):
        for name in r.slots:
            group, _, kind = name.rpartition(".")
            assert len(r.read_state(shard, group, kind))
    assert verify(url, trust=pub).ok and verify(url, digests=True).ok
    entry = r.manifest.files[0]
    path = Path(url) / entry.path
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))
    with pytest.raises(TrustError, match="bytes do not match the signed digest"):
        TrustedFiles(Storage(url), r.manifest).check(entry)
    assert any("sha256 digest" in p for p in verify(url, digests=True).problems)


def test_sign_keeps_the_recorded_algorithm_and_picks_blake3_otherwise(golden, tmp_path):
    key, pub = _keypair(tmp_path)
    url, _ = golden
    m = sign_checkpoint(url, key)  # signed again with another key: still SHA-256, still 1.4
    assert m.version == DIGESTS_VERSION and {f.algorithm for f in m.files} == {SHA256}
    assert verify(url, trust=pub).ok
    plain = str(tmp_path / "plain" / "step-00000100")
    synthesize(plain, 3000, 2, units=1, step=100, chunk_size=CHUNK)
    m = sign_checkpoint(plain, key)
    assert m.version == BLAKE3_VERSION and {f.algorithm for f in m.files} == {BLAKE3}
    assert verify(plain, trust=pub).ok
    sha = str(tmp_path / "sha" / "step-00000100")
    synthesize(sha, 3000, 2, units=1, step=100, chunk_size=CHUNK, digests=SHA256)
    m = sign_checkpoint(sha, key)
    assert m.version == DIGESTS_VERSION and {f.algorithm for f in m.files} == {SHA256}
    assert verify(sha, trust=pub).ok
    assert trusted_keys(pub) is not None


def _edited(url: str, edit) -> bytes:
    doc = json.loads((Path(url) / MANIFEST_NAME).read_bytes())
    edit(doc)
    return seal({k: v for k, v in doc.items() if k != "manifest_crc32c"})


@pytest.mark.parametrize("case, message", [
    ("both", r"files\[0\]\.sha256: .*shard-00000-of-00002\.safetensors: digest members \['blake3', 'sha256'\]"),
    ("unknown", r"files\[1\]\.sha512: .*shard-00001-of-00002\.safetensors: digest members \['sha512'\]"),
    ("mixed", r"files: file digests of blake3 and sha256; a manifest uses one algorithm"),
    ("old_version", r"'blake3' digests need format 1\.5 or later; this manifest says 1\.4"),
])
def test_a_manifest_with_digests_it_cannot_have_is_refused_naming_the_file(tmp_path, case, message):
    url = str(tmp_path / "ck")
    synthesize(url, 3000, 2, units=1, chunk_size=CHUNK, digests=BLAKE3)

    def edit(doc):
        files = doc["files"]
        if case == "both":
            files[0]["sha256"] = files[0]["blake3"]
        elif case == "unknown":
            files[1]["sha512"] = files[1].pop("blake3")
        elif case == "mixed":
            files[1]["sha256"] = files[1].pop("blake3")
        else:
            doc["version"] = "1.4"

    raw = _edited(url, edit)
    source = str(Path(url) / MANIFEST_NAME)
    with pytest.raises(ManifestError, match=message) as e:
        parse(raw, source)
    assert str(e.value).count(source) == 1


@pytest.mark.parametrize("algorithm", [SHA256, BLAKE3])
def test_a_signed_consolidation_of_either_algorithm_checks(tmp_path, monkeypatch, algorithm):
    """A provenance signed with SHA-256 digests (every one before BLAKE3) or BLAKE3 ones."""
    from shardckpt.tools import consolidate_sign
    from shardckpt.tools.consolidate import PROVENANCE, consolidate

    key, pub = _keypair(tmp_path)
    src = str(tmp_path / "run" / "step-00000100")
    synthesize(src, 3000, 2, units=1, step=100, chunk_size=CHUNK)
    hf = tmp_path / "hf"
    consolidate(src, str(hf))
    monkeypatch.setattr(consolidate_sign, "algorithm_for", lambda choice: algorithm)
    consolidate_sign.sign_consolidation(str(hf), key)
    doc = json.loads((hf / PROVENANCE).read_bytes())
    assert [a for a in (SHA256, BLAKE3) if a in doc] == [algorithm]
    consolidate_sign.check_consolidation(str(hf), pub)
    weights = next(hf.glob("model-*.safetensors"))
    good = bytearray(weights.read_bytes())
    good[-1] ^= 1
    weights.write_bytes(bytes(good))
    with pytest.raises(TrustError, match="its digest differs"):
        consolidate_sign.check_consolidation(str(hf), pub)


def test_digests_true_says_once_in_the_log_which_algorithm(caplog):
    from shardckpt.format import digests

    digests._default.cache_clear()
    with caplog.at_level("INFO", logger="shardckpt.format.digests"):
        assert digests.algorithm_for(True) == digests.algorithm_for(True) == BLAKE3
        assert digests.algorithm_for(SHA256) == SHA256
    said = [r.getMessage() for r in caplog.records if r.name == "shardckpt.format.digests"]
    assert said == ["file digests: BLAKE3 (manifest format 1.5)"]
