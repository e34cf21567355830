"""Every offline command on ``s3://`` against a real S3 server (Ceph RGW), S3→S3 and mixed.

Results are compared bit for bit with the same commands run on local disk: shard files by their
data sections (headers carry the save id), consolidated files whole. Figures are measured outside
the code under test: bytes read are counted by wrapping s3fs's ranged GET, objects are read back
with plain s3fs, uploads are listed with ListMultipartUploads.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import pytest
import s3fs

from shardckpt.errors import CommitConflictError
from shardckpt.storage import Storage, list_open_uploads
from shardckpt.tools.synth import synthesize

from testing.cli import CLI_COMMAND, cli, ok, one_line_error

pytestmark = [pytest.mark.s3, pytest.mark.timeout(240)]

PARAMS = "4M"           # 48 MB of fp32 master + AdamW moments; 12 MB shards: multipart uploads
RANKS, TO, SEED = 4, 2, 3
ROOT = Path(__file__).resolve().parent.parent


# ------------------------------------------------------------------------------------ helpers


class Site:
    """A bucket on the server, reachable by URL, CLI options, AWS environment or plain s3fs."""

    def __init__(self, server: Any, bucket: str) -> None:
        self.server, self.bucket = server, bucket
        self.options = {"key": server.key, "secret": server.secret,
                        "client_kwargs": {"endpoint_url": server.endpoint_url, "region_name": "us-east-1"}}
        self.cli_options = ["-o", f"key={server.key}", "-o", f"secret={server.secret}",
                            "-o", f"client_kwargs.endpoint_url={server.endpoint_url}"]
        self.env = {"AWS_ENDPOINT_URL": server.endpoint_url, "AWS_ACCESS_KEY_ID": server.key,
                    "AWS_SECRET_ACCESS_KEY": server.secret, "AWS_DEFAULT_REGION": "us-east-1"}
        self.fs = server.filesystem()

    def url(self, key: str) -> str:
        return f"s3://{self.bucket}/{key}"

    def uploads(self, prefix: str = "") -> list[str]:
        resp = self.fs.call_s3("list_multipart_uploads", Bucket=self.bucket, Prefix=prefix)
        return [u["Key"] for u in resp.get("Uploads", [])]

    def keys(self, prefix: str) -> list[str]:
        self.fs.invalidate_cache()
        return sorted(k.split("/", 1)[1] for k in self.fs.find(f"{self.bucket}/{prefix}"))


def read_any(location: str, site: Site, rel: str) -> bytes:
    if location.startswith("s3://"):
        return site.fs.cat_file(f"{location[5:]}/{rel}")
    return (Path(location) / rel).read_bytes()


def shard_data(location: str, site: Site) -> dict[str, bytes]:
    """Data sections of every file a manifest names, keyed by role and index: what must match."""
    m = json.loads(read_any(location, site, "manifest.json"))
    out = {}
    for f in m["files"]:
        raw = read_any(location, site, f["path"])
        assert len(raw) == f["size"]
        out[f"{f['role']}-{f.get('index')}"] = raw[8 + f["header_size"]:]
    return out


def consolidated(location: str, site: Site) -> dict[str, bytes]:
    if location.startswith("s3://"):
        site.fs.invalidate_cache()
        names = [p.rsplit("/", 1)[1] for p in site.fs.ls(location[5:])]
    else:
        names = os.listdir(location)
    return {n: read_any(location, site, n) for n in sorted(names) if n != "shardckpt_consolidated.json"}


@pytest.fixture(scope="module")
def site(ceph_server: Any) -> Iterator[Site]:
    bucket = ceph_server.create_bucket("cmd")
    try:
        yield Site(ceph_server, bucket)
    finally:
        ceph_server.delete_bucket(bucket)


@pytest.fixture(scope="module")
def local(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The reference: synth, reshard and consolidate on local disk."""
    d = tmp_path_factory.mktemp("local")
    src, rs, hf = str(d / "src"), str(d / "reshard"), str(d / "hf")
    ok(cli("synth", src, "--params", PARAMS, "--ranks", str(RANKS), "--seed", str(SEED)))
    ok(cli("reshard", src, rs, "--to", str(TO)))
    ok(cli("consolidate", src, hf))
    return {"src": src, "reshard": rs, "hf": hf, "dir": str(d)}


