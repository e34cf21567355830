"""``memory://``: fsspec's in-process store, with conditional writes that are atomic.

The store is this process's (fsspec's ``MemoryFileSystem`` keeps one for every instance), so a
lock of this process makes ``create_only`` and ``replace_if`` a check and a write that nothing
else in the store comes between.
"""

from __future__ import annotations

import threading
from typing import ClassVar
from collections.abc import Collection

from shardckpt.storage.backends import Backend, changed_error, conflict_error
from shardckpt.storage.options import fsspec_option_names

_LOCK = threading.Lock()


class MemoryBackend(Backend):
    """fsspec's ``memory://`` filesystem."""

    schemes: ClassVar[tuple[str, ...]] = ("memory",)

    @classmethod
    def known_options(cls) -> Collection[str]:
        from fsspec.implementations.memory import MemoryFileSystem

        return fsspec_option_names(MemoryFileSystem)

    def create_only(self, path: str, url: str, data: bytes) -> None:
        with _LOCK:
            if self.exists(path, url):
                raise conflict_error(url)
            self.put(path, url, data)

    def replace_if(self, path: str, url: str, data: bytes, expected: bytes) -> None:
        with _LOCK:
            if not self.holds(path, url, expected):
                raise changed_error(url)
            self.put(path, url, data)
