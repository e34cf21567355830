"""Run a function on N real processes over torch.distributed (gloo, 127.0.0.1, a free port).

The launcher of every multi-process test, built on :mod:`shardckpt.training.launch`'s
primitives (free port, rank environment, join with a timeout)::

    from testing.ranks import run_distributed, run_ranks

    def case(rank: int, world_size: int, scale: float) -> dict:   # module level: spawn imports it
        ...                                  # the default process group is initialized
        return {"loss": 1.0}                 # JSON-serializable

    values = run_distributed(case, 4, args=(2.0,))   # one value per rank, or DistributedFailure
    results = run_ranks(case, 4, args=(2.0,))        # RankResult per rank, never raises for ranks

Test modules whose cases run in one job per world size can share that job (one spawn, one
``torch`` import and one process group per world size for all of them)::

    register_suite(__name__, "_job", cases_for)     # at import; _job(rank, world, names) -> dict
    reports = shared_reports(__name__, world, selected_modules(request.session))

Each child gets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT`` (as
torchrun sets them), one intra-op thread (``torch.set_num_threads(threads)``, for bit-exact tests)
and, unless ``init_process_group=False``, an initialized default group whose collectives raise
after ``pg_timeout_s``. Results travel back as JSON files (never pickles; spawn itself pickles
only the target's qualified name and ``args``), written before a child exits; children end with ``os._exit`` after every rank has reported (bounded by the process-group
timeout), so a broken group cannot abort or hang interpreter shutdown. The parent joins with
``timeout_s`` and kills what is left: a hung rank is reported, never waited on forever.
"""

from __future__ import annotations

import datetime
import importlib
import json
import multiprocessing
import os
import tempfile
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any
from collections.abc import Callable, Iterable, Sequence

from shardckpt.checkpoint.rendezvous import bound_store
from shardckpt.training.launch import LOOPBACK, free_port, join_all, rank_env

__all__ = ["DistributedFailure", "RankResult", "case_suite", "check_case", "free_port",
           "register_suite", "run_cases", "run_distributed", "run_ranks", "selected_modules",
           "shared_reports"]

_EXIT_KEY = "ranks/exited"
_RELEASED = "released"  # the parent has seen every rank report or die


@dataclass(frozen=True)
class RankResult:
    """What one rank reported (or what the parent saw if it reported nothing)."""

    rank: int
    ok: bool
    value: Any = None
    error_type: str = ""
    error: str = ""
    traceback: str = ""
    exitcode: int | None = None
    elapsed_s: float = 0.0

    def describe(self) -> str:
        head = f"rank {self.rank}: {self.error_type}: {self.error} (exit code {self.exitcode})"
        return head + ("\n" + self.traceback if self.traceback else "")


class DistributedFailure(AssertionError):
    """One or more ranks failed; ``results`` holds every rank's :class:`RankResult`."""

    def __init__(self, results: Sequence[RankResult]) -> None:
        self.results = list(results)
        failed = [r for r in self.results if not r.ok]
        super().__init__(f"{len(failed)} of {len(self.results)} ranks failed:\n\n"
                         + "\n\n".join(r.describe() for r in failed))


def _child(rank: int, world_size: int, port: int, target: Callable[..., Any], args: tuple,
           result_dir: str, pg_timeout_s: float, backend: str, threads: int,
           env: dict[str, str], init_pg: bool) -> None:
    os.environ.update(env)
    os.environ.update(rank_env(rank, world_size, port))
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    start = time.monotonic()
    store = None
    out: dict[str, Any] = {"rank": rank}
    try:
        if init_pg:
            timeout = datetime.timedelta(seconds=pg_timeout_s)
            store = bound_store(LOOPBACK, port, world_size, rank == 0, timeout)  # on 127.0.0.1 only
            dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                    timeout=timeout)
        value = target(rank, world_size, *args)
        json.dumps(value)  # fail here, with a traceback, if it cannot travel
        out.update(ok=True, value=value)
    except BaseException as exc:  # noqa: BLE001 - everything is reported to the parent
        out.update(ok=False, error_type=type(exc).__name__, error=str(exc),
                   traceback=traceback.format_exc())
    out["elapsed_s"] = time.monotonic() - start
    path = Path(result_dir) / f"rank-{rank:05d}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(out))
    os.replace(tmp, path)
    if store is not None:  # rank 0 hosts the store: it leaves last, even after a failure
        _wait_for_everyone(store, world_size, wait=out["ok"] or rank == 0,
                           deadline_s=pg_timeout_s, released=Path(result_dir) / _RELEASED)
    os._exit(0 if out["ok"] else 1)


