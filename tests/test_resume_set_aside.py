"""After a resume falls back past a newer committed checkpoint that does not load, the run saves
that step number again: the passed-over checkpoint is put aside (renamed on a file system,
superseded by a conditional write elsewhere), with why, never deleted. One process, each tier:
the local tier, the durable tier alone on a disk, and on ``memory://`` (no rename)."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import uuid

import pytest

from testing.ckpt_runs import flip_bit
from testing.engines import tiny_engine, tiny_step


def _state(engine) -> dict:
    import torch

    return {f"{g}.{k}": hashlib.sha256(t.detach().contiguous().view(torch.uint8).numpy()).hexdigest()
            for g, kinds in sorted(engine.local_shards().items()) for k, t in sorted(kinds.items())}


def _run(url: str, **kwargs):
    from shardckpt.training.checkpointer import Checkpointer

    engine, opt = tiny_engine(None)
    return engine, opt, Checkpointer(url, engine, **kwargs)


def _save_twice_resume_and_save_again(url: str, damage, **kwargs) -> dict:
    """Save steps 1 and 2, ``damage()`` step 2, resume in a new engine (step 1), train one step
    and save step 2 again; then resume that in a third engine."""
    engine, opt, ckpt = _run(url, **kwargs)
    for i in (1, 2):
        tiny_step(engine, opt, i, 0)
        ckpt.save(i)
    ckpt.close()
    damage()
    engine, opt, ckpt = _run(url, **kwargs)
    out: dict = {"start": ckpt.resume()}
    tiny_step(engine, opt, 2, 0)
    ckpt.save(2)  # CommitConflictError here before: the passed-over manifest was in the way
    ckpt.close()
    out["state"] = _state(engine)
    again, _, ckpt = _run(url, **kwargs)
    out["again"] = ckpt.resume()
    out["resumed"] = _state(again)
    return out


def _notes(folder: str) -> list[dict]:
    out = []
    for d, _, names in os.walk(folder):
        if "passed-over.json" in names:
            with open(os.path.join(d, "passed-over.json")) as f:
                out.append(json.load(f))
    return out


def test_local_tier_saves_a_passed_over_step_again(tmp_path, caplog):
    from shardckpt.checkpoint.tiers import LocalTier

    node = tmp_path / "node0"
    tier = LocalTier(path=str(tmp_path / "node{node}"), every=1, peers=0)
    with caplog.at_level(logging.WARNING, logger="shardckpt"):
        out = _save_twice_resume_and_save_again(
            str(tmp_path / "durable"), lambda: flip_bit(str(node / "step-00000002"), "shard-"),
            local=tier, durable_every=1000)
    assert out["start"] == 1
    assert out["again"] == 2 and out["resumed"] == out["state"]  # the new step 2, bit-exact
    aside = os.listdir(node / "passed-over")
    assert len(aside) == 1 and aside[0].startswith("step-00000002."), aside
    # evidence, whole: the damaged shard is there (moved aside within it), with the note
    kept = [n for _, _, fs in os.walk(node / "passed-over") for n in fs]
    assert any(n.startswith("shard-00000-of-00001.safetensors.damaged-") for n in kept), kept
    [note] = _notes(str(node / "passed-over"))
    assert note["step_dir"] == "step-00000002" and "fail their checksums" in note["why"], note
    said = [r.getMessage() for r in caplog.records if "was passed over at resume" in r.getMessage()]
    assert len(said) == 1 and "fail their checksums" in said[0] and "passed-over" in said[0], said


def test_durable_tier_alone_on_a_disk_renames_the_passed_over_step(tmp_path):
    from shardckpt.checkpoint.run_dir import CheckpointManager

    run = tmp_path / "run"
    out = _save_twice_resume_and_save_again(
        str(run), lambda: flip_bit(str(run / "step-00000002"), "shard-"), keep_last=3)
    assert out["start"] == 1 and out["again"] == 2 and out["resumed"] == out["state"]
    [aside] = os.listdir(run / "passed-over")
    assert aside.startswith("step-00000002.")
    [note] = _notes(str(run / "passed-over"))
    assert "fails its checksums" in note["why"], note
    assert CheckpointManager(str(run)).read_latest() == "step-00000002"


def test_durable_tier_alone_on_memory_supersedes_by_a_conditional_write():
    from shardckpt.checkpoint.run_dir import CheckpointManager
    from shardckpt.storage import Storage

    url = f"memory://set-aside-{uuid.uuid4().hex}"
    store = Storage(url)
    seen: dict = {}

    def damage() -> None:
        name = next(f"{d}/{n}" for d in store.child("step-00000002").ls("")
                    if store.child("step-00000002").isdir(d)
                    for n in store.child(f"step-00000002/{d}").ls("") if n.startswith("shard-"))
        rel = f"step-00000002/{name}"
        data = bytearray(store.read(rel))
        data[-100] ^= 1
        store.put(rel, bytes(data))
        seen["manifest"] = store.read("step-00000002/manifest.json")

    try:
        out = _save_twice_resume_and_save_again(url, damage, keep_last=3)
        assert out["start"] == 1 and out["again"] == 2 and out["resumed"] == out["state"]
        [aside] = store.ls("passed-over")
        # the passed-over manifest is kept as it was; the step's own is the new save's
        assert store.read(f"passed-over/{aside}/manifest.json") == seen["manifest"]
        assert store.read("step-00000002/manifest.json") != seen["manifest"]
        why = json.loads(store.read(f"passed-over/{aside}/passed-over.json"))["why"]
        assert "fails its checksums" in why, why
        assert CheckpointManager(url).read_latest() == "step-00000002"
    finally:
        store.rm("", recursive=True)


def test_a_manifest_no_resume_passed_over_still_conflicts(tmp_path):
    """Two saves of one step with no resume between them: the second still loses."""
    from shardckpt.errors import CollectiveError

    engine, opt, ckpt = _run(str(tmp_path / "run"))
    tiny_step(engine, opt, 1, 0)
    ckpt.save(1)
    with pytest.raises(CollectiveError, match="CommitConflictError: .*another save committed here first"):
        ckpt.save(1)
