"""A seeded, structure-aware fuzzer for readers of untrusted inputs.

A case starts from a valid document (a manifest, DCP metadata records, a safetensors header, a
DeepSpeed state, a watch record) and replaces one or a few of its nodes with hostile values: NaN
and infinities, huge or negative integers, lone surrogates, long strings, deep nesting, wrong
types, path tricks. :func:`mutations` yields the cases of one seed, so a failure is reproduced by
its seed and index; :func:`expect_clean` states what every reader must do with any of them:
return, or raise one :class:`~shardckpt.errors.ShardckptError`; never another exception.
"""

from __future__ import annotations

import copy
import math
import random
import signal
from contextlib import contextmanager
from typing import Any, Callable, Iterator

#: Values a hostile author puts where a number, a name or a list goes.
HOSTILE: tuple[Any, ...] = (
    math.nan, math.inf, -math.inf, -1, 0, 2**63, 2**64 + 1, -(2**63) - 1, 10**30, 1e308,
    True, None, "", "x" * 5000, "\ud800", "a\nb", "../../etc/passwd", "/etc/passwd",
    "step-00000001\n", "%s%s%n", "<script>", [], {}, [1, 2, 3], {"a": 1}, 1.5, "1", "nan",
    "../step-00000001/x/frozen-00000-of-00001.safetensors", "frozen",
)


class Deep:
    """A list nested ``depth`` deep, kept as a marker so that copying and walking a case stay
    cheap; :func:`dumps` writes it out (parsers that recurse must refuse it, not overflow)."""

    def __init__(self, depth: int) -> None:
        self.depth = depth

    def __deepcopy__(self, memo: dict) -> "Deep":
        return self


def _paths(doc: Any) -> list[tuple]:
    """Every node's path (a tuple of keys and indices) in ``doc``, the root included."""
    out, todo = [], [((), doc)]
    while todo:
        here, node = todo.pop()
        out.append(here)
        if isinstance(node, dict):
            todo.extend((here + (k,), v) for k, v in node.items())
        elif isinstance(node, list):
            todo.extend((here + (i,), v) for i, v in enumerate(node))
    return out


def _get(doc: Any, path: tuple) -> Any:
    for k in path:
        doc = doc[k]
    return doc


def dumps(case: Any) -> str:
    """``case`` as JSON text, hostile values kept: NaN and infinities as JS literals, lone
    surrogates escaped, each :class:`Deep` written out as nested brackets."""
    import json

    deep: list[int] = []

    def default(o: Any) -> Any:
        if isinstance(o, Deep):
            deep.append(o.depth)
            return f"\x00deep{len(deep) - 1}\x00"
        raise TypeError(type(o).__name__)

    text = json.dumps(case, default=default)
    for i, d in enumerate(deep):
        text = text.replace(f'"\\u0000deep{i}\\u0000"', "[" * d + "0" + "]" * d, 1)
    return text


def materialize(case: Any) -> Any:
    """``case`` with each :class:`Deep` replaced by real nested lists (for inputs that are not
    JSON text: a ``torch.save`` payload, a Python object handed to a parser)."""
    if isinstance(case, Deep):
        v: Any = 0
        for _ in range(case.depth):
            v = [v]
        return v
    if isinstance(case, dict):
        return {k: materialize(v) for k, v in case.items()}
    if isinstance(case, list):
        return [materialize(v) for v in case]
    return case


def mutate(doc: Any, rng: random.Random, edits: int = 1) -> Any:
    """A copy of ``doc`` with ``edits`` nodes replaced, removed or duplicated."""
    out = copy.deepcopy(doc)
    for _ in range(edits):
        paths = list(_paths(out))
        path = rng.choice(paths)
        if not path:  # the root itself
            out = copy.deepcopy(rng.choice(HOSTILE + (Deep(5000),)))  # never the shared value
            continue
        parent, key = _get(out, path[:-1]), path[-1]
        op = rng.random()
        if op < 0.15 and isinstance(parent, dict):
            del parent[key]
        elif op < 0.2 and isinstance(parent, list):
            del parent[key]
        elif op < 0.25 and isinstance(parent, dict):
            parent[rng.choice(("x" * 5000, "\ud800", "../x", ""))] = copy.deepcopy(parent[key])
        elif op < 0.3:
            parent[key] = Deep(rng.choice((50, 5000)))
        elif op < 0.4 and isinstance(parent[key], int) and not isinstance(parent[key], bool):
            parent[key] = parent[key] * rng.choice((-1, 2**40, 10**4000)) + rng.choice((0, 1, -1))
        elif op < 0.5 and isinstance(parent[key], str):
            parent[key] = parent[key] + rng.choice(("\n", "\ud800", "/..", "\x00", "x" * 5000))
        else:  # a copy: a later edit of this case may change what it inserts
            parent[key] = copy.deepcopy(rng.choice(HOSTILE))
    return out


def mutate_bytes(data: bytes, rng: random.Random) -> bytes:
    """``data`` truncated, extended, or with a few bytes changed."""
    b = bytearray(data)
    op = rng.random()
    if op < 0.3 and b:
        return bytes(b[: rng.randrange(len(b))])
    if op < 0.4:
        return bytes(b) + bytes(rng.randrange(256) for _ in range(rng.randrange(1, 64)))
    for _ in range(rng.randrange(1, 8)):
        if b:
            b[rng.randrange(len(b))] = rng.randrange(256)
    return bytes(b)


def mutations(doc: Any, seed: int, n: int, max_edits: int = 3) -> Iterator[tuple[int, Any]]:
    """``n`` mutated copies of ``doc`` as ``(index, case)``, the same for the same ``seed``."""
    rng = random.Random(seed)
    for i in range(n):
        yield i, mutate(doc, rng, rng.randint(1, max_edits))


@contextmanager
def hang_guard(seconds: int, what: str) -> Iterator[None]:
    """Fail (``AssertionError``) a case that runs past ``seconds``: a hang detector, not a speed
    bound, so give it ample room (the main thread only; POSIX)."""
    def alarm(*_: Any) -> None:
        raise AssertionError(f"{what}: still running after {seconds} s (a hang?)")
    old = signal.signal(signal.SIGALRM, alarm)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def expect_clean(fn: Callable[[], Any], what: str, hang_s: int = 60) -> BaseException | None:
    """Run ``fn``: it returns, or raises a :class:`ShardckptError` (returned). Any other exception
    fails with ``what`` (the case's seed and index) in the message."""
    from shardckpt.errors import ShardckptError

    with hang_guard(hang_s, what):
        try:
            fn()
        except ShardckptError as e:
            return e
        except Exception as e:  # noqa: BLE001 - the point: nothing else may escape
            raise AssertionError(f"{what}: {type(e).__name__} escaped: {e!r:.500}") from e
    return None
