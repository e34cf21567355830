"""The options of the ``deepspeed`` importer (DeepSpeed), apart from its reading code, so that the
importer's registry entry and its reading code both use them without importing each other."""

from __future__ import annotations

from dataclasses import dataclass, field

from shardckpt.interop.importer import ImportOptions, ImporterConfig, OptionError


@dataclass(frozen=True, slots=True)
class DeepSpeedConfig(ImporterConfig):
    """``tag``: the tag folder to import (None: the one ``latest`` names). ``tmp_dir``: the local
    folder the source's fp32 state is staged below (None: the system's temporary folder)."""

    tag: str | None = field(default=None, metadata={
        "help": "Tag folder to import (default: the one 'latest' names)."})
    tmp_dir: str | None = field(default=None, metadata={
        "help": "Local folder for the staged fp32 state (about the size of the optimizer files)."})

    def check(self, options: ImportOptions) -> None:
        if options.ranks is None:
            raise OptionError("import deepspeed needs {ranks}: the world size the checkpoint is "
                              "laid out for", "ranks")
