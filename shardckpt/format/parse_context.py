"""Strict parsing of JSON documents: typed field checks that name the field, and every fault at once.

A :class:`ParseContext` checks one document (a manifest, a shard's header). Each check returns
the checked value or raises a :class:`Problem` naming the field (``"files[3].size"``) and what is
wrong. A parser catches the problems of independent parts with :meth:`ParseContext.attempt` or
:meth:`ParseContext.add`, goes on with the next part, and at the end :meth:`ParseContext.finish`
raises one :class:`~shardckpt.errors.ManifestError` that names the document and every problem.
A part whose fault makes later checks meaningless (not JSON, a newer version) raises at once.
Pure; no I/O.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any, TypeVar
from collections.abc import Callable

from shardckpt.errors import ManifestError
from shardckpt.format.dtypes import DTYPES
from shardckpt.format.integrity import MAX_NAME, MAX_SHORT

#: Largest size, offset or element count accepted anywhere (2**53: exact in JSON doubles too).
MAX_INT = 1 << 53
#: Offenders listed by name in one error; the rest are counted.
MAX_LISTED = 10

T = TypeVar("T")


def listed(items: list[str]) -> str:
    """The first :data:`MAX_LISTED` items joined by ``"; "``, and how many more there are."""
    more = len(items) - MAX_LISTED
    return "; ".join(items[:MAX_LISTED]) + (f"; and {more} more" if more > 0 else "")


class Problem(ManifestError):
    """One fault of a document: ``problem`` is ``"<where>: <what>"``, the message adds the source."""

    def __init__(self, source: str, where: str, what: str) -> None:
        super().__init__(f"{source}: {where}: {what}")
        self.problem = f"{where}: {what}"


class ParseContext:
    """Checks for one document named ``source``, and the problems found so far."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.problems: list[str] = []

    # ------------------------------------------------------------------ collecting problems

    def fail(self, where: str, what: str) -> Problem:
        return Problem(self.source, where, what)

    def note(self, where: str, what: str) -> None:
        """Record a problem and go on."""
        self.problems.append(f"{where}: {what}")

    def add(self, p: Problem) -> None:
        """Record a raised problem and go on."""
        self.problems.append(p.problem)

    def attempt(self, fn: Callable[..., T], *args: Any) -> T | None:
        """``fn(*args)``, or None after recording the problem it raised."""
        try:
            return fn(*args)
        except Problem as p:
            self.problems.append(p.problem)
            return None

    def mark(self) -> int:
        """A position to ask :meth:`clean_since` about."""
        return len(self.problems)

    def clean_since(self, mark: int) -> bool:
        """Whether no problem was recorded after ``mark``."""
        return len(self.problems) == mark

    def finish(self) -> None:
        """Raise one :class:`ManifestError` naming the source and every recorded problem."""
        ps = self.problems
        if len(ps) == 1:
            raise ManifestError(f"{self.source}: {ps[0]}")
        if ps:
            more = len(ps) - MAX_LISTED
            raise ManifestError(f"{self.source}: {len(ps)} problems:\n  " + "\n  ".join(ps[:MAX_LISTED])
                                + (f"\n  and {more} more" if more > 0 else ""))

    # ---------------------------------------------------------------------- typed checks

    def obj(self, v: Any, where: str) -> dict[str, Any]:
        if not isinstance(v, dict):
            raise self.fail(where, f"expected an object, found {type(v).__name__}")
        return v

    def lst(self, v: Any, where: str) -> list[Any]:
        if not isinstance(v, list):
            raise self.fail(where, f"expected a list, found {type(v).__name__}")
        return v

    def str_(self, v: Any, where: str, limit: int = MAX_NAME) -> str:
        if not isinstance(v, str):
            raise self.fail(where, f"expected a string, found {type(v).__name__}")
        if len(v) > limit:
            raise self.fail(where, f"a string of {len(v)} characters ({v[:40]!r}...); at most "
                            f"{limit} are allowed")
        return v

    def bool_(self, v: Any, where: str) -> bool:
        if not isinstance(v, bool):
            raise self.fail(where, f"expected true or false, found {v!r}")
        return v

    def int_(self, v: Any, where: str, lo: int = 0, hi: int = MAX_INT) -> int:
        if not isinstance(v, int) or isinstance(v, bool):
            raise self.fail(where, f"expected an integer, found {type(v).__name__}")
        if not lo <= v <= hi:
            raise self.fail(where, f"{v} is outside [{lo}, {hi}]")
        return v

    def key(self, d: dict[str, Any], k: str, where: str) -> Any:
        if k not in d:
            raise self.fail(where, f"missing field {k!r}")
        return d[k]

    def dtype(self, v: Any, where: str) -> str:
        s = self.str_(v, where, MAX_SHORT)
        if s not in DTYPES:
            raise self.fail(where, f"unknown dtype {s!r}")
        return s

    def shape(self, v: Any, where: str) -> tuple[int, ...]:
        dims = self.lst(v, where)
        if len(dims) > 16:
            raise self.fail(where, f"{len(dims)} dimensions; at most 16 are allowed")
        out = tuple(self.int_(d, f"{where}[{i}]") for i, d in enumerate(dims))
        n = 1
        for d in out:
            n *= d
            if n > MAX_INT:
                raise self.fail(where, f"shape {list(out)} has more than 2**53 elements")
        return out

    def hex32(self, v: Any, where: str) -> int:
        s = self.str_(v, where)
        if len(s) != 8 or not all(c in "0123456789abcdef" for c in s):
            raise self.fail(where, f"expected 8 lowercase hex digits, found {s[:20]!r}")
        return int(s, 16)


