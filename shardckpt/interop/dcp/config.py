"""The options of the ``dcp`` importer (DCP), the origin record it leaves in ``extras``
(:class:`DcpOrigin`) and the export's default file size, apart from the reading and writing
code, so that the registry entries and that code both use them without importing each other."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, ClassVar
from collections.abc import Mapping

from shardckpt.format.records import Check, Origin, text, texts
from shardckpt.interop.importer import ImportOptions, ImporterConfig, OptionError


#: A payload file an export writes is closed once it holds this many bytes (``--file-size``;
#: DCP reads files independently).
DEFAULT_FILE_BYTES = 1 << 30


@dataclass(frozen=True, slots=True)
class DcpOrigin(Origin):
    """``extras.dcp`` of a checkpoint imported from DCP: the source's metadata version and its
    payload files, sorted (the import writes one chunks file per source file, in that order)."""

    version: str | None = None
    files: tuple[str, ...] = ()
    other: Mapping[str, Any] = field(default_factory=dict, repr=False)
    keys: tuple[str, ...] | None = field(default=None, compare=False, repr=False)

    KEY: ClassVar[str] = "dcp"
    KEYS: ClassVar[dict[str, tuple[Check, bool, bool]]] = {
        "version": (text, False, True), "files": (texts, False, True)}


@dataclass(frozen=True, slots=True)
class DcpConfig(ImporterConfig):
    """What only an import into flat groups (``ranks`` given) reads: the state-dict keys of the
    model (``""``: torchtitan's top-level model keys) and of the optimizer (None: ``optim`` or
    ``optimizer``), the patterns naming frozen parameters (each matching whole FQNs), and the
    local folder the source is staged below (None: the system's temporary folder)."""

    model_key: str = field(default="model", metadata={
        "help": "With --ranks: the state-dict key of the model ('' for torchtitan's top-level "
                "model keys)."})
    optim_key: str | None = field(default=None, metadata={
        "help": "With --ranks: the key of the optimizer (default: optim or optimizer)."})
    frozen: tuple[str, ...] = field(default=(), metadata={
        "help": "With --ranks: regular expression matching (whole) the FQN of frozen parameters "
                "(requires_grad=False; repeatable). A model tensor without optimizer state is a "
                "frozen parameter when a param group lists it or it matches --frozen, else a "
                "buffer."})
    tmp_dir: str | None = field(default=None, metadata={
        "help": "With --ranks: local folder for the staged source (about its size)."})

    def __post_init__(self) -> None:
        if not isinstance(self.frozen, tuple):
            object.__setattr__(self, "frozen", tuple(self.frozen))
        for pat in self.frozen:
            try:
                re.compile(pat)
            except re.error as e:
                raise OptionError(f"{{frozen}} pattern {pat!r} is not a regular expression: {e}",
                                  "frozen") from None

    def check(self, options: ImportOptions) -> None:
        if options.ranks is None and self.frozen:
            raise OptionError("{frozen} needs {ranks} (chunks keep every tensor as it is)",
                              "frozen", "ranks")
