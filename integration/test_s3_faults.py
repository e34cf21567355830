"""Object stores under faults: shardckpt's retries, deadline, error mapping and cleanup.

Requests go through the fault proxy to a real S3 server (Ceph RGW). With one request in ten
faulted (503, 500, connection resets, resets of UploadPart, truncated GET bodies) synth, reshard
and consolidate succeed and give the bytes of a fault-free local run. With a permanent fault the
command fails within its deadline with one line naming the object, commits nothing and leaves no
multipart upload open. Answers lost after the server acted (commit, complete, create) are
recognised. Classification and options are checked without a server at the end.
"""

from __future__ import annotations

import errno
import json
import os
import time
from pathlib import Path
from typing import Any, Iterator

import aiohttp
import botocore.exceptions
import pytest

from shardckpt.errors import ConfigError
from shardckpt.storage import DEADLINE_ENV, S3_CONFIG_DEFAULTS, RetryPolicy, Storage, split_options
from shardckpt.storage.retry import map_error
from shardckpt.storage.s3 import _is_precondition_failed
from shardckpt.tools.synth import synthesize

from testing.cli import cli, ok, one_line_error

pytestmark = [pytest.mark.s3, pytest.mark.timeout(240)]

PARAMS, RANKS, TO = "3M", 4, 2   # 9 MB shards (2 parts), 18 MB after reshard (3 parts)
DEADLINE = 4.0
UPLOAD_PART = {"method": "PUT", "query": r"(^|&)partNumber="}


class Via:
    """A bucket reached through ``endpoint`` (the proxy) and, for checks, directly."""

    def __init__(self, server: Any, bucket: str, endpoint: str) -> None:
        self.server, self.bucket = server, bucket
        self.env = {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": server.key,
                    "AWS_SECRET_ACCESS_KEY": server.secret, "AWS_DEFAULT_REGION": "us-east-1"}
        self.direct = server.filesystem()

    def url(self, key: str) -> str:
        return f"s3://{self.bucket}/{key}"

    def uploads(self) -> list[str]:
        resp = self.direct.call_s3("list_multipart_uploads", Bucket=self.bucket)
        return [u["Key"] for u in resp.get("Uploads", [])]

    def exists(self, key: str) -> bool:
        self.direct.invalidate_cache()
        return self.direct.exists(f"{self.bucket}/{key}")

    def read(self, location: str, rel: str) -> bytes:
        if location.startswith("s3://"):
            return self.direct.cat_file(f"{location[5:]}/{rel}")
        return (Path(location) / rel).read_bytes()

    def shard_data(self, location: str) -> dict[str, bytes]:
        m = json.loads(self.read(location, "manifest.json"))
        return {f"{f['role']}-{f.get('index')}": self.read(location, f["path"])[8 + f["header_size"]:]
                for f in m["files"]}

    def consolidated(self, location: str) -> dict[str, bytes]:
        if location.startswith("s3://"):
            self.direct.invalidate_cache()
            names = [p.rsplit("/", 1)[1] for p in self.direct.ls(location[5:])]
        else:
            names = os.listdir(location)
        return {n: self.read(location, n) for n in sorted(names) if n != "shardckpt_consolidated.json"}


@pytest.fixture
def via(ceph_server: Any, fault_proxy: Any) -> Iterator[tuple[Via, Any]]:
    proxy = fault_proxy(ceph_server)
    bucket = ceph_server.create_bucket("flt")
    try:
        yield Via(ceph_server, bucket, proxy.endpoint_url), proxy
    finally:
        proxy.clear()
        ceph_server.delete_bucket(bucket)