@pytest.fixture(scope="module")
def s3src(site: Site, local: dict[str, str]) -> str:
    """The same checkpoint synthesized straight to S3, configured from the AWS environment."""
    url = site.url("src")
    r = ok(cli("synth", url, "--params", PARAMS, "--ranks", str(RANKS), "--seed", str(SEED), env=site.env))
    assert r.stdout.startswith(f"wrote {url}: 5 files")
    assert site.uploads() == []
    return url


# -------------------------------------------------------------------------------------- tests


def test_synth_inspect_verify(site: Site, local: dict[str, str], s3src: str) -> None:
    assert shard_data(s3src, site) == shard_data(local["src"], site)
    a = json.loads(ok(cli("inspect", s3src, "--json", *site.cli_options)).stdout)
    b = json.loads(ok(cli("inspect", local["src"], "--json")).stdout)
    for k in ("mesh", "world_size", "step", "components", "optimizer", "total_bytes"):
        assert a[k] == b[k], k
    assert [(f["role"], f["size"]) for f in a["files"]] == [(f["role"], f["size"]) for f in b["files"]]
    r = ok(cli("verify", s3src, *site.cli_options))
    assert r.stdout.startswith(f"ok: {s3src}: 5 files")
    rep = json.loads(ok(cli("verify", s3src, "--json", env=site.env)).stdout)
    assert rep["ok"] and len(rep["files"]) == 5


