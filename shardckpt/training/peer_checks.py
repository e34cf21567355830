"""What a peer announces in a copy, checked before it is believed: no rank's report or request
makes another rank write outside the step it copies, or allocate for sizes the file cannot
have. Pure.

* a file's path (from a rank's report of the files it wrote) is a plain relative path inside the
  step: no ``..``, ``.``, empty or absolute component (a frozen reference ``../step-N/...`` names
  another step's file, which a copy never writes);
* the spans a receiver asks for (:func:`~shardckpt.training.peer_copy.receive_into`) are at most
  one per byte of the file and :data:`MAX_SPANS` in all, each of 1 to ``piece`` bytes, together
  the whole file: what :func:`~shardckpt.storage.checked.spans` produces.
"""

from __future__ import annotations

from shardckpt.errors import IntegrityError

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
