"""DeepSpeed's own objects in the files an export writes, pickled as DeepSpeed pickles them
(naming DeepSpeed's classes without importing DeepSpeed): the one place shardckpt writes such a
pickle (``docs/FORMAT.md`` section 14.2). Used by :mod:`shardckpt.interop.deepspeed.export`."""

from __future__ import annotations

import io
import pickle
import types
from typing import Any

__all__ = ["FragmentAddress", "LossScaler", "ZeroStageEnum", "make", "saved", "zero_stage"]


class _DsObject:
    """An instance of a DeepSpeed class, pickled as ``GLOBAL module name`` + ``NEWOBJ`` + its
    ``__dict__`` (or ``REDUCE`` of ``args`` when it sets them), as Python pickles DeepSpeed's own."""

    _args: tuple[Any, ...] | None = None

    def __reduce_ex__(self, protocol: Any) -> Any:
        if self._args is not None:
            return (type(self), self._args)
        return super().__reduce_ex__(protocol)


def _ds_class(module: str, name: str) -> type[_DsObject]:
    return type(name, (_DsObject,), {"__module__": module, "__qualname__": name,
                                      "_ds_global": f"{module}\n{name}\n"})


LossScaler = _ds_class("deepspeed.runtime.fp16.loss_scaler", "LossScaler")
ZeroStageEnum = _ds_class("deepspeed.runtime.zero.config", "ZeroStageEnum")
FragmentAddress = _ds_class("deepspeed.utils.tensor_fragment", "fragment_address")


def make(cls: type[_DsObject], **state: Any) -> Any:
    """An instance of DeepSpeed class ``cls`` holding ``state``."""
    obj = cls.__new__(cls)
    obj.__dict__.update(state)
    return obj


def zero_stage(stage: int) -> Any:
    """DeepSpeed's ``ZeroStageEnum`` of ``stage``."""
    obj = ZeroStageEnum.__new__(ZeroStageEnum)
    obj._args = (stage,)
    return obj


class _Pickler(pickle._Pickler):
    """Python's pickler, naming the stand-ins above by DeepSpeed's module and class (without
    importing DeepSpeed, which the standard pickler would do to check the name)."""

    def save_global(self, obj: Any, name: Any = None) -> None:
        ds = getattr(obj, "_ds_global", None) if isinstance(obj, type) else None
        if ds is None:
            super().save_global(obj, name)  # type: ignore[misc]
            return
        self.write(pickle.GLOBAL + ds.encode("utf-8"))  # type: ignore[attr-defined]
        self.memoize(obj)  # type: ignore[attr-defined]


_PICKLE_MODULE = types.SimpleNamespace(__name__=__name__, Pickler=_Pickler)


def saved(obj: Any) -> bytes:
    """``torch.save`` bytes of ``obj`` (plain containers, tensors and the objects above)."""
    import torch

    buf = io.BytesIO()
    torch.save(obj, buf, pickle_module=_PICKLE_MODULE)
    return buf.getvalue()
