"""Digests and signatures (format 1.4, 1.5, docs/FORMAT.md section 16): a signed round trip, every
single-byte change refused (with BLAKE3 and with SHA-256 digests), a replayed older manifest
refused, key rotation, the CLI's one line."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner, Result

from shardckpt.checkpoint.reader import CheckpointReader, read_manifest
from shardckpt.checkpoint.trust import TrustedFiles, check_manifest, signing_key, trusted_keys
from shardckpt.checkpoint.verify import verify
from shardckpt.errors import ConfigError, ShardckptError, TrustError
from shardckpt.format.digests import ALGORITHMS, BLAKE3, BLAKE3_VERSION, DIGESTS_VERSION
from shardckpt.format.integrity import CHECKSUM_FIELD, crc32c
from shardckpt.format.manifest import MANIFEST_NAME
from shardckpt.format.manifest_parse import parse
from shardckpt.storage import Storage
from shardckpt.tools.sign import sign_checkpoint
from shardckpt.tools.synth import synthesize

CHUNK = 4096


def _keypair(d: Path, name: str, pem: bool = False) -> tuple[str, str]:
    """(private, public) key files, OpenSSH (as ``ssh-keygen -t ed25519`` writes) or PEM."""
    from cryptography.hazmat.primitives import serialization as ser
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    k = Ed25519PrivateKey.generate()
    if pem:
        priv = k.private_bytes(ser.Encoding.PEM, ser.PrivateFormat.PKCS8, ser.NoEncryption())
        pub = k.public_key().public_bytes(ser.Encoding.PEM, ser.PublicFormat.SubjectPublicKeyInfo)
    else:
        priv = k.private_bytes(ser.Encoding.PEM, ser.PrivateFormat.OpenSSH, ser.NoEncryption())
        pub = k.public_key().public_bytes(ser.Encoding.OpenSSH, ser.PublicFormat.OpenSSH) + b" me@host\n"
    (d / name).write_bytes(priv)
    (d / f"{name}.pub").write_bytes(pub)
    return str(d / name), str(d / f"{name}.pub")


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[str, str]]:
    d = tmp_path_factory.mktemp("keys")
    return {"old": _keypair(d, "old"), "new": _keypair(d, "new"), "pem": _keypair(d, "pem", pem=True)}


def _signed(dst: Path, key: str, step: int = 100, digests: bool | str = True) -> str:
    url = str(dst / f"step-{step:08d}")
    synthesize(url, 3000, 2, units=1, step=step, chunk_size=CHUNK, signing_key=signing_key(key),
               digests=digests)
    return url


def _hash(algorithm: str, data: bytes) -> bytes:
    """``algorithm`` of ``data``, from its own package (independently of shardckpt's)."""
    if algorithm == BLAKE3:
        import blake3
        return blake3.blake3(data).digest()
    return hashlib.sha256(data).digest()


def _all_states(url: str, trust: str) -> int:
    r = CheckpointReader(url, trust=trust)
    n = 0
    for shard in range(r.manifest.mesh.shard_degree):
        for name in r.slots:
            group, _, kind = name.rpartition(".")
            n += len(r.read_state(shard, group, kind))
    return n


@pytest.mark.parametrize("algorithm", list(ALGORITHMS))
def test_digests_are_the_chunked_hash_of_the_bytes_written(tmp_path, algorithm):
    m = synthesize(str(tmp_path / "ck"), 3000, 2, units=1, chunk_size=CHUNK, digests=algorithm)
    assert m.version == ALGORITHMS[algorithm]
    doc = json.loads((tmp_path / "ck" / MANIFEST_NAME).read_bytes())
    assert all(set(ALGORITHMS) & set(f) == {algorithm} for f in doc["files"])
    for f in m.files:  # computed here independently of shardckpt.storage.digest
        data = (tmp_path / "ck" / f.path).read_bytes()
        chunks = b"".join(_hash(algorithm, data[i:i + CHUNK]) for i in range(0, len(data), CHUNK))
        assert f.algorithm == algorithm and f.digest == _hash(algorithm, chunks).hex(), f.path
    assert verify(str(tmp_path / "ck"), digests=True).ok
    plain = synthesize(str(tmp_path / "plain"), 3000, 2, units=1, chunk_size=CHUNK)
    assert plain.version < DIGESTS_VERSION and all(f.digest is None for f in plain.files)
    problems = verify(str(tmp_path / "plain"), digests=True).problems
    assert len(problems) == len(plain.files) and all("no digest recorded" in p for p in problems)


def test_digests_true_means_blake3_where_it_imports(tmp_path):
    m = synthesize(str(tmp_path / "ck"), 3000, 2, units=1, chunk_size=CHUNK, digests=True)
    assert m.version == BLAKE3_VERSION and {f.algorithm for f in m.files} == {BLAKE3}
    with pytest.raises(ConfigError, match="md5"):
        synthesize(str(tmp_path / "bad"), 3000, 2, units=1, chunk_size=CHUNK, digests="md5")


@pytest.mark.parametrize("algorithm", list(ALGORITHMS))
def test_signed_round_trip_openssh_and_pem(tmp_path, keys, algorithm):
    for name in ("old", "pem"):
        url = _signed(tmp_path / name, keys[name][0], digests=algorithm)
        assert _all_states(url, keys[name][1]) > 0
        assert verify(url, trust=keys[name][1]).ok
        m = read_manifest(Storage(url), trusted_keys(keys[name][1]))
        assert m.version == ALGORITHMS[algorithm] and {f.algorithm for f in m.files} == {algorithm}


@pytest.mark.parametrize("algorithm", list(ALGORITHMS))
def test_unsigned_unknown_key_and_changed_bytes_are_named(tmp_path, keys, algorithm):
    plain = str(tmp_path / "plain")
    synthesize(plain, 3000, 2, units=1, chunk_size=CHUNK)
    with pytest.raises(TrustError, match="unsigned"):
        CheckpointReader(plain, trust=keys["old"][1])
    url = _signed(tmp_path / "run", keys["old"][0], digests=algorithm)
    with pytest.raises(TrustError, match="unknown key"):
        CheckpointReader(url, trust=keys["new"][1])
    m = read_manifest(Storage(url))
    shard = Path(url) / m.files[0].path
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1
    shard.write_bytes(bytes(data))
    with pytest.raises(TrustError, match="bytes do not match"):
        _all_states(url, keys["old"][1])
    assert any("differs from the recorded" in p for p in verify(url, trust=keys["old"][1]).problems)


def _reseal(raw: bytes) -> bytes:
    """``raw`` with its manifest_crc32c recomputed, as anyone who edits a manifest can."""
    at = raw.rindex(b'"%s"' % CHECKSUM_FIELD.encode())
    return raw[:at] + b'"%s": "%08x"\n}' % (CHECKSUM_FIELD.encode(), crc32c(raw[:at]))


@pytest.mark.parametrize("algorithm", list(ALGORITHMS))
def test_every_single_byte_change_of_the_manifest_is_refused(tmp_path, keys, algorithm):
    """Every byte of the manifest, each changed once (xor 0x01; where it lies before the checksum
    member, with the checksum recomputed so that the signature alone must refuse it)."""
    url = _signed(tmp_path / "run", keys["old"][0], digests=algorithm)
    raw = (Path(url) / MANIFEST_NAME).read_bytes()
    trust = trusted_keys(keys["old"][1])
    assert trust is not None
    check_manifest(raw, parse(raw, url), url, trust)
    crc_at = raw.rindex(b'"%s"' % CHECKSUM_FIELD.encode())
    accepted = []
    for i in range(len(raw)):
        bad = bytearray(raw)
        bad[i] ^= 1
        changed = _reseal(bytes(bad)) if i < crc_at else bytes(bad)
        try:
            check_manifest(changed, parse(changed, url), url, trust)
        except (ShardckptError, ValueError):
            continue
        accepted.append(i)
    assert not accepted, f"changes at bytes {accepted[:10]} were accepted"


@pytest.mark.parametrize("algorithm", list(ALGORITHMS))
def test_every_single_byte_change_of_every_file_is_refused(tmp_path, keys, algorithm):
    """Every byte of every file (header and data), each changed once (xor 0x01)."""
    url = _signed(tmp_path / "run", keys["old"][0], digests=algorithm)
    m = CheckpointReader(url, trust=keys["old"][1]).manifest
    assert {f.algorithm for f in m.files} == {algorithm}
    checked = 0
    for entry in m.files:
        path = Path(url) / entry.path
        good = path.read_bytes()
        TrustedFiles(Storage(url), m).check(entry)  # the unchanged file passes
        with open(path, "r+b") as f:
            for i in range(len(good)):
                f.seek(i)
                f.write(bytes([good[i] ^ 1]))
                f.flush()
                with pytest.raises(TrustError, match="bytes do not match"):
                    TrustedFiles(Storage(url), m).check(entry)
                f.seek(i)
                f.write(good[i:i + 1])
                checked += 1
    assert checked == sum(f.size for f in m.files)


def test_a_replayed_older_signed_manifest_is_refused(tmp_path, keys):
    old = _signed(tmp_path / "run", keys["old"][0], step=100)
    _signed(tmp_path / "run", keys["old"][0], step=200)
    replay = Path(tmp_path / "run" / "step-00000200")
    shutil.rmtree(replay)
    shutil.copytree(old, replay)  # step 100's signed manifest and files, under step 200
    with pytest.raises(TrustError, match="signed for step 100, found under step-00000200"):
        CheckpointReader(str(replay), trust=keys["old"][1])
    assert not verify(str(replay), trust=keys["old"][1]).ok


def test_key_rotation_keeps_old_checkpoints_readable(tmp_path, keys):
    old = _signed(tmp_path / "run", keys["old"][0], step=100)
    new = _signed(tmp_path / "run", keys["new"][0], step=200)
    both = f"{keys['old'][1]},{keys['new'][1]}"
    assert _all_states(old, both) and _all_states(new, both)
    assert _all_states(old, keys["old"][1])
    with pytest.raises(TrustError, match="unknown key"):
        CheckpointReader(old, trust=keys["new"][1])
    # re-signing an old checkpoint with the new key (`shardckpt sign`) moves it to the new key
    sign_checkpoint(old, keys["new"][0])
    assert _all_states(old, keys["new"][1])


def test_sign_adds_digests_and_refuses_a_damaged_file(tmp_path, keys):
    url = str(tmp_path / "run" / "step-00000100")
    m = synthesize(url, 3000, 2, units=1, step=100, chunk_size=CHUNK)
    signed = sign_checkpoint(url, keys["old"][0])
    assert all(f.digest for f in signed.files) and verify(url, trust=keys["old"][1]).ok
    shard = Path(url) / m.files[0].path
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 1
    shard.write_bytes(bytes(data))
    before = (Path(url) / MANIFEST_NAME).read_bytes()
    with pytest.raises(ShardckptError, match="CRC32C"):
        sign_checkpoint(url, keys["new"][0])
    assert (Path(url) / MANIFEST_NAME).read_bytes() == before


def test_cli_sign_and_verify_exit_codes_with_one_line(tmp_path, keys):
    from shardckpt.cli.main import app

    runner = CliRunner()
    url = str(tmp_path / "run" / "step-00000100")
    synthesize(url, 3000, 2, units=1, step=100, chunk_size=CHUNK)
    r = runner.invoke(app, ["verify", url, "--trust", keys["old"][1]])
    assert r.exit_code == 1 and r.output.strip().count("\n") == 0 and "unsigned" in r.output
    r = runner.invoke(app, ["sign", url, "--key", keys["old"][0]])
    assert r.exit_code == 0 and "signed" in r.output
    r = runner.invoke(app, ["verify", url, "--trust", keys["old"][1]])
    assert r.exit_code == 0, r.output
    r = runner.invoke(app, ["verify", url, "--trust", keys["new"][1]])
    assert r.exit_code == 1 and r.output.strip().count("\n") == 0 and "unknown key" in r.output
    r = runner.invoke(app, ["sign", url, "--key", str(tmp_path / "absent")])
    assert r.exit_code == 2 and r.output.strip().count("\n") == 0 and "absent" in r.output
    r = runner.invoke(app, ["verify", url, "--trust", keys["old"][0] + ".nothere"])
    assert r.exit_code == 1 and r.output.strip().count("\n") == 0 and "cannot read the key" in r.output


def test_checkpointer_signs_and_load_trusts(tmp_path, keys, one_thread):
    import torch
    from torch import nn

    from shardckpt.runtime import ZeroEngine
    from shardckpt.training.checkpointer import Checkpointer
    from shardckpt.training.save_load import load

    def engine(seed: int) -> ZeroEngine:
        torch.manual_seed(seed)
        net = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4))
        net[0].requires_grad_(False)  # a frozen group: its file is referenced by the next save
        return ZeroEngine(net, policy=(nn.Linear,))

    ours = engine(0)
    ckpt = Checkpointer(str(tmp_path / "run"), ours, signing_key=keys["old"][0])
    ckpt.save(1)
    ckpt.save(2)
    url = ckpt.manager.url_for(2)
    refs = CheckpointReader(url, trust=keys["old"][1]).manifest.references()
    assert refs and all(r.digest for r in refs)  # the digest comes with the reference
    assert verify(url, trust=keys["old"][1]).ok
    theirs = engine(1)
    load(theirs, url, trust=keys["old"][1])
    for g, kinds in ours.local_shards().items():
        for kind, t in kinds.items():
            assert torch.equal(theirs.local_shards()[g][kind], t), (g, kind)
    with pytest.raises(ShardckptError, match="signed by an unknown key"):  # every rank's error
        Checkpointer(str(tmp_path / "run"), engine(2)).load(url, trust=keys["new"][1])
    frozen = tmp_path / "run" / refs[0].path[3:]  # the step-1 file step 2 references
    data = bytearray(frozen.read_bytes())
    data[-1] ^= 1
    frozen.write_bytes(bytes(data))
    with pytest.raises(ShardckptError, match="bytes do not match the signed digest"):
        load(engine(3), url, trust=keys["old"][1])


