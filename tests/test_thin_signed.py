"""Thinning a signed checkpoint: a caller that holds the signing key (``Checkpointer(...,
signing_key=..., keep_optimizer_last=...)``, or ``thin(..., resign=resign_with(key))``) thins it
into a weights-only checkpoint signed again, with a digest for every file, that a trusted reader
accepts; without the key it stays whole (tests/test_retention.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from shardckpt.checkpoint.reader import CheckpointReader
from shardckpt.checkpoint.thin import THINNED, resign_with, thin
from shardckpt.checkpoint.trust import signing_key
from shardckpt.checkpoint.verify import verify
from shardckpt.format.digests import ALGORITHMS
from shardckpt.format.manifest import MANIFEST_NAME
from shardckpt.storage import Storage
from shardckpt.tools.synth import synthesize

pytestmark = pytest.mark.usefixtures("one_thread")


def _keypair(d: Path) -> tuple[str, str]:
    from cryptography.hazmat.primitives import serialization as ser
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    k = Ed25519PrivateKey.generate()
    (d / "ckpt").write_bytes(k.private_bytes(ser.Encoding.PEM, ser.PrivateFormat.OpenSSH, ser.NoEncryption()))
    (d / "ckpt.pub").write_bytes(k.public_key().public_bytes(ser.Encoding.OpenSSH, ser.PublicFormat.OpenSSH))
    return str(d / "ckpt"), str(d / "ckpt.pub")


def _trusted_weights_only(url: str, pub: str) -> None:
    r = CheckpointReader(url, trust=pub)
    m = r.manifest
    assert THINNED in m.extras and m.optimizer is None
    assert all(f.digest for f in m.files), [f.path for f in m.files if not f.digest]
    for shard in range(m.mesh.shard_degree):  # every byte, each file's digest checked first
        for g, kinds in m.components["model"].states.items():
            assert [k for k, _ in kinds] == ["master"]
            r.read_state(shard, g, "master")
    report = verify(url, trust=pub)
    assert report.ok, report.problems


@pytest.mark.parametrize("algorithm", list(ALGORITHMS))
def test_thin_with_the_key_signs_the_weights_only_manifest_again(tmp_path: Path, algorithm: str) -> None:
    key, pub = _keypair(tmp_path)
    url = str(tmp_path / "run" / "step-00000100")
    synthesize(url, 3000, 2, units=1, step=100, chunk_size=4096, signing_key=signing_key(key),
               digests=algorithm)
    before = json.loads(Path(url, MANIFEST_NAME).read_bytes())
    assert thin(Storage(url), resign=resign_with(signing_key(key))) is not None
    after = json.loads(Path(url, MANIFEST_NAME).read_bytes())
    assert after["signature"]["key_id"] == before["signature"]["key_id"]
    # the new shard files' digests are of the algorithm of the others: a manifest uses one
    assert after["version"] == before["version"] == "%d.%d" % ALGORITHMS[algorithm]
    assert all(algorithm in f for f in after["files"])
    assert after["save_id"] != before["save_id"]
    _trusted_weights_only(url, pub)


def test_a_signing_checkpointer_thins_past_its_optimizer_window(tmp_path: Path) -> None:
    from shardckpt.runtime import ShardedAdamW, ZeroEngine
    from shardckpt.training.checkpointer import Checkpointer

    key, pub = _keypair(tmp_path)
    torch.manual_seed(0)
    engine = ZeroEngine(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4)), policy=(nn.Linear,))
    ShardedAdamW(engine)
    ckpt = Checkpointer(str(tmp_path / "run"), engine, signing_key=key, keep_last=None,
                        keep_optimizer_last=1)
    for step in (1, 2):
        ckpt.save(step)
    ckpt.close()
    _trusted_weights_only(ckpt.manager.url_for(1), pub)  # thinned, and signed again
    newest = CheckpointReader(ckpt.manager.url_for(2), trust=pub).manifest
    assert THINNED not in newest.extras and newest.optimizer is not None
