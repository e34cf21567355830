"""DCP's metadata and the manifest's chunked section, each made from the other.

A save keeps DCP's ``Metadata`` as JSON in the manifest (each chunk with the file and bytes that
hold it); a load gives DCP back the ``Metadata`` it expects. Values DCP's planner serializes itself
are blobs that shardckpt never deserializes.
"""

from __future__ import annotations

from typing import Any
from collections.abc import Mapping

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata, ChunkStorageMetadata, Metadata, StorageMeta, TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.storage import WriteResult

from shardckpt.errors import ConfigError
from shardckpt.format.chunked import Blob, ChunkRecord, ChunkedSection, ChunkedTensor
from shardckpt.format.dtypes import DTYPES


def dtype_name(dtype: torch.dtype, what: str) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise ConfigError(f"{what}: dtype {name} cannot be stored; shardckpt stores "
                          f"{', '.join(DTYPES)}")
    return name


def chunked_section(metadata: Metadata, results: list[list[WriteResult]]) -> ChunkedSection:
    """The manifest's chunked section: DCP's metadata with each chunk's file and bytes."""
    where: dict[tuple[str, tuple[int, ...] | None], Any] = {}  # the writer's _Stored
    for rs in results:
        for r in rs:
            off = None if r.index.offset is None else tuple(r.index.offset)
            where[(r.index.fqn, off)] = r.storage_data
    tensors: dict[str, ChunkedTensor] = {}
    blobs: dict[str, Blob] = {}
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, BytesStorageMetadata):
            s = where[(fqn, None)]
            blobs[fqn] = Blob(fqn, s.entry.path, s.begin, s.end)
            continue
        chunks = []
        for c in md.chunks:
            s = where[(fqn, tuple(c.offsets))]
            chunks.append(ChunkRecord(tuple(c.offsets), tuple(c.sizes), s.entry.path, s.begin, s.end))
        tensors[fqn] = ChunkedTensor(fqn, dtype_name(md.properties.dtype, fqn), tuple(md.size),
                                     tuple(chunks))
    return ChunkedSection(tensors, blobs, _planner_data(metadata.planner_data))


def _planner_data(pd: Any) -> dict[str, tuple[str | int, ...]]:
    """The default planner's flattening map, kept as JSON; anything else cannot be kept."""
    if pd is None:
        return {}
    ok = isinstance(pd, Mapping) and all(
        isinstance(k, str) and isinstance(v, (tuple, list))
        and all(isinstance(x, (str, int)) and not isinstance(x, bool) for x in v)
        for k, v in pd.items())
    if not ok:
        raise ConfigError(f"the save planner's planner_data ({type(pd).__name__}) is not a map of "
                          "keys to paths of strings and integers; shardckpt stores metadata as "
                          "JSON only (DefaultSavePlanner's is)")
    return {k: tuple(v) for k, v in pd.items()}


def section_metadata(section: ChunkedSection, checkpoint_id: str, save_id: str,
                     storage_data: Any = None, version: str | None = None) -> Metadata:
    """DCP's ``Metadata`` of the chunked tensors and blobs a manifest's section describes."""
    sd: dict[str, Any] = {}
    for fqn, t in section.tensors.items():
        sd[fqn] = TensorStorageMetadata(
            TensorProperties(dtype=getattr(torch, t.dtype)), torch.Size(t.shape),
            [ChunkStorageMetadata(torch.Size(c.offsets), torch.Size(c.sizes)) for c in t.chunks])
    for key in section.blobs:
        sd[key] = BytesStorageMetadata()
    planner = {k: tuple(v) for k, v in section.planner_data.items()} or None
    return Metadata(sd, planner_data=planner, storage_data=storage_data,
                    storage_meta=StorageMeta(checkpoint_id=checkpoint_id, save_id=save_id),
                    version=version)
