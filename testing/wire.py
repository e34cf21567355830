"""Count what the runtime sends through ``torch.distributed`` (it looks the collectives up at
call time, so wrapping the module's functions sees every call)."""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist


@contextlib.contextmanager
def counting(*names: str) -> Iterator[list[int]]:
    """Bytes of the first tensor of every call of the named ``torch.distributed`` functions
    (the runtime looks them up at call time)."""
    calls: list[int] = []
    real = {name: getattr(dist, name) for name in names}

    def wrap(fn: Callable) -> Callable:
        def counted(out: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            calls.append(out.numel() * out.element_size())
            return fn(out, *args, **kwargs)
        return counted

    with wrapped(real, lambda name, fn: wrap(fn)):
        yield calls

#: torch.distributed collectives and how each counts (index of the whole buffer, factor).
COLLECTIVES = {"all_gather_single": ("all_gather", 0, 1),
               "all_gather_into_tensor": ("all_gather", 0, 1),
               "reduce_scatter_single": ("reduce_scatter", 1, 1),
               "reduce_scatter_tensor": ("reduce_scatter", 1, 1),
               "all_reduce": ("all_reduce", 0, 2),
               "all_to_all_single": ("all_to_all", 1, 1)}


@contextlib.contextmanager
def wrapped(real: dict[str, Callable], wrap: Callable[[str, Callable], Callable]) -> Iterator[None]:
    """``torch.distributed``'s functions named in ``real`` replaced by ``wrap(name, fn)`` for the
    block, then restored."""
    for name, fn in real.items():
        setattr(dist, name, wrap(name, fn))
    try:
        yield
    finally:
        for name, fn in real.items():
            setattr(dist, name, fn)


@contextlib.contextmanager
def wire() -> Iterator[dict[str, Any]]:
    """Wrap the ``torch.distributed`` collectives: ``bytes`` and ``calls`` by type, ``async``
    (calls with ``async_op=True``), and ``outputs``: every all-gather output tensor."""
    seen: dict[str, Any] = {"bytes": {}, "calls": {}, "async": 0, "outputs": [], "samples": []}
    real = {name: getattr(dist, name) for name in COLLECTIVES}

    def wrap(name: str, fn: Callable) -> Callable:
        op, index, factor = COLLECTIVES[name]

        def counted(*args: Any, **kwargs: Any) -> Any:
            t = args[index] if len(args) > index else kwargs["input" if index else "output"]
            seen["bytes"][op] = seen["bytes"].get(op, 0) + factor * t.numel() * t.element_size()
            seen["calls"][op] = seen["calls"].get(op, 0) + 1
            seen["async"] += bool(kwargs.get("async_op"))
            result = fn(*args, **kwargs)
            if op == "all_gather":
                seen["outputs"].append(args[0])
                seen["samples"].append(live_bytes(seen["outputs"]))
            return result
        return counted

    with wrapped(real, wrap):
        yield seen


def live_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of the distinct storages of ``tensors`` that hold bytes now."""
    sizes = {}
    for t in tensors:
        st = t.untyped_storage()
        if st.nbytes():
            sizes[st.data_ptr()] = st.nbytes()
    return sum(sizes.values())