def test_dcp_shardckpt_reader_refuses_what_its_trust_did_not_sign(tmp_path, keys):
    from shardckpt.interop.dcp.storage import ShardckptReader

    url = _signed(tmp_path / "run", keys["old"][0])
    assert ShardckptReader(url, trust=keys["old"][1]).read_metadata().state_dict_metadata
    with pytest.raises(TrustError, match="unknown key"):
        ShardckptReader(url, trust=keys["new"][1]).read_metadata()


def test_watch_trust_dead_letters_what_its_keys_did_not_sign(tmp_path, keys):
    from shardckpt.errors import ConfigError
    from shardckpt.watch.config import load_pipeline
    from shardckpt.watch.service import Watcher

    _signed(tmp_path / "run", keys["old"][0], step=100)
    synthesize(str(tmp_path / "run" / "step-00000200"), 3000, 2, units=1, step=200, chunk_size=CHUNK)
    shutil.copy(keys["old"][1], tmp_path / "ckpt.pub")
    toml = tmp_path / "p.toml"
    shutil.copy(keys["new"][0], tmp_path / "ckpt")
    toml.write_text('name = "t"\nwatch = "run"\nstate = "out"\nretries = 0\ntrust = ["ckpt.pub"]\n'
                    'signing_key = "ckpt"\n[[steps]]\nkind = "verify"\n'
                    '[[steps]]\nkind = "reshard"\ndst = "out/ws1/{name}"\nto = 1\n')
    report = Watcher(load_pipeline(str(toml))).run(once=True)
    assert (report.done, report.dead) == (2, 1)
    dead = list((tmp_path / "out").rglob("*.dead"))
    assert len(dead) == 1 and "step-00000200" in str(dead[0]) and "unsigned" in dead[0].read_text()
    # the reshard step signed its output with the pipeline's key
    assert verify(str(tmp_path / "out" / "ws1" / "step-00000100"), trust=keys["new"][1]).ok
    toml.write_text(toml.read_text().replace("ckpt.pub", "absent.pub"))
    with pytest.raises(ConfigError, match="absent.pub"):
        load_pipeline(str(toml))