@pytest.fixture(scope="module")
def local(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    d = tmp_path_factory.mktemp("ref")
    src, rs, hf = str(d / "src"), str(d / "reshard"), str(d / "hf")
    ok(cli("synth", src, "--params", PARAMS, "--ranks", str(RANKS)))
    ok(cli("reshard", src, rs, "--to", str(TO)))
    ok(cli("consolidate", src, hf, "--dtype", "fp32"))
    return {"src": src, "reshard": rs, "hf": hf}


# --------------------------------------------------------------------------- transient faults


def test_ten_percent_faults_synth_reshard_consolidate_bit_for_bit(via: tuple[Via, Any],
                                                                  local: dict[str, str]) -> None:
    v, proxy = via
    proxy.add_rule("slowdown", probability=0.025, seed=1)
    proxy.add_rule("internal_error", probability=0.025, seed=2)
    proxy.add_rule("reset", probability=0.06, seed=3, **UPLOAD_PART)
    proxy.add_rule("reset", probability=0.02, seed=4)
    proxy.add_rule("truncate", method="GET", probability=0.05, seed=5)
    src, rs, hf = v.url("src"), v.url("reshard"), v.url("hf")
    ok(cli("synth", src, "--params", PARAMS, "--ranks", str(RANKS), env=v.env))
    ok(cli("reshard", src, rs, "--to", str(TO), env=v.env))
    ok(cli("consolidate", src, hf, "--dtype", "fp32", env=v.env))
    faulted, seen = proxy.faulted, proxy.seen
    kinds = {r.fault for r in proxy.log if r.fault}
    proxy.clear()
    assert faulted >= 0.05 * seen and len(kinds) >= 3, (faulted, seen, kinds)
    assert v.shard_data(src) == v.shard_data(local["src"])
    assert v.shard_data(rs) == v.shard_data(local["reshard"])
    assert v.consolidated(hf) == v.consolidated(local["hf"])
    for ckpt in (src, rs):
        ok(cli("verify", ckpt, env=v.env))
    assert v.uploads() == []


def test_delay_beyond_the_read_timeout_is_retried(via: tuple[Via, Any], local: dict[str, str]) -> None:
    v, proxy = via
    synthesize(v.url("src"), 500_000, ranks=2, storage_options={
        "key": v.server.key, "secret": v.server.secret, "client_kwargs": {"endpoint_url": v.server.endpoint_url}})
    # botocore's 2 tries time out, then shardckpt's own retry gets through
    rule = proxy.add_rule("delay", method="GET", path=r"shard-", first=3, delay_s=2.5)
    t0 = time.monotonic()
    r = ok(cli("verify", v.url("src"), "-o", "config_kwargs.read_timeout=1", env=v.env))
    assert r.stdout.startswith("ok:") and rule.faulted == 3 and time.monotonic() - t0 < 30


def test_lost_answers_after_the_server_acted(via: tuple[Via, Any]) -> None:
    """Create, complete and commit land but their answers are lost: recognised, no stray upload."""
    v, proxy = via
    proxy.add_rule("reset", method="POST", query=r"^uploads", first=1, after_upstream=True)
    proxy.add_rule("reset", method="POST", query=r"uploadId=", first=1, after_upstream=True)
    proxy.add_rule("reset", method="PUT", path=r"manifest\.json$", first=1, after_upstream=True)
    url = v.url("lost")
    ok(cli("synth", url, "--params", "1M", "--ranks", "1", env=v.env))  # one 12 MB shard
    assert proxy.faulted == 3
    ok(cli("verify", url, env=v.env))
    assert v.uploads() == []


# --------------------------------------------------------------------------- permanent faults


def _fails_within_deadline(v: Via, args: list[str], *needles: str, dst: str) -> str:
    t0 = time.monotonic()
    r = cli(*args, "-o", f"shardckpt_deadline_s={DEADLINE}", env=v.env)
    elapsed = time.monotonic() - t0
    line = one_line_error(r, *needles)
    assert elapsed < DEADLINE + 10, elapsed
    assert f"deadline {DEADLINE:g} s" in line
    assert not v.exists(f"{dst}/manifest.json")
    assert v.uploads() == []
    return line


def test_permanent_fault_on_put(via: tuple[Via, Any]) -> None:
    v, proxy = via
    proxy.add_rule("internal_error", method="PUT")
    line = _fails_within_deadline(v, ["synth", v.url("p"), "--params", PARAMS, "--ranks", "2"],
                                  f"s3://{v.bucket}/p/", ".safetensors", "InternalError", dst="p")
    assert "upload of part 1 failed" in line


def test_permanent_reset_on_upload_part(via: tuple[Via, Any]) -> None:
    v, proxy = via
    proxy.add_rule("reset", **UPLOAD_PART)
    _fails_within_deadline(v, ["synth", v.url("r"), "--params", PARAMS, "--ranks", "2"],
                           f"s3://{v.bucket}/r/", ".safetensors", "upload of part", dst="r")


def test_permanently_truncated_gets(via: tuple[Via, Any], tmp_path: Path) -> None:
    v, proxy = via
    synthesize(v.url("src"), 1_000_000, ranks=2, storage_options={
        "key": v.server.key, "secret": v.server.secret, "client_kwargs": {"endpoint_url": v.server.endpoint_url}})
    proxy.add_rule("truncate", method="GET", path=r"shard-")
    _fails_within_deadline(v, ["reshard", v.url("src"), v.url("dst"), "--to", "1"],
                           f"s3://{v.bucket}/src/", "shard-0000", "ClientPayloadError", dst="dst")
    r = cli("verify", v.url("src"), "-o", f"shardckpt_deadline_s={DEADLINE}", env=v.env)
    assert r.exit_code == 1 and r.stderr.count("shard-0000") >= 2  # every file named


# ------------------------------------------------------------------------- no server needed


def test_s3_defaults_and_overrides(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(DEADLINE_ENV, raising=False)
    opts, retry, tuning, retries = split_options("s3://b/x", {"key": "k"})
    assert opts["config_kwargs"] == S3_CONFIG_DEFAULTS and opts["key"] == "k" and retries == 1
    assert retry == RetryPolicy() and retry.deadline_s == 120 and opts["use_listings_cache"] is False
    opts, retry, tuning, retries = split_options("s3://b/x", {
        "config_kwargs": {"read_timeout": 3}, "retries": 4, "shardckpt_deadline_s": 9,
        "shardckpt_part_size": 16 << 20, "shardckpt_concurrency": 2})
    assert opts["config_kwargs"] == {**S3_CONFIG_DEFAULTS, "read_timeout": 3}
    assert retries == 4 and retry.deadline_s == 9 and (tuning.part_size, tuning.concurrency) == (16 << 20, 2)
    assert not any(k.startswith("shardckpt_") or k == "retries" for k in opts)
    monkeypatch.setenv(DEADLINE_ENV, "7.5")
    assert split_options("s3://b/x", {})[1].deadline_s == 7.5
    assert split_options("/tmp/x", {})[1].deadline_s == 7.5  # local files too
    assert split_options("s3://b/x", {"shardckpt_deadline_s": 3})[1].deadline_s == 3  # option wins
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    assert split_options("s3://b/x", {})[0]["client_kwargs"]["endpoint_url"] == "http://127.0.0.1:9"
    for bad in ({"shardckpt_deadline_s": 0}, {"shardckpt_deadline_s": "soon"}, {"shardckpt_part_size": 1 << 20}):
        with pytest.raises(ConfigError, match="storage option"):
            split_options("s3://b/x", bad)


def _client_error(code: str, status: int, op: str = "GetObject") -> botocore.exceptions.ClientError:
    return botocore.exceptions.ClientError(
        {"Error": {"Code": code, "Message": code}, "ResponseMetadata": {"HTTPStatusCode": status}}, op)


def test_retryable_classification_and_mapping() -> None:
    def translated(code: str, status: int, exc: BaseException) -> BaseException:
        exc.__cause__ = _client_error(code, status)
        return exc
    transient = [
        botocore.exceptions.EndpointConnectionError(endpoint_url="http://x"),
        botocore.exceptions.ConnectionClosedError(endpoint_url="http://x"),
        botocore.exceptions.ReadTimeoutError(endpoint_url="http://x"),
        aiohttp.ClientPayloadError("Response payload is not completed"),
        aiohttp.ServerDisconnectedError(),
        translated("SlowDown", 503, OSError(errno.EBUSY, "slow down")),
        translated("InternalError", 500, OSError(errno.EREMOTEIO, "internal")),
        translated("RequestTimeout", 400, OSError(errno.EIO, "timeout")),
        _client_error("TooManyRequests", 429), ConnectionResetError(), TimeoutError(),
    ]
    permanent = [
        botocore.exceptions.NoCredentialsError(), PermissionError("denied"), FileNotFoundError("gone"),
        translated("PreconditionFailed", 412, OSError(errno.EINVAL, "precondition")),
        translated("InvalidArgument", 400, OSError(errno.EINVAL, "bad")), ValueError("bug"),
    ]
    classify = Storage("s3://b", {"key": "k", "secret": "s"}).backend.classify
    assert [e for e in transient if classify(e) != "retry"] == []
    assert [e for e in permanent if classify(e) != "permanent"] == []
    assert _is_precondition_failed(permanent[3]) and _is_precondition_failed(FileExistsError())
    assert not _is_precondition_failed(permanent[4])
    e = map_error(transient[5], "upload of part 3", "s3://b/k", attempts=6, elapsed=4.2, deadline=4)
    assert type(e).__name__ == "DeadlineExceededError" and "\n" not in str(e)
    assert str(e).startswith("s3://b/k: upload of part 3 failed after 6 attempts in 4.2 s (deadline 4 s")
    assert "(SlowDown, HTTP 503)" in str(e)
    assert type(map_error(FileNotFoundError(), "read", "s3://b/k")).__name__ == "NotFoundError"
