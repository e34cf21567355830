"""Local S3 servers on 127.0.0.1 for integration tests; no pytest dependency.

- `MotoServer`: moto's ThreadedMotoServer in this process (starts in ~0.4 s).
  Accepts any credentials, checks no signatures, never throttles.
- `CephServer`: a real Ceph RADOS Gateway (mon + memstore OSD + RGW) started by
  scripts/ceph-rgw.sh on free ports (starts in ~2 s). Checks SigV4 signatures.

Both give `storage_options()` for s3fs and `create_bucket()`. Servers are
stopped by `stop()`, at interpreter exit, and (Ceph) by the script's watchdog
if this process dies without either.
"""

from __future__ import annotations

import atexit
import errno
import os
import shutil
import subprocess
import tempfile
import uuid
from pathlib import Path
from typing import Any

from shardckpt.training.launch import free_port

ACCESS_KEY = "testkey"
SECRET_KEY = "testsecret"
REGION = "us-east-1"
CEPH_SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "ceph-rgw.sh"
CEPH_BINARIES = ("ceph-mon", "ceph-osd", "radosgw")


class S3ServerError(RuntimeError):
    """A local S3 server could not be started or is not installed."""


class S3Server:
    """Common part: credentials, endpoint, s3fs options, buckets."""

    key = ACCESS_KEY
    secret = SECRET_KEY
    name = "s3"

    def __init__(self) -> None:
        self._endpoint_url: str | None = None
        self._admin_fs: Any = None

    @property
    def endpoint_url(self) -> str:
        if self._endpoint_url is None:
            raise S3ServerError(f"{type(self).__name__} is not started")
        return self._endpoint_url

    @property
    def running(self) -> bool:
        return self._endpoint_url is not None

    def storage_options(
        self,
        endpoint_url: str | None = None,
        *,
        max_attempts: int = 3,
        connect_timeout: float = 5.0,
        read_timeout: float = 15.0,
    ) -> dict[str, Any]:
        """s3fs keyword arguments for this server, or for a proxy in front of it.

        `max_attempts` is botocore's total tries per call (first try included, standard
        retry mode); s3fs retries on top of that (`S3FileSystem.retries`, default 5).
        """
        return {
            "key": self.key,
            "secret": self.secret,
            "client_kwargs": {"endpoint_url": endpoint_url or self.endpoint_url, "region_name": REGION},
            "config_kwargs": {
                "retries": {"mode": "standard", "total_max_attempts": max_attempts},
                "connect_timeout": connect_timeout,
                "read_timeout": read_timeout,
            },
        }

    def filesystem(self, endpoint_url: str | None = None, **kwargs: Any) -> Any:
        """A new, uncached s3fs.S3FileSystem (kwargs go to storage_options)."""
        import s3fs

        return s3fs.S3FileSystem(skip_instance_cache=True, **self.storage_options(endpoint_url, **kwargs))

    def _admin(self) -> Any:
        if self._admin_fs is None:
            self._admin_fs = self.filesystem()
        return self._admin_fs

    def create_bucket(self, prefix: str = "t") -> str:
        """Create a bucket with a fresh name and return the name (not the URL).

        Uses CreateBucket without a LocationConstraint: s3fs's `mkdir` would send
        the region (us-east-1), which Ceph rejects with InvalidLocationConstraint.
        """
        name = f"{prefix}-{uuid.uuid4().hex[:16]}".lower()
        self._admin().call_s3("create_bucket", Bucket=name)
        return name

    def delete_bucket(self, name: str) -> None:
        """Abort open multipart uploads, delete every object, then the bucket."""
        fs = self._admin()
        uploads = fs.call_s3("list_multipart_uploads", Bucket=name).get("Uploads", [])
        for up in uploads[:1000]:
            fs.call_s3("abort_multipart_upload", Bucket=name, Key=up["Key"], UploadId=up["UploadId"])
        fs.invalidate_cache(name)
        keys = fs.find(name)
        if keys:
            fs.rm(keys)
        fs.call_s3("delete_bucket", Bucket=name)
        fs.invalidate_cache(name)

    def start(self) -> S3Server:  # pragma: no cover - abstract
        raise NotImplementedError

    def stop(self) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def __enter__(self) -> S3Server:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._endpoint_url or 'stopped'})"


class MotoServer(S3Server):
    """moto's S3 in a thread of this process, on 127.0.0.1 and a free port."""

    name = "moto"

    def __init__(self) -> None:
        super().__init__()
        self._server: Any = None

    def start(self) -> MotoServer:
        if self._server is not None:
            return self
        import logging

        from moto.server import ThreadedMotoServer

        # werkzeug logs one line per request to stderr; keep test output readable.
        logging.getLogger("werkzeug").setLevel(logging.WARNING)
        server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        server.start()
        host, port = server.get_host_and_port()
        self._server = server
        self._endpoint_url = f"http://{host}:{port}"
        atexit.register(self.stop)
        return self

    def stop(self) -> None:
        server, self._server = self._server, None
        self._endpoint_url = None
        self._admin_fs = None
        if server is not None:
            server.stop()
            atexit.unregister(self.stop)

    def reset(self) -> None:
        """Drop all of moto's state (every bucket) via its `/moto-api/reset`."""
        import urllib.request

        req = urllib.request.Request(f"{self.endpoint_url}/moto-api/reset", method="POST")
        with urllib.request.urlopen(req, timeout=10):
            pass
        if self._admin_fs is not None:
            self._admin_fs.invalidate_cache()