def test_reshard_signs_what_it_writes(tmp_path, keys):
    """Library (two worker processes write the files) and CLI (`--sign-key`)."""
    from shardckpt.cli.main import app
    from shardckpt.tools.reshard import reshard

    src = str(tmp_path / "run" / "step-00000100")
    synthesize(src, 3000, 2, units=1, step=100, chunk_size=CHUNK)
    dst = str(tmp_path / "ws4" / "step-00000100")
    m = reshard(src, dst, 4, workers=2, signing_key=keys["old"][0]).manifest
    assert m.version == BLAKE3_VERSION and all(f.digest for f in m.files)
    assert verify(dst, trust=keys["old"][1]).ok and _all_states(dst, keys["old"][1])
    out = str(tmp_path / "ws1" / "step-00000100")
    r = CliRunner().invoke(app, ["reshard", src, out, "--to", "1", "--sign-key", keys["new"][0]])
    assert r.exit_code == 0, r.output
    assert verify(out, trust=keys["new"][1]).ok
    assert not verify(out, trust=keys["old"][1]).ok


def test_import_signs_what_it_writes(tmp_path, keys):
    """`import hf` in code (ImportOptions.signing_key) and on the command line (--sign-key)."""
    import numpy as np
    from safetensors.numpy import save_file

    from shardckpt.cli.main import app
    from shardckpt.interop.importer import ImportOptions, get_importer, run_importer

    folder = tmp_path / "hf"
    folder.mkdir()
    rng = np.random.default_rng(0)
    save_file({"model.layers.0.w": rng.standard_normal((4, 4), dtype=np.float32),
               "model.norm.weight": np.ones(4, np.float32)}, str(folder / "model.safetensors"))
    dst = str(tmp_path / "ck")
    m = run_importer(get_importer("hf"), ImportOptions(str(folder), dst, 2, signing_key=keys["old"][0]))
    assert all(f.digest for f in m.files) and verify(dst, trust=keys["old"][1]).ok
    out = str(tmp_path / "ck2")
    r = CliRunner().invoke(app, ["import", "hf", str(folder), out, "--ranks", "1", "--sign-key", keys["new"][0]])
    assert r.exit_code == 0, r.output
    assert verify(out, trust=keys["new"][1]).ok and not verify(out, trust=keys["old"][1]).ok


