"""A user's ``storage_options`` split into fsspec's options and shardckpt's own settings.

shardckpt's keys (``shardckpt_deadline_s``, ``shardckpt_part_size``, ``shardckpt_concurrency``)
never reach fsspec; the deadline falls back to ``SHARDCKPT_DEADLINE_S``, then to 120 s. For s3
the client defaults below (:data:`S3_CONFIG_DEFAULTS`) are filled in, the user's own keys winning.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable, Mapping, TypeVar

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


#: botocore settings for s3 unless the user gives their own (merged key by key).
S3_CONFIG_DEFAULTS: dict[str, Any] = {
    "retries": {"mode": "standard", "total_max_attempts": 2},
    "connect_timeout": 10,
    "read_timeout": 30,
    "max_pool_connections": 32,
}
S3FS_RETRIES = 1  # s3fs's own retry loop (its default is 5)


def fill_s3_defaults(opts: dict[str, Any]) -> int:
    """Fill the s3 defaults into fsspec options ``opts`` (in place); return s3fs's retry count."""
    config = dict(S3_CONFIG_DEFAULTS)
    config.update(opts.get("config_kwargs") or {})
    opts["config_kwargs"] = config
    opts.setdefault("use_listings_cache", False)  # other processes write here too
    return int(opts.pop("retries", S3FS_RETRIES))  # not an S3FileSystem argument


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


def split_options(url: str, options: Mapping[str, Any] | None,
                  ) -> tuple[dict[str, Any], RetryPolicy, Tuning, int | None]:
    """(fsspec options, retry policy, tuning, s3fs retries) from a user's ``storage_options``.

    shardckpt's own keys (``shardckpt_*``) are popped; for s3 the defaults are filled in.
    """
    opts = storage_options_from_env(url, options)
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
    s3fs_retries = None
    if url.startswith(("s3://", "s3a://")):
        s3fs_retries = fill_s3_defaults(opts)
    return opts, retry, tuning, s3fs_retries


def storage_options_from_env(url: str, options: Mapping[str, Any] | None) -> dict[str, Any]:
    """fsspec options for ``url``: the user's, plus an S3 endpoint from ``AWS_ENDPOINT_URL(_S3)``.

    Credentials (``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_PROFILE``) are read by
    botocore itself.
    """
    opts = dict(options or {})
    if url.startswith(("s3://", "s3a://")):
        endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        ck = dict(opts.get("client_kwargs") or {})
        if endpoint and "endpoint_url" not in ck and "endpoint_url" not in opts:
            ck["endpoint_url"] = endpoint
        if ck:
            opts["client_kwargs"] = ck
    return opts
