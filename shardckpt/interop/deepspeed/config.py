"""The options of the ``deepspeed`` importer (DeepSpeed) and the origin record it leaves in
``extras`` (:class:`DeepSpeedOrigin`), apart from its reading code, so that the importer's
registry entry and its reading code both use them without importing each other."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar
from collections.abc import Mapping

from shardckpt.format.records import Check, Origin, count, text
from shardckpt.interop.importer import ImportOptions, ImporterConfig, OptionError


@dataclass(frozen=True, slots=True)
class DeepSpeedOrigin(Origin):
    """``extras.deepspeed`` of a checkpoint imported from DeepSpeed."""

    version: str | None = None
    stage: int | None = None        # the ZeRO stage that wrote it
    world_size: int | None = None   # the data-parallel world that wrote it
    tag: str | None = None
    precision: str | None = None    # "bf16" or "fp32" optimizer files
    other: Mapping[str, Any] = field(default_factory=dict, repr=False)
    keys: tuple[str, ...] | None = field(default=None, compare=False, repr=False)

    KEY: ClassVar[str] = "deepspeed"
    KEYS: ClassVar[dict[str, tuple[Check, bool, bool]]] = {
        "version": (text, False, True), "stage": (count, False, True),
        "world_size": (count, False, True), "tag": (text, False, True),
        "precision": (text, False, True)}


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
