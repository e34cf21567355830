"""The options of the ``hf`` importer (Hugging Face), apart from its reading code, so that the
importer's registry entry and its reading code both use them without importing each other."""

from __future__ import annotations

from dataclasses import dataclass, field

from shardckpt.interop.importer import ImportOptions, ImporterConfig, OptionError


#: Unit pattern of Hugging Face decoder models: one unit per block, the rest in the root.
DEFAULT_UNITS = (r"model\.layers\.\d+",)


@dataclass(frozen=True, slots=True)
class HFConfig(ImporterConfig):
    """``workers``: ranged reads in flight at once (memory about ``workers`` x the buffer)."""

    workers: int = field(default=4)

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise OptionError(f"{{workers}} {self.workers} must be at least 1", "workers")

    def check(self, options: ImportOptions) -> None:
        if options.ranks is None:
            raise OptionError("import hf needs {ranks}: the world size the checkpoint is laid "
                              "out for", "ranks")
