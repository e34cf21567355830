"""A DCP load planner for states whose ``bytes`` values their consumer unpickles (torchtitan's
data loader): each such value must be a pickle of plain data
(:func:`~shardckpt.interop.plain_pickle.plain_pickle_problem`), or the load is refused before any
state sees it."""

from __future__ import annotations

import io
from typing import Any

import torch
from torch.distributed.checkpoint.planner import ReadItem

from shardckpt.errors import UnsafePickleError
from shardckpt.interop.dcp.storage import WeightsOnlyLoadPlanner
from shardckpt.interop.plain_pickle import plain_pickle_problem

__all__ = ["PlainBytesLoadPlanner"]


def _bytes_in(obj: Any) -> list[bytes]:
    """Every ``bytes`` / ``bytearray`` inside ``obj`` (dicts, lists, tuples, sets), iteratively."""
    out: list[bytes] = []
    todo = [obj]
    while todo:
        v = todo.pop()
        if isinstance(v, (bytes, bytearray)):
            out.append(bytes(v))
        elif isinstance(v, dict):
            todo.extend(v.keys())
            todo.extend(v.values())
        elif isinstance(v, (list, tuple, set, frozenset)):
            todo.extend(v)
    return out


class PlainBytesLoadPlanner(WeightsOnlyLoadPlanner):
    """:class:`~shardckpt.interop.dcp.storage.WeightsOnlyLoadPlanner` that also refuses, with
    :class:`~shardckpt.errors.UnsafePickleError` naming ``source`` and the value, any ``bytes``
    inside a value that is not a pickle of plain data: such bytes are there to be unpickled by
    whoever loads them (``consumer``, for the message)."""

    def __init__(self, source: str, consumer: str, hint: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.source, self.consumer, self.hint = source, consumer, hint

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        from torch.distributed.checkpoint._traverse import set_element

        obj = torch.load(value, weights_only=True)
        fqn = read_item.dest_index.fqn
        for data in _bytes_in(obj):
            problem = plain_pickle_problem(data)
            if problem is not None:
                raise UnsafePickleError(
                    f"{self.source}: value {fqn!r} holds {len(data)} bytes that {self.consumer} "
                    f"passes to pickle.loads, and they {problem}: refused, nothing of them was "
                    f"run. {self.hint}", key=fqn, file=self.source)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj
