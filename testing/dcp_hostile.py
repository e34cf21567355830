"""Hand-built DCP checkpoints for the hostile-input tests (``tests/test_dcp_hostile.py``): what
DCP's ``FileSystemWriter`` would write, with the metadata and payloads chosen by the test."""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any, Sequence

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata, Metadata, MetadataIndex, TensorProperties, TensorStorageMetadata,
)

Box = tuple[Sequence[int], Sequence[int]]  # (offsets, sizes)


def payload(t: Any) -> bytes:
    """``torch.save`` bytes of ``t``, as DCP writes a tensor chunk."""
    buf = io.BytesIO()
    torch.save(t, buf)
    return buf.getvalue()


def write_metadata(path: Path, md: Any) -> None:
    (Path(path) / ".metadata").write_bytes(pickle.dumps(md))


def grid(rows: int, cols: int) -> list[Box]:
    """A ``rows`` x ``cols`` tensor tiled by 1 x 1 boxes."""
    return [((r, c), (1, 1)) for r in range(rows) for c in range(cols)]


def tiled_checkpoint(path: Path, shape: Sequence[int], boxes: Sequence[Box],
                     fqn: str = "t", dtype: Any = torch.float32) -> Path:
    """A DCP checkpoint of one tensor ``fqn`` of ``shape`` stored as ``boxes``; every box of the
    same sizes shares one payload (zeros), so a checkpoint of many chunks stays small."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    data, where, storage = bytearray(), {}, {}
    chunks = []
    for off, sizes in boxes:
        sizes = tuple(sizes)
        if sizes not in where:
            p = payload(torch.zeros(sizes, dtype=dtype))
            where[sizes] = (len(data), len(p))
            data += p
        pos, n = where[sizes]
        storage[MetadataIndex(fqn, torch.Size(off))] = _StorageInfo("__0_0.distcp", pos, n)
        chunks.append(ChunkStorageMetadata(torch.Size(off), torch.Size(sizes)))
    (path / "__0_0.distcp").write_bytes(bytes(data))
    md = Metadata({fqn: TensorStorageMetadata(TensorProperties(dtype=dtype), torch.Size(shape),
                                              chunks)},
                  storage_data=storage)
    write_metadata(path, md)
    return path


def blob_checkpoint(path: Path, values: dict[str, bytes], file: str = "__0_0.distcp") -> Path:
    """A DCP checkpoint of non-tensor values only (``key`` -> its bytes, one after another in
    ``file``)."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    data, storage = bytearray(), {}
    for key, v in values.items():
        storage[MetadataIndex(key)] = _StorageInfo(file, len(data), len(v))
        data += v
    (path / file).write_bytes(bytes(data))
    write_metadata(path, Metadata({k: BytesStorageMetadata() for k in values},
                                  storage_data=storage))
    return path


def one_payload_checkpoint(path: Path, fqn: str, dtype: Any, shape: Sequence[int],
                           data: bytes) -> Path:
    """A DCP checkpoint of one tensor ``fqn`` (``dtype``, ``shape``, one chunk) whose payload is
    ``data``, whatever that holds."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "__0_0.distcp").write_bytes(data)
    zeros = (0,) * len(shape)
    md = Metadata({fqn: TensorStorageMetadata(
        TensorProperties(dtype=dtype), torch.Size(shape),
        [ChunkStorageMetadata(torch.Size(zeros), torch.Size(shape))])},
        storage_data={MetadataIndex(fqn, torch.Size(zeros)): _StorageInfo("__0_0.distcp", 0,
                                                                           len(data))})
    write_metadata(path, md)
    return path
