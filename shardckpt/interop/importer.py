"""One interface for every importer (Hugging Face, DeepSpeed, DCP).

An importer (:class:`Importer`) turns a foreign checkpoint into a shardckpt one in two steps:
:meth:`~Importer.plan` reads and checks the source and says what will be written (an
:class:`ImportPlan`: the checkpoint's spec and what produces each file's bytes, holding whatever
the source staged until it is closed); :meth:`~Importer.write` writes it, alone or as the
processes of a ``torchrun`` job, and commits ``manifest.json`` last. :meth:`~Importer.describe_source`
says what a source holds without importing it. Each importer also names what it records of
its source: its :attr:`~Importer.origin` record under ``extras`` (the format layer names no
foreign format) and the keys of :meth:`~Importer.summary` in the summary of an import.

Its options are one :class:`ImportOptions`: what every importer takes (source, destination, mesh,
units, buffer, storage options) and, in ``config``, the importer's own frozen dataclass (an
:class:`ImporterConfig`: ``HFConfig``, ``DeepSpeedConfig``, ``DcpConfig``). Each dataclass checks
its own fields when it is made, and :meth:`ImporterConfig.check` the combinations with the common
options; a bad value is one :class:`OptionError` naming the fields.

:data:`IMPORTERS` names every importer by the name ``shardckpt import <name>`` takes; an importer
object and its config live in a light module (``shardckpt.interop.<format>.importer``) that loads
the format's reading code only when a source is read. The command line builds its commands from
this table and each config's fields. The twin for the way out is :mod:`shardckpt.interop.exporter`.

Does not import torch, numpy or fsspec.
"""

from __future__ import annotations

import dataclasses
import importlib
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable
from collections.abc import Callable, Mapping

from shardckpt.errors import ConfigError
from shardckpt.storage import DEFAULT_BATCH

if TYPE_CHECKING:
    from shardckpt.checkpoint.writer import CheckpointSpec, Producer
    from shardckpt.format.manifest import Manifest
    from shardckpt.format.records import Origin, RunExtras
    from shardckpt.checkpoint.job import Job
    from shardckpt.storage import Storage

#: Bytes per read when an import is not told (``--buffer``).
DEFAULT_BUFFER = DEFAULT_BATCH

#: Importer name -> ``"module:attribute"`` of the importer object (imported on first use).
IMPORTERS: dict[str, str] = {
    "hf": "shardckpt.interop.hf.importer:HF",
    "deepspeed": "shardckpt.interop.deepspeed.importer:DEEPSPEED",
    "dcp": "shardckpt.interop.dcp.importer:DCP",
}


class OptionError(ConfigError):
    """A bad option, or a bad combination of options. ``template`` names each field of
    ``fields`` as ``{field}``; the message spells them as the fields' names, and
    :meth:`spelled` another way (the command line's ``--ranks``)."""

    def __init__(self, template: str, *fields: str) -> None:
        self.template, self.fields = template, fields
        super().__init__(self.spelled(lambda f: f))

    def spelled(self, spell: Callable[[str], str]) -> str:
        out = self.template
        for f in self.fields:
            out = out.replace("{" + f + "}", spell(f))
        return out

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (self.template, *self.fields)


@dataclass(frozen=True, slots=True)
class ImporterConfig:
    """An importer's own options, nested in :attr:`ImportOptions.config`. A subclass's
    ``__post_init__`` rejects bad values of its own fields; :meth:`check` rejects combinations
    with the common options. A field's ``metadata["help"]`` is its command-line help (a field
    without one is not on the command line)."""

    def check(self, options: ImportOptions) -> None:
        """Raise :class:`OptionError` for a combination of ``options`` this importer refuses."""


@dataclass(frozen=True, slots=True)
class ImportOptions:
    """What an import is asked to do.

    ``ranks`` is the world size the checkpoint is laid out for (``replicate`` x shards); None
    where an importer can keep the source's own layout (DCP's chunks). ``units``: regular
    expressions, each match (whole name components) one unit; None for the importer's default.
    ``buffer_bytes`` bounds each read, and so memory. ``storage_options`` go to fsspec for the
    source, ``dst_storage_options`` for the destination. ``config``: the importer's own options
    (its ``Config``; None for its defaults). ``signing_key``: a private key file (or key) that
    signs the checkpoint written, with a digest per file (docs/FORMAT.md section 16).
    """

    src: Any            # a path or URL, a Storage, or a source an importer opened (HFSource)
    dst: Any            # a path or URL, or a Storage
    ranks: int | None = None
    replicate: int = 1
    units: tuple[str, ...] | None = None
    buffer_bytes: int = DEFAULT_BUFFER
    storage_options: Mapping[str, Any] | None = None
    dst_storage_options: Mapping[str, Any] | None = None
    config: ImporterConfig | None = None
    signing_key: Any = None

    def __post_init__(self) -> None:
        if self.units is not None and not isinstance(self.units, tuple):
            object.__setattr__(self, "units", tuple(self.units))
        if self.ranks is not None and (self.ranks < 1 or self.replicate < 1
                                       or self.ranks % self.replicate):
            raise OptionError(f"{{ranks}} {self.ranks} must be a positive multiple of "
                              f"{{replicate}} {self.replicate}", "ranks", "replicate")
        if self.buffer_bytes < 1:
            raise OptionError(f"{{buffer_bytes}} {self.buffer_bytes} must be at least 1 byte",
                              "buffer_bytes")
        if self.config is not None:
            self.config.check(self)


