"""What a peer announces in a copy, checked before it is believed: no rank's report or request
makes another rank write outside the step it copies, or allocate for sizes the file cannot
have. Pure (no torch).

* a rank's report of the files it wrote is a list of file entries, each checked as a manifest's
  (:func:`report_entries`);
* a file's path (from such a report) is a plain relative path inside the
  step: no ``..``, ``.``, empty or absolute component (a frozen reference ``../step-N/...`` names
  another step's file, which a copy never writes);
* the spans a receiver asks for (:func:`~shardckpt.training.peer_copy.receive_into`) are at most
  one per byte of the file and :data:`MAX_SPANS` in all, each of 1 to ``piece`` bytes, together
  the whole file: what :func:`~shardckpt.storage.checked.spans` produces.
"""

from __future__ import annotations

from typing import Any

from shardckpt.errors import IntegrityError, ShardckptError
from shardckpt.format.manifest import FileEntry

#: The most spans a receiver may ask for in one file (their lengths cost 8 bytes each).
MAX_SPANS = 1 << 22


def outside_step(path: str) -> str | None:
    """Why ``path`` is not a file inside the step directory it is copied to; None if it is."""
    parts = path.split("/")
    if not path or path.startswith("/") or "\\" in path or "\x00" in path:
        return "not a relative path inside the step"
    if any(p in ("", ".", "..") for p in parts):
        return "a path that leaves the step (a '..', '.' or empty component)"
    return None


def report_entries(payload: Any, rank: int, what: str) -> list[FileEntry]:
    """The file entries of rank ``rank``'s report in ``what`` (a list of entry documents), each
    checked as a manifest's is; anything else is one :class:`IntegrityError` naming the rank."""
    if not isinstance(payload, list):
        raise IntegrityError(f"{what}: rank {rank} reports {type(payload).__name__}, not a list "
                             "of the files it wrote")
    try:
        return [FileEntry.from_doc(d, f"rank {rank}'s file {i}") for i, d in enumerate(payload)]
    except ShardckptError as e:
        raise IntegrityError(f"{what}: rank {rank} reports a file that cannot be: {e}") from e


def checked_count(count: int, size: int, dst: int, url: str) -> int:
    """The number of spans rank ``dst`` asks for in ``url`` (``size`` bytes), if it can be."""
    if not 0 <= count <= min(max(size, 0), MAX_SPANS):
        raise IntegrityError(f"peer copy: rank {dst} asks for {count} spans of {url} ({size} "
                             f"bytes; at most one per byte and {MAX_SPANS} in all); nothing sent")
    return count


def checked_spans(lengths: list[int], size: int, piece: int, dst: int, url: str) -> list[int]:
    """The span lengths rank ``dst`` asks for in ``url``, if each is 1 to ``piece`` bytes and
    together they are the file's ``size``."""
    bad = next((n for n in lengths if not 0 < n <= piece), None)
    if bad is not None or sum(lengths) != size:
        what = f"a span of {bad} bytes" if bad is not None else f"spans of {sum(lengths)} bytes in all"
        raise IntegrityError(f"peer copy: rank {dst} asks for {what} of {url} ({size} bytes, spans "
                             f"of 1 to {piece} bytes); nothing sent")
    return lengths
