"""Reading the files of a foreign checkpoint (a Hugging Face model folder, a DeepSpeed folder)
whose author is not trusted.

* :func:`source_root` and :func:`check_link`: a file is read only if, with every symbolic link on
  its way followed, it lies inside the source's root (:mod:`shardckpt.storage.links`). The root is
  the folder the operator named, except for a Hugging Face cache snapshot
  (``.../models--<org>--<name>/snapshots/<revision>``), whose files are links into the repository
  folder's ``blobs/``: there the root is the repository folder ``models--<org>--<name>``.
* :func:`strict_json`: JSON without duplicate keys, ``NaN`` / ``Infinity``, numbers out of a
  double's range or lone UTF-16 surrogates, every fault one error naming the file.
* :func:`shown`: text from the input as it appears in an error: one line, control characters and
  lone surrogates escaped, a long string cut with its length said.

Does not import torch.
"""

from __future__ import annotations

import json
import os
from typing import Any

from shardckpt.errors import ManifestError
from shardckpt.format.parse_context import finite_float, no_duplicate_keys, reject_constant
from shardckpt.storage import Storage, resolve_inside

#: Characters of a name from the input that an error shows before cutting it.
SHOWN_CHARS = 120


def shown(text: Any, limit: int = SHOWN_CHARS) -> str:
    """``text`` quoted as Python writes a string literal (a newline as ``\\n``, a lone surrogate as
    ``\\udc80``): one line, whatever it holds; longer than ``limit`` characters, cut and its
    length said."""
    s = text if isinstance(text, str) else str(text)
    if len(s) > limit:
        return f"{s[:limit]!r}... ({len(s)} characters)"
    return repr(s)


def plain(text: str, limit: int = SHOWN_CHARS) -> str:
    """``text`` as it is where it is one short printable line, else :func:`shown`."""
    if len(text) <= limit and text.isprintable() and _encodes(text):
        return text
    return shown(text, limit)


def escaped(text: str) -> str:
    """``text`` on one line: control characters and lone surrogates as backslash escapes."""
    if text.isprintable() and _encodes(text):
        return text
    return "".join(c if c.isprintable() and _encodes(c) else c.encode("unicode_escape").decode("ascii")
                   for c in text)


def _hf_cache_repo(real: str) -> str | None:
    """The repository folder of a Hugging Face cache snapshot folder (``<cache>/models--org--name/
    snapshots/<revision>``), else None."""
    snapshots = os.path.dirname(real)
    repo = os.path.dirname(snapshots)
    if (os.path.basename(snapshots) == "snapshots" and os.path.basename(repo).startswith("models--")
            and os.path.basename(real) not in ("", ".", "..")):
        return repo
    return None


def source_root(storage: Storage) -> str | None:
    """The folder inside which ``storage``'s files must resolve, or None where the storage is
    not a local disk (object stores have no links). The operator's path is trusted: its own links
    are resolved first; a Hugging Face cache snapshot's root is its repository folder."""
    from shardckpt.storage import LocalBackend

    if not isinstance(storage.backend, LocalBackend):
        return None
    real = os.path.realpath(storage.root)
    return _hf_cache_repo(real) or real


def check_link(storage: Storage, rel: str, root: str | None) -> str | None:
    """The real path of file ``rel`` of ``storage``, refusing one that resolves outside ``root``
    (:func:`source_root`): one :class:`~shardckpt.errors.IntegrityError` naming the file and
    where its link leads. None (nothing checked) where ``root`` is None."""
    if root is None:
        return None
    base = os.path.realpath(storage.root)
    rel_to_root = os.path.relpath(os.path.join(base, rel) if rel else base, root)
    return resolve_inside(root, rel_to_root, storage.url_of(rel))


def strict_json(data: bytes, source: str) -> Any:
    """The JSON document ``data`` from file ``source``, strictly: UTF-8, no duplicate keys, no
    ``NaN`` / ``Infinity`` or number out of range, no lone surrogate in a string or key. Any fault
    is one :class:`~shardckpt.errors.ManifestError` naming ``source`` and what is wrong."""
    try:
        text = data.decode("utf-8")
        doc = json.loads(text, object_pairs_hook=no_duplicate_keys, parse_constant=reject_constant,
                         parse_float=finite_float)
    except UnicodeDecodeError as e:
        raise ManifestError(f"{source}: not valid JSON: not UTF-8 ({e.reason} at byte "
                            f"{e.start})") from None
    except (ValueError, RecursionError) as e:
        what = "nested too deeply" if isinstance(e, RecursionError) else escaped(str(e))
        raise ManifestError(f"{source}: not valid JSON: {what}") from None
    where = _lone_surrogate(doc)
    if where is not None:
        raise ManifestError(f"{source}: {where}: a string holds a lone UTF-16 surrogate (an "
                            "unpaired \\uD800-\\uDFFF escape); JSON text must be valid Unicode")
    return doc


def _encodes(s: str) -> bool:
    try:
        s.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


def _lone_surrogate(doc: Any) -> str | None:
    """Where the first string or key holding a lone surrogate is (walked without recursion)."""
    stack: list[tuple[Any, str]] = [(doc, "top level")]
    while stack:
        v, where = stack.pop()
        if isinstance(v, str):
            if not v.isascii() and not _encodes(v):
                return shown(where, 80)
        elif isinstance(v, dict):
            for k, x in v.items():
                name = k if where == "top level" else f"{where}.{k}"
                if not k.isascii() and not _encodes(k):
                    return f"{shown(name, 80)} (a key)"
                stack.append((x, name))
        elif isinstance(v, list):
            stack.extend((x, f"{where}[{i}]") for i, x in enumerate(v))
    return None
