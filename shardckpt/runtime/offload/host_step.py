"""The host step of one flat group, on several threads, with the resident run's bits.

The optimizer's update is element-wise (:mod:`shardckpt.runtime.optim`): an element's new value
depends on that element alone, so running the update on contiguous slices of a group gives every
element the bits of one run over the whole group. :class:`HostStepper` cuts a group's elements
into slices of :data:`SLICE` elements and runs their updates on a pool of threads (thread i
takes slices i, i + threads, ...); torch's ops release the GIL, so the slices compute at once.
A slice stays below ATen's grain size (32768 elements), so each op runs serially in its thread
and the pool does not oversubscribe the cores with ATen's own threads; and its temporaries
(``exp_avg_sq.sqrt()``, ...) are small and cached, where those of a whole group are fresh pages
each step. With one thread the slices run in turn on the pool's one thread: on the main thread,
right after ATen's parallel ops, the same serial slices measured up to several times slower.

``fused_adamw=True`` (opt-in) runs torch's fused CPU AdamW (``torch._fused_adamw_``, one pass
per parameter, vectorized and threaded by ATen) instead of the optimizer's update. It computes
the same formula in another order: after one step the moments are the same, the masters differ
from a resident run's in the last bits, and from there the run drifts. Only the default keeps
the resident run's bits.

The work items are the optimizer's: ``(segment, step, hyper)`` with ``segment.lo``/``hi`` the
segment's range in the group's shard (a frozen dataclass) and ``hyper`` its param group's
hyper-parameters.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any
from collections.abc import Callable, Mapping

import torch

from shardckpt.errors import ConfigError, ShardckptError

__all__ = ["ADAMW_KINDS", "JOIN_TIMEOUT_S", "SLICE", "HostStepper", "fused_adamw",
           "slice_items"]

#: Elements per slice: a multiple of 64 below ATen's grain size (``at::internal::GRAIN_SIZE``).
SLICE = 32704

#: How long a group's step may run before the step gives up on it (a stuck thread).
JOIN_TIMEOUT_S = 600.0

#: The state kinds of AdamW, the only optimizer ``fused_adamw`` runs.
ADAMW_KINDS = ("exp_avg", "exp_avg_sq")

#: The update of one flat group: (master, grad, state kinds, the group's work items).
Update = Callable[[torch.Tensor, torch.Tensor, dict[str, torch.Tensor], Any], None]


def slice_items(items: Any, lo: int, hi: int) -> list[Any]:
    """The work items of elements ``[lo, hi)`` of a group, their ranges relative to ``lo``."""
    out = []
    for seg, step, hyper in items:
        a, b = max(seg.lo, lo), min(seg.hi, hi)
        if a < b:
            out.append((dataclasses.replace(seg, lo=a - lo, hi=b - lo), step, hyper))
    return out


def fused_adamw(master: torch.Tensor, grad: torch.Tensor, state: Mapping[str, torch.Tensor],
                items: Any) -> None:
    """AdamW on each segment by ``torch._fused_adamw_`` (decoupled weight decay): not the
    resident run's bits (module docstring)."""
    for seg, step, hyper in items:
        s = slice(seg.lo, seg.hi)
        beta1, beta2 = hyper["betas"]
        ams = bool(hyper["amsgrad"])
        torch._fused_adamw_(
            [master[s]], [grad[s]], [state["exp_avg"][s]], [state["exp_avg_sq"][s]],
            [state["max_exp_avg_sq"][s]] if ams else [],
            [torch.tensor(float(step), dtype=torch.float32)], lr=float(hyper["lr"]),
            beta1=beta1, beta2=beta2, weight_decay=hyper["weight_decay"], eps=hyper["eps"],
            amsgrad=ams, maximize=bool(hyper["maximize"]))


class HostStepper:
    """Runs a group's update on ``threads`` threads, slice by slice (module docstring).

    ``fused``: :func:`fused_adamw` instead of the update given (the state kinds must be
    AdamW's). A slice that raises fails the group: the other slices finish, then the first
    error is raised; a group not done within ``timeout_s`` is one :class:`ShardckptError`.
    """

    def __init__(self, threads: int, fused: bool = False, kinds: tuple[str, ...] = ()) -> None:
        if fused and kinds[:2] != ADAMW_KINDS:
            raise ConfigError(f"OffloadConfig.fused_adamw is for AdamW; this optimizer's state "
                              f"kinds are {kinds}; set fused_adamw=False")
        self.threads = max(1, int(threads))
        self.fused = fused
        self.slice = SLICE
        self.timeout_s = JOIN_TIMEOUT_S
        self._pool: ThreadPoolExecutor | None = None
        if not fused:  # a pool of one thread too: not the main thread (module docstring)
            self._pool = ThreadPoolExecutor(self.threads,
                                            thread_name_prefix="shardckpt-offload-step")

    def run(self, update: Update, master: torch.Tensor, grad: torch.Tensor,
            state: dict[str, torch.Tensor], items: Any, name: str = "") -> None:
        """``update`` (or :func:`fused_adamw`) on the group's ``master``, ``grad`` and ``state``
        (host tensors of one length), with the resident run's bits unless ``fused``."""
        if self.fused:
            fused_adamw(master, grad, state, items)
            return
        n, size = master.numel(), self.slice
        bounds = [(lo, min(lo + size, n)) for lo in range(0, n, size)]
        if self._pool is None:
            raise ShardckptError("the offloaded step's threads were shut down (engine closed)")
        futures = [self._pool.submit(_slices_update, update, master, grad, state, items,
                                     bounds[i::self.threads])
                   for i in range(min(self.threads, len(bounds)))]
        self._join(futures, name)

    def _join(self, futures: list[Future[None]], name: str) -> None:
        deadline = time.monotonic() + self.timeout_s
        errors: list[BaseException] = []
        for f in futures:
            try:
                f.result(timeout=max(0.0, deadline - time.monotonic()))
            except concurrent.futures.TimeoutError:
                for g in futures:
                    g.cancel()
                raise ShardckptError(
                    f"the host step of flat group {name} did not finish within "
                    f"{self.timeout_s:.0f} s (a thread of the offloaded step is stuck)") from None
            except BaseException as e:  # noqa: BLE001 - every slice ends, then the first raises
                errors.append(e)
        if errors:
            raise errors[0]

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None


def _slices_update(update: Update, master: torch.Tensor, grad: torch.Tensor,
                   state: Mapping[str, torch.Tensor], items: Any,
                   bounds: list[tuple[int, int]]) -> None:
    """One thread's share of a group: every ``threads``-th slice."""
    for lo, hi in bounds:
        sub = slice_items(items, lo, hi)
        if sub:
            update(master[lo:hi], grad[lo:hi], {k: v[lo:hi] for k, v in state.items()}, sub)
