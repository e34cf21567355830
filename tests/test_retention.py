"""Retention per component: the policy's plan; thinning a checkpoint into weights only (round trip,
a kill at each point, a concurrent writer on memory:// and S3, a signed checkpoint); the run's
retention, ``clean``, ``inspect`` and ``watch``'s ``retain`` with it."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Iterator

import pytest
from typer.testing import CliRunner

from shardckpt.checkpoint.reader import CheckpointReader, read_manifest
from shardckpt.checkpoint.retention import RetentionPolicy, plan_retention
from shardckpt.checkpoint.run_dir import CheckpointManager
from shardckpt.checkpoint.thin import optimizer_kinds, thin, thinned_record
from shardckpt.checkpoint.verify import verify
from shardckpt.errors import CommitConflictError, ConfigError
from shardckpt.format.integrity import seal
from shardckpt.format.manifest import MANIFEST_NAME, to_json
from shardckpt.storage import Storage
from shardckpt.tools.clean import clean
from shardckpt.tools.synth import synthesize

PARAMS = 20_000


def masters(url: str | Storage) -> dict[tuple[int, str], bytes]:
    """Every shard's master bytes per group, read through the checked read path."""
    r = CheckpointReader(url)
    return {(s, g.name): bytes(r.read_state(s, g.name, "master"))
            for s in range(r.manifest.mesh.shard_degree) for g in r.manifest.components["model"].layout.groups}


def shard_paths(url: str) -> list[str]:
    return [f.path for f in read_manifest(Storage(url)).files if f.role == "shard"]


# ------------------------------------------------------------------------------------ the plan


def test_plan_keeps_the_last_whole_thins_the_window_and_every_kth():
    steps = [(s, f"step-{s:08d}") for s in (500, 1000, 1500, 2000, 2500, 3000, 3500)]
    plan = plan_retention(RetentionPolicy(keep_last=3, keep_optimizer_last=1, keep_every=1000), steps)
    assert plan.whole == ("step-00003500",)
    assert plan.thin == ("step-00001000", "step-00002000", "step-00002500", "step-00003000")
    assert plan.remove == ("step-00000500", "step-00001500")
    # latest (protected) stays whole wherever it is; keep_optimizer_last=None: all kept are whole
    plan = plan_retention(RetentionPolicy(keep_last=2, keep_optimizer_last=1), steps, {"step-00002500"})
    assert plan.whole == ("step-00002500", "step-00003500") and plan.thin == ("step-00003000",)
    plan = plan_retention(RetentionPolicy(keep_last=2), steps)
    assert plan.whole == ("step-00003000", "step-00003500") and not plan.thin
    with pytest.raises(ConfigError, match="keep_optimizer_last \\(3\\) is more than keep_last \\(2\\)"):
        RetentionPolicy(keep_last=2, keep_optimizer_last=3)
    with pytest.raises(ConfigError, match="keep_every must be an integer >= 1"):
        RetentionPolicy(keep_every=0)


# ------------------------------------------------------------------------------ thinning itself


def test_thinning_round_trip(tmp_path):
    url = str(tmp_path / "step-00000100")
    synthesize(url, PARAMS, ranks=2, units=2, step=100)
    before, old = masters(url), shard_paths(url)
    size_before = sum(f.size for f in read_manifest(Storage(url)).files)
    done = thin(Storage(url))
    assert done is not None and done.dropped == ("exp_avg", "exp_avg_sq")
    m = read_manifest(Storage(url))
    assert optimizer_kinds(m) == [] and m.optimizer is None
    assert thinned_record(m)["removed"] == sorted(old) and thinned_record(m)["dropped"] == ["exp_avg", "exp_avg_sq"]
    assert not verify(Storage(url)).problems
    assert masters(url) == before  # the weights, bit for bit
    assert not any(os.path.exists(tmp_path / "step-00000100" / p) for p in old)  # optimizer files gone
    assert m.total_bytes < size_before * 0.4  # AdamW: master is a third of the shard bytes
    # nothing is left that the manifest does not name, but the directories' own names
    on_disk = {str(p.relative_to(url)) for p in Path(url).rglob("*") if p.is_file()}
    assert on_disk == {MANIFEST_NAME} | {f.path for f in m.files}
    assert thin(Storage(url)) is None  # weights only already: nothing to do


