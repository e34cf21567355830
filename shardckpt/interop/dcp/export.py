"""Export a shardckpt checkpoint (chunked tensors or flat groups) as a directory stock DCP reads.

The output is what DCP's ``FileSystemWriter`` writes and its ``FileSystemReader`` (the default
of ``dcp.load(state_dict, checkpoint_id=DIR)``) reads: ``__<n>_0.distcp`` payload files (one or
more per ``chunks`` file of the source; flat groups: a new one every ``file_bytes``), in which
each stored box, split into boxes of at most ``block_bytes`` (:func:`blocks`, each its own DCP
chunk, as FSDP2's shards are), is a ``torch.save`` archive of that box as a plain tensor (the
only tensor payload DCP's reader decodes) and each blob is its bytes as they were; and
``.metadata``, DCP's :class:`~torch.distributed.checkpoint.metadata.Metadata` built from DCP's
own classes and pickled, because DCP reads nothing else. That file is the one pickle shardckpt
writes; it is written last, create-only, so a directory without it is not a checkpoint DCP would
open. Every source byte is read checked (CRC32C); memory is a few blocks, whatever the largest
parameter (flat groups are read as :class:`shardckpt.interop.dcp.flat_view.FlatView` presents them).
"""

from __future__ import annotations

import io
import logging
import pickle
from typing import TYPE_CHECKING, Any
from collections.abc import Iterator, Mapping, Sequence

from shardckpt.checkpoint.attempt import Attempt, ForeignFiles, Steps
from shardckpt.checkpoint.job import Job
from shardckpt.checkpoint.reader import CheckpointReader
from shardckpt.format.chunked import ChunkedSection
from shardckpt.checkpoint.chunked_read import read_blob, read_box
from shardckpt.errors import ConfigError
from shardckpt.format.dtypes import itemsize
from shardckpt.format.layout import prod
from shardckpt.format.manifest import DEFAULT_CHUNK_SIZE
from shardckpt.interop.dcp.model_state import as_tensor
from shardckpt.interop.dcp.config import DEFAULT_FILE_BYTES
from shardckpt.storage import DEFAULT_BATCH, Storage

if TYPE_CHECKING:
    from shardckpt.storage import StreamWriter

log = logging.getLogger(__name__)

__all__ = ["export_dcp", "blocks"]

METADATA_NAME = ".metadata"
DCP_VERSION = "1.0.0"  # the version DCP's FileSystemWriter records (its CURRENT_DCP_VERSION)
Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes)