# ---------------------------------------------------------------------- strict JSON hooks


_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.S)
_BRACKET = re.compile(r"[\[\]{}]")


def json_depth(text: str) -> int:
    """How deep the arrays and objects of JSON ``text`` nest (brackets inside strings aside),
    counted without parsing: a reader refuses a document nested past its schema before
    ``json.loads`` could recurse into it."""
    depth = deepest = 0
    for ch in _BRACKET.findall(_JSON_STRING.sub('""', text)):
        depth += 1 if ch in "[{" else -1
        deepest = max(deepest, depth)
    return deepest


def json_object(data: bytes, max_bytes: int, max_depth: int, what: str) -> dict[str, Any]:
    """A small JSON object read strictly: at most ``max_bytes``, UTF-8, nested at most
    ``max_depth`` deep (counted before parsing), no duplicate keys, no ``NaN`` or infinities.
    Raises :class:`ValueError` with one line naming what is wrong (``what``: "a lease", for
    the messages); the caller wraps it in its own error."""
    if len(data) > max_bytes:
        raise ValueError(f"{len(data)} bytes, more than the {max_bytes} {what} may have")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"not UTF-8 text (byte {e.start})") from None
    deepest = json_depth(text)
    if deepest > max_depth:
        raise ValueError(f"nested {deepest} deep, more than the {max_depth} {what} may be")
    try:
        doc = json.loads(text, parse_constant=reject_constant, object_pairs_hook=no_duplicate_keys)
    except RecursionError:  # unreachable after the depth check
        raise ValueError("nested too deep") from None
    except ValueError as e:
        raise ValueError(f"not valid JSON: {str(e)[:200]}") from None
    if not isinstance(doc, dict):
        raise ValueError(f"a JSON {type(doc).__name__}, not an object")
    return doc


def no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``json.loads`` hook that refuses duplicate keys (the stdlib keeps the last one)."""
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"duplicate key {k!r}")
        out[k] = v
    return out


def reject_constant(name: str) -> Any:
    """``json.loads`` hook that refuses ``NaN``, ``Infinity`` and ``-Infinity``."""
    raise ValueError(f"{name} is not valid JSON")


def finite_float(text: str) -> float:
    """``json.loads`` hook that refuses numbers out of a double's range."""
    # ``1e400`` parses to inf: as hostile as ``Infinity``, and could not be encoded back
    v = float(text)
    if not math.isfinite(v):
        raise ValueError(f"{text} is out of range for a JSON number")
    return v
