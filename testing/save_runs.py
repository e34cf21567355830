"""Fewer launches for the save/load suites: several commands in one ``torchrun`` job, and one job
per world size for the save/load and offload modules.

**Commands.**
Each command of a torchrun job of the offline tools costs a launcher and N interpreters that
import torch; a suite that checks many commands at one size runs them as one job instead::

    from testing.save_runs import torchrun_commands

    runs = torchrun_commands(2, [["verify", src, "--json"], ["diff", a, b, "--json"]])
    runs[0].codes    # the exit code of each process, by rank
    runs[0].stdout   # what every process printed, rank after rank

Every process initializes the gloo group from torchrun's variables once; each command then runs
in process (typer's ``CliRunner``, the ``shardckpt`` app) and finds the group up: the job it
belongs to is the torchrun job, as when torchrun starts ``-m shardckpt`` itself (which then
initializes the same group). A process records each command's outcome as soon as it ends, so
a job that fails part way still reports the commands before. A command that fails on purpose
belongs at the end of the list.

**Jobs by world size.** ``integration/test_save_load.py`` saves from a 4-rank job and loads on 1
to 4 ranks; ``integration/test_offload_runtime.py`` runs its cases on 1 to 4 ranks. Each module
registers a runner ``runner(rank, world, root, names) -> {name: value}`` and the names it runs
at each size; :func:`world_reports` runs one job per world size with the runners of every
registered module the session selected, module after module in the same process group, the
4-rank job first (it saves what the others load)::

    register(__name__, "run", names_for)                 # at import
    reports = world_reports(__name__, 3, tmp_path_factory, selected_modules(session))

``root`` is one directory for the session (:func:`session_root`).
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from testing.ranks import run_distributed
from testing.torchrun import ROOT

__all__ = ["CommandRun", "register", "session_root", "torchrun_commands", "world_reports"]


@dataclass(frozen=True)
class CommandRun:
    """One command of a job: each process's exit code, and its output, rank after rank."""

    args: list[str]
    codes: list[int]
    stdout: str
    stderr: str
    errors: list[str]  # per rank: the unexpected exception's traceback, or ""

    def describe(self) -> str:
        return f"{self.args}: exit codes {self.codes}\n{self.stderr[-3000:]}\n" + \
            "\n".join(e for e in self.errors if e)[-3000:]


def torchrun_commands(nproc: int, commands: list[list[str]], timeout: float = 240
                      ) -> list[CommandRun]:
    """Run ``commands`` (each the arguments of ``shardckpt``) in order in one torchrun job of
    ``nproc`` processes; one :class:`CommandRun` per command. Raises AssertionError (with the
    job's output) where a process did not report every command."""
    with tempfile.TemporaryDirectory(prefix="save-runs-") as tmp:
        plan = Path(tmp, "plan.json")
        plan.write_text(json.dumps(commands))
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
               str(nproc), "-m", "testing.save_runs", str(plan), tmp]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "SHARDCKPT_DIST_TIMEOUT_S": "60",
               "PYTHONPATH": str(ROOT)}
        job = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env,
                             cwd=ROOT)
        reports = []
        for rank in range(nproc):
            path = Path(tmp, f"rank-{rank}.json")
            reports.append(json.loads(path.read_text()) if path.exists() else [])
        if any(len(r) != len(commands) for r in reports):
            raise AssertionError(f"the job (exit code {job.returncode}) did not run every command "
                                 f"on every process:\n{job.stdout[-3000:]}\n{job.stderr[-6000:]}")
    return [CommandRun(args, [r[i]["code"] for r in reports],
                       "".join(r[i]["stdout"] for r in reports),
                       "".join(r[i]["stderr"] for r in reports),
                       [r[i]["error"] for r in reports])
            for i, args in enumerate(commands)]


def _worker(plan: str, out: str) -> None:
    import datetime
    import traceback

    import torch.distributed as dist

    from testing.cli import cli

    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", timeout=datetime.timedelta(
        seconds=float(os.environ["SHARDCKPT_DIST_TIMEOUT_S"])))
    done = []
    path = Path(out, f"rank-{rank}.json")
    try:
        for args in json.loads(Path(plan).read_text()):
            r = cli(*args)
            error = ""
            if r.exception is not None and not isinstance(r.exception, SystemExit):
                error = "".join(traceback.format_exception(*r.exc_info)) if r.exc_info else \
                    repr(r.exception)
            done.append({"code": r.exit_code, "stdout": r.stdout, "stderr": r.stderr,
                         "error": error})
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(done))
            os.replace(tmp, path)
    finally:
        dist.destroy_process_group()


# ------------------------------------------------------------------------ jobs by world size

#: The world size whose job runs first: it saves the checkpoint the other sizes load.
FIRST_WORLD = 4


@dataclass(frozen=True)
class _Part:
    module: str
    runner: str
    names_for: Callable[[int], list[str]]


_PARTS: dict[str, _Part] = {}
_ROOT: list[str] = []
#: (world, modules) -> module -> name -> per-rank values, or the failure of that job
_DONE: dict[tuple[int, frozenset[str]], Any] = {}


def register(module: str, runner: str, names_for: Callable[[int], list[str]]) -> None:
    """Let the job of each world size run ``module.runner``'s ``names_for(world)`` (at import)."""
    _PARTS[module] = _Part(module, runner, names_for)


def session_root(tmp_path_factory: Any) -> str:
    """The session's directory for the jobs' checkpoints (made on the first call)."""
    if not _ROOT:
        _ROOT.append(str(tmp_path_factory.mktemp("save-runs")))
    return _ROOT[0]


def _job(rank: int, world: int, root: str, plan: list[tuple[str, str, list[str]]]
         ) -> dict[str, Any]:
    import torch.distributed as dist

    out = {}
    for module, runner, names in plan:
        out[module] = getattr(importlib.import_module(module), runner)(rank, world, root, names)
        dist.barrier()
    return out


def _run(world: int, wanted: frozenset[str], root: str) -> dict[str, Any]:
    key = (world, wanted)
    if key not in _DONE:
        parts = [p for name, p in _PARTS.items() if name in wanted]
        plan = [(p.module, p.runner, p.names_for(world)) for p in parts]
        try:
            values = run_distributed(_job, world, args=(root, plan), timeout_s=900,
                                     pg_timeout_s=150)
            _DONE[key] = {p.module: {n: [v[p.module][n] for v in values]
                                     for n in p.names_for(world)} for p in parts}
        except AssertionError as e:  # every module sharing the job fails with it, once
            _DONE[key] = e
    if isinstance(_DONE[key], AssertionError):
        raise _DONE[key]
    return _DONE[key]


def world_reports(module: str, world: int, tmp_path_factory: Any,
                  selected: Iterable[str] | None = None) -> dict[str, list[Any]]:
    """name -> per-rank values of ``module``'s runner on ``world`` ranks, from the job of that
    size, which runs every registered module in ``selected`` (default: all; ``module`` always).
    The :data:`FIRST_WORLD` job runs before any other."""
    wanted = set(_PARTS) if selected is None else set(selected) & set(_PARTS)
    wanted.add(module)
    root = session_root(tmp_path_factory)
    _run(FIRST_WORLD, frozenset(wanted), root)
    return _run(world, frozenset(wanted), root)[module]


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2])
