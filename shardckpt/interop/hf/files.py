"""The files of a Hugging Face model folder that are not weights.

* ``config.json`` comes from the checkpoint: a manifest's ``extras["hf_config"]`` holds the
  model's Hugging Face config (a JSON object); it is written with ``torch_dtype`` and ``dtype``
  (the key newer ``transformers`` read) set to the dtype of the consolidated weights.
* Tokenizer and generation files are copied from another model folder (``--copy-from``), by an
  explicit allow-list: never weights, never code. That folder's author is not trusted: a file
  that is a symbolic link is copied only when it resolves inside the folder (inside the
  repository folder, for a Hugging Face cache snapshot, whose files are links into ``blobs/``),
  and a ``config.json`` only when it is strict JSON a checkpoint could hold
  (:mod:`shardckpt.interop.foreign`). Both are checked before anything is written.

Does not import torch.
"""

from __future__ import annotations

import json
import re
from typing import Any
from collections.abc import Mapping

from shardckpt.errors import ConfigError
from shardckpt.format.manifest import Manifest
from shardckpt.format.records import run_extras
from shardckpt.interop.foreign import check_link, source_root
from shardckpt.storage import Storage

CONFIG = "config.json"

#: What a copy takes from a model folder: tokenizers of the common families, chat templates and
#: generation settings. ``config.json`` only when the checkpoint carries no config of its own.
COPY_ALLOWED = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "tokenizer.model", "spiece.model", "sentencepiece.bpe.model", "vocab.json", "vocab.txt",
    "merges.txt", "chat_template.jinja", "chat_template.json", "generation_config.json",
)
MAX_COPY_BYTES = 1 << 30  # a tokenizer is megabytes; anything near this is not one

#: Names that hold weights (or an index of them) in a model folder, in any common format.
WEIGHT_NAME = re.compile(r"\.(safetensors|bin|pt|pth|ckpt|gguf|h5|msgpack)(\.index\.json)?\Z"
                         r"|\.safetensors\.partial-[0-9a-f]+\Z")


def hf_config(m: Manifest, dtype: str, source: str = "") -> dict[str, Any] | None:
    """The ``config.json`` of ``m``'s weights cast to ``dtype``; None if ``m`` records no config."""
    cfg = run_extras(m, source or "the manifest").hf_config
    if cfg is None:
        return None
    return {**cfg, "torch_dtype": dtype, "dtype": dtype}


def config_bytes(config: Mapping[str, Any]) -> bytes:
    return (json.dumps(config, indent=2, sort_keys=True) + "\n").encode()


def files_to_copy(src: Storage, with_config: bool) -> list[str]:
    """The allow-listed files of model folder ``src`` (and ``config.json`` if ``with_config``).

    Raises :class:`ConfigError` when ``src`` is missing or holds none of them.
    """
    names = set(src.ls(""))
    wanted = COPY_ALLOWED + ((CONFIG,) if with_config else ())
    chosen = [n for n in wanted if n in names]
    if not names:
        raise ConfigError(f"{src.url}: no such model folder (nothing is there) to copy "
                          "tokenizer files from")
    if not chosen:
        raise ConfigError(f"{src.url} holds none of the files a copy takes ({', '.join(wanted)})")
    check_sources(src, chosen)
    return chosen


def check_sources(src: Storage, names: list[str]) -> None:
    """Refuse, before anything is written, a file of ``names`` that is a symbolic link leading
    out of ``src`` (:func:`~shardckpt.interop.foreign.source_root`), or a ``config.json`` that is
    not strict JSON: one error naming the file."""
    from shardckpt.interop.hf.source import read_config

    root = source_root(src)
    for name in names:
        check_link(src, name, root)
    if CONFIG in names:
        read_config(src, CONFIG, root)


def copy_files(src: Storage, dst: Storage, names: list[str]) -> None:
    """Copy ``names`` from ``src`` to ``dst``, each replaced atomically where the store allows;
    every name is checked (:func:`check_sources`) before the first is written."""
    check_sources(src, names)
    for name in names:
        dst.put(name, src.read_limited(name, MAX_COPY_BYTES))
