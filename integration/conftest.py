"""S3 fixtures for everything under integration/.

- `moto_server` (session): moto on 127.0.0.1, ~0.3 s to start.
- `ceph_server` (session): Ceph RGW via scripts/ceph-rgw.sh, ~2 s to start.
  Skipped if the Ceph binaries are not installed, unless SHARDCKPT_REQUIRE_CEPH
  is set (not "", "0" or "false"): then the missing binaries are an error.
- `s3_server` (session, parametrized "moto"/"ceph"): run a test on both.
- `s3_bucket` (function): factory `s3_bucket(server, via=None, **opts) -> S3Bucket`,
  a fresh empty bucket; deleted with its objects and open uploads afterwards.
- `fault_proxy` (function): factory `fault_proxy(server_or_url) -> FaultProxy`,
  started; stopped afterwards.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import pytest

from testing.faultproxy import FaultProxy
from testing.s3servers import CephServer, MotoServer, S3Server

REQUIRE_CEPH_ENV = "SHARDCKPT_REQUIRE_CEPH"


def _ceph_required() -> bool:
    return os.environ.get(REQUIRE_CEPH_ENV, "").strip().lower() not in ("", "0", "false", "no")


@dataclass(frozen=True)
class S3Bucket:
    """A fresh bucket: `url` is "s3://<name>", `storage_options` go to s3fs/fsspec."""

    name: str
    url: str
    storage_options: dict[str, Any]
    server: S3Server

    def filesystem(self) -> Any:
        """A new uncached s3fs.S3FileSystem with this bucket's storage options."""
        import s3fs

        return s3fs.S3FileSystem(skip_instance_cache=True, **self.storage_options)


@pytest.fixture(scope="session")
def moto_server() -> Iterator[MotoServer]:
    server = MotoServer().start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def ceph_server() -> Iterator[CephServer]:
    missing = CephServer.missing_binaries()
    if missing:
        reason = (
            f"Ceph binaries not installed ({', '.join(missing)}); "
            "install with `scripts/ceph-rgw.sh install`"
        )
        if _ceph_required():
            pytest.fail(f"{reason}, and {REQUIRE_CEPH_ENV} is set", pytrace=False)
        pytest.skip(f"{reason}, or set {REQUIRE_CEPH_ENV}=1 to make this an error")
    server = CephServer().start()  # start failures are errors, never skips
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session", params=["moto", "ceph"])
def s3_server(request: pytest.FixtureRequest) -> S3Server:
    return request.getfixturevalue(f"{request.param}_server")


@pytest.fixture
def s3_bucket() -> Iterator[Callable[..., S3Bucket]]:
    created: list[tuple[S3Server, str]] = []

    def make(server: S3Server, via: FaultProxy | None = None, **options: Any) -> S3Bucket:
        """Fresh bucket on `server`; s3fs reaches it through `via` if given.

        `options` go to `server.storage_options` (max_attempts, read_timeout, ...).
        The bucket is created directly on the server, never through the proxy.
        """
        name = server.create_bucket()
        created.append((server, name))
        endpoint = via.endpoint_url if via is not None else None
        return S3Bucket(name, f"s3://{name}", server.storage_options(endpoint, **options), server)

    yield make
    for server, name in reversed(created):
        if server.running:
            try:
                server.delete_bucket(name)
            except Exception:  # noqa: BLE001 - cleanup must not mask the test's outcome
                pass


@pytest.fixture
def fault_proxy() -> Iterator[Callable[..., FaultProxy]]:
    proxies: list[FaultProxy] = []

    def make(upstream: S3Server | str) -> FaultProxy:
        url = upstream if isinstance(upstream, str) else upstream.endpoint_url
        proxy = FaultProxy(url).start()
        proxies.append(proxy)
        return proxy

    yield make
    for proxy in proxies:
        proxy.stop()


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Skip ``cuda``-marked tests without a CUDA device (torch imported only for those)."""
    if item.get_closest_marker("cuda") is not None:
        import torch

        if not torch.cuda.is_available():
            pytest.skip("needs a CUDA device")
