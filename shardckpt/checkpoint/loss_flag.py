"""Agreements that every surviving rank abandons promptly when one rank dies.

gloo fails an operation with a dead peer only on the ranks that talk to that peer directly: a
rank whose ring all-gather waits on a live neighbour that has itself failed and left waits until
the process group's timeout. So a watched agreement (:func:`shardckpt.checkpoint.collective.agree`
with a ``flag``; a :class:`~shardckpt.checkpoint.job.Job` that carries one) runs in a worker
thread (:func:`watch`), and the calling thread watches a flag in the group's rendezvous store:
the first rank whose agreement loses contact with another rank raises the flag, and every other
rank, wherever its worker is blocked, raises a :class:`~shardckpt.errors.CollectiveError` ("lost
contact") as soon as it sees the flag (or sees that the store itself is gone with the rank
hosting it). The worker is left behind (a daemon thread; gloo ends its wait at the group's
timeout): after a lost rank the group is unusable, and the job is restarted.

The flag's key names the operation (the save id for a peer copy), so a flag raised in one save
never stops another.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, TypeVar
from collections.abc import Callable

from shardckpt.errors import CollectiveError

log = logging.getLogger(__name__)

T = TypeVar("T")

#: Seconds between two looks at the flag while the worker runs.
POLL_S = 0.05


class LossFlag:
    """One flag in a process group's store: "a rank was lost during ``key``"."""

    def __init__(self, store: Any, key: str, rank: int) -> None:
        self.store, self.key, self.rank = store, key, rank

    @classmethod
    def for_group(cls, group: Any, key: str) -> LossFlag | None:
        """The flag ``key`` in ``group``'s store (the default group's where ``group`` is None);
        None without torch.distributed, or where this torch does not expose the store."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return None
        from torch.distributed import distributed_c10d as c10d

        try:
            store = (c10d._get_default_store() if group is None
                     else c10d._get_process_group_store(group))
        except (AttributeError, KeyError, RuntimeError, ValueError) as e:
            log.debug("no store to signal a lost rank through (%s); agreements are not watched", e)
            return None
        return cls(store, f"shardckpt/lost/{key}", dist.get_rank())

    def raise_flag(self, why: str) -> None:
        try:
            self.store.set(self.key, f"rank {self.rank} lost contact with a rank: {why}")
        except Exception as e:  # noqa: BLE001 - the store's host may be the rank lost
            log.debug("could not raise %s: %s", self.key, e)

    def seen(self) -> str | None:
        """What the rank that raised the flag saw, or None while it is down."""
        try:
            if not self.store.check([self.key]):
                return None
            return bytes(self.store.get(self.key)).decode(errors="replace")
        except Exception as e:  # noqa: BLE001 - the store went away with the rank hosting it
            return f"the rendezvous store is unreachable ({type(e).__name__}: {e})"


def lost_contact(e: BaseException) -> bool:
    """Whether ``e`` (from :func:`~shardckpt.checkpoint.collective.agree`) is a lost rank rather
    than failures every rank reported."""
    return isinstance(e, CollectiveError) and not e.failures


def left_behind(after_loss: Callable[[], str] | None) -> str:
    """``"; <what a loss left behind>"`` as ``after_loss()`` says it (asked now), or ""."""
    if after_loss is None:
        return ""
    try:
        return f"; {after_loss()}"
    except Exception as probe:  # noqa: BLE001 - the lost contact is the error to report
        return f"; could not tell what was left behind ({type(probe).__name__}: {probe})"


def watch(work: Callable[[], T], what: str, flag: LossFlag,
          after_loss: Callable[[], str] | None = None) -> T:
    """``work()`` (an agreement), abandoned as soon as any rank raises ``flag`` (see the module
    docstring); a lost contact ``work`` meets itself raises the flag for the others."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["out"] = work()
        except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
            box["err"] = e

    worker = threading.Thread(target=run, name=f"shardckpt-agree-{flag.key}", daemon=True)
    worker.start()
    while True:
        worker.join(POLL_S)
        if not worker.is_alive():
            break
        seen = flag.seen()
        if seen is not None:
            raise CollectiveError(f"{what}: lost contact with another rank ({seen})"
                                  f"{left_behind(after_loss)}")
    err = box.get("err")
    if err is not None:
        if lost_contact(err):
            cause = err.__cause__ or err
            flag.raise_flag(f"{type(cause).__name__}: {str(cause).splitlines()[0][:300] if str(cause) else ''}")
        raise err
    out: T = box["out"]
    return out
