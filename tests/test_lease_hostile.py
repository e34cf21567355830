"""Leases and names read from an untrusted prefix: whoever can write below a prefix can plant a
lease file or a directory whose name only looks like a step, a save or an output.

A lease file that is not a lease (nested 2000 deep, an expiry of 10**400, a pid no process can
have, not JSON, ...) counts as held, with one warning naming it, and never raises anything but a
ShardckptError; names are matched with ASCII digits only (``\\d`` also matches ``٠١٢``, which
``int`` reads as a number)."""

from __future__ import annotations

import json
import logging
import math
import os
import time
from pathlib import Path

import pytest

from testing.ckpts import TINY_PARAMS
from shardckpt.checkpoint.run_dir import CheckpointManager
from shardckpt.errors import ManifestError
from shardckpt.format.manifest import MANIFEST_NAME
from shardckpt.format.manifest_parse import parse
from shardckpt.storage import Storage
from shardckpt.storage.lease import LEASE_PREFIX, live_until, whoami
from shardckpt.tools.clean import clean
from shardckpt.tools.consolidate import consolidate
from shardckpt.tools.synth import synthesize

OLD_SAVE = "20200101T000000Z-0000aaaa"
ARABIC_INDIC = str.maketrans("0123456789", "٠١٢٣٤٥٦٧٨٩")


def hostile_leases() -> dict[str, bytes]:
    later = time.time() + 3600
    return {
        "deep": b"[" * 2000 + b"]" * 2000,
        "deep-object": b'{"expires": ' + b"[" * 2000 + b"]" * 2000 + b"}",
        "huge-expiry": json.dumps({"expires": 10**400}).encode(),
        "huge-pid": json.dumps({"expires": later, **whoami(), "pid": 10**30}).encode(),
        "negative-pid": json.dumps({"expires": later, **whoami(), "pid": -5}).encode(),
        "bool-pid": json.dumps({"expires": later, **whoami(), "pid": True}).encode(),
        "nan": b'{"expires": NaN}',
        "infinity": b'{"expires": Infinity}',
        "overflowing-float": b'{"expires": 1e999}',
        "string-expiry": b'{"expires": "tomorrow"}',
        "bool-expiry": b'{"expires": true}',
        "no-expiry": b'{"host": "h"}',
        "array": b"[1, 2]",
        "number": b"12",
        "not-json": b"{",
        "not-utf8": b'{"expires": "\xff"}',
        "repeated-key": b'{"expires": 0, "expires": 1e11}',
        "host-not-text": json.dumps({"expires": later, "host": 7}).encode(),
        "oversized": json.dumps({"expires": later, "pad": "x" * 5000}).encode(),
    }


@pytest.mark.parametrize("kind", sorted(hostile_leases()))
def test_a_malformed_lease_counts_as_held_with_one_warning(tmp_path: Path, kind: str, caplog) -> None:
    s = Storage(str(tmp_path))
    (tmp_path / OLD_SAVE).mkdir()
    (tmp_path / OLD_SAVE / f"{LEASE_PREFIX}{kind}").write_bytes(hostile_leases()[kind])
    with caplog.at_level(logging.WARNING, logger="shardckpt.storage.lease"):
        assert live_until(s, OLD_SAVE) == math.inf
        assert live_until(s, OLD_SAVE) == math.inf  # asked again: no second warning
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    assert f"{LEASE_PREFIX}{kind}" in warnings[0].getMessage()


def test_a_lease_that_is_a_directory_counts_as_held(tmp_path: Path) -> None:
    (tmp_path / OLD_SAVE / f"{LEASE_PREFIX}dir").mkdir(parents=True)
    assert live_until(Storage(str(tmp_path)), OLD_SAVE) == math.inf


def test_well_formed_leases_still_decide(tmp_path: Path) -> None:
    s = Storage(str(tmp_path))
    lease = tmp_path / OLD_SAVE / f"{LEASE_PREFIX}0000abcd"
    lease.parent.mkdir()
    lease.write_text(json.dumps({"expires": time.time() - 1}))
    assert live_until(s, OLD_SAVE) is None
    later = time.time() + 3600
    lease.write_text(json.dumps({"expires": later, "released": False, **whoami()}))
    assert live_until(s, OLD_SAVE) == later
    lease.write_text(json.dumps({"expires": int(later), "host": "elsewhere", "pid": 2**31 - 1,
                                 "pidns": None}))
    assert live_until(s, OLD_SAVE) == int(later)


def test_clean_keeps_a_save_whose_lease_is_malformed(tmp_path: Path) -> None:
    for kind, data in hostile_leases().items():
        save = f"2020010{len(kind) % 10}T000000Z-{abs(hash(kind)) % 16**8:08x}"
        (tmp_path / "ck" / save).mkdir(parents=True, exist_ok=True)
        (tmp_path / "ck" / save / f"{LEASE_PREFIX}{kind}").write_bytes(data)
    saves = sorted(os.listdir(tmp_path / "ck"))
    r = clean(str(tmp_path), min_age_s=0)
    assert not r.debris
    assert sorted(r.kept_live) == [f"ck/{n}" for n in saves]
    assert sorted(os.listdir(tmp_path / "ck")) == saves


# ------------------------------------------------------------------ names with non-ASCII digits


def test_a_step_directory_with_unicode_digits_is_not_a_step(tmp_path: Path) -> None:
    fake = "step-00000100".translate(ARABIC_INDIC)
    (tmp_path / fake).mkdir()
    (tmp_path / fake / MANIFEST_NAME).write_text("{}")
    (tmp_path / "latest").write_text(fake)
    m = CheckpointManager(str(tmp_path))
    assert m.step_dirs() == []
    assert m.committed() == []
    assert m.read_latest() is None


def test_clean_does_not_take_a_unicode_digit_name_for_a_save(tmp_path: Path) -> None:
    fake = OLD_SAVE[:16].translate(ARABIC_INDIC) + OLD_SAVE[16:]
    (tmp_path / "ck" / fake).mkdir(parents=True)
    (tmp_path / "ck" / fake / "keep.bin").write_bytes(b"x")
    r = clean(str(tmp_path), min_age_s=0)
    assert not r.debris
    assert (tmp_path / "ck" / fake / "keep.bin").exists()


def test_a_manifest_naming_shards_with_unicode_digits_is_refused(tmp_path: Path) -> None:
    synthesize(str(tmp_path / "ck"), TINY_PARAMS, 2)
    doc = json.loads((tmp_path / "ck" / MANIFEST_NAME).read_text())
    for f in doc["files"]:
        if f["role"] == "shard":
            head, name = f["path"].rsplit("/", 1)
            f["path"] = f"{head}/{name.translate(ARABIC_INDIC)}"
    with pytest.raises(ManifestError, match="shard"):  # paths are ASCII, and named by the rule
        parse(json.dumps(doc))


def test_consolidate_overwrite_leaves_a_unicode_digit_weight_name_alone(tmp_path: Path) -> None:
    synthesize(str(tmp_path / "ck"), TINY_PARAMS, 2)
    consolidate(str(tmp_path / "ck"), str(tmp_path / "hf"), dtype="float32")
    foreign = tmp_path / "hf" / "model-00001-of-00001.safetensors".translate(ARABIC_INDIC)
    foreign.write_bytes(b"not ours")
    consolidate(str(tmp_path / "ck"), str(tmp_path / "hf"), dtype="float32", overwrite=True)
    assert foreign.read_bytes() == b"not ours"
