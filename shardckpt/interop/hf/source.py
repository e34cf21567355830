"""A Hugging Face safetensors checkpoint opened as a source: its index, headers and config.

A Hugging Face model folder holds ``model.safetensors`` or ``model-0000i-of-0000K.safetensors``
files with ``model.safetensors.index.json`` (``weight_map``: tensor name -> file), and usually a
``config.json``. :func:`open_hf` reads only the index and each file's header (strictly parsed;
offsets checked against the file size) and the config, never tensor data.

Does not import torch.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any
from collections.abc import Mapping

from shardckpt.checkpoint.reader import as_storage
from shardckpt.errors import IntegrityError, ManifestError
from shardckpt.format.integrity import MAX_NAME, free_text_problem
from shardckpt.format.layout import prod
from shardckpt.format.parse_context import MAX_INT
from shardckpt.format.safetensors_header import header_length, parse_header
from shardckpt.interop.foreign import check_link, plain, shown, source_root, strict_json
from shardckpt.storage import NotFoundError, Storage

log = logging.getLogger(__name__)

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
CONFIG_NAME = "config.json"
MAX_INDEX_BYTES = 64 << 20
MAX_CONFIG_BYTES = 16 << 20


@dataclass(frozen=True, slots=True)
class HFTensor:
    """One tensor of a source file: bytes ``[begin, end)`` of ``file`` (absolute offsets)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    file: str
    begin: int
    end: int

    @property
    def numel(self) -> int:
        return prod(self.shape)


@dataclass(frozen=True)
class HFSource:
    """An opened Hugging Face checkpoint: its tensors by name and its ``config.json`` (or None)."""

    storage: Storage
    tensors: Mapping[str, HFTensor]
    config: Mapping[str, Any] | None = None
    files: tuple[str, ...] = field(default=())

    @property
    def url(self) -> str:
        return self.storage.url

    @property
    def total_bytes(self) -> int:
        return sum(t.end - t.begin for t in self.tensors.values())


# ------------------------------------------------------------------------------ opening


def read_config(storage: Storage, rel: str = CONFIG_NAME, root: str | None = None) -> dict[str, Any]:
    """A model folder's ``config.json``: a JSON object, strictly parsed
    (:func:`~shardckpt.interop.foreign.strict_json`), whose strings a checkpoint's ``extras`` can
    hold; one :class:`ManifestError` naming the file otherwise."""
    config = _read_json(storage, rel, MAX_CONFIG_BYTES, root)
    url = storage.url_of(rel)
    if not isinstance(config, dict):
        raise ManifestError(f"{url}: not a JSON object")
    problem = free_text_problem(config, "")
    if problem is not None:
        raise ManifestError(f"{url}: {shown(problem[0].lstrip('.'), 80)}: {problem[1]}")
    return config


def _split(url: str) -> tuple[str, str]:
    """(folder, file name) of a URL that names a file."""
    if "/" not in url.rstrip("/"):
        return ".", url
    head, tail = url.rstrip("/").rsplit("/", 1)
    return (head or "/"), tail


def read_header(storage: Storage, rel: str, root: str | None = None) -> dict[str, HFTensor]:
    """The tensors of one safetensors file, with absolute byte ranges; reads the header only.

    ``root``: the folder the file must resolve inside (:func:`~shardckpt.interop.foreign.source_root`;
    None: not checked). Every name and shape must be one a checkpoint can record (a name of at
    most 4096 characters, valid Unicode; at most 2**53 elements per dimension and in all), so
    that a fault is reported against this file, not against the import's manifest."""
    url = storage.url_of(rel)
    check_link(storage, rel, root)
    try:
        size = storage.size(rel)
    except NotFoundError:
        raise IntegrityError(f"{url}: no such file") from None
    n = header_length(storage.read(rel, 0, min(size, 8)), size, url)
    raw = storage.read(rel, 8, 8 + n)
    slots, _ = parse_header(raw, size, url)
    for s in slots.values():
        problem = _tensor_problem(s.name, s.shape)
        if problem is not None:
            raise IntegrityError(f"{url}: tensor {shown(s.name, 64)}: {problem}")
    base = 8 + n
    return {s.name: HFTensor(s.name, s.dtype, tuple(s.shape), rel, base + s.begin, base + s.end)
            for s in slots.values()}


