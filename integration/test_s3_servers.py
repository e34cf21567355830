"""Tests of the S3 test harness itself: servers, fixtures and the fault proxy.

They pin down what plain s3fs 2026.9 does on each server and under each fault,
which is what shardckpt's storage layer has to map. Fault tests run on moto
(fast) unless the server makes a difference.
"""

from __future__ import annotations

import errno
import http.client
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Iterator

import aiohttp
import botocore.exceptions
import pytest

from testing.s3servers import is_precondition_failed

pytestmark = [pytest.mark.s3, pytest.mark.timeout(120)]

MiB = 1 << 20
DATA = bytes(range(256)) * 4096  # 1 MiB, every byte value


# -- servers -----------------------------------------------------------------


def test_put_get_range_ls_rm(s3_server, s3_bucket):
    b = s3_bucket(s3_server)
    fs = b.filesystem()
    fs.pipe(f"{b.url}/dir/a.bin", DATA)
    fs.pipe(f"{b.url}/dir/b.bin", b"small")
    assert fs.cat(f"{b.url}/dir/a.bin") == DATA
    assert fs.cat_file(f"{b.url}/dir/a.bin", start=1000, end=70_000) == DATA[1000:70_000]
    assert fs.info(f"{b.url}/dir/a.bin")["size"] == len(DATA)
    assert sorted(fs.ls(f"{b.url}/dir")) == [f"{b.name}/dir/a.bin", f"{b.name}/dir/b.bin"]
    fs.rm(f"{b.url}/dir/a.bin")
    assert fs.ls(f"{b.url}/dir", refresh=True) == [f"{b.name}/dir/b.bin"]
    with pytest.raises(FileNotFoundError):
        fs.cat(f"{b.url}/dir/a.bin")


def test_multipart_upload(s3_server, s3_bucket):
    b = s3_bucket(s3_server)
    fs = b.filesystem()
    parts = [bytes([i]) * (5 * MiB) for i in range(2)] + [b"tail"]
    with fs.open(f"{b.url}/big", "wb", block_size=5 * MiB) as f:
        for p in parts:
            f.write(p)
    assert fs.info(f"{b.url}/big")["size"] == 10 * MiB + 4
    assert fs.cat_file(f"{b.url}/big", start=5 * MiB - 2, end=5 * MiB + 2) == b"\x00\x00\x01\x01"
    assert fs.cat(f"{b.url}/big") == b"".join(parts)


def test_create_only_write_fails_the_second_time(s3_server, s3_bucket):
    b = s3_bucket(s3_server)
    fs = b.filesystem()
    fs.pipe_file(f"{b.url}/marker", b"first", mode="create")
    with pytest.raises(OSError) as info:
        fs.pipe_file(f"{b.url}/marker", b"second", mode="create")
    with pytest.raises(OSError) as info_x:
        with fs.open(f"{b.url}/marker", "xb") as f:
            f.write(b"third")
    for exc in (info.value, info_x.value):
        if s3_server.name == "moto":
            assert type(exc) is FileExistsError
        else:  # Ceph: HTTP 412 PreconditionFailed, which s3fs maps to EINVAL
            assert type(exc) is OSError and exc.errno == errno.EINVAL
            assert exc.__cause__.response["Error"]["Code"] == "PreconditionFailed"
        assert is_precondition_failed(exc)
    assert fs.cat(f"{b.url}/marker") == b"first"


def test_list_multipart_uploads_shows_an_open_upload(s3_server, s3_bucket):
    b = s3_bucket(s3_server)
    fs = b.filesystem()
    up = fs.call_s3("create_multipart_upload", Bucket=b.name, Key="pending")
    fs.call_s3(
        "upload_part", Bucket=b.name, Key="pending", UploadId=up["UploadId"], PartNumber=1, Body=b"x" * MiB
    )
    listed = fs.call_s3("list_multipart_uploads", Bucket=b.name).get("Uploads", [])
    assert [(u["Key"], u["UploadId"]) for u in listed] == [("pending", up["UploadId"])]
    assert not fs.exists(f"{b.url}/pending")
    fs.call_s3("abort_multipart_upload", Bucket=b.name, Key="pending", UploadId=up["UploadId"])
    assert fs.call_s3("list_multipart_uploads", Bucket=b.name).get("Uploads", []) == []