def test_consolidate_signs_its_output_and_verify_trust_checks_every_file(tmp_path, keys):
    from shardckpt.cli.main import app

    runner = CliRunner()
    src = str(tmp_path / "run" / "step-00000100")
    synthesize(src, 3000, 2, units=1, step=100, chunk_size=CHUNK)
    hf = tmp_path / "hf"
    r = runner.invoke(app, ["consolidate", src, str(hf), "--sign-key", keys["old"][0]])
    assert r.exit_code == 0, r.output

    def check(pub: str) -> Result:
        return runner.invoke(app, ["verify", str(hf), "--trust", pub])

    assert check(keys["old"][1]).exit_code == 0
    r = check(keys["new"][1])
    assert r.exit_code == 1 and r.output.strip().count("\n") == 0 and "unknown key" in r.output
    weights = next(hf.glob("model-*.safetensors"))
    good = weights.read_bytes()
    for i in (0, len(good) // 2, len(good) - 1):  # header, data, last byte
        bad = bytearray(good)
        bad[i] ^= 1
        weights.write_bytes(bytes(bad))
        r = check(keys["old"][1])
        assert r.exit_code == 1 and "its digest differs" in r.output, (i, r.output)
    weights.write_bytes(good)
    (hf / "extra.json").write_text("{}")
    assert "does not list" in check(keys["old"][1]).output
    (hf / "extra.json").unlink()
    assert check(keys["old"][1]).exit_code == 0
    # an unsigned consolidation, then signed after the fact with `shardckpt sign`
    plain = tmp_path / "plain"
    assert runner.invoke(app, ["consolidate", src, str(plain)]).exit_code == 0
    assert "unsigned" in runner.invoke(app, ["verify", str(plain), "--trust", keys["new"][1]]).output
    assert runner.invoke(app, ["sign", str(plain), "--key", keys["new"][0]]).exit_code == 0
    assert runner.invoke(app, ["verify", str(plain), "--trust", keys["new"][1]]).exit_code == 0