def blocks(sizes: Sequence[int], elem: int, budget: int) -> Iterator[Box]:
    """The box ``sizes`` tiled by boxes (relative offsets, sizes) of at most ``budget`` bytes:
    bands of whole rows along dim 0; a row over the budget split the same way along the next
    dim. Each box is one contiguous run of the row-major box (leading sizes 1, trailing whole)."""
    if not sizes or not prod(sizes):
        yield (0,) * len(sizes), tuple(sizes)
        return
    row = prod(sizes[1:]) * elem
    if row <= budget or len(sizes) == 1:
        step = max(1, budget // row)
        for r in range(0, sizes[0], step):
            yield (r, *(0,) * (len(sizes) - 1)), (min(step, sizes[0] - r), *sizes[1:])
        return
    for r in range(sizes[0]):
        for off, size in blocks(sizes[1:], elem, budget):
            yield (r, *off), (1, *size)


def _payload(tensor: Any) -> bytes:
    """``torch.save`` bytes of ``tensor`` as a plain contiguous tensor of its own storage."""
    import torch

    buf = io.BytesIO()
    torch.save(tensor.clone(), buf)
    return buf.getvalue()


class _Files(ForeignFiles):
    """``__<n>_0.distcp`` files written one after another: :meth:`next_file` starts the next one,
    and one that reached ``file_bytes`` is closed before the next payload. Records each item's
    ``_StorageInfo``; :meth:`discard` (a failed export) aborts the one open and removes them."""

    def __init__(self, out: Storage, file_bytes: int) -> None:
        super().__init__(out)
        self.out, self.file_bytes = out, file_bytes
        self.storage_data: dict[Any, Any] = {}
        self._w: StreamWriter | None = None
        self.total, self._rel, self._pos = 0, "", 0

    def next_file(self) -> None:
        if self._w is not None:
            self._w.close()
            self.total += self._pos
        self._rel = f"__{len(self.written)}_0.distcp"
        self.written.append(self._rel)
        self._w, self._pos = self.out.writer(self._rel, DEFAULT_CHUNK_SIZE), 0

    def write(self, key: Any, data: bytes) -> None:
        from torch.distributed.checkpoint.filesystem import _StorageInfo

        if self._w is None or self._pos >= self.file_bytes:
            self.next_file()
        assert self._w is not None
        self._w.write(data)
        self.storage_data[key] = _StorageInfo(self._rel, self._pos, len(data))
        self._pos += len(data)

    def close(self) -> int:
        if self._w is not None:
            self._w.close()
            self.total += self._pos
            self._w = None
        return self.total

    def discard(self) -> bool:
        if self._w is not None:
            self._w.abort()
            self._w = None
        return super().discard()


def _write_payloads(reader: CheckpointReader, section: ChunkedSection, files: _Files,
                    budget: int) -> dict[str, list[Box]]:
    """Every stored box, split into boxes of at most ``budget`` bytes, and every blob: one file
    (at least) per source file, in source order. Returns each tensor's boxes (offsets, sizes)."""
    import torch
    from torch.distributed.checkpoint.metadata import MetadataIndex

    boxes: dict[str, list[Box]] = {}
    for path in sorted(section.files()):
        items: list[tuple[int, Any, Any]] = [(c.begin, t, c) for t in section.tensors.values()
                                             for c in t.chunks if c.file == path]
        items += [(b.begin, None, b) for b in section.blobs.values() if b.file == path]
        items.sort(key=lambda x: x[0])
        files.next_file()
        for _, t, c in items:
            if t is None:
                files.write(MetadataIndex(c.key), read_blob(reader, c))
                continue
            dtype = getattr(torch, t.dtype)
            for rel, sizes in blocks(c.sizes, itemsize(t.dtype), budget):
                off = tuple(o + r for o, r in zip(c.offsets, rel, strict=True))
                if prod(sizes):
                    raw = read_box(reader, t, c, off, sizes)
                    tensor = as_tensor(raw, t.dtype).reshape(sizes)
                else:
                    tensor = torch.empty(sizes, dtype=dtype)
                files.write(MetadataIndex(t.fqn, torch.Size(off)), _payload(tensor))
                boxes.setdefault(t.fqn, []).append((off, sizes))
    return boxes


def _write_flat(view: Any, files: _Files, budget: int) -> dict[str, list[Box]]:
    """A flat-group checkpoint through :class:`~shardckpt.interop.dcp.flat_view.FlatView`: every
    tensor in boxes of at most ``budget`` bytes (each read from the shards that hold it), then
    every value. Returns each tensor's boxes (offsets, sizes)."""
    import torch
    from torch.distributed.checkpoint.metadata import MetadataIndex

    boxes: dict[str, list[Box]] = {}
    for key, e in view.tensors.items():
        for off, sizes in blocks(e.shape, itemsize(e.dtype), budget):
            files.write(MetadataIndex(key, torch.Size(off)), _payload(view.box(key, off, sizes)))
            boxes.setdefault(key, []).append((off, sizes))
    for key in view.values:
        files.write(MetadataIndex(key), view.value(key).getvalue())
    return boxes


def _set_chunks(md: Any, boxes: Mapping[str, list[Box]]) -> None:
    """Each tensor's chunks in ``md`` as the boxes written."""
    import torch
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    for key, bs in boxes.items():
        md.state_dict_metadata[key].chunks = [
            ChunkStorageMetadata(torch.Size(o), torch.Size(z)) for o, z in bs]


def _metadata(section: ChunkedSection, storage_data: dict[Any, Any] | None, checkpoint_id: str,
              save_id: str) -> Any:
    from shardckpt.interop.dcp.metadata import section_metadata

    return section_metadata(section, checkpoint_id, save_id, storage_data, DCP_VERSION)


def export_dcp(src: str, dst: str, storage_options: Mapping[str, Any] | None = None,
               dst_storage_options: Mapping[str, Any] | None = None, model_key: str = "model",
               optim_key: str = "optim", block_bytes: int = DEFAULT_BATCH,
               file_bytes: int = DEFAULT_FILE_BYTES) -> dict[str, Any]:
    """Write checkpoint ``src`` at ``dst`` as DCP's ``FileSystemWriter`` would:
    ``dcp.load(state_dict, checkpoint_id=dst)`` reads it at any world size. Chunked tensors keep
    their chunks and keys; flat groups (``ZeroEngine``) become the state dict
    ``get_state_dict(model, optimizer)`` gives, under ``{model_key: ..., optim_key: ...}``. A box
    over ``block_bytes`` is written as several chunks (:func:`blocks`), so memory is a few
    blocks whatever the largest parameter; a payload file is closed once it holds ``file_bytes``
    (chunked tensors: also at each source file). Refuses a ``dst`` that holds a ``.metadata``; on
    any error the files written are removed and no ``.metadata`` is left. Returns a summary
    (tensors, values, files, bytes)."""
    if block_bytes < 1 or file_bytes < 1:
        raise ConfigError(f"block_bytes {block_bytes} and file_bytes {file_bytes} must be >= 1")
    reader = CheckpointReader(src, storage_options)
    for entry in reader.manifest.files:  # nothing read through a link out of the source
        reader.files.check_inside(entry.path)
    section = reader.manifest.chunked
    out = Storage(dst, dst_storage_options)
    files = _Files(out, file_bytes)

    def guard() -> None:
        if out.exists(METADATA_NAME):
            raise ConfigError(f"{out.url_of(METADATA_NAME)} exists; export into an empty location")

    def write(files: _Files) -> tuple[Any, tuple[int, int], int]:
        """The payload files; DCP's metadata of them, (tensors, values) and their bytes."""
        if section is None:
            from shardckpt.interop.dcp.flat_view import FlatView

            view = FlatView(reader, model_key, optim_key)
            boxes = _write_flat(view, files, block_bytes)
            md = view.metadata(out.url, reader.manifest.save_id)
            counts = len(view.tensors), len(view.values)
        else:
            boxes = _write_payloads(reader, section, files, block_bytes)
            md = _metadata(section, None, out.url, reader.manifest.save_id)
            counts = len(section.tensors), len(section.blobs)
        total = files.close()
        _set_chunks(md, boxes)
        md.storage_data, md.version = files.storage_data, DCP_VERSION
        return md, counts, total

    # one process, whose report travels as it is; the commit: ``.metadata``, create-only, last
    attempt = Attempt(Job.single(), out.url, Steps.named("export dcp"), lambda _: files, guard=guard)
    attempt.run(write, lambda f, reports: out.create_only(METADATA_NAME, pickle.dumps(reports[0][0])))
    _, counts, total = attempt.reports[0]
    log.info("exported %s -> %s (%d files, %d bytes)", reader.url, out.url, len(files.written), total)
    return {"destination": out.url, "tensors": counts[0], "values": counts[1], "files": files.written,
            "bytes": total}