def _wait_for_everyone(store: Any, world_size: int, wait: bool, deadline_s: float,
                       released: Path) -> None:
    """Count this rank out; with ``wait``, stay until every rank is out, the parent has seen every
    rank report or die (``released``: a killed rank never counts out), or the deadline."""
    try:
        store.add(_EXIT_KEY, 1)
        end = time.monotonic() + deadline_s
        while (wait and time.monotonic() < end and store.add(_EXIT_KEY, 0) < world_size
               and not released.exists()):
            time.sleep(0.01)
    except Exception:  # noqa: BLE001 - the store host is gone: nobody is left to wait for
        pass


def run_ranks(target: Callable[..., Any], world_size: int, args: Sequence[Any] = (), *,
              timeout_s: float = 120.0, pg_timeout_s: float = 30.0, backend: str = "gloo",
              threads: int = 1, env: dict[str, str] | None = None,
              init_process_group: bool = True) -> list[RankResult]:
    """Spawn ``world_size`` processes running ``target(rank, world_size, *args)``; one result each.

    ``target`` must be a module-level function of an importable module. Retries once on a
    different port if the rendezvous port was taken in the meantime.
    """
    results = _run_once(target, world_size, tuple(args), timeout_s, pg_timeout_s, backend,
                        threads, dict(env or {}), init_process_group)
    if any("address already in use" in r.error.lower() for r in results):
        results = _run_once(target, world_size, tuple(args), timeout_s, pg_timeout_s, backend,
                            threads, dict(env or {}), init_process_group)
    return results


def _run_once(target: Callable[..., Any], world_size: int, args: tuple, timeout_s: float,
              pg_timeout_s: float, backend: str, threads: int, env: dict[str, str],
              init_pg: bool) -> list[RankResult]:
    ctx = multiprocessing.get_context("spawn")
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="ranks-") as result_dir:
        procs = [ctx.Process(target=_child, name=f"rank-{r}",
                             args=(r, world_size, port, target, args, result_dir, pg_timeout_s,
                                   backend, threads, env, init_pg))
                 for r in range(world_size)]
        for p in procs:
            p.start()
        hung = _join(procs, Path(result_dir), timeout_s)
        results = []
        for r, p in enumerate(procs):
            path = Path(result_dir) / f"rank-{r:05d}.json"
            if path.exists():
                d = json.loads(path.read_text())
                results.append(RankResult(r, d["ok"], d.get("value"), d.get("error_type", ""),
                                          d.get("error", ""), d.get("traceback", ""),
                                          p.exitcode, d.get("elapsed_s", 0.0)))
            elif r in hung:
                results.append(RankResult(r, False, error_type="Hung",
                                          error=f"still running after {timeout_s:g}s; killed",
                                          exitcode=p.exitcode))
            else:
                results.append(RankResult(r, False, error_type="Crashed",
                                          error="exited without reporting a result",
                                          exitcode=p.exitcode))
        return results


def _join(procs: Sequence[Any], result_dir: Path, timeout_s: float) -> list[int]:
    """:func:`join_all`, and once every rank has reported or died, release the ones that wait
    for the others to count out (a rank killed on purpose never does)."""
    deadline = time.monotonic() + timeout_s
    released = result_dir / _RELEASED
    while time.monotonic() < deadline and any(p.is_alive() for p in procs):
        if not released.exists() and all(
                not p.is_alive() or (result_dir / f"rank-{r:05d}.json").exists()
                for r, p in enumerate(procs)):
            released.touch()
        wait([p.sentinel for p in procs if p.is_alive()], timeout=0.05)
    return join_all(procs, max(0.0, deadline - time.monotonic()))


def run_distributed(target: Callable[..., Any], world_size: int, args: Sequence[Any] = (),
                    **kwargs: Any) -> list[Any]:
    """:func:`run_ranks`, then each rank's return value; raises :class:`DistributedFailure`
    (every failed rank's traceback in the message) if any rank failed."""
    results = run_ranks(target, world_size, args, **kwargs)
    if not all(r.ok for r in results):
        raise DistributedFailure(results)
    return [r.value for r in results]


# ------------------------------------------------------------------- suites sharing one job


@dataclass(frozen=True)
class Suite:
    """A test module's cases: ``module.runner(rank, world, names)`` returns case -> value; or,
    with ``cases`` (see :func:`case_suite`), :func:`run_cases` runs them."""

    module: str
    runner: str
    cases_for: Callable[[int], list[str]]
    timeout_s: float
    pg_timeout_s: float
    cases: dict[str, Callable[..., Any]] | None = None
    case_pg_timeout_s: float = 120.0


