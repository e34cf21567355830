"""fsspec filesystems for tests: count the bytes each process reads, or die after N bytes written.

``countfile://`` and ``killfile://`` behave like the local filesystem. They are not "local" to
shardckpt's storage layer, so they exercise its generic (object-store-like) code path.
"""

from __future__ import annotations

import os
import signal
from typing import Any

from fsspec.implementations.local import LocalFileSystem
from fsspec.registry import register_implementation


class _Prefixed(LocalFileSystem):
    prefix = ""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("auto_mkdir", True)  # like an object store: no directories to make
        super().__init__(*args, **kwargs)

    @classmethod
    def _strip_protocol(cls, path: Any) -> str:
        path = str(path)
        if path.startswith(cls.prefix):
            path = path[len(cls.prefix):]
        return super()._strip_protocol(path)


class CountingFS(_Prefixed):
    """Counts every byte returned by ``cat_file`` (shardckpt's ranged reads) in this process."""

    protocol = ("countfile",)
    prefix = "countfile://"
    bytes_read = 0
    reads = 0

    def cat_file(self, path: str, start: int | None = None, end: int | None = None, **kw: Any) -> bytes:
        data = super().cat_file(path, start=start, end=end, **kw)
        CountingFS.bytes_read += len(data)
        CountingFS.reads += 1
        return data


class KillingFS(_Prefixed):
    """SIGKILLs this process once ``SHARDCKPT_TEST_KILL_AFTER`` bytes of a shard file are written
    (only where that variable is set, i.e. on the victim rank)."""

    protocol = ("killfile",)
    prefix = "killfile://"

    def _open(self, path: str, mode: str = "rb", **kw: Any) -> Any:
        f = super()._open(path, mode, **kw)
        limit = os.environ.get("SHARDCKPT_TEST_KILL_AFTER")
        if "w" in mode and limit and "/shard-" in path:
            written = [0]
            real_write = f.write

            def write(data: Any) -> int:
                n = real_write(data)
                written[0] += memoryview(data).nbytes
                if written[0] >= int(limit):
                    f.flush()
                    os.kill(os.getpid(), signal.SIGKILL)
                return n

            f.write = write  # type: ignore[method-assign]
        return f


def register() -> None:
    register_implementation("countfile", CountingFS, clobber=True)
    register_implementation("killfile", KillingFS, clobber=True)
    register_implementation("recordfile", RecordingFS, clobber=True)


class SlowFS(_Prefixed):
    """Sleeps ``SHARDCKPT_TEST_WRITE_DELAY`` seconds per write; records when the last write ended
    in ``SlowFS.last_write_end`` (time.monotonic())."""

    protocol = ("slowfile",)
    prefix = "slowfile://"
    last_write_end = 0.0

    def _open(self, path: str, mode: str = "rb", **kw: Any) -> Any:
        import time

        f = super()._open(path, mode, **kw)
        delay = float(os.environ.get("SHARDCKPT_TEST_WRITE_DELAY", "0"))
        if "w" in mode and delay:
            real_write = f.write

            def write(data: Any) -> int:
                time.sleep(delay)
                n = real_write(data)
                SlowFS.last_write_end = time.monotonic()
                return n

            f.write = write  # type: ignore[method-assign]
        return f


class FailingFS(_Prefixed):
    """Writes of shard files fail with ENOSPC while ``SHARDCKPT_TEST_FAIL_WRITES`` is set."""

    protocol = ("failfile",)
    prefix = "failfile://"

    def _open(self, path: str, mode: str = "rb", **kw: Any) -> Any:
        import errno

        f = super()._open(path, mode, **kw)
        if "w" in mode and "/shard-" in path and os.environ.get("SHARDCKPT_TEST_FAIL_WRITES"):
            def write(data: Any) -> int:
                raise OSError(errno.ENOSPC, "No space left on device (injected)")

            f.write = write  # type: ignore[method-assign]
        return f


def register_all() -> None:
    register()
    register_implementation("slowfile", SlowFS, clobber=True)
    register_implementation("failfile", FailingFS, clobber=True)


class RecordingFS(_Prefixed):
    """Records every path this process opens for writing in ``RecordingFS.written``."""

    protocol = ("recordfile",)
    prefix = "recordfile://"
    written: list[str] = []

    def _open(self, path: str, mode: str = "rb", **kw: Any) -> Any:
        if "w" in mode:
            RecordingFS.written.append(path)
        return super()._open(path, mode, **kw)
