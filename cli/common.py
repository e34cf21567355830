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


_BYTES = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")
_BYTE_UNITS = {"": 1, "b": 1,
               **{f"{p}{b}": 1000 ** (i + 1) for i, p in enumerate("kmgt") for b in ("", "b")},
               **{f"{p}i{b}": 1 << 10 * (i + 1) for i, p in enumerate("kmgt") for b in ("", "b")}}


def parse_bytes(text: str, what: str) -> int:
    """A size in bytes, the one parser of every size option: '64' and '64B' are 64 bytes;
    K/KB, M/MB, G/GB, T/TB are powers of 1000, Ki/KiB, Mi/MiB, Gi/GiB, Ti/TiB powers of 1024
    (case-insensitive); '1e9' is a billion bytes."""
    m = _BYTES.match(text)
    unit = m.group(2).lower() if m else ""
    if not m or unit not in _BYTE_UNITS:
        fail(f"{what} {text!r}: expected a size in bytes such as 65536, 64KiB, 32MB, 1GiB", EXIT_USAGE)
    value = int(round(float(m.group(1)) * _BYTE_UNITS[unit]))
    if value <= 0:
        fail(f"{what} {text!r}: must be positive", EXIT_USAGE)
    return value


def fail(message: str, code: int = EXIT_FAILED) -> None:
    """One line on stderr, then exit with ``code``."""
    typer.echo(f"error: {safe_text(message, sys.stderr)}", err=True)
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
        except OSError as e:  # the last resort: an I/O failure that no layer below named
            where = f"{e.filename}: " if getattr(e, "filename", None) else ""
            fail(f"{where}{type(e).__name__}: {e.strerror or e}", EXIT_FAILED)

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


def safe_text(value: object, stream: Any = None) -> str:
    """``value`` as printable text for ``stream`` (stdout by default): control characters (a
    newline, an escape sequence) and characters the stream cannot encode (a lone surrogate) come
    out as backslash escapes instead of acting on the terminal or raising."""
    text = str(value)
    encoding = getattr(stream or sys.stdout, "encoding", None) or "utf-8"
    if text.isprintable():
        try:
            text.encode(encoding)
            return text
        except (UnicodeError, LookupError):
            pass
    out = []
    for ch in text:
        if ch.isprintable():
            try:
                ch.encode(encoding)
                out.append(ch)
                continue
            except (UnicodeError, LookupError):
                pass
        out.append(ch.encode("unicode_escape").decode("ascii"))
    return "".join(out)


def echo(text: object, err: bool = False) -> None:
    """``typer.echo`` of text that may hold names read from a checkpoint (see :func:`safe_text`)."""
    typer.echo(safe_text(text, sys.stderr if err else sys.stdout), err=err)


def console(stderr: bool = False) -> Any:
    """A rich console that prints strings as they are (no markup, emoji or highlighting: names
    come from checkpoints) and, writing to a pipe or file, never wraps or cuts a line."""
    from rich.console import Console

    stream = sys.stderr if stderr else sys.stdout
    wide = None if stream.isatty() else 1 << 20
    return Console(stderr=stderr, markup=False, emoji=False, highlight=False, width=wide)


def checkpoint_location(url: str, storage_options: dict[str, Any]) -> str:
    """The checkpoint ``url`` names: a run directory resolves to the checkpoint its ``latest``
    names, and stderr says so."""
    from shardckpt.checkpoint.run_dir import resolve_checkpoint

    resolved, note = resolve_checkpoint(url, storage_options)
    if note:
        echo(note, err=True)
    return resolved
