"""DCP's metadata classes as plain records: a ``.metadata`` pickle decoded without importing
torch or ``torch.distributed.checkpoint`` (whose imports are most of the start-up of an import).

:class:`shardckpt.interop.dcp.source.MetadataUnpickler` maps exactly the globals it allows (DCP's
metadata dataclasses, the ``FileSystemWriter``'s ``_StorageInfo``, ``_MEM_FORMAT_ENCODING``,
``torch.Size``, dtypes, ``torch.serialization._get_layout``) to these records (a tuple, the
dtype's name) when asked for records; each record takes the state pickle gives a dataclass (its
``__dict__``, or ``TensorProperties``' tuple) and nothing is called but ``__setstate__``. Defaults
of fields an older writer did not record are class attributes, as they are on DCP's classes.
:class:`MetadataIndex` compares and hashes as DCP's does: by ``fqn`` and ``offset``.
"""

from __future__ import annotations

from typing import Any, ClassVar
from collections.abc import Callable

__all__ = ["RECORDS", "Metadata", "MetadataIndex", "TensorStorageMetadata",
           "BytesStorageMetadata", "StorageInfo"]

_MD = "torch.distributed.checkpoint.metadata"


class Record:
    """Fields as attributes, set from a pickled dataclass's state."""

    FIELDS: ClassVar[tuple[str, ...]] = ()  # the order of a tuple state

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, dict) and all(isinstance(k, str) and k.isidentifier()
                                           and not k.startswith("_") for k in state):
            self.__dict__.update(state)
        elif isinstance(state, tuple) and self.FIELDS and len(state) <= len(self.FIELDS):
            # a tuple shorter than FIELDS sets the leading fields
            self.__dict__.update(zip(self.FIELDS, state, strict=False))
        else:
            raise TypeError(f"{type(self).__name__}: unexpected pickled state "
                            f"{type(state).__name__}")


class Metadata(Record):
    planner_data: Any = None
    storage_data: Any = None
    storage_meta: Any = None
    version: Any = None


class StorageMeta(Record):
    checkpoint_id: Any = None
    save_id: Any = None
    load_id: Any = None
    modules: Any = ()


class TensorProperties(Record):
    FIELDS = ("dtype", "layout", "requires_grad", "memory_format", "pin_memory")


class TensorStorageMetadata(Record):
    pass


class BytesStorageMetadata(Record):
    pass


class ChunkStorageMetadata(Record):
    pass


class StorageInfo(Record):
    """``torch.distributed.checkpoint.filesystem._StorageInfo``: where one item is stored."""

    transform_descriptors: Any = None


class MetadataIndex(Record):
    """A storage record's key: equal and hashed by ``fqn`` and ``offset`` (not ``index``)."""

    offset: Any = None
    index: Any = None

    def __init__(self, fqn: str = "", offset: Any = None) -> None:
        self.fqn, self.offset = fqn, None if offset is None else tuple(offset)

    def _key(self) -> tuple[Any, Any]:
        return self.fqn, None if self.offset is None else tuple(self.offset)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, MetadataIndex) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())


def dtype_name(name: str) -> str:
    """A torch dtype global (``torch.<name>``), as the string ``str(dtype)`` gives."""
    return f"torch.{name}"


def _size(*args: Any) -> tuple[int, ...]:
    """``torch.Size(sizes)``: the sizes as a tuple."""
    return tuple(*args)


def _layout(name: Any) -> Any:
    """``torch.serialization._get_layout(name)``: the layout's name (unused)."""
    return name


def _mem_format(value: Any) -> Any:
    """``_MEM_FORMAT_ENCODING(value)``: the enum's value (only the dtype is used)."""
    return value


#: (module, name) of each DCP global the unpickler allows -> its record.
RECORDS: dict[tuple[str, str], Callable[..., Any]] = {
    (_MD, "Metadata"): Metadata,
    (_MD, "MetadataIndex"): MetadataIndex,
    (_MD, "StorageMeta"): StorageMeta,
    (_MD, "TensorProperties"): TensorProperties,
    (_MD, "TensorStorageMetadata"): TensorStorageMetadata,
    (_MD, "BytesStorageMetadata"): BytesStorageMetadata,
    (_MD, "ChunkStorageMetadata"): ChunkStorageMetadata,
    (_MD, "_MEM_FORMAT_ENCODING"): _mem_format,
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): StorageInfo,
    ("torch", "Size"): _size,
    ("torch.serialization", "_get_layout"): _layout,
}
