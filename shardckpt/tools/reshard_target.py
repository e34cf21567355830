"""Reshard's destination: the guards before anything is written and the removals after an
``--overwrite`` commit (the clean-up after a failure is the attempt's:
:mod:`shardckpt.checkpoint.attempt`).

Removals stay inside DST and never go through a symbolic link: a link where a removal would
go is refused before anything is written, and one that appears later is left alone and logged.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from shardckpt.errors import ConfigError, LinkRefusedError, ShardckptError
from shardckpt.format.manifest import MANIFEST_NAME, MAX_MANIFEST_BYTES
from shardckpt.format.manifest_parse import parse
from shardckpt.storage import Storage
from shardckpt.storage.places import contains
from shardckpt.tools.clean import SAVE_ID, remove_stale_saves, sibling_references

log = logging.getLogger(__name__)


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

