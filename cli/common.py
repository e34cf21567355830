"""Helpers shared by commands: storage options, error-to-exit-code mapping, progress, JSON."""

from __future__ import annotations

import functools
import json
import re
import sys
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional, TypeVar

import typer

F = TypeVar("F", bound=Callable[..., Any])

#: Exit codes: 1 = the checkpoint or an I/O operation failed; 2 = bad usage or options.
EXIT_FAILED = 1
EXIT_USAGE = 2

StorageOptionArg = typer.Option(
    None, "--storage-option", "-o",
    help="KEY=VALUE passed to fsspec (repeatable; VALUE is parsed as JSON when it can be).",
)


def parse_storage_options(items: Optional[list[str]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in items or []:
        if "=" not in item:
            fail(f"--storage-option {item!r}: expected KEY=VALUE", EXIT_USAGE)
        key, value = item.split("=", 1)
        try:
            parsed: Any = json.loads(value)
        except ValueError:
            parsed = value
        cur = out
        parts = key.split(".")  # client_kwargs.endpoint_url=... nests
        for p in parts[:-1]:
            cur = cur.setdefault(p, {})
        cur[parts[-1]] = parsed
    return out


_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([kKmMgGtTbB]?)[iI]?[bB]?\s*$")


def parse_count(text: str, what: str) -> int:
    """'7.5e9', '7.5B', '125M', '5GB' -> int (K/M/G/B/T are powers of 1000)."""
    m = _SIZE.match(text)
    if not m:
        fail(f"{what} {text!r}: expected a number such as 1e6, 125M, 7.5B", EXIT_USAGE)
    scale = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "b": 1e9, "t": 1e12}[m.group(2).lower()]
    value = int(round(float(m.group(1)) * scale))
    if value <= 0:
        fail(f"{what} {text!r}: must be positive", EXIT_USAGE)
    return value


def fail(message: str, code: int = EXIT_FAILED) -> None:
    """One line on stderr, then exit with ``code``."""
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


def guarded(fn: F) -> F:
    """Turn shardckpt errors into one line on stderr and a non-zero exit."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        from shardckpt.errors import ConfigError, ShardckptError

        try:
            return fn(*args, **kwargs)
        except ConfigError as e:
            fail(str(e), EXIT_USAGE)
        except ShardckptError as e:
            fail(str(e).splitlines()[0] if str(e) else type(e).__name__, EXIT_FAILED)
        except KeyboardInterrupt:
            fail("interrupted", 130)

    return wrapper  # type: ignore[return-value]


@contextmanager
def progress(total: int, description: str, enabled: bool = True) -> Iterator[Callable[[int], None]]:
    """A rich progress bar on stderr when it is a terminal; a no-op callback otherwise."""
    if not enabled or not sys.stderr.isatty():
        yield lambda n: None
        return
    from rich.console import Console
    from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn,
                               TimeRemainingColumn, TransferSpeedColumn)

    with Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(),
                  TransferSpeedColumn(), TimeRemainingColumn(),
                  console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task(description, total=total)
        yield lambda n: bar.advance(task, n)


def echo_json(obj: Any) -> None:
    typer.echo(json.dumps(obj, indent=2, sort_keys=False))


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    return f"{n:.2f} TB"
