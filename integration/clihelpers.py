"""Run the CLI in-process and check its outcome (shared by the S3 test modules)."""

from __future__ import annotations

from typer.testing import CliRunner, Result

from shardckpt.cli.main import app


def cli(*args: str, env: dict[str, str] | None = None) -> Result:
    return CliRunner().invoke(app, list(args), env=env)


def ok(r: Result) -> Result:
    assert r.exit_code == 0, (r.exit_code, r.output, r.exception)
    return r


def one_line_error(r: Result, *needles: str) -> str:
    """Exit code 1 and exactly one stderr line, ``error: ...``, containing every needle."""
    assert r.exit_code == 1, (r.exit_code, r.output, r.exception)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]
