"""The offline tools under torchrun on ``s3://`` (Ceph RGW): the same bytes, reports and exit
status as the single-process command (reshard, consolidate, verify, diff); a process killed
mid-run commits nothing, and a rerun succeeds."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Iterator

import pytest

from shardckpt.checkpoint.verify import verify
from shardckpt.format.manifest import MANIFEST_NAME
from shardckpt.tools.synth import synthesize

from testing.cli import cli_process
from testing.torchrun import contents, kill_when, torchrun

pytestmark = [pytest.mark.s3, pytest.mark.slow, pytest.mark.timeout(300)]


def cli_options(bucket: Any) -> list[str]:
    o = bucket.storage_options
    return ["-o", f"key={o['key']}", "-o", f"secret={o['secret']}",
            "-o", f"client_kwargs.endpoint_url={o['client_kwargs']['endpoint_url']}",
            "-o", f"client_kwargs.region_name={o['client_kwargs']['region_name']}"]


@dataclass(frozen=True)
class Bucket:
    """The module's bucket on the Ceph server: its checkpoints are written once and shared."""

    name: str
    url: str
    storage_options: dict[str, Any]

    def filesystem(self) -> Any:
        import s3fs

        return s3fs.S3FileSystem(skip_instance_cache=True, **self.storage_options)


@pytest.fixture(scope="module")
def bucket(ceph_server: Any) -> Iterator[Bucket]:
    name = ceph_server.create_bucket()
    try:
        yield Bucket(name, f"s3://{name}", ceph_server.storage_options(None))
    finally:
        try:
            ceph_server.delete_bucket(name)
        except Exception:  # noqa: BLE001 - cleanup must not mask the tests' outcome
            pass


@pytest.fixture(scope="module")
def src(bucket: Bucket) -> str:
    """A checkpoint of 4 ranks, read (never changed) by every test of the module."""
    url = f"{bucket.url}/src"
    synthesize(url, 300_000, ranks=4, units=3, seed=7, storage_options=bucket.storage_options)
    return url


def test_reshard_on_s3_under_torchrun_equals_one_process(bucket: Bucket, src: str) -> None:
    b = bucket
    r = cli_process("reshard", src, f"{b.url}/ref", "--to", "6", *cli_options(b))
    assert r.returncode == 0, r.stderr
    fs = b.filesystem()
    reference = contents(f"{b.name}/ref", fs)
    dst = f"{b.url}/dst"
    r = torchrun(3, "reshard", src, dst, "--to", "6", *cli_options(b))
    assert r.returncode == 0, r.stderr[-3000:]
    fs.invalidate_cache()
    assert contents(f"{b.name}/dst", fs) == reference
    result = verify(dst, b.storage_options)
    assert result, result.problems
    # no lease and no other attempt left behind
    assert sorted(k.rsplit("/", 1)[-1] for k in fs.ls(f"{b.name}/dst")) == sorted(
        [MANIFEST_NAME, result.manifest.save_id])


def test_consolidate_on_s3_under_torchrun_equals_one_process(bucket: Bucket, src: str) -> None:
    b = bucket
    opts = ["--max-shard-size", "300KB", *cli_options(b)]
    assert cli_process("consolidate", src, f"{b.url}/one", *opts).returncode == 0
    r = torchrun(2, "consolidate", src, f"{b.url}/job", *opts)
    assert r.returncode == 0, r.stderr[-3000:]
    fs = b.filesystem()
    one, job = (sorted(fs.find(f"{b.name}/{d}")) for d in ("one", "job"))
    assert len(job) >= 4 and [k.split("/")[-1] for k in job] == [k.split("/")[-1] for k in one]
    assert all(fs.cat_file(x) == fs.cat_file(y) for x, y in zip(one, job))


def test_verify_on_s3_under_torchrun_reports_what_one_process_does(bucket: Bucket,
                                                                    src: str) -> None:
    """A copy of ``src`` with one damaged object: both report it, by name, and exit 1."""
    b, fs = bucket, bucket.filesystem()
    fs.copy(f"{b.name}/src", f"{b.name}/bad", recursive=True)
    m = json.loads(fs.cat_file(f"{b.name}/bad/{MANIFEST_NAME}"))
    damaged = m["files"][-1]["path"]
    data = bytearray(fs.cat_file(f"{b.name}/bad/{damaged}"))
    data[-5] ^= 0xFF
    fs.pipe_file(f"{b.name}/bad/{damaged}", bytes(data))
    one = cli_process("verify", f"{b.url}/bad", "--json", *cli_options(b))
    r = torchrun(2, "verify", f"{b.url}/bad", "--json", *cli_options(b))
    assert one.returncode == r.returncode == 1, (one.stderr, r.stderr[-3000:])
    assert json.loads(r.stdout) == json.loads(one.stdout)
    problems = json.loads(r.stdout)["problems"]
    assert len(problems) == 1 and damaged in problems[0], problems


def test_diff_on_s3_under_torchrun_reports_what_one_process_does(bucket: Bucket, src: str) -> None:
    """``src`` against a checkpoint of other values on 2 ranks: the same differences, exit 1."""
    b = bucket
    synthesize(f"{b.url}/other", 300_000, ranks=2, units=3, seed=9,
               storage_options=b.storage_options)
    one = cli_process("diff", src, f"{b.url}/other", "--json", *cli_options(b))
    r = torchrun(2, "diff", src, f"{b.url}/other", "--json", *cli_options(b))
    assert one.returncode == r.returncode == 1, (one.stderr, r.stderr[-3000:])
    a, c = json.loads(one.stdout), json.loads(r.stdout)
    for doc in (a, c):  # time, and bytes read (whole checksum chunks, per process) differ
        doc.pop("seconds"), doc.pop("bytes_read")
    assert a == c and a["differences"]


def test_sigkill_on_s3_commits_nothing_and_a_rerun_succeeds(ceph_server: Any, s3_bucket: Any) -> None:
    b = s3_bucket(ceph_server)
    src, dst = f"{b.url}/src", f"{b.url}/dst"
    synthesize(src, 2_000_000, ranks=4, units=4, storage_options=b.storage_options)  # ~24 MB
    fs = b.filesystem()
    proc = torchrun(2, "reshard", src, dst, "--to", "8", "--buffer", "64KiB", *cli_options(b),
                    wait=False)

    def written() -> bool:  # a first target file is complete: the job is mid-run
        fs.invalidate_cache()
        return any("/shard-" in k for k in fs.find(f"{b.name}/dst"))
    killed, err = kill_when(proc, written, 1, poll_s=0.05)
    assert killed is not None, "the job finished before a process could be killed; make it bigger"
    assert proc.returncode != 0, err[-3000:]
    fs.invalidate_cache()
    assert not fs.exists(f"{b.name}/dst/{MANIFEST_NAME}")
    r = torchrun(2, "reshard", src, dst, "--to", "8", "--overwrite", *cli_options(b))
    assert r.returncode == 0, r.stderr[-3000:]
    result = verify(dst, b.storage_options)
    assert result, result.problems
    fs.invalidate_cache()
    assert sorted(k.rsplit("/", 1)[-1] for k in fs.ls(f"{b.name}/dst")) == sorted(
        [MANIFEST_NAME, result.manifest.save_id])
