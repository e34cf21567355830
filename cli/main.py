"""Entry point of the ``shardckpt`` console script: imports every command module, exposes ``app``."""

from __future__ import annotations

from shardckpt.cli.app import app
from shardckpt.cli import commands  # noqa: F401  (registers commands)
from shardckpt.cli import estimate  # noqa: F401  (registers `estimate`)
from shardckpt.cli import reshard  # noqa: F401  (registers `reshard`)
from shardckpt.cli import clean  # noqa: F401  (registers `clean`)
from shardckpt.cli import demo  # noqa: F401  (registers `demo`)
from shardckpt.cli import offline  # noqa: F401
from shardckpt.cli import importers  # noqa: F401  (registers `import hf`)
from shardckpt.cli import watch  # noqa: F401  (registers `watch`)

__all__ = ["app"]

if __name__ == "__main__":
    app()
