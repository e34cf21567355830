"""What a new user of the command line meets first: ``--version``, a top-level ``--help`` that
names every command, and one line that says what a foreign or missing path is and what to run."""

from __future__ import annotations

import re

from testing.cli import cli, ok
from shardckpt import __version__


def test_version() -> None:
    r = ok(cli("--version"))
    assert r.stdout == f"shardckpt {__version__}\n"


def test_help_names_every_command() -> None:
    from shardckpt.cli.run import COMMAND_MODULES

    text = ok(cli("--help")).stdout
    intro = text.split("Options:")[0]  # the description, not click's (truncated) command list
    words = set(re.findall(r"[a-z]+", intro))
    missing = sorted(set(COMMAND_MODULES) - words)
    assert not missing, (missing, intro)