def _tensor_problem(name: str, shape: Any) -> str | None:
    """Why a checkpoint cannot record a tensor of this name and shape, or None."""
    if len(name) > MAX_NAME:
        return f"a name of {len(name)} characters; at most {MAX_NAME} are allowed"
    if not name.isascii():
        try:
            name.encode("utf-8")
        except UnicodeEncodeError:
            return ("its name holds a lone UTF-16 surrogate (an unpaired \\uD800-\\uDFFF escape); "
                    "a name must be valid Unicode")
    n = 1
    for d in shape:
        n *= d
        if d > MAX_INT or n > MAX_INT:
            return f"shape {list(shape)} has more than 2**53 elements in a dimension or in all"
    return None


def _read_json(storage: Storage, rel: str, limit: int, root: str | None = None) -> Any:
    check_link(storage, rel, root)
    return strict_json(storage.read_limited(rel, limit), storage.url_of(rel))


def _weight_map(storage: Storage, rel: str, root: str | None) -> dict[str, str]:
    doc = _read_json(storage, rel, MAX_INDEX_BYTES, root)
    wm = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(wm, dict) or not all(isinstance(v, str) for v in wm.values()):
        raise ManifestError(f"{storage.url_of(rel)}: 'weight_map' must map tensor names to file names")
    bad = sorted({f for f in wm.values() if not f or f.startswith("/") or ".." in f.split("/")})
    if bad:
        raise ManifestError(f"{storage.url_of(rel)}: weight_map names files outside the folder: "
                            f"{', '.join(plain(b, 64) for b in bad[:5])}")
    return wm


def open_hf(location: str | Storage, storage_options: Mapping[str, Any] | None = None) -> HFSource:
    """Open a folder (``model.safetensors.index.json`` or ``model.safetensors``), a ``.safetensors``
    file or an index file, local or any fsspec URL. Reads the index, ``config.json`` and headers.

    Raises one error naming the file (and tensor) for a missing file, a truncated file, a header
    whose offsets run past the end, or an index that names tensors a file does not hold.
    """
    url = location if isinstance(location, str) else location.url
    named = isinstance(location, str) and (url.endswith(".safetensors") or url.endswith(".json"))
    if named:
        folder, name = _split(url)
        storage = Storage(folder, storage_options)
        index = name if name.endswith(".json") else None
        single = None if index else name
    elif (storage := as_storage(location, storage_options)).exists(INDEX_NAME):
        index, single = INDEX_NAME, None
    elif storage.exists(SINGLE_NAME):
        index, single = None, SINGLE_NAME
    else:
        what = "holds neither" if storage.exists("") else "does not exist; expected a folder with either"
        raise ManifestError(f"{url} {what} {SINGLE_NAME} {'nor' if 'neither' in what else 'or'} "
                            f"{INDEX_NAME}")
    # The files a folder holds are its author's: each is read only if it resolves inside the
    # folder (a Hugging Face cache snapshot: inside its repository folder, where its blobs are).
    # A file the operator named is read as named.
    root = source_root(storage)
    tensors: dict[str, HFTensor] = {}
    if index is not None:
        wm = _weight_map(storage, index, None if named else root)
        files = tuple(dict.fromkeys(wm.values()))
        for f in files:
            if not storage.exists(f):
                names = [n for n, v in wm.items() if v == f]
                more = ", ..." if len(names) > 3 else ""
                raise IntegrityError(f"{storage.url_of(f)}: missing; {index} names it for "
                                     f"{len(names)} tensor(s) "
                                     f"({', '.join(plain(n, 64) for n in names[:3])}{more})")
            held = read_header(storage, f, root)
            absent = sorted(n for n, v in wm.items() if v == f and n not in held)
            if absent:
                raise IntegrityError(f"{storage.url_of(f)}: {index} places "
                                     f"{', '.join(plain(n, 64) for n in absent[:5])} "
                                     "in this file, whose header does not hold it")
            tensors.update((n, t) for n, t in held.items() if wm.get(n) == f)
    else:
        files = (single,)  # type: ignore[assignment]
        tensors = read_header(storage, single, None if named else root)  # type: ignore[arg-type]
    config = None
    if storage.exists(CONFIG_NAME):
        config = read_config(storage, CONFIG_NAME, root)
    log.info("opened %s: %d tensors in %d file(s), %d bytes", url, len(tensors), len(files),
             sum(t.end - t.begin for t in tensors.values()))
    return HFSource(storage, tensors, config, tuple(files))