# -- proxy: forwarding ---------------------------------------------------------


class _Echo(BaseHTTPRequestHandler):
    """Answers with what it received; HEAD gets Content-Length 12345 and no body."""

    protocol_version = "HTTP/1.1"

    def log_message(self, *args: object) -> None:
        pass

    def _body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            out = bytearray()
            for _ in range(100_000):  # bounded: a chunk per iteration
                size = int(self.rfile.readline().split(b";")[0], 16)
                if size == 0:
                    self.rfile.readline()
                    return bytes(out)
                out += self.rfile.read(size)
                self.rfile.readline()
            raise ValueError("too many chunks")
        return self.rfile.read(int(self.headers.get("Content-Length", 0)))

    def _answer(self) -> None:
        body = self._body()
        echo = json.dumps(
            {"method": self.command, "path": self.path, "headers": list(self.headers.items()),
             "body": body.decode("latin-1")}
        ).encode()
        self.send_response(200)
        if self.command == "HEAD":
            self.send_header("Content-Length", "12345")
            self.end_headers()
            return
        self.send_header("Transfer-Encoding", "chunked")  # upstream answers chunked
        self.end_headers()
        for i in range(0, len(echo), 1000):
            piece = echo[i : i + 1000]
            self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
        self.wfile.write(b"0\r\n\r\n")

    do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _answer


@pytest.fixture
def echo_url() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Echo)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def _request(url: str, method: str, path: str, body=None, headers=None, chunked=False):
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    try:
        conn.request(method, path, body=body, headers=headers or {}, encode_chunked=chunked)
        resp = conn.getresponse()
        return resp.status, dict(resp.getheaders()), resp.read()
    finally:
        conn.close()


def test_proxy_forwards_raw_path_headers_and_bodies(echo_url, fault_proxy):
    proxy = fault_proxy(echo_url)
    path = "/bkt/a%2Fb%20c+d?partNumber=1&uploadId=x%2By%3D"
    body = bytes(range(256)) * 400
    status, _, raw = _request(
        proxy.endpoint_url, "PUT", path, body,
        {"Host": "bkt.example:9000", "X-Amz-Date": "20261129T000000Z", "Content-MD5": "abc=="},
    )
    echo = json.loads(raw)
    headers = dict(echo["headers"])
    assert status == 200 and echo["method"] == "PUT" and echo["path"] == path
    assert headers["Host"] == "bkt.example:9000"  # as the client signed it
    assert headers["X-Amz-Date"] == "20261129T000000Z" and headers["Content-MD5"] == "abc=="
    assert headers["Content-Length"] == str(len(body))
    assert echo["body"].encode("latin-1") == body

    chunks = [b"a" * 70_000, b"", b"b" * 3]  # streaming upload without Content-Length
    status, _, raw = _request(proxy.endpoint_url, "POST", "/bkt/k?uploads", iter(chunks), chunked=True)
    assert status == 200 and json.loads(raw)["body"].encode("latin-1") == b"".join(chunks)

    status, resp_headers, raw = _request(proxy.endpoint_url, "HEAD", "/bkt/k")
    assert status == 200 and resp_headers["Content-Length"] == "12345" and raw == b""
    assert [r.method for r in proxy.log] == ["PUT", "POST", "HEAD"]


