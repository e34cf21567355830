"""Small torch.distributed helpers for checkpointing: bytes over collectives (no object serialization) and
"every rank raises the same error".

``torch.distributed``'s ``*_object`` collectives serialize Python objects; these send raw bytes in uint8 tensors.
Without an initialized process group everything degrades to the single-process case.
"""

from __future__ import annotations

import json
import traceback
from typing import Any, TypeVar
from collections.abc import Callable

from shardckpt import errors
from shardckpt.checkpoint.loss_flag import LossFlag, left_behind, watch
from shardckpt.checkpoint.job_secret import AGREEMENTS, SECRET_VARIABLE, job_key, open_reports, sign_report
from shardckpt.errors import CollectiveError, ShardckptError

T = TypeVar("T")

#: The most bytes one rank's message may announce (a manifest is at most 512 MiB), and the most
#: an all-gather may allocate in all: a length past them, or negative, is refused on every rank
#: before anything is allocated for it.
MAX_MESSAGE_BYTES = 1 << 30
MAX_GATHER_BYTES = 4 << 30


def _checked_lengths(lengths: list[int], world: int, what: str) -> None:
    bad = [(r, n) for r, n in enumerate(lengths) if not 0 <= n <= MAX_MESSAGE_BYTES]
    if bad or max(lengths, default=0) * world > MAX_GATHER_BYTES:
        r, n = bad[0] if bad else max(enumerate(lengths), key=lambda x: x[1])
        raise CollectiveError(f"{what}: rank {r} announces a message of {n} bytes (at most "
                              f"{MAX_MESSAGE_BYTES}, {MAX_GATHER_BYTES} for all ranks together); "
                              "refused before allocating it", {r: f"announced {n} bytes"})


def _dist() -> Any:
    import torch.distributed as dist

    return dist


def is_distributed() -> bool:
    dist = _dist()
    return dist.is_available() and dist.is_initialized()


def rank_and_world(group: Any = None) -> tuple[int, int]:
    if not is_distributed():
        return 0, 1
    dist = _dist()
    return dist.get_rank(group), dist.get_world_size(group)


def _device(group: Any) -> Any:
    import torch

    dist = _dist()
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_gather_bytes(data: bytes, group: Any = None) -> list[bytes]:
    """Every rank's ``data``, in group rank order, on every rank."""
    if not is_distributed():
        return [data]
    import torch

    dist = _dist()
    dev = _device(group)
    world = dist.get_world_size(group)
    n = torch.tensor([len(data)], dtype=torch.int64, device=dev)
    sizes = [torch.zeros(1, dtype=torch.int64, device=dev) for _ in range(world)]
    dist.all_gather(sizes, n, group=group)
    lengths = [int(s.item()) for s in sizes]
    _checked_lengths(lengths, world, "all_gather_bytes")
    longest = max(lengths) or 1
    buf = torch.zeros(longest, dtype=torch.uint8, device=dev)
    if data:
        buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(dev)
    out = [torch.empty(longest, dtype=torch.uint8, device=dev) for _ in range(world)]
    dist.all_gather(out, buf, group=group)
    return [bytes(o[:k].cpu().numpy().tobytes()) for o, k in zip(out, lengths, strict=True)]


def broadcast_bytes(data: bytes | None, src: int = 0, group: Any = None) -> bytes:
    """``data`` from global rank ``src`` on every rank."""
    if not is_distributed():
        assert data is not None
        return data
    import torch

    dist = _dist()
    dev = _device(group)
    me = dist.get_rank()
    n = torch.tensor([len(data) if me == src and data is not None else 0], dtype=torch.int64, device=dev)
    dist.broadcast(n, src=src, group=group)
    lengths = [0] * src + [int(n.item())]
    _checked_lengths(lengths, 1, "broadcast_bytes")
    buf = torch.zeros(lengths[src], dtype=torch.uint8, device=dev)
    if me == src and data:
        buf[:] = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(dev)
    dist.broadcast(buf, src=src, group=group)
    return bytes(buf.cpu().numpy().tobytes())


def broadcast_from(data: bytes | None, src: int, what: str, group: Any = None) -> bytes:
    """:func:`broadcast_bytes` of ``data`` from ``src`` after an agreement that said it is
    there: one copy to each rank, where an all-gather pads every rank's report to the longest.
    A lost rank is a :class:`CollectiveError` naming ``what``, as in :func:`agree`. The bytes
    are not signed: a caller under a job secret checks them against a digest that ``src``
    reported in the agreement."""
    try:
        return broadcast_bytes(data, src, group)
    except CollectiveError:
        raise
    except Exception as e:  # noqa: BLE001 - a peer died or timed out
        raise _lost(what, e, None) from e


def _lost(what: str, e: BaseException, after_loss: Callable[[], str] | None) -> CollectiveError:
    """The error of a collective that lost contact with another rank (``e``: what the
    exchange raised), naming ``what`` and what ``after_loss()`` says it left behind."""
    said = str(e).splitlines()[0] if str(e) else ""
    return CollectiveError(f"{what}: lost contact with another rank ({type(e).__name__}: {said})"
                           f"{left_behind(after_loss)}")