def test_reshard_s3_to_s3_reads_each_byte_once(site: Site, local: dict[str, str], s3src: str,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    fetched: list[int] = []  # body bytes of every GET, counted under s3fs
    real = s3fs.S3FileSystem._call_s3

    async def counting(self: Any, method: str, *args: Any, **kwargs: Any) -> Any:
        out = await real(self, method, *args, **kwargs)
        if method == "get_object":
            fetched.append(out["ContentLength"])
        return out
    monkeypatch.setattr(s3fs.S3FileSystem, "_call_s3", counting)
    dst = site.url("reshard-s3")
    r = json.loads(ok(cli("reshard", s3src, dst, "--to", str(TO), "--json", *site.cli_options)).stdout)
    monkeypatch.undo()
    source_bytes = sum(len(v) for v in shard_data(s3src, site).values())
    assert source_bytes <= sum(fetched) <= 1.05 * source_bytes + (2 << 20), (sum(fetched), source_bytes)
    assert r["from"] == RANKS and r["to"] == TO
    assert shard_data(dst, site) == shard_data(local["reshard"], site)
    assert site.uploads() == []


def test_reshard_mixed(site: Site, local: dict[str, str], s3src: str, tmp_path: Path) -> None:
    down = str(tmp_path / "from-s3")
    ok(cli("reshard", s3src, down, "--to", str(TO), env=site.env))                     # S3 -> local
    up = site.url("reshard-up")
    ok(cli("reshard", local["src"], up, "--to", str(TO), "--workers", "2", env=site.env))  # local -> S3
    want = shard_data(local["reshard"], site)
    assert shard_data(down, site) == want and shard_data(up, site) == want
    assert ok(cli("verify", up, env=site.env)).stdout.startswith("ok:")


def test_consolidate_s3_to_s3_and_mixed(site: Site, local: dict[str, str], s3src: str, tmp_path: Path) -> None:
    s3s3, down, up = site.url("hf-s3"), str(tmp_path / "hf-down"), site.url("hf-up")
    ok(cli("consolidate", s3src, s3s3, "--dtype", "fp32", *site.cli_options))  # 16 MB: multipart
    ok(cli("consolidate", s3src, down, env=site.env))
    ok(cli("consolidate", local["src"], up, "--max-shard-size", "3MB", env=site.env))
    ok(cli("consolidate", local["src"], str(tmp_path / "fp32"), "--dtype", "fp32"))
    ok(cli("consolidate", local["src"], str(tmp_path / "split"), "--max-shard-size", "3MB"))
    want = consolidated(local["hf"], site)
    assert "model.safetensors.index.json" in want and consolidated(down, site) == want
    assert consolidated(s3s3, site) == consolidated(str(tmp_path / "fp32"), site)
    split = consolidated(up, site)
    assert len([n for n in split if n.endswith(".safetensors")]) > 2
    assert split == consolidated(str(tmp_path / "split"), site)
    assert site.uploads() == []


def test_diff(site: Site, local: dict[str, str], s3src: str) -> None:
    r = ok(cli("diff", s3src, local["src"], env=site.env))
    assert r.stdout.startswith("equal:")
    other = site.url("reshard-diff")
    ok(cli("reshard", s3src, other, "--to", "3", env=site.env))
    assert ok(cli("diff", s3src, other, "--json", env=site.env)).stdout.count('"equal": true') == 1
    different = site.url("seed-4")
    synthesize(different, 1_000_000, ranks=2, seed=4, storage_options=site.options)
    r = cli("diff", s3src, different, env=site.env)
    assert r.exit_code == 1


def test_flipped_byte_caught_by_verify_and_by_ranged_reshard(site: Site, tmp_path: Path) -> None:
    url = site.url("flip")
    m = synthesize(url, 1_500_000, ranks=2, seed=1, storage_options=site.options)
    shard = m.files[1]
    key = f"{site.bucket}/flip/{shard.path}"
    raw = bytearray(site.fs.cat_file(key))
    pos = 8 + shard.header_size + (shard.size - 8 - shard.header_size) // 2
    raw[pos] ^= 0x10
    site.fs.pipe_file(key, bytes(raw))  # rewrite the object with one byte flipped
    r = cli("verify", url, env=site.env)
    assert r.exit_code == 1 and f"{url}/{shard.path}" in r.stderr and "CRC32C" in r.stderr
    r = cli("reshard", url, str(tmp_path / "out"), "--to", "1", env=site.env)
    line = one_line_error(r, f"{url}/{shard.path}", "CRC32C", "corrupted")
    chunk = pos // m.chunk_size * m.chunk_size
    assert f"bytes [{chunk}, " in line
    assert not (tmp_path / "out" / "manifest.json").exists()


_SAVER = r"""
import sys, time, os
from shardckpt.checkpoint.reader import as_storage
from shardckpt.checkpoint.writer import CheckpointWriter
from shardckpt.errors import CommitConflictError
from shardckpt.tools.synth import shard_producer, synth_spec
url, barrier, me = sys.argv[1], sys.argv[2], sys.argv[3]
spec = synth_spec(600_000, 2, seed=int(me))
writer = CheckpointWriter(as_storage(url), spec)
layout = spec.components["model"].layout
files = [writer.write_shard(s, shard_producer(layout, int(me), s)) for s in range(2)]
files.append(writer.write_buffers(lambda slot: iter([bytes(slot.end - slot.begin)])))
open(os.path.join(barrier, me), "w").close()
for _ in range(600):  # both saves have written their shards: now race for the manifest
    if len(os.listdir(barrier)) == 2:
        break
    time.sleep(0.01)
try:
    writer.commit(files)
    print("COMMITTED", writer.save_id)
except CommitConflictError as e:
    print("CONFLICT", type(e).__name__, e)
"""


def test_two_concurrent_saves_exactly_one_commits(site: Site, tmp_path: Path) -> None:
    url = site.url("race")
    env = {**os.environ, **site.env, "PYTHONPATH": str(ROOT)}
    procs = [subprocess.Popen([sys.executable, "-c", _SAVER, url, str(tmp_path), str(i)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in (1, 2)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    lines = sorted(o.strip().splitlines()[-1] for o, _ in outs)
    assert lines[0].startswith("COMMITTED") and lines[1].startswith("CONFLICT CommitConflictError"), lines
    assert f"{url}/manifest.json already exists" in lines[1]
    winner = lines[0].split()[1]
    assert json.loads(site.fs.cat_file(f"{site.bucket}/race/manifest.json"))["save_id"] == winner
    ok(cli("verify", url, env=site.env))
    r = ok(cli("clean", url, "--min-age", "0", "--json", env=site.env))
    report = json.loads(r.stdout)
    assert len(report["debris"]) == 1 and winner not in report["debris"][0]
    assert sorted({k.split("/")[1] for k in site.keys("race")}) == sorted([winner, "manifest.json"])


def test_failed_write_aborts_its_upload(site: Site) -> None:
    storage = Storage(site.url("abort"), site.options)
    with pytest.raises(RuntimeError, match="producer failed"):
        with storage.writer("x/big.bin", 1 << 20) as w:
            w.write(bytes(20 << 20))  # two parts of 8 MiB are up: the upload is open
            assert site.uploads("abort/") == ["abort/x/big.bin"]
            raise RuntimeError("producer failed")
    assert site.uploads("abort/") == [] and site.keys("abort") == []
    with storage.writer("x/ok.bin", 1 << 20) as w:
        w.write(b"\x01" * (17 << 20))
        size, _, chunks = w.close()
    assert size == 17 << 20 and len(chunks) == 17
    assert site.fs.cat_file(f"{site.bucket}/abort/x/ok.bin") == b"\x01" * (17 << 20)
    with pytest.raises(CommitConflictError):
        storage.create_only("x/ok.bin", b"again")


def test_kill9_during_upload_leaves_no_manifest_and_clean_removes_debris(site: Site) -> None:
    url = site.url("killed")
    env = {**os.environ, **site.env, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([*CLI_COMMAND, "synth", url, "--params", "40M", "--ranks", "2"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        for _ in range(1200):  # poll ListMultipartUploads, not a sleep
            if site.uploads("killed/") or proc.poll() is not None:
                break
            time.sleep(0.025)
        assert site.uploads("killed/"), "no upload was ever open"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    assert proc.returncode == -signal.SIGKILL
    assert "manifest.json" not in [k.rsplit("/", 1)[-1] for k in site.keys("killed")]
    r = cli("verify", url, env=site.env)
    assert r.exit_code == 1 and ("never committed" in r.stderr or "no such checkpoint" in r.stderr)
    r = ok(cli("clean", url, "--dry-run", "--min-age", "0", "--json", env=site.env))
    dry = json.loads(r.stdout)
    assert dry["open_uploads"] and not dry["aborted_uploads"]
    r = ok(cli("clean", url, "--min-age", "0", env=site.env))
    assert "aborted multipart upload" in r.stdout
    assert site.uploads("killed/") == [] and site.keys("killed") == []
    assert list_open_uploads(Storage(url, site.options)) == []


def test_fsspec_file_path_never_commits_after_abort(site: Site) -> None:
    """Other fsspec backends write through ``fs.open("wb")``; on S3 that path would complete a
    partial object on ``__exit__``/``__del__``. Aborting it must leave neither object nor upload."""
    import gc

    from shardckpt.storage.writer import FsspecSink

    storage = Storage(site.url("sink"), site.options)
    sink = FsspecSink(storage.backend, storage.full("partial.bin"), storage.url_of("partial.bin"))
    sink.f.blocksize = 5 << 20
    sink.write(memoryview(bytes(11 << 20)))  # two parts sent: the upload is open
    assert site.uploads("sink/") == ["sink/partial.bin"]
    sink.abort()
    del sink
    gc.collect()  # S3File.__del__ would close() -> complete the upload if it could
    assert site.uploads("sink/") == [] and site.keys("sink") == []