@dataclass(frozen=True, slots=True)
class SourceInfo:
    """What a source holds, read without importing it: its format, the files an import reads
    (relative to ``url``) and their total size, how many tensors (None where that is known only
    once the files are loaded), and what else the format records (``details``)."""

    format: str
    url: str
    files: tuple[str, ...]
    bytes: int
    tensors: int | None
    details: Mapping[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class ImportPlan:
    """What an importer will write at ``out``: the checkpoint ``spec``; for flat groups
    ``shard(s)``, the producer of shard ``s``'s bytes, and ``buffers``, of the buffers file;
    ``state``, what only its importer reads. ``what`` names the import in logs and errors.
    Holds what the source staged (temporary folders) until closed."""

    options: ImportOptions
    out: Storage
    spec: CheckpointSpec
    what: str
    shard: Callable[[int], Producer] | None = None
    buffers: Producer | None = None
    state: Any = None
    stack: ExitStack = field(default_factory=ExitStack)

    def close(self) -> None:
        self.stack.close()

    def __enter__(self) -> ImportPlan:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


@runtime_checkable
class Importer(Protocol):
    """A foreign format in. Presentation (``help``, ``source_help``, ``ranks_help``,
    :meth:`summary_line`) is what ``shardckpt import <name>`` shows."""

    @property
    def name(self) -> str:
        """``shardckpt import <name>``."""
        ...

    @property
    def Config(self) -> type[ImporterConfig]:  # noqa: N802 - the nested config class
        """The importer's own options (an :class:`ImporterConfig` subclass)."""
        ...

    @property
    def help(self) -> str:
        """The command's help: one line, then paragraphs."""
        ...

    @property
    def source_help(self) -> str:
        ...

    @property
    def ranks_help(self) -> str | None:
        """Help of ``--ranks`` where it is optional; None where the importer needs it."""
        ...

    @property
    def default_units(self) -> tuple[str, ...]:
        """Unit patterns when ``units`` is None."""
        ...

    @property
    def origin(self) -> type[Origin] | None:
        """The record this importer leaves in ``extras`` (under its ``KEY``) saying where the
        checkpoint came from; None where it leaves none."""
        ...

    def splits(self, options: ImportOptions) -> bool:
        """Whether the processes of a job share the writing (each plans and writes its share of
        the files); otherwise one process imports while the others wait."""
        ...

    def describe_source(self, src: Any, storage_options: Mapping[str, Any] | None = None,
                        config: ImporterConfig | None = None) -> SourceInfo:
        ...

    def plan(self, options: ImportOptions) -> ImportPlan:
        """Read and check the source (refusing a destination that holds a checkpoint) and say
        what to write. The caller closes the plan."""
        ...

    def write(self, plan: ImportPlan, job: Job | None = None) -> Manifest:
        """Write ``plan``'s files and commit the manifest last; on any error nothing is
        committed. Every process of ``job`` calls this with the same plan (None: one process
        alone, :meth:`~shardckpt.checkpoint.job.Job.single`)."""
        ...

    def summary(self, extras: RunExtras, dst: str) -> dict[str, Any]:
        """What an import of flat groups recorded of its source, from the ``extras`` it wrote
        (a fault in them names ``dst``): the importer's keys of
        :func:`~shardckpt.interop.importing.import_summary`."""
        ...

    def summary_line(self, summary: Mapping[str, Any], options: ImportOptions,
                     size: Callable[[int], str]) -> str:
        """One line of what an import wrote (``summary``: :func:`~shardckpt.interop.importing.import_summary`);
        ``size`` formats a byte count."""
        ...


def get_importer(name: str) -> Importer:
    """The importer ``name`` (:data:`IMPORTERS`); an unknown name is a :class:`ConfigError`."""
    target = IMPORTERS.get(name)
    if target is None:
        raise ConfigError(f"no importer {name!r}; importers: {', '.join(IMPORTERS)}")
    module, attr = target.split(":")
    return getattr(importlib.import_module(module), attr)


def with_config(importer: Importer, options: ImportOptions) -> ImportOptions:
    """``options`` with the importer's default config where it has none (checked again); a
    config of another importer is an :class:`OptionError`."""
    if options.config is None:
        return dataclasses.replace(options, config=importer.Config())
    if not isinstance(options.config, importer.Config):
        raise OptionError(f"{{config}} is a {type(options.config).__name__}; import "
                          f"{importer.name} takes a {importer.Config.__name__}", "config")
    return options


def run_importer(importer: Importer, options: ImportOptions,
                 job: Job | None = None) -> Manifest:
    """Plan, write and close: the whole import, by this process of ``job`` (None: one process
    alone, :meth:`~shardckpt.checkpoint.job.Job.single`). Returns the committed manifest."""
    from shardckpt.checkpoint.job import Job

    from shardckpt.checkpoint.trust import signing_key

    options = with_config(importer, options)
    with importer.plan(options) as plan:
        plan.spec.signing_key = signing_key(options.signing_key)  # before any file is written
        return importer.write(plan, job or Job.single())


def write_flat(plan: ImportPlan, job: Job | None = None) -> Manifest:
    """Write a plan of flat groups (its shard files and buffers file) through
    :func:`shardckpt.interop.importing.write_import`."""
    from shardckpt.interop.importing import write_import

    assert plan.shard is not None, "a plan of flat groups produces its shards"
    return write_import(plan.out, plan.spec, plan.what, plan.shard, plan.buffers, job)


def file_bytes(storage: Storage, files: tuple[str, ...] | list[str]) -> int:
    """The total size of ``files`` in ``storage``."""
    return sum(storage.size(f) for f in files)