def test_a_signed_checkpoint_is_thinned_only_when_it_can_be_signed_again(tmp_path, caplog):
    url = str(tmp_path / "ckpt")
    synthesize(url, PARAMS, ranks=2, units=1)
    doc = json.loads(Path(url, MANIFEST_NAME).read_bytes())
    doc.pop("manifest_crc32c")
    doc["signature"] = {"key_id": "k1", "sig": "00"}
    signed = seal(doc)
    Path(url, MANIFEST_NAME).write_bytes(signed)
    with caplog.at_level(logging.WARNING):
        assert thin(Storage(url)) is None
    assert "is signed and no signing key is at hand" in caplog.text
    assert Path(url, MANIFEST_NAME).read_bytes() == signed  # untouched, optimizer state too
    seen: list[bytes] = []

    def resign(data: bytes) -> bytes:
        seen.append(data)
        d = json.loads(data)
        d.pop("manifest_crc32c")
        d["signature"] = {"key_id": "k1", "sig": "11"}
        return seal(d)
    assert thin(Storage(url), resign=resign) is not None
    assert seen and json.loads(Path(url, MANIFEST_NAME).read_bytes())["signature"]["sig"] == "11"
    assert not verify(Storage(url)).problems
    # a signature beside the manifest counts as one too
    other = str(tmp_path / "beside")
    synthesize(other, PARAMS, ranks=2, units=1)
    Path(other, "manifest.json.sig").write_bytes(b"a detached signature")
    raw = Path(other, MANIFEST_NAME).read_bytes()
    assert thin(Storage(other)) is None and Path(other, MANIFEST_NAME).read_bytes() == raw


@pytest.fixture(params=["memory", pytest.param("s3", marks=pytest.mark.s3)])
def place(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Storage]:
    if request.param == "memory":
        yield Storage(f"memory://thin-{os.getpid()}-{time.monotonic_ns()}")
        return
    from testing.s3servers import MotoServer

    server = MotoServer().start()
    try:
        bucket = server.create_bucket()
        yield Storage(f"s3://{bucket}/run", server.storage_options())
    finally:
        server.stop()


def test_thinning_is_conditional_a_concurrent_writer_is_never_overwritten(place):
    url = place.url_of("step-00000100")
    synthesize(url, PARAMS, ranks=2, units=1, storage_options=place.storage_options)
    ckpt = place.child("step-00000100")
    m = read_manifest(ckpt)
    theirs = to_json(replace(m, extras={**m.extras, "note": "a concurrent writer's"}))

    def concurrent(point: str) -> None:
        if point == "files_written":  # another writer replaces the manifest meanwhile
            ckpt.put(MANIFEST_NAME, theirs)
    with pytest.raises(CommitConflictError, match="nothing was replaced"):
        thin(ckpt, on_point=concurrent)
    assert ckpt.read(MANIFEST_NAME) == theirs
    assert not verify(ckpt).problems
    # the new files are gone, the old ones all there
    assert sorted(ckpt.ls("")) == sorted({MANIFEST_NAME, m.save_id})
    assert optimizer_kinds(read_manifest(ckpt)) == ["exp_avg", "exp_avg_sq"]
    assert thin(ckpt) is not None and not verify(ckpt).problems  # with no one in the way: thinned


# ---------------------------------------------------------------------- a kill in the middle

CHILD = r"""
import sys, time
from shardckpt.checkpoint.thin import thin
from shardckpt.storage import Storage

url, pause, marker = sys.argv[1:4]
seen = {}

def hook(name):
    seen[name] = seen.get(name, 0) + 1
    if f"{name}#{seen[name]}" == pause:
        with open(marker, "w") as f:
            f.write(pause)
        time.sleep(3600)

thin(Storage(url), on_point=hook)
"""


@pytest.mark.parametrize("pause", ["shard_written#1", "files_written#1", "manifest_replaced#1",
                                   "removing#2"])