class CephServer(S3Server):
    """Single-node Ceph RGW via scripts/ceph-rgw.sh; state in a private temp dir.

    Ports default to free ones picked at start (the script refuses busy ports).
    A watchdog started by the script stops the cluster if this process dies.
    """

    name = "ceph"

    def __init__(
        self,
        *,
        rgw_port: int = 0,
        mon_port: int = 0,
        state_dir: str | os.PathLike | None = None,
        script: str | os.PathLike = CEPH_SCRIPT,
        start_timeout: float = 120.0,
    ) -> None:
        super().__init__()
        self._rgw_port, self._mon_port = rgw_port, mon_port
        self._state_dir = Path(state_dir) if state_dir else None
        self._tmp_dir: Path | None = None
        self._script = Path(script)
        self._start_timeout = start_timeout
        self._env: dict[str, str] | None = None

    @staticmethod
    def missing_binaries() -> list[str]:
        return [b for b in CEPH_BINARIES if shutil.which(b) is None]

    @classmethod
    def available(cls) -> bool:
        return not cls.missing_binaries()

    def start(self) -> CephServer:
        if self._env is not None:
            return self
        missing = self.missing_binaries()
        if missing:
            raise S3ServerError(
                f"Ceph binaries not found: {', '.join(missing)}. "
                f"Install them with `{self._script} install` (apt-get radosgw ceph-mon ceph-osd)."
            )
        state_dir = self._state_dir
        if state_dir is None:  # empty, so the script adopts it (and removes it on stop)
            self._tmp_dir = state_dir = Path(tempfile.mkdtemp(prefix="shardckpt-ceph-"))
        env = {
            **os.environ,
            "CEPH_RGW_DIR": str(state_dir),
            "CEPH_RGW_PORT": str(self._rgw_port or free_port()),
            "CEPH_MON_PORT": str(self._mon_port or free_port()),
            "CEPH_RGW_TIMEOUT": str(int(self._start_timeout)),
            "CEPH_RGW_WATCH_PID": str(os.getpid()),
        }
        self._env = env
        atexit.register(self.stop)
        try:
            proc = subprocess.run(
                ["bash", str(self._script), "start"],
                env=env, capture_output=True, text=True, timeout=self._start_timeout + 30,
            )
        except subprocess.TimeoutExpired as e:
            self.stop()
            raise S3ServerError(f"{self._script} start timed out after {e.timeout:.0f}s") from e
        if proc.returncode != 0:
            self.stop()
            raise S3ServerError(
                f"{self._script} start failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}"
            )
        exported = dict(
            line.removeprefix("export ").split("=", 1)
            for line in proc.stdout.splitlines()
            if line.startswith("export ") and "=" in line
        )
        if "CEPH_RGW_ENDPOINT" not in exported:
            self.stop()
            raise S3ServerError(f"{self._script} start printed no endpoint:\n{proc.stdout}")
        self._endpoint_url = exported["CEPH_RGW_ENDPOINT"]
        return self

    def stop(self) -> None:
        """Kill the daemons and remove the state dir. Safe to call twice."""
        env, self._env = self._env, None
        self._endpoint_url = None
        self._admin_fs = None
        if env is None:
            return
        atexit.unregister(self.stop)
        try:
            proc = subprocess.run(
                ["bash", str(self._script), "stop"], env=env, capture_output=True, text=True, timeout=60
            )
            if proc.returncode != 0:
                raise S3ServerError(f"{self._script} stop failed: {proc.stderr[-2000:]}")
        finally:
            if self._tmp_dir is not None:
                shutil.rmtree(self._tmp_dir, ignore_errors=True)
                self._tmp_dir = None


def is_precondition_failed(exc: BaseException) -> bool:
    """True if `exc` is s3fs's rendering of a failed create-only write.

    moto answers an existing key with FileExistsError; Ceph answers HTTP 412
    PreconditionFailed, which s3fs 2026.9 raises as OSError(EINVAL) with the
    botocore ClientError as __cause__.
    """
    if isinstance(exc, FileExistsError):
        return True
    cause = exc.__cause__
    response = getattr(cause, "response", None) or {}
    code = str(response.get("Error", {}).get("Code", ""))
    return isinstance(exc, OSError) and exc.errno == errno.EINVAL and code in ("PreconditionFailed", "412")