def agree(fn: Callable[[], T], what: str, group: Any = None,
          after_loss: Callable[[], str] | None = None,
          flag: LossFlag | None = None) -> tuple[T | None, list[dict[str, Any]]]:
    """Run ``fn`` on every rank, then exchange outcomes; raise the same error everywhere on failure.

    Returns this rank's result and every rank's report (``{"ok": bool, "payload": ...}``, where
    the payload is ``fn``'s result if it is JSON-serializable, else None). A rank that died makes
    the exchange itself fail (gloo/NCCL raise when the peer goes away or the group timeout
    passes); that too becomes a :class:`CollectiveError` naming ``what``, and ``after_loss()``,
    if given, says what state that leaves behind (it is asked then, not assumed). With ``flag``
    (:class:`~shardckpt.checkpoint.loss_flag.LossFlag`), the agreement is watched: every
    surviving rank abandons it as soon as any rank reports another rank lost
    (:func:`~shardckpt.checkpoint.loss_flag.watch`).
    """
    if flag is not None:
        return watch(lambda: _agree(fn, what, group, after_loss), what, flag, after_loss)
    return _agree(fn, what, group, after_loss)


def _agree(fn: Callable[[], T], what: str, group: Any,
           after_loss: Callable[[], str] | None) -> tuple[T | None, list[dict[str, Any]]]:
    """:func:`agree`, unwatched."""
    result: T | None = None
    report: dict[str, Any]
    local: Exception | None
    try:
        result = fn()
        payload = result if isinstance(result, (dict, list, str, int, float, type(None))) else None
        report = {"ok": True, "payload": payload}
    except Exception as e:  # noqa: BLE001 - re-raised below on every rank
        report = {"ok": False, "error": f"{type(e).__name__}: {e}", "message": str(e),
                  "kinds": [c.__name__ for c in type(e).__mro__],
                  "trace": traceback.format_exc(limit=8)}
        local = e
    else:
        local = None
    try:
        reports = [json.loads(r) for r in _exchange(json.dumps(report).encode(), group)]
    except CollectiveError:
        raise
    except Exception as e:  # noqa: BLE001 - a peer died or timed out
        raise _lost(what, e, after_loss) from (local or e)
    failures = {r: rep["error"] for r, rep in enumerate(reports) if not rep["ok"]}
    if failures:
        first = min(failures)
        err = CollectiveError(
            f"{what} failed on rank(s) {sorted(failures)}; rank {first}: {failures[first]}",
            failures)
        # class names of each failure and its bases, so every rank can tell kinds apart alike
        err.kinds = {r: set(rep.get("kinds", ())) for r, rep in enumerate(reports) if not rep["ok"]}
        err.kind_order = {r: list(rep.get("kinds", ())) for r, rep in enumerate(reports) if not rep["ok"]}
        err.messages = {r: rep.get("message", rep["error"]) for r, rep in enumerate(reports)
                        if not rep["ok"]}
        raise err from local
    return result, reports


def _exchange(report: bytes, group: Any) -> list[bytes]:
    """Every rank's ``report``: signed and checked where the job has a secret (one error on
    every rank naming the ranks whose report fails; :mod:`.job_secret`)."""
    key = job_key()
    if key is None:
        return all_gather_bytes(report, group)
    number = AGREEMENTS.next(group)
    signed = all_gather_bytes(sign_report(key, rank_and_world(group)[0], number, report), group)
    reports, bad = open_reports(key, number, signed)
    if bad:
        raise CollectiveError(f"the report(s) of rank(s) {bad} in an agreement fail their "
                              f"authentication ({SECRET_VARIABLE} differs, or someone else speaks "
                              "for those ranks)", {r: "report fails its authentication" for r in bad})
    return reports


def failed_with(err: CollectiveError, kind: type[BaseException]) -> list[int]:
    """Ranks whose failure in ``err`` (raised by :func:`agree`) was a ``kind`` (or a subclass)."""
    kinds = getattr(err, "kinds", {})
    return sorted(r for r, names in kinds.items() if kind.__name__ in names)


def same_error(err: CollectiveError, what: str) -> ShardckptError:
    """The error of the lowest failing rank in ``err`` (raised by :func:`agree`), rebuilt on this
    rank with the most derived class of its lineage that :mod:`shardckpt.errors` defines, and its
    message (prefixed with the rank when ranks failed differently), so that every process raises,
    and a command exits, alike: a ``NotFoundError`` stays one, a usage error stays a
    ``ConfigError``. Lost contact, or a failure outside shardckpt's classes, stays ``err``."""
    failures = err.failures
    if not failures:
        return err
    first = min(failures)
    kind, _, said = failures[first].partition(": ")
    message = getattr(err, "messages", {}).get(first, said)
    same = len(set(failures.values())) == 1
    text = message if same else f"{what}: rank {first}: {message}"
    for name in getattr(err, "kind_order", {}).get(first, [kind]):
        cls = getattr(errors, name, None)
        if not (isinstance(cls, type) and issubclass(cls, ShardckptError)):
            continue
        if cls is CollectiveError or cls is ShardckptError:
            break
        try:
            return cls(text)
        except TypeError:  # a class with a richer constructor: try its base
            continue
    return CollectiveError(text if kind in text else f"{text} ({kind})", failures)