def test_rule_schedules_and_filters(echo_url, fault_proxy):
    proxy = fault_proxy(echo_url)
    every = proxy.add_rule("internal_error", method="GET", path=r"^/a/", every=3)
    first = proxy.add_rule("slowdown", method="PUT|POST", query=r"partNumber=", first=2)
    statuses = [_request(proxy.endpoint_url, "GET", f"/a/{i}")[0] for i in range(7)]
    assert statuses == [200, 200, 500, 200, 200, 500, 200]
    assert _request(proxy.endpoint_url, "GET", "/b/0")[0] == 200  # path filter
    statuses = [_request(proxy.endpoint_url, "PUT", "/a/k?partNumber=1&uploadId=u")[0] for _ in range(3)]
    assert statuses == [503, 503, 200]
    status, headers, body = _request(proxy.endpoint_url, "PUT", "/a/k?partNumber=1", b"x")
    assert status == 200  # first=2 is spent
    assert (every.matched, every.faulted, first.matched, first.faulted) == (7, 2, 4, 2)
    assert (proxy.seen, proxy.faulted) == (12, 4)

    proxy.clear()
    coin = proxy.add_rule("slowdown", probability=0.5, seed=7)
    pattern = [_request(proxy.endpoint_url, "GET", "/c")[0] for _ in range(20)]
    proxy.clear()
    again = proxy.add_rule("slowdown", probability=0.5, seed=7)
    assert [_request(proxy.endpoint_url, "GET", "/c")[0] for _ in range(20)] == pattern
    assert 0 < coin.faulted < 20 and again.faulted == coin.faulted
    with pytest.raises(ValueError, match="at most one"):
        proxy.add_rule("reset", every=2, first=1)


def test_proxy_passes_s3_through_unchanged(s3_server, s3_bucket, fault_proxy):
    proxy = fault_proxy(s3_server)
    b = s3_bucket(s3_server, via=proxy)
    fs = b.filesystem()
    fs.pipe(f"{b.url}/k", DATA)  # Ceph checks the SigV4 signature made for the proxy's Host
    assert fs.info(f"{b.url}/k")["size"] == len(DATA)  # HEAD keeps Content-Length
    assert fs.cat_file(f"{b.url}/k", start=5, end=500) == DATA[5:500]
    with fs.open(f"{b.url}/mpu", "wb", block_size=5 * MiB) as f:
        f.write(b"z" * (5 * MiB + 1))
    assert fs.cat(f"{b.url}/mpu") == b"z" * (5 * MiB + 1)
    assert proxy.faulted == 0 and {"PUT", "HEAD", "GET", "POST"} <= {r.method for r in proxy.log}


# -- proxy: faults seen by s3fs ------------------------------------------------


def test_slowdown_is_retried_and_recovers(moto_server, s3_bucket, fault_proxy):
    proxy = fault_proxy(moto_server)
    b = s3_bucket(moto_server, via=proxy)
    rule = proxy.add_rule("slowdown", method="PUT", first=2)
    b.filesystem().pipe(f"{b.url}/k", b"v")
    assert rule.faulted == 2 and [r.fault for r in proxy.log] == ["slowdown", "slowdown", None]
    assert moto_server.filesystem().cat(f"{b.name}/k") == b"v"


def test_slowdown_storm_surfaces_as_ebusy(moto_server, s3_bucket, fault_proxy):
    proxy = fault_proxy(moto_server)
    b = s3_bucket(moto_server, via=proxy, max_attempts=2)
    proxy.add_rule("slowdown", method="PUT")
    fs = b.filesystem()
    fs.retries = 2  # s3fs retries SlowDown itself: 2 (s3fs) x 2 (botocore) tries
    with pytest.raises(OSError) as info:
        fs.pipe(f"{b.url}/k", b"v")
    assert type(info.value) is OSError and info.value.errno == errno.EBUSY
    assert info.value.__cause__.response["Error"]["Code"] == "SlowDown"
    assert proxy.faulted == 4


def test_permanent_internal_error_raises_eremoteio(moto_server, s3_bucket, fault_proxy):
    proxy = fault_proxy(moto_server)
    b = s3_bucket(moto_server, via=proxy, max_attempts=2)
    moto_server.filesystem().pipe(f"{b.name}/k", b"v")
    proxy.add_rule("internal_error", method="GET")
    with pytest.raises(OSError) as info:
        b.filesystem().cat(f"{b.url}/k")
    assert type(info.value) is OSError and info.value.errno == errno.EREMOTEIO
    assert info.value.__cause__.response["Error"]["Code"] == "InternalError"
    assert proxy.faulted == 2  # botocore retried; s3fs does not retry a 500


