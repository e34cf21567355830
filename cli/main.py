"""Entry point of the ``shardckpt`` console script: imports every command module, exposes ``app``."""

from __future__ import annotations

from .app import app
from . import commands, estimate, reshard, clean, demo, offline, importers, exporters, watch, sign

#: The command modules: each registers its commands on ``app`` when imported, in the order
#: ``shardckpt --help`` lists them.
COMMAND_MODULES = (commands, estimate, reshard, clean, demo, offline, importers, exporters, watch, sign)

__all__ = ["app"]

if __name__ == "__main__":
    app()
