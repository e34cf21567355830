"""The registry of exporters: the twin of :data:`shardckpt.interop.importer.IMPORTERS`.

:data:`EXPORTERS` names every :class:`~shardckpt.interop.exporter.Exporter` by the name
``shardckpt export <name>`` takes; the command line builds its commands from this table and each
config's fields. It sits in the tools layer because one exporter (``hf``) is ``consolidate``;
the others live with their formats in :mod:`shardckpt.interop`. An exporter's module is imported
on first use, and loads its writing code only when it exports.
"""

from __future__ import annotations

import importlib

from shardckpt.errors import ConfigError
from shardckpt.interop.exporter import Exporter

#: Exporter name -> ``"module:attribute"`` of the exporter object (imported on first use).
EXPORTERS: dict[str, str] = {
    "dcp": "shardckpt.interop.dcp.exporter:DCP",
    "deepspeed": "shardckpt.interop.deepspeed.exporter:DEEPSPEED",
    "hf": "shardckpt.tools.hf_export:HF",
}


def get_exporter(name: str) -> Exporter:
    """The exporter ``name`` (:data:`EXPORTERS`); an unknown name is a :class:`ConfigError`."""
    target = EXPORTERS.get(name)
    if target is None:
        raise ConfigError(f"no exporter {name!r}; exporters: {', '.join(EXPORTERS)}")
    module, attr = target.split(":")
    exporter: Exporter = getattr(importlib.import_module(module), attr)
    return exporter
