"""Export a shardckpt checkpoint (chunked tensors or flat groups) as a directory stock DCP reads.

The output is what DCP's ``FileSystemWriter`` writes and its ``FileSystemReader`` (the default
of ``dcp.load(state_dict, checkpoint_id=DIR)``) reads: one ``__<n>_0.distcp`` payload file per
``chunks`` file of the source, in which each stored box is a ``torch.save`` archive of that box
as a plain tensor (the only tensor payload DCP's reader decodes) and each blob is its bytes as
they were, and ``.metadata``, DCP's :class:`~torch.distributed.checkpoint.metadata.Metadata`
built from DCP's own classes and pickled, because DCP reads nothing else. That file is the one
pickle shardckpt writes; it is written last, create-only, so a directory without it is not a
checkpoint DCP would open. Every source byte is read checked (CRC32C); memory is one stored box
(flat groups: one parameter, presented as :class:`shardckpt.interop.flat_as_dcp.FlatView` presents it).
"""

from __future__ import annotations

import io
import logging
import pickle
from typing import Any, Mapping

from shardckpt.checkpoint.reader import CheckpointReader
from shardckpt.format.chunked import ChunkedSection
from shardckpt.checkpoint.chunked_read import read_blob, read_box
from shardckpt.errors import ConfigError
from shardckpt.format.manifest import DEFAULT_CHUNK_SIZE
from shardckpt.storage import Storage

log = logging.getLogger(__name__)

__all__ = ["export_dcp"]

METADATA_NAME = ".metadata"
DCP_VERSION = "1.0.0"  # the version DCP's FileSystemWriter records (its CURRENT_DCP_VERSION)


def _box_payload(reader: CheckpointReader, t: Any, c: Any) -> bytes:
    """``torch.save`` bytes of box ``c`` of tensor ``t`` as a plain contiguous tensor."""
    import torch

    dtype = getattr(torch, t.dtype)
    if c.numel == 0:
        tensor = torch.empty(c.sizes, dtype=dtype)
    else:
        raw = bytearray(read_box(reader, t, c, c.offsets, c.sizes))
        tensor = torch.frombuffer(raw, dtype=torch.uint8).view(dtype).reshape(c.sizes)
    buf = io.BytesIO()
    torch.save(tensor, buf)
    return buf.getvalue()


def _write_payloads(reader: CheckpointReader, section: ChunkedSection, out: Storage,
                    written: list[str]) -> tuple[dict[Any, Any], int]:
    """Write one ``.distcp`` per source file; DCP's storage records by item, and bytes written."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import MetadataIndex

    import torch

    storage_data: dict[Any, Any] = {}
    total = 0
    for n, path in enumerate(sorted(section.files())):
        rel = f"__{n}_0.distcp"
        items: list[tuple[int, Any, Any]] = [(c.begin, t, c) for t in section.tensors.values()
                                             for c in t.chunks if c.file == path]
        items += [(b.begin, None, b) for b in section.blobs.values() if b.file == path]
        items.sort(key=lambda x: x[0])
        written.append(rel)
        pos = 0
        with out.writer(rel, DEFAULT_CHUNK_SIZE) as w:
            for _, t, c in items:
                if t is None:
                    data = read_blob(reader, c)
                    key = MetadataIndex(c.key)
                else:
                    data = _box_payload(reader, t, c)
                    key = MetadataIndex(t.fqn, torch.Size(c.offsets))
                w.write(data)
                storage_data[key] = _StorageInfo(rel, pos, len(data))
                pos += len(data)
            w.close()
        total += pos
    return storage_data, total


def _write_flat(view: Any, out: Storage, written: list[str]) -> tuple[dict[Any, Any], int]:
    """A flat-group checkpoint through :class:`~shardckpt.interop.flat_as_dcp.FlatView`: every tensor
    whole (one parameter in memory at a time) and every value, in one ``__0_0.distcp``."""
    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import MetadataIndex

    rel, pos, storage_data = "__0_0.distcp", 0, {}
    written.append(rel)
    with out.writer(rel, DEFAULT_CHUNK_SIZE) as w:
        for key, e in view.tensors.items():
            zeros = (0,) * len(e.shape)
            buf = io.BytesIO()
            torch.save(view.box(key, zeros, e.shape).clone(), buf)
            data = buf.getvalue()
            w.write(data)
            storage_data[MetadataIndex(key, torch.Size(zeros))] = _StorageInfo(rel, pos, len(data))
            pos += len(data)
        for key in view.values:
            data = view.value(key).getvalue()
            w.write(data)
            storage_data[MetadataIndex(key)] = _StorageInfo(rel, pos, len(data))
            pos += len(data)
        w.close()
    return storage_data, pos


def _metadata(section: ChunkedSection, storage_data: dict[Any, Any], checkpoint_id: str,
              save_id: str) -> Any:
    from shardckpt.interop.dcp_metadata import section_metadata

    return section_metadata(section, checkpoint_id, save_id, storage_data, DCP_VERSION)


def export_dcp(src: str, dst: str, storage_options: Mapping[str, Any] | None = None,
               dst_storage_options: Mapping[str, Any] | None = None, model_key: str = "model",
               optim_key: str = "optim") -> dict[str, Any]:
    """Write checkpoint ``src`` at ``dst`` as DCP's ``FileSystemWriter`` would:
    ``dcp.load(state_dict, checkpoint_id=dst)`` reads it at any world size. Chunked tensors keep
    their chunks and keys; flat groups (``ZeroEngine``) become the state dict
    ``get_state_dict(model, optimizer)`` gives, under ``{model_key: ..., optim_key: ...}``.
    Refuses a ``dst`` that holds a ``.metadata``; on any error the files written are removed and
    no ``.metadata`` is left. Returns a summary (tensors, values, files, bytes)."""
    reader = CheckpointReader(src, storage_options)
    section = reader.manifest.chunked
    out = Storage(dst, dst_storage_options)
    if out.exists(METADATA_NAME):
        raise ConfigError(f"{out.url_of(METADATA_NAME)} exists; export into an empty location")
    written: list[str] = []
    try:
        if section is None:
            from shardckpt.interop.flat_as_dcp import FlatView

            view = FlatView(reader, model_key, optim_key)
            storage_data, total = _write_flat(view, out, written)
            md = view.metadata(out.url, reader.manifest.save_id)
            md.storage_data, md.version = storage_data, DCP_VERSION
            counts = len(view.tensors), len(view.values)
        else:
            storage_data, total = _write_payloads(reader, section, out, written)
            md = _metadata(section, storage_data, out.url, reader.manifest.save_id)
            counts = len(section.tensors), len(section.blobs)
        out.create_only(METADATA_NAME, pickle.dumps(md))
    except BaseException:
        for rel in written:
            try:
                if out.exists(rel):
                    out.rm(rel)
            except Exception as e:  # noqa: BLE001 - best effort; the missing .metadata is what counts
                log.warning("could not remove %s (%s)", out.url_of(rel), e)
        raise
    log.info("exported %s -> %s (%d files, %d bytes)", reader.url, out.url, len(written), total)
    return {"destination": out.url, "tensors": counts[0], "values": counts[1], "files": written,
            "bytes": total}
