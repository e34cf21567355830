"""Entry point of the ``shardckpt`` console script: registers only the command it runs.

typer builds the click parameters of every registered command before it dispatches, and each
command module costs its own imports; a run registers the module of its command alone (click's
"lazy subcommands" pattern), which is most of what separates ``shardckpt inspect`` from the
interpreter's own start-up. Help, and anything this table does not know, registers every
command (:mod:`shardckpt.cli.main`). ``tests/test_cli_core.py`` holds the table to the commands
the modules register.
"""

from __future__ import annotations

import importlib
import sys

#: Command name -> the module of ``shardckpt.cli`` that registers it.
COMMAND_MODULES = {
    "synth": "commands", "inspect": "commands", "verify": "commands", "estimate": "estimate",
    "reshard": "reshard", "clean": "clean", "demo": "demo", "consolidate": "offline",
    "diff": "offline", "watch": "watch", "import": "importers", "export": "exporters",
    "sign": "sign",
}


def main() -> None:
    name = next((a for a in sys.argv[1:] if not a.startswith("-")), "")
    module = COMMAND_MODULES.get(name)
    if module is None or "--help" in sys.argv[1:2]:
        from .main import app
    else:
        from .app import app

        importlib.import_module(f".{module}", __package__)
    app()


if __name__ == "__main__":
    main()