def test_a_kill_during_thinning_leaves_a_whole_checkpoint(tmp_path, pause):
    url = str(tmp_path / "run" / "step-00000100")
    synthesize(url, PARAMS, ranks=2, units=2, step=100)
    before, old = masters(url), shard_paths(url)
    marker = tmp_path / "paused"
    proc = subprocess.Popen([sys.executable, "-c", CHILD, url, pause, str(marker)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        for _ in range(12000):  # a safety net, not a bound: the child pauses in a second or two
            if marker.exists() or proc.poll() is not None:
                break
            time.sleep(0.05)
        assert marker.exists(), proc.communicate()[1].decode()[-2000:]
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait(timeout=60)
    ckpt = Storage(url)
    m = read_manifest(ckpt)
    thinned = thinned_record(m) is not None
    assert thinned == (pause in ("manifest_replaced#1", "removing#2"))
    assert optimizer_kinds(m) == ([] if thinned else ["exp_avg", "exp_avg_sq"])
    assert not verify(ckpt).problems and masters(url) == before  # whole, before or after
    report = clean(str(tmp_path / "run"), min_age_s=0)
    if pause == "removing#2":  # the first old file went; the second is debris clean removes
        assert report.debris == [f"step-00000100/{old[1]}"]
    assert not verify(ckpt).problems
    thin(ckpt)  # a second thinning completes the first
    m = read_manifest(ckpt)
    assert thinned_record(m) is not None and not verify(ckpt).problems and masters(url) == before
    assert not any(os.path.exists(os.path.join(url, p)) for p in old)


# -------------------------------------------------------------------- the run, clean, inspect


def test_run_retention_clean_and_inspect(tmp_path):
    from shardckpt.cli.main import app

    run = tmp_path / "run"
    mgr = CheckpointManager(str(run), keep_last=3, keep_optimizer_last=1, keep_every=1000)
    for step in (500, 1000, 1500, 2000, 2500):
        synthesize(mgr.url_for(step), PARAMS, ranks=2, units=1, step=step)
        mgr.mark_committed(step)
    holds = {f.step: optimizer_kinds(read_manifest(Storage(f.url))) for f in mgr.committed()}
    assert holds == {1000: [], 1500: [], 2000: [], 2500: ["exp_avg", "exp_avg_sq"]}
    assert all(not verify(Storage(f.url)).problems for f in mgr.committed())
    res = CliRunner().invoke(app, ["inspect", str(run), "--no-params"])
    assert res.exit_code == 0, res.output
    assert "step-00001500: weights, optimizer: thinned (weights only), buffers" in res.output
    assert "step-00002500: weights, optimizer (exp_avg, exp_avg_sq), buffers" in res.output
    res = CliRunner().invoke(app, ["inspect", mgr.url_for(2000), "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["holds"] == ["weights", "optimizer: thinned (weights only)", "buffers"]
    # clean with a narrower policy: thin the newest but one, drop what is neither kept nor kth
    synthesize(mgr.url_for(3000), PARAMS, ranks=2, units=1, step=3000)
    CheckpointManager(str(run)).mark_committed(3000)  # latest moves; no retention of its own
    res = CliRunner().invoke(app, ["clean", str(run), "--keep-last", "2", "--keep-optimizer-last",
                                   "1", "--keep-every", "1000", "--dry-run"])
    assert res.exit_code == 0, res.output
    assert "would thin" in res.output and res.output.count("would thin") == 1  # 1500 is thin already
    assert "would remove checkpoint" in res.output and "step-00001500" in res.output
    res = CliRunner().invoke(app, ["clean", str(run), "--keep-last", "2", "--keep-optimizer-last",
                                   "1", "--keep-every", "1000", "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)["retention"]
    assert sorted(Path(u).name for u in out["removed"]) == ["step-00001500"]
    assert [Path(u).name for u in out["thinned"]] == ["step-00002500"]
    assert [f.step for f in mgr.committed()] == [1000, 2000, 2500, 3000]


def test_watch_retain_thins_past_the_optimizer_window(tmp_path):
    from shardckpt.watch.config import parse_pipeline
    from shardckpt.watch.retain import retain

    def pipeline(**keys: int) -> object:
        return parse_pipeline({"name": "p", "watch": str(tmp_path / "run"),
                               "steps": [{"kind": "retain", **keys}]}, "p.toml")
    spec = pipeline(keep=3, keep_optimizer_last=1, keep_every=2).steps[0]
    assert (spec.keep, spec.keep_optimizer_last, spec.keep_every) == (3, 1, 2)
    with pytest.raises(ConfigError, match="keep_optimizer_last = 4 is more than keep = 3"):
        pipeline(keep=3, keep_optimizer_last=4)
    with pytest.raises(ConfigError, match="keep_every = 0: expected an integer >= 1"):
        pipeline(keep=3, keep_every=0)

    run = Storage(str(tmp_path / "run"))
    mgr = CheckpointManager(run)
    for step in (1, 2, 3, 4):
        synthesize(mgr.url_for(step), PARAMS, ranks=2, units=1, step=step)
        mgr.mark_committed(step)
    facts = retain(run, 4, 3, (), {}, lambda name: True, keep_optimizer_last=1, keep_every=2)
    assert facts["removed"] == ["step-00000001"]
    assert facts["thinned"] == ["step-00000002", "step-00000003"]
    assert optimizer_kinds(read_manifest(run.child("step-00000004"))) == ["exp_avg", "exp_avg_sq"]


def test_retention_never_thins_through_a_symbolic_link(tmp_path, caplog):
    outside = tmp_path / "elsewhere" / "step-00000001"
    synthesize(str(outside), PARAMS, ranks=2, units=1, step=1)
    before = {p: p.read_bytes() for p in outside.rglob("*") if p.is_file()}
    run = tmp_path / "run"
    run.mkdir()
    (run / "step-00000001").symlink_to(outside, target_is_directory=True)
    mgr = CheckpointManager(str(run), keep_last=3, keep_optimizer_last=1)
    for step in (2, 3):
        synthesize(mgr.url_for(step), PARAMS, ranks=2, units=1, step=step)
    with caplog.at_level(logging.WARNING):
        mgr.mark_committed(3)
    assert "lies behind a symbolic link" in caplog.text
    assert mgr.thinned == [mgr.url_for(2)]
    assert {p: p.read_bytes() for p in outside.rglob("*") if p.is_file()} == before


def test_thinning_respects_frozen_references(tmp_path):
    """Later checkpoints name the frozen files of the first (format 1.3): thinning leaves frozen
    files alone, a thinned checkpoint keeps its references, and a checkpoint that retention would
    delete but a kept one references is kept, thinned."""
    import torch
    from torch import nn

    from shardckpt.runtime import ShardedAdamW, ZeroEngine, decay_param_groups
    from shardckpt.runtime.mesh import ProcessMesh
    from shardckpt.training.checkpointer import Checkpointer

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 4, bias=False))
    model[0].requires_grad_(False)
    engine = ZeroEngine(model, process_mesh=ProcessMesh.single())
    opt = ShardedAdamW(engine, decay_param_groups(engine, 0.0), lr=1e-2)
    ckpt = Checkpointer(str(tmp_path / "run"), engine, keep_last=3, keep_optimizer_last=1)
    for step in (1, 2, 3):
        engine(torch.randn(2, 32, generator=torch.Generator().manual_seed(step))).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
        ckpt.save(step)
    mgr = ckpt.manager
    m2, m3 = (read_manifest(Storage(mgr.url_for(s))) for s in (2, 3))
    assert m2.references() and m3.references() and thinned_record(m2) is not None
    assert optimizer_kinds(m3) == ["exp_avg", "exp_avg_sq"]
    assert all(not verify(Storage(f.url)).problems for f in mgr.committed())
    # keep one: the first would go, but the newest references its frozen files: kept, thinned
    mgr.policy = RetentionPolicy(keep_last=1, keep_optimizer_last=1)
    assert mgr.apply_retention() == [mgr.url_for(2)]
    assert mgr.kept_referenced == [mgr.url_for(1)]
    assert [f.step for f in mgr.committed()] == [1, 3]
    assert thinned_record(read_manifest(Storage(mgr.url_for(1)))) is not None
    assert not verify(Storage(mgr.url_for(3))).problems
