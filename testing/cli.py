"""Run the ``shardckpt`` command line from a test and check its outcome.

In-process (:func:`cli`, typer's ``CliRunner``: fast, sees monkeypatches) or as a child process
(:func:`cli_process`, ``python -m shardckpt.cli.main``: for commands that may block, be killed or
must start cold). :func:`ok` and :func:`one_line_error` check either kind of result's exit code.
"""

from __future__ import annotations

import subprocess
import sys
from typing import Any

from typer.testing import Result

#: The command line that runs the CLI in a child process (extend with the arguments).
CLI_COMMAND = (sys.executable, "-m", "shardckpt.cli.main")


def cli(*args: str, env: dict[str, str] | None = None) -> Result:
    """``shardckpt ARGS`` in this process; stdout and stderr kept apart."""
    from typer.testing import CliRunner

    from shardckpt.cli.main import app

    return CliRunner().invoke(app, list(args), env=env)


def cli_process(*args: str, timeout: float = 300, **kwargs: Any) -> subprocess.CompletedProcess[str]:
    """``shardckpt ARGS`` in a child process (text output captured), so that a command that
    blocks cannot block the test run: it is killed after ``timeout`` seconds."""
    return subprocess.run([*CLI_COMMAND, *args], capture_output=True, text=True, timeout=timeout,
                          **kwargs)


def _code(r: Result | subprocess.CompletedProcess[str]) -> int:
    return r.exit_code if isinstance(r, Result) else r.returncode


def _output(r: Result | subprocess.CompletedProcess[str]) -> str:
    return r.output if isinstance(r, Result) else r.stdout + r.stderr


def ok(r: Any) -> Any:
    """``r`` after checking that the command exited 0."""
    assert _code(r) == 0, (_code(r), _output(r), getattr(r, "exception", None))
    return r


def one_line_error(r: Any, *needles: str, code: int = 1) -> str:
    """The command exited with ``code`` and printed exactly one stderr line, ``error: ...``,
    containing every needle, and no traceback; returns that line."""
    assert _code(r) == code, (_code(r), _output(r), getattr(r, "exception", None))
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    for n in needles:
        assert n in lines[0], (n, lines[0])
    assert "Traceback" not in _output(r)
    return lines[0]
