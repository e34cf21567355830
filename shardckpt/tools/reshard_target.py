"""Reshard's destination: what a target is (:class:`ReshardTarget`), the guards before anything
is written and the removals after an ``--overwrite`` commit (the clean-up after a failure is the
attempt's: :mod:`shardckpt.checkpoint.attempt`).

Removals stay inside DST and never go through a symbolic link: a link where a removal would
go is refused before anything is written, and one that appears later is left alone and logged.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, runtime_checkable
from collections.abc import Callable, Sequence

from shardckpt.errors import ConfigError, LinkRefusedError, ShardckptError
from shardckpt.format.manifest import MANIFEST_NAME, MAX_MANIFEST_BYTES
from shardckpt.format.manifest_parse import parse
from shardckpt.storage import Storage, contains
from shardckpt.tools.clean import SAVE_ID, remove_stale_saves, sibling_references

if TYPE_CHECKING:
    from shardckpt.checkpoint.reader import CheckpointReader
    from shardckpt.checkpoint.writer import CheckpointSpec, CheckpointWriter
    from shardckpt.format.manifest import FileEntry
    from shardckpt.tools.reshard_stream import Written

log = logging.getLogger(__name__)


@runtime_checkable
class ReshardTarget(Protocol):
    """What a reshard writes: flat groups from flat groups (:class:`~shardckpt.tools.reshard.FlatTarget`),
    chunks from chunks (:class:`~shardckpt.tools.reshard_chunked.ChunkedTarget`), flat groups
    from chunks (:class:`~shardckpt.tools.reshard_to_flat.FlatFromChunks`).

    A target names its files by index (``0 .. len(costs()) - 1``: shard ranks, or ranks' chunks
    files) plus, where :meth:`has_buffers`, one buffers file. A frozen dataclass: it travels to
    ``--workers`` processes pickled, and ``dataclasses.replace`` gives it a signed ``spec``.

    Call order (:func:`~shardckpt.tools.reshard.write_reshard`): rank 0 makes the attempt's
    :meth:`writer` and checks the destination has room for :meth:`data_bytes`; every process
    (and worker) makes a writer of that save id, splits :meth:`costs` and calls :meth:`write` on
    its share; the last process calls :meth:`write_buffers` where :meth:`has_buffers`; rank 0
    commits the entries. Pure but for :meth:`write` and :meth:`write_buffers`, which read the
    source and write the destination.
    """

    __dataclass_fields__: ClassVar[dict[str, Any]]

    @property
    def spec(self) -> CheckpointSpec:
        """The target's manifest-to-be."""
        ...

    def writer(self, dst: Storage, save_id: str | None = None) -> CheckpointWriter:
        """The writer of the target at ``dst`` (a new save id where None)."""
        ...

    def data_bytes(self, writer: CheckpointWriter) -> int:
        """Bytes the target's files take."""
        ...

    def costs(self) -> list[int]:
        """Per target file, what writing it costs (bytes read plus written), to balance shares."""
        ...

    def write(self, reader: CheckpointReader, writer: CheckpointWriter, files: Sequence[int],
              buffer_bytes: int, on_bytes: Callable[[int], None] | None) -> Written:
        """Write target files ``files``, reading at most ``buffer_bytes`` at a time."""
        ...

    def has_buffers(self, reader: CheckpointReader) -> bool:
        """Whether the target has a buffers file."""
        ...

    def write_buffers(self, reader: CheckpointReader, writer: CheckpointWriter,
                      buffer_bytes: int) -> FileEntry | None:
        """Write the buffers file (None where nothing was written)."""
        ...


def prepare_dst(dst: Storage, src: Storage, overwrite: bool) -> bytes | None:
    """Refuse a DST that is, holds or lies in SRC, and an existing DST unless ``overwrite``;
    return the bytes of DST's manifest that the new one is to replace (None: create)."""
    here, there = dst.location(), src.location()
    if here == there:
        raise ConfigError(f"{dst.url}: the destination is the source ({src.url}); choose another "
                          "directory")
    if contains(there, here):
        raise ConfigError(f"{dst.url} lies inside the source {src.url}; choose a directory outside it")
    if overwrite and contains(here, there):
        raise ConfigError(f"the source {src.url} lies inside the destination {dst.url}, which "
                          "--overwrite would replace; choose another destination")
    existing = dst.ls("")
    if not existing:
        return None
    if not overwrite:
        raise ConfigError(f"{dst.url} already exists and is not empty; pass --overwrite to replace it "
                          "(the current checkpoint there stays until the new one commits)")
    replacing = None
    if MANIFEST_NAME in existing:  # replaced as it is, readable or not (a damaged one too)
        replacing = dst.read_limited(MANIFEST_NAME, MAX_MANIFEST_BYTES)
    _refuse_links(dst, existing, replacing)
    return replacing


def _replaced_files(dst: Storage, replaced: bytes | None) -> list[str]:
    """The files of the manifest ``replaced`` (its bytes), or none where it cannot be read."""
    if replaced is None:
        return []
    try:
        return [f.path for f in parse(replaced, dst.url_of(MANIFEST_NAME)).files]
    except ShardckptError:
        return []  # a damaged manifest: its save directory goes with the other stale ones


def _refuse_links(dst: Storage, existing: Sequence[str], replacing: bytes | None) -> None:
    """Before anything is written: refuse an ``--overwrite`` whose removals after the commit (the
    replaced checkpoint's files, earlier save directories) would meet a symbolic link in DST. A
    link is never followed (its target may be anything) nor removed (someone put it there)."""
    doomed = _replaced_files(dst, replacing) + [n for n in existing if SAVE_ID.fullmatch(n)]
    for rel in doomed:
        link = dst.first_link(rel)
        if link is not None:
            raise LinkRefusedError(
                f"{dst.url}: --overwrite would remove {dst.url_of(rel)}, but {link[0]} is a symbolic "
                f"link to {link[1]}; shardckpt never deletes through a link or removes one. Nothing "
                "was written: remove the link, or choose another destination", dst.url_of(rel),
                link[0], link[1])


def remove_replaced(dst: Storage, replaced: bytes | None, keep: str) -> None:
    """After an ``--overwrite`` commit: remove the files of the manifest it replaced (where that
    could be read) and every save directory no writer holds a lease on, except the new one and
    those whose frozen files a committed sibling checkpoint of the run references.
    Removals stay inside DST (:meth:`~shardckpt.storage.Storage.remove_inside`): a symbolic link
    that appeared since :func:`prepare_dst` checked is left alone and logged."""
    try:
        referenced = sibling_references(dst)  # a later checkpoint of the run still reads them
        for path in _replaced_files(dst, replaced):
            if path.split("/", 1)[0] in referenced or path.split("/", 1)[0] == keep:
                continue
            try:
                dst.remove_inside(path)
            except LinkRefusedError as e:
                log.warning("%s", e)
        removed = remove_stale_saves(dst, keep, referenced)
    except ShardckptError as e:
        log.warning("%s: committed, but could not remove what it replaced (%s); `shardckpt clean "
                    "%s` removes it", dst.url, e, dst.url)
        return
    if removed:
        log.info("%s: removed %d earlier save directories: %s", dst.url, len(removed), ", ".join(removed))

