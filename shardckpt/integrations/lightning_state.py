"""Lightning's checkpoint dict as JSON plus tensors, and back: the pure side of the Lightning
strategies (:mod:`shardckpt.integrations.lightning`, whose docstring describes the layout).

:func:`split_state` takes the dict apart (every tensor becomes ``{"$tensor": name}``; tuples,
dicts with keys that are not strings and floats JSON lacks are tagged), :func:`join_state` puts it
back together, :func:`lightning_doc` reads the document from a manifest. Nothing is pickled: a
value that is none of these is one :class:`~shardckpt.errors.ConfigError` naming its place.
"""

from __future__ import annotations

import math
from typing import Any
from collections.abc import Mapping

import torch

from shardckpt.errors import ConfigError, ManifestError
from shardckpt.format.manifest import Manifest
from shardckpt.format.records import run_extras
from shardckpt.integrations.lightning_hf import APP_KEY

__all__ = ["LAYOUT_VERSION", "join_state", "lightning_doc", "split_state", "tensor_names"]

#: ``extras["app"]`` key of Lightning's state (``APP_KEY``), and the version of its layout.
LAYOUT_VERSION = 1
TENSOR, TUPLE, DICT, FLOAT = "$tensor", "$tuple", "$dict", "$float"
_NON_FINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


def split_state(checkpoint: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Lightning's checkpoint dict as (JSON document, tensors by DCP name).

    Every tensor becomes ``{"$tensor": name}``, ``name`` being its path joined with dots. Raises
    :class:`ConfigError` naming the path of the first value JSON cannot hold, or of two tensors
    whose paths join to one name."""
    tensors: dict[str, torch.Tensor] = {}

    def key(k: Any, path: tuple[str, ...]) -> Any:
        if isinstance(k, torch.Tensor):
            raise _not_json(k, path, "a dict key")
        return enc(k, path)

    def enc(v: Any, path: tuple[str, ...]) -> Any:
        if isinstance(v, torch.Tensor):
            name = ".".join(path)
            if name in tensors:
                raise ConfigError(f"Lightning checkpoint: two tensors are named {name!r} (their paths "
                                  "join to the same dotted name); rename one of the keys")
            tensors[name] = v
            return {TENSOR: name}
        if v is None or isinstance(v, (bool, int, str)):
            return v
        if isinstance(v, float):
            return v if math.isfinite(v) else {FLOAT: repr(v)}
        if isinstance(v, tuple):
            return {TUPLE: [enc(x, (*path, str(i))) for i, x in enumerate(v)]}
        if isinstance(v, list):
            return [enc(x, (*path, str(i))) for i, x in enumerate(v)]
        if isinstance(v, Mapping):
            plain = all(isinstance(k, str) for k in v) and not (len(v) == 1 and next(iter(v)).startswith("$"))
            if plain:
                return {k: enc(x, (*path, k)) for k, x in v.items()}
            return {DICT: [[key(k, path), enc(x, (*path, str(k)))] for k, x in v.items()]}
        raise _not_json(v, path, "a value")

    doc = enc(dict(checkpoint), ())
    return doc, tensors


def _not_json(v: Any, path: tuple[str, ...], what: str) -> ConfigError:
    where = ".".join(path) or "(top level)"
    return ConfigError(
        f"Lightning checkpoint entry {where}: {what} of type {type(v).__module__}.{type(v).__qualname__}, "
        "which shardckpt does not keep: Lightning's state is stored as JSON (None, bool, int, float, "
        "str, list, tuple, dict and tensors), never pickled. Leave it out (for hyper-parameters: "
        "save_hyperparameters(ignore=[...])) or store a JSON form of it")


def tensor_names(doc: Any) -> list[str]:
    """The DCP names that ``doc`` refers to, in document order."""
    out: list[str] = []

    def walk(v: Any) -> None:
        if isinstance(v, list):
            for x in v:
                walk(x)
        elif isinstance(v, dict):
            if len(v) == 1 and TENSOR in v and isinstance(v[TENSOR], str):
                out.append(v[TENSOR])
                return
            for x in v.values():
                walk(x)

    walk(doc)
    return out


def join_state(doc: Any, tensors: Mapping[str, torch.Tensor], source: str) -> Any:
    """The value :func:`split_state` took apart, with each ``{"$tensor": name}`` replaced by
    ``tensors[name]``. A document that does not follow the layout is one :class:`ManifestError`
    naming ``source`` and the place."""

    def bad(path: tuple[str, ...], what: str) -> ManifestError:
        return ManifestError(f"{source}: extras.app.{APP_KEY}.state.{'.'.join(path)}: {what}")

    def dec(v: Any, path: tuple[str, ...]) -> Any:
        if isinstance(v, list):
            return [dec(x, (*path, str(i))) for i, x in enumerate(v)]
        if not isinstance(v, dict):
            return v
        if len(v) == 1 and next(iter(v)).startswith("$"):
            tag, x = next(iter(v.items()))
            if tag == TENSOR:
                if not isinstance(x, str) or x not in tensors:
                    raise bad(path, f"names tensor {x!r}, which was not loaded")
                return tensors[x]
            if tag == FLOAT:
                if x not in _NON_FINITE:
                    raise bad(path, f"{FLOAT} must be one of {sorted(_NON_FINITE)}, found {x!r}")
                return _NON_FINITE[x]
            if tag == TUPLE:
                if not isinstance(x, list):
                    raise bad(path, f"{TUPLE} must hold a list")
                return tuple(dec(y, (*path, str(i))) for i, y in enumerate(x))
            if tag == DICT:
                if not isinstance(x, list) or not all(isinstance(p, list) and len(p) == 2 for p in x):
                    raise bad(path, f"{DICT} must hold a list of [key, value] pairs")
                out = {}
                for k, y in x:
                    k = dec(k, (*path, "<key>"))
                    try:
                        out[k] = dec(y, (*path, str(k)))
                    except TypeError:  # a list as a key: JSON arrays are not hashable
                        raise bad(path, f"key {k!r} cannot be a dict key") from None
                return out
            raise bad(path, f"unknown tag {tag!r}")
        return {k: dec(x, (*path, k)) for k, x in v.items()}

    return dec(doc, ())


def lightning_doc(m: Manifest, source: str) -> Any:
    """The JSON document of Lightning's state in manifest ``m``."""
    app = run_extras(m, source).app or {}
    entry = app.get(APP_KEY)
    if not isinstance(entry, dict) or "state" not in entry:
        raise ManifestError(f"{source}: no extras.app.{APP_KEY}.state: this checkpoint was not saved "
                            "by shardckpt's Lightning strategy")
    if entry.get("version") != LAYOUT_VERSION:
        raise ManifestError(f"{source}: extras.app.{APP_KEY}.version is {entry.get('version')!r}; "
                            f"this shardckpt reads version {LAYOUT_VERSION}")
    return entry["state"]