#: Registered suites and the reports of jobs already run, for this test session (the cache is
#: what lets several modules share one job per world size).
_SUITES: dict[str, Suite] = {}
_SHARED: dict[tuple[int, frozenset[str]], dict[str, dict[str, list[Any]]]] = {}


def register_suite(module: str, runner: str, cases_for: Callable[[int], list[str]],
                   timeout_s: float = 120.0, pg_timeout_s: float = 60.0) -> None:
    """Let the shared job of each world size run ``module``'s cases (call at import time)."""
    _SUITES[module] = Suite(module, runner, cases_for, timeout_s, pg_timeout_s)


def selected_modules(session: Any) -> set[str]:
    """Names of the modules that have selected test items in a pytest session."""
    return {item.module.__name__ for item in getattr(session, "items", ())
            if getattr(item, "module", None) is not None}


def case_suite(module: str, cases: dict[str, Callable[..., Any]],
               cases_for: Callable[[int], list[str]], worlds: Sequence[int], *,
               timeout_s: float = 120.0, pg_timeout_s: float = 150.0,
               case_pg_timeout_s: float = 120.0) -> Any:
    """Register ``module``'s ``cases`` (each ``case(process_mesh)`` on every rank) for the shared
    job of each world size, and return its module-scoped ``reports`` fixture, one per size in
    ``worlds``: case -> per-rank values (call at import time; assign the result to ``reports``)."""
    import pytest

    _SUITES[module] = Suite(module, "", cases_for, timeout_s, pg_timeout_s, cases, case_pg_timeout_s)

    @pytest.fixture(scope="module", params=list(worlds), ids=lambda n: f"world{n}")
    def reports(request: Any) -> dict[str, list[Any]]:
        return shared_reports(module, request.param, selected_modules(request.session))
    return reports


def _suite_job(rank: int, world_size: int, plan: list[tuple[str, str, list[str]]]
               ) -> dict[str, Any]:
    out = {}
    for module, runner, names in plan:
        mod = importlib.import_module(module)  # registers its suite in this process too
        suite = _SUITES[module]
        if suite.cases is not None:
            out[module] = run_cases(suite.cases, names, timeout_s=suite.case_pg_timeout_s)
        else:
            out[module] = getattr(mod, runner)(rank, world_size, names)
    return out


def shared_reports(module: str, world_size: int, selected: Iterable[str] | None = None
                   ) -> dict[str, list[Any]]:
    """case -> per-rank values of ``module``'s cases on ``world_size`` ranks.

    The first request for a world size runs one job with the cases of every registered suite
    whose module is in ``selected`` (default: all; ``module`` always), suite after suite in
    registration order, and remembers the result for the session. Raises
    :class:`DistributedFailure` if any rank fails.
    """
    wanted = set(_SUITES) if selected is None else set(selected) & set(_SUITES)
    wanted.add(module)
    key = (world_size, frozenset(wanted))
    if key not in _SHARED:
        suites = [s for name, s in _SUITES.items() if name in wanted]
        plan = [(s.module, s.runner, s.cases_for(world_size)) for s in suites]
        values = run_distributed(_suite_job, world_size, args=(plan,),
                                 timeout_s=sum(s.timeout_s for s in suites),
                                 pg_timeout_s=max(s.pg_timeout_s for s in suites))
        _SHARED[key] = {s.module: {case: [v[s.module][case] for v in values]
                                   for case in s.cases_for(world_size)} for s in suites}
    return _SHARED[key][module]


def check_case(reports: dict, case: str) -> None:
    """Fail with every rank's problems for ``case``; skip if ``case`` does not run at this size."""
    import pytest

    if case not in reports:
        pytest.skip(f"{case} does not run at this world size")
    failed = {rank: p for rank, p in enumerate(reports[case]) if p}
    assert not failed, f"{case}: problems by rank: {failed}"


def run_cases(cases: dict[str, Callable[..., Any]], names: Sequence[str],
              timeout_s: float = 120.0) -> dict[str, Any]:
    """Body of a suite's job: the process mesh from the launcher's variables, then each case."""
    from shardckpt.runtime import init_distributed

    pm = init_distributed(timeout_s=timeout_s)
    return {name: cases[name](pm) for name in names}


def gloo_threads() -> int:
    """How many gloo worker threads this process runs now (``pt_gloo_runloop``, two per live
    gloo group), as Linux names them in ``/proc/self/task``: a group whose threads are gone has
    been destroyed, not merely removed from ``torch.distributed``'s tables."""
    task = Path("/proc/self/task")
    names = []
    for tid in os.listdir(task):
        try:
            names.append((task / tid / "comm").read_text().strip())
        except FileNotFoundError:  # a thread that ended meanwhile
            continue
    return names.count("pt_gloo_runloop")
