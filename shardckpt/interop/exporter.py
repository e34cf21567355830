"""One interface for every exporter (DCP, DeepSpeed, Hugging Face): the twin of
:mod:`shardckpt.interop.importer`.

An exporter (:class:`Exporter`) writes a shardckpt checkpoint out in a foreign format:
:meth:`~Exporter.export` reads the source through the checked read path and writes the foreign
files, the one that makes them whole last (DCP's ``.metadata``, DeepSpeed's ``latest``, the
Hugging Face index), and returns a summary as plain data (what ``shardckpt export <name> --json``
prints); :meth:`~Exporter.summary_line` is the one line printed otherwise.

Its options are one :class:`ExportOptions`: the source, the destination and their storage
options and, in ``config``, the exporter's own frozen dataclass (an :class:`ExporterConfig`).
A config field's ``metadata`` says how the command line spells it: ``help`` (a field without
one is not on the command line), ``flag`` (default ``--<name-with-dashes>``) and, for a byte
count the command line takes as text (``32MB``), ``bytes``: its default as text. A field without
a default is a required option.

The registry of exporters, by the name ``shardckpt export <name>`` takes, is
:data:`shardckpt.tools.exporters.EXPORTERS`: one of the three (Hugging Face) is ``consolidate``,
which lives a layer above this one. An exporter object and its config live in a light module
(``shardckpt.interop.<format>.exporter``) that loads the format's writing code only when it
exports.

Does not import torch, numpy or fsspec.
"""

from __future__ import annotations

import dataclasses
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable
from collections.abc import Callable, Mapping

from shardckpt.errors import ConfigError

#: Opens a progress display for ``total`` units of work named ``what``; yields the callback
#: counting units done.
Progress = Callable[[int, str], AbstractContextManager[Callable[[int], None]]]


@dataclass(frozen=True, slots=True)
class ExporterConfig:
    """An exporter's own options, nested in :attr:`ExportOptions.config` (module docstring: how
    its fields are spelled on the command line)."""


@dataclass(frozen=True, slots=True)
class ExportOptions:
    """What an export is asked to do: ``src``, a shardckpt checkpoint (path or URL); ``dst``,
    where the foreign files go (path or URL); ``storage_options`` go to fsspec for the source,
    ``dst_storage_options`` for the destination; ``config``: the exporter's own options (None
    for its defaults, where it has them)."""

    src: str
    dst: str
    storage_options: Mapping[str, Any] | None = None
    dst_storage_options: Mapping[str, Any] | None = None
    config: ExporterConfig | None = None


@runtime_checkable
class Exporter(Protocol):
    """A foreign format out. Presentation (``help``, ``source_help``, ``destination_help``,
    :meth:`summary_line`) is what ``shardckpt export <name>`` shows."""

    @property
    def name(self) -> str:
        """``shardckpt export <name>``."""
        ...

    @property
    def Config(self) -> type[ExporterConfig]:  # noqa: N802 - the nested config class
        """The exporter's own options (an :class:`ExporterConfig` subclass)."""
        ...

    @property
    def help(self) -> str:
        """The command's help."""
        ...

    @property
    def source_help(self) -> str:
        ...

    @property
    def destination_help(self) -> str:
        ...

    def export(self, options: ExportOptions, progress: Progress | None = None) -> dict[str, Any]:
        """Write ``options.src`` at ``options.dst``; on any error nothing is left that the
        foreign reader takes for whole. Returns the summary (plain data)."""
        ...

    def summary_line(self, summary: Mapping[str, Any], options: ExportOptions,
                     size: Callable[[int], str]) -> str:
        """One line of what an export wrote; ``size`` formats a byte count."""
        ...


def with_export_config(exporter: Exporter, options: ExportOptions) -> ExportOptions:
    """``options`` with the exporter's default config where it has none; a config of another
    exporter, or none where the exporter's config has required fields, is a
    :class:`ConfigError`."""
    cls = exporter.Config
    if options.config is None:
        required = [f.name for f in dataclasses.fields(cls)
                    if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
        if required:
            raise ConfigError(f"export {exporter.name} needs a {cls.__name__} (its "
                              f"{', '.join(required)})")
        return dataclasses.replace(options, config=cls())
    if not isinstance(options.config, cls):
        raise ConfigError(f"config is a {type(options.config).__name__}; export {exporter.name} "
                          f"takes a {cls.__name__}")
    return options


def run_exporter(exporter: Exporter, options: ExportOptions,
                 progress: Progress | None = None) -> dict[str, Any]:
    """The whole export by ``exporter``, its config checked first; returns its summary."""
    return exporter.export(with_export_config(exporter, options), progress)
