"""shardckpt as DCP's storage layer on S3 (the Ceph RADOS Gateway): FSDP2 saves from 2 ranks
through the project's multipart uploads and loads into 3 ranks bit for bit; a rank SIGKILLed
mid-save commits nothing and the previous checkpoint loads."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from testing.fsdp2_dcp import kill_job, load_job, save_job
from testing.ranks import run_distributed, run_ranks

pytestmark = [pytest.mark.slow, pytest.mark.s3,
              pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]


def test_fsdp2_save_to_s3_load_on_3_ranks(ceph_server, s3_bucket, tmp_path: Path) -> None:
    from shardckpt.checkpoint.verify import verify

    b = s3_bucket(ceph_server)
    root = f"{b.url}/run"
    run_distributed(save_job, 2, args=(root, str(tmp_path), b.storage_options), timeout_s=300)
    assert verify(f"{root}/ck", b.storage_options)
    for r in run_distributed(load_job, 3, args=(f"{root}/ck", str(tmp_path), False,
                                                 b.storage_options), timeout_s=300):
        assert r["differ"] == [] and r["groups"], r
    fs = b.filesystem()
    assert fs.call_s3("list_multipart_uploads", Bucket=b.name).get("Uploads", []) == []


def test_killed_rank_on_s3_commits_nothing(ceph_server, s3_bucket) -> None:
    import torch
    import torch.distributed.checkpoint as dcp

    from shardckpt.interop.dcp.storage import ShardckptReader

    b = s3_bucket(ceph_server)
    root = f"{b.url}/run"
    results = run_ranks(kill_job, 2, args=(root, b.storage_options), timeout_s=300,
                        pg_timeout_s=20)
    assert not results[1].ok and results[1].exitcode == -signal.SIGKILL
    fs = b.filesystem()
    assert not fs.exists(f"{b.name}/run/killed/manifest.json")
    sd = {"model": {"l1.weight": torch.zeros(10, 6)}}
    dcp.load(sd, storage_reader=ShardckptReader(f"{root}/good", b.storage_options),
             planner=dcp.DefaultLoadPlanner(allow_partial_load=True))
    assert sd["model"]["l1.weight"].abs().sum() > 0
