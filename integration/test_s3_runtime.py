"""Save from a running job to S3 (Ceph), async, and load back from S3 on another world size."""

from __future__ import annotations

import hashlib

import pytest

from testing.engines import llama_batches, llama_engine, train_llama
from testing.ranks import run_distributed

pytestmark = [pytest.mark.slow, pytest.mark.s3]


def job_save(rank: int, world: int, s3_run: str, opts: dict, local_run: str) -> dict:
    from shardckpt.training.checkpointer import Checkpointer
    from shardckpt.runtime import init_distributed

    pm = init_distributed(timeout_s=60)
    cfg, engine, opt = llama_engine(pm, seed=0)
    train_llama(engine, opt, llama_batches(cfg, pm.rank, world), range(2))
    remote = Checkpointer(s3_run, engine, async_save=True, storage_options=opts)
    remote.save(2)
    Checkpointer(local_run, engine).save(2)   # the same state, on local disk
    remote.close()
    return {}


def job_load(rank: int, world: int, url: str, opts: dict) -> dict:
    from shardckpt.runtime import init_distributed
    from shardckpt.training.save_load import load

    pm = init_distributed(timeout_s=60)
    _, engine, opt = llama_engine(pm, seed=9)
    load(engine, url, storage_options=opts or None)
    full = engine.gather_full_params()
    digest = hashlib.sha256()
    for name in sorted(full):
        digest.update(full[name].numpy().tobytes())
    return {"digest": digest.hexdigest(), "steps": [g["step"] for g in opt.optimizer_metadata()["param_groups"]]}


def test_runtime_save_to_s3_and_load_from_s3(ceph_server, s3_bucket, tmp_path):
    from shardckpt.checkpoint.verify import verify
    from shardckpt.tools.diff import diff
    from shardckpt.checkpoint.run_dir import CheckpointManager

    b = s3_bucket(ceph_server)
    s3_run, local_run = f"{b.url}/run", str(tmp_path / "run")
    run_distributed(job_save, 2, args=(s3_run, b.storage_options, local_run), timeout_s=180)
    mgr = CheckpointManager(s3_run, storage_options=b.storage_options)
    assert [f.step for f in mgr.committed()] == [2] and mgr.read_latest() == "step-00000002"
    url = mgr.url_for(2)
    result = verify(url, b.storage_options)
    assert result, result.problems
    assert diff(url, f"{local_run}/step-00000002", storage_options=b.storage_options).equal
    from_s3 = run_distributed(job_load, 1, args=(url, b.storage_options), timeout_s=120)[0]
    from_disk = run_distributed(job_load, 1, args=(f"{local_run}/step-00000002", {}), timeout_s=120)[0]
    assert from_s3 == from_disk and from_s3["steps"] == [2, 2]
    # no multipart upload left open
    fs = b.filesystem()
    assert fs.call_s3("list_multipart_uploads", Bucket=b.name).get("Uploads", []) == []
