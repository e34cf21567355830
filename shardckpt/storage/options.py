"""A user's ``storage_options`` split into the filesystem's options and shardckpt's own settings.

Each backend parses its options (:meth:`~shardckpt.storage.backend.StorageBackend.parse_options`)
with the helpers here: shardckpt's keys (``shardckpt_deadline_s``, ``shardckpt_part_size``,
``shardckpt_concurrency``) never reach the filesystem, and the deadline falls back to
``SHARDCKPT_DEADLINE_S``, then to 120 s; the backend fills in its own defaults (S3's client
settings: :data:`~shardckpt.storage.s3.S3_CONFIG_DEFAULTS`) and refuses options it does not know.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, TypeVar
from collections.abc import Callable, Collection, Mapping

from shardckpt.errors import ConfigError
from shardckpt.storage.retry import DEADLINE_ENV, RetryPolicy

T = TypeVar("T")

MiB = 1 << 20
DEFAULT_PART_SIZE = 8 * MiB
DEFAULT_CONCURRENCY = 4


@dataclass(frozen=True, slots=True)
class Tuning:
    """Transfer sizes for object stores (``shardckpt_part_size``, ``shardckpt_concurrency``)."""

    part_size: int = DEFAULT_PART_SIZE  # multipart part; doubles every 1000 parts (10,000 max)
    concurrency: int = DEFAULT_CONCURRENCY  # parts in flight per file; range pieces per read
    range_piece: int = DEFAULT_PART_SIZE    # ranged reads larger than this are split


_OWN = ("shardckpt_deadline_s", "shardckpt_part_size", "shardckpt_concurrency")


def _positive(options: Mapping[str, Any], key: str, cast: Callable[[Any], T]) -> T | None:
    if key not in options or options[key] is None:
        return None
    try:
        value = cast(options[key])
        if value > 0:  # type: ignore[operator]
            return value
    except (TypeError, ValueError):
        pass
    raise ConfigError(f"storage option {key}={options[key]!r}: expected a positive number")


def own_settings(raw: Mapping[str, Any]) -> tuple[dict[str, Any], RetryPolicy, Tuning]:
    """(the options left for the filesystem, retry policy, tuning) from ``raw``: shardckpt's own
    keys popped and checked; a ``shardckpt_`` key that is none of them is refused, named."""
    opts = dict(raw)
    stray = sorted(k for k in opts if isinstance(k, str) and k.startswith("shardckpt_") and k not in _OWN)
    if stray:
        raise ConfigError(f"storage option {', '.join(stray)}: not a shardckpt option (known: "
                          f"{', '.join(_OWN)})")
    own = {k: opts.pop(k) for k in _OWN if k in opts}
    deadline = _positive(own, "shardckpt_deadline_s", float)
    if deadline is None and os.environ.get(DEADLINE_ENV, "").strip():
        deadline = _positive({DEADLINE_ENV: os.environ[DEADLINE_ENV]}, DEADLINE_ENV, float)
    retry = RetryPolicy(deadline) if deadline is not None else RetryPolicy()
    part = _positive(own, "shardckpt_part_size", int)
    if part is not None and part < 5 * MiB:
        raise ConfigError(f"storage option shardckpt_part_size={part}: S3 parts must be >= 5 MiB")
    tuning = Tuning(part or DEFAULT_PART_SIZE,
                    _positive(own, "shardckpt_concurrency", int) or DEFAULT_CONCURRENCY)
    return opts, retry, tuning


def refuse_unknown(opts: Mapping[str, Any], known: Collection[str], where: str) -> None:
    """:class:`ConfigError` naming every key of ``opts`` not in ``known`` (``where``: the kind of
    place, for the message)."""
    unknown = sorted(str(k) for k in opts if k not in known)
    if unknown:
        raise ConfigError(f"storage option{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}: "
                          f"not known for {where} nor any other kind of place (known here: "
                          f"{', '.join(sorted(known))})")


def fsspec_option_names(fs_class: type) -> frozenset[str]:
    """The keyword options an fsspec filesystem class takes: its and its bases' named
    ``__init__`` parameters, the listing cache's, and ``skip_instance_cache``."""
    import inspect

    from fsspec.dircache import DirCache

    names = {"skip_instance_cache"}
    for cls in (*fs_class.__mro__, DirCache):
        init = cls.__dict__.get("__init__")
        if init is None:
            continue
        for p in inspect.signature(init).parameters.values():
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name != "self":
                names.add(p.name)
    return frozenset(names)


@dataclass(frozen=True, slots=True)
class BackendOptions:
    """A backend's parsed options (:meth:`~shardckpt.storage.backend.StorageBackend.parse_options`)."""

    fs: dict[str, Any] = field(default_factory=dict)  # for the filesystem
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    tuning: Tuning = field(default_factory=Tuning)
    extra: dict[str, Any] = field(default_factory=dict)  # the backend's own (s3fs's retry count)
