"""Bytes that a consumer will hand to ``pickle.loads``, admitted only when they hold plain data.

Some state values are pickles in a checkpoint's values: torchtitan's ``ParallelAwareDataloader``
stores ``pickle.dumps(state_dict)`` under ``dp_rank_<r>`` and calls ``pickle.loads`` on what it
gets back. ``torch.load(weights_only=True)`` admits the ``bytes``, so checking the value stops
nothing: the code runs in the consumer. :func:`plain_pickle_problem` reads such bytes with an
unpickler that resolves no global at all (``find_class`` refuses every name, persistent ids are
refused): a pickle of dicts, lists, tuples, sets, strings, bytes, numbers, booleans and None
reads through; one that names any class or function (``posix.system``, ``builtins.eval``, but
also ``collections.OrderedDict`` or a tensor) does not. Whatever reads through here unpickles to
the same plain values in ``pickle.loads``: no global is ever looked up, so no code can run.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

__all__ = ["plain_pickle_problem"]


class _NoGlobals(pickle.Unpickler):
    """An unpickler that looks no global up: the first one named ends the read."""

    def __init__(self, file: Any, named: list[str]) -> None:
        super().__init__(file, fix_imports=False, encoding="latin1")
        self.named = named

    def find_class(self, module: str, name: str) -> Any:
        self.named.append(f"{module}.{name}")
        raise pickle.UnpicklingError(f"global {module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        self.named.append("a persistent id")
        raise pickle.UnpicklingError("persistent id")


def plain_pickle_problem(data: bytes) -> str | None:
    """None if ``data`` is a whole pickle of plain data (module doc); else what is wrong, as the
    end of a sentence (``"names the global posix.system"``)."""
    named: list[str] = []
    try:
        _NoGlobals(io.BytesIO(bytes(data)), named).load()
    except RecursionError:
        return "nest deeper than Python unpickles"
    except Exception as e:  # noqa: BLE001 - whatever does not read through is refused
        if named:
            return f"name {named[0]}" if named[0] == "a persistent id" else f"name the global {named[0]}"
        return f"are not a whole pickle ({type(e).__name__}: {e})"
    return None
