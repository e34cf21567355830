"""Helpers shared by commands: storage options, error-to-exit-code mapping, progress, JSON."""

from __future__ import annotations

import functools
import json
import sys
from contextlib import contextmanager
from typing import Any, TypeVar
from collections.abc import Callable, Iterator

import typer

F = TypeVar("F", bound=Callable[..., Any])

#: Exit codes: 1 = the checkpoint or an I/O operation failed; 2 = bad usage or options.
EXIT_FAILED = 1
EXIT_USAGE = 2

StorageOptionArg = typer.Option(
    None, "--storage-option", "-o",
    help="KEY=VALUE passed to fsspec (repeatable; VALUE is parsed as JSON when it can be).",
)


def parse_storage_options(items: list[str] | None) -> dict[str, Any]:
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


def parse_count(text: str, what: str) -> int:
    """A count option ('1_000_000', '1e6', '125M', '7B'): :func:`shardckpt.format.quantities.parse_count`;
    bad text is one line and exit code 2."""
    from shardckpt.format.quantities import QuantityError, parse_count as parse

    try:
        return parse(text, what)
    except QuantityError as e:
        fail(str(e), EXIT_USAGE)
        raise  # unreachable: fail exits


def parse_bytes(text: str, what: str) -> int:
    """A size option in bytes, the one parser of every size option: '64' and '64B' are 64 bytes;
    K/KB … T/TB are powers of 1000, Ki/KiB … Ti/TiB powers of 1024
    (:func:`shardckpt.format.quantities.parse_size`); bad text is one line and exit code 2."""
    from shardckpt.format.quantities import QuantityError, parse_size

    try:
        return parse_size(text, what)
    except QuantityError as e:
        fail(str(e), EXIT_USAGE)
        raise  # unreachable: fail exits


def fail(message: str, code: int = EXIT_FAILED) -> None:
    """One line on stderr, then exit with ``code``."""
    typer.echo(f"error: {safe_text(message, sys.stderr)}", err=True)
    raise typer.Exit(code)


def one_line(message: str) -> str:
    """A multi-line error (a parser's list of every offender) as one line: the first line, then
    each further line stripped, joined by "; ", so no reason is cut."""
    first, *rest = message.splitlines() or [""]
    rest = [r.strip() for r in rest if r.strip()]
    return f"{first.rstrip()} {'; '.join(rest)}" if rest else first


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
            fail(one_line(str(e)) or type(e).__name__, EXIT_FAILED)
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


def checkpoint_location(url: str, storage_options: dict[str, Any]) -> Any:
    """The checkpoint ``url`` names (a :class:`shardckpt.checkpoint.run_dir.Resolved`: its URL
    and the storage open on it, which the command reads through): a run directory resolves to
    the checkpoint its ``latest`` names, and stderr says so; a run directory of another layout,
    or a foreign checkpoint, is one error saying what it is and what to run
    (:func:`shardckpt.checkpoint.locate.locate_checkpoint`)."""
    from shardckpt.checkpoint.locate import locate_checkpoint

    resolved = locate_checkpoint(url, storage_options)
    if resolved.note:
        echo(resolved.note, err=True)
    return resolved