def test_reset_on_upload_part(s3_server, s3_bucket, fault_proxy):
    proxy = fault_proxy(s3_server)
    b = s3_bucket(s3_server, via=proxy, max_attempts=2)
    fs = b.filesystem()
    part = {"method": "PUT", "query": r"(^|&)partNumber="}
    rule = proxy.add_rule("reset", first=1, **part)
    with fs.open(f"{b.url}/ok", "wb", block_size=5 * MiB) as f:
        f.write(b"p" * (10 * MiB))
    assert rule.faulted == 1 and fs.cat(f"{b.url}/ok") == b"p" * (10 * MiB)

    proxy.clear()
    proxy.add_rule("reset", **part)
    with pytest.raises(botocore.exceptions.EndpointConnectionError):
        with fs.open(f"{b.url}/broken", "wb", block_size=5 * MiB) as f:
            f.write(b"q" * (10 * MiB))
    uploads = s3_server.filesystem().call_s3("list_multipart_uploads", Bucket=b.name).get("Uploads", [])
    assert [u["Key"] for u in uploads] == ["broken"]  # left open: a sweeper must abort it
    assert not fs.exists(f"{b.url}/broken")


def test_reset_after_the_server_applied_a_put_is_retried(moto_server, s3_bucket, fault_proxy):
    proxy = fault_proxy(moto_server)
    b = s3_bucket(moto_server, via=proxy)
    proxy.add_rule("reset", method="PUT", first=1, after_upstream=True)
    b.filesystem().pipe(f"{b.url}/k", b"v")
    assert [r.fault for r in proxy.log] == ["reset", None]


def test_truncated_get_body(moto_server, s3_bucket, fault_proxy):
    proxy = fault_proxy(moto_server)
    b = s3_bucket(moto_server, via=proxy)
    moto_server.filesystem().pipe(f"{b.name}/k", DATA)
    fs = b.filesystem()
    proxy.add_rule("truncate", method="GET", first=1)
    assert fs.cat(f"{b.url}/k") == DATA  # s3fs retries ClientPayloadError
    proxy.clear()
    proxy.add_rule("truncate", method="GET", keep_bytes=1000)
    fs.retries = 2
    with pytest.raises(aiohttp.ClientPayloadError):  # raw, not an OSError
        fs.cat(f"{b.url}/k")


def test_delay_beyond_read_timeout_is_retried(moto_server, s3_bucket, fault_proxy):
    proxy = fault_proxy(moto_server)
    b = s3_bucket(moto_server, via=proxy, max_attempts=2, read_timeout=0.5)
    moto_server.filesystem().pipe(f"{b.name}/k", b"v")
    fs = b.filesystem()
    proxy.add_rule("delay", method="GET", first=1, delay_s=2.0)
    assert fs.cat(f"{b.url}/k") == b"v"
    proxy.clear()
    proxy.add_rule("delay", method="GET", delay_s=2.0)
    fs.retries = 1
    with pytest.raises(botocore.exceptions.ReadTimeoutError):
        fs.cat(f"{b.url}/k")


def test_corrupt_body_is_caught_only_on_full_gets_with_checksums(s3_server, s3_bucket, fault_proxy):
    proxy = fault_proxy(s3_server)
    b = s3_bucket(s3_server, via=proxy)
    s3_server.filesystem().pipe(f"{b.name}/k", DATA)
    fs = b.filesystem()
    proxy.add_rule("corrupt", method="GET", first=1)
    if s3_server.name == "moto":  # moto returns the stored CRC32; botocore checks full GETs
        with pytest.raises(botocore.exceptions.FlexibleChecksumError):
            fs.cat(f"{b.url}/k")
    else:  # Ceph 16 returns no x-amz-checksum: the flipped bit goes through
        assert fs.cat(f"{b.url}/k") != DATA
    proxy.clear()
    proxy.add_rule("corrupt", method="GET", first=1)
    assert fs.cat_file(f"{b.url}/k", start=0, end=1000) != DATA[:1000]  # ranged: never checked
