"""The one resume policy: the newest step that loads, over every tier, chosen alike on every rank.

Every caller that resumes a run goes through :func:`resume_newest`: the ``Checkpointer`` (its
durable run directory and its node-local tier), :class:`~shardckpt.interop.dcp.checkpointer.DcpCheckpointer`
and the torchtitan and ``Trainer`` integrations, which only name their run directory
(:func:`pick_committed`).

Call order (collective: every rank makes each call, in the same order):

1. One agreement, the survey: each rank runs ``source.survey()`` of every source (what it sees
   of that tier: rank 0 lists a run directory, every rank its node's directory), then
   ``source.candidates(surveyed)`` gets every rank's part and gives the same list on every rank.
   The candidates of all sources are tried newest step first; at equal steps the earlier
   source's first (the order given: the preferred tier first).
2. ``source.attempt(candidate, last_resort=False)`` for each, until one is ``loaded``. Every read
   that can fail runs inside an agreement of the ranks, so an outcome is the same on every rank.
   A candidate ``passed`` over (it fails a check, cannot be assembled), ``damaged`` (a checksum
   failed while loading) or ``lacking`` (it holds weights only and the job needs optimizer
   state) gives way to the next older one, and why is logged once, by rank 0.
3. Where none loads: the ``lacking`` ones, newest first, with ``last_resort=True`` (better the
   newest weights with a fresh optimizer than step 0).
4. One agreement, the put-aside: each rank runs ``source.put_aside(above, why)`` of every source
   (its share: rank 0 the run directory's, each node's leader its node's): the committed steps
   newer than the one loaded (0 where none did), each with why it was passed over
   (:mod:`.set_aside`), so that the run can save those steps again. No rank goes on (to a save
   that may write one of those steps again) before every rank is done. Sources that never put
   aside do nothing here. Where no source's survey saw a step newer than the one loaded
   (``source.newer_than(above)``, the same on every rank), there is nothing to put aside and
   no round: the common case, the newest step loading.

One agreement each for the survey and the put-aside, whatever the number of tiers: each is a
round of every rank, and a resume is on the path back to training.
5. Where nothing loaded and some candidate failed its checksums, :class:`IntegrityError` (a run
   never starts over silently past damaged checkpoints); else the fresh start is logged.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Protocol
from collections.abc import Callable, Mapping, Sequence

from shardckpt.checkpoint.collective import agree, failed_with, rank_and_world, same_error
from shardckpt.checkpoint.run_dir import LATEST, CheckpointManager, Found
from shardckpt.checkpoint.set_aside import put_aside_all
from shardckpt.errors import CollectiveError, IntegrityError, ShardckptError

log = logging.getLogger(__name__)

LOADED, PASSED, DAMAGED, LACKING = "loaded", "passed", "damaged", "lacking"


@dataclass(frozen=True, slots=True)
class Candidate:
    """A step a tier offers: its ``url`` there, and ``key``, the tier's own id of it (a local
    step's save id)."""

    step: int
    tier: str
    url: str
    key: str = ""


@dataclass(frozen=True, slots=True)
class Outcome:
    """What one attempt at a candidate gave: ``status`` (``loaded``, ``passed``, ``damaged``,
    ``lacking``), why it was not loaded, and for a loaded one, the tier's ``value`` (what it
    fetched, the load's result) and a ``note`` for the log (where it came from)."""

    status: str
    why: str = ""
    value: Any = None
    note: str = ""


class ResumeSource(Protocol):
    """The resume side of a tier (call order: the module docstring). ``name`` tells its
    candidates apart; ``where`` names it in messages."""

    name: str

    @property
    def where(self) -> str: ...

    def survey(self) -> Any: ...

    def candidates(self, surveyed: list[Any]) -> list[Candidate]: ...

    def attempt(self, candidate: Candidate, last_resort: bool) -> Outcome: ...

    def newer_than(self, above: int) -> bool: ...

    def put_aside(self, above: int, why: Mapping[int, str]) -> None: ...


@dataclass
class Resumed:
    """What :func:`resume_newest` chose: the candidate loaded (None: none), its outcome, and why
    each candidate before it was passed over ((tier, step) -> why)."""

    candidate: Candidate | None
    outcome: Outcome | None
    why: dict[tuple[str, int], str] = field(default_factory=dict)

    @property
    def step(self) -> int:
        return self.candidate.step if self.candidate is not None else 0


def damaged(e: CollectiveError, url: str) -> Outcome:
    """A load of ``url`` that failed its checksums on some rank(s) (``e``), logged by rank 0."""
    ranks = failed_with(e, IntegrityError)
    said = e.failures[ranks[0]]
    if rank_and_world()[0] == 0:
        log.warning("%s fails its checksums on rank(s) %s (%s); trying the next older checkpoint "
                    "(nothing is deleted)", url, ranks, said)
    return Outcome(DAMAGED, f"it fails its checksums ({said})")


def resume_newest(sources: Sequence[ResumeSource]) -> Resumed:
    """The newest candidate of ``sources`` that loads, on every rank alike (module docstring)."""
    rank = rank_and_world()[0]
    by_name = {s.name: s for s in sources}
    order = {s.name: i for i, s in enumerate(sources)}
    where = " and ".join(s.where for s in sources)
    _, reports = agree(lambda: [s.survey() for s in sources], f"survey of {where}")
    todo = sorted((c for i, s in enumerate(sources) for c in s.candidates([r["payload"][i] for r in reports])),
                  key=lambda c: (-c.step, order[c.tier]))
    out = Resumed(None, None)
    broken: list[str] = []
    lacking: list[Candidate] = []
    for c in todo:
        got = by_name[c.tier].attempt(c, False)
        if got.status == LOADED:
            return _settle(sources, out, c, got)
        if got.status == LACKING:
            lacking.append(c)
        elif got.status == DAMAGED:
            broken.append(f"{c.url}: {got.why}")
        out.why[(c.tier, c.step)] = got.why
    for c in lacking:  # better the newest weights with a fresh optimizer than step 0
        if rank == 0:
            log.warning("no committed checkpoint of %s holds optimizer state; resuming from the "
                        "weights of %s with a fresh optimizer", where, c.url)
        got = by_name[c.tier].attempt(c, True)
        if got.status == LOADED:
            out.why.pop((c.tier, c.step), None)
            return _settle(sources, out, c, got)
        if got.status == DAMAGED:
            broken.append(f"{c.url}: {got.why}")
        out.why[(c.tier, c.step)] = got.why
    if broken:  # before anything is put aside: the run is left as it was found
        raise IntegrityError(f"{where}: no checkpoint loads; {len(broken)} failed their "
                             "checksums: " + "; ".join(broken))
    if rank == 0:
        log.info("no checkpoint of %s loads; nothing to resume from", where)
    return _settle(sources, out, None, None)


def _settle(sources: Sequence[ResumeSource], out: Resumed, c: Candidate | None,
            got: Outcome | None) -> Resumed:
    """Log the choice (rank 0), then put aside, in every source, what is newer than it."""
    out.candidate, out.outcome = c, got
    if c is not None and got is not None and rank_and_world()[0] == 0:
        passed = "; ".join(f"{t} step {s}: {w}" for (t, s), w in
                           sorted(out.why.items(), key=lambda x: (-x[0][1], x[0][0])))
        log.info("resumed from %s (step %d)%s%s", c.url, c.step, f", {got.note}" if got.note else "",
                 f" (passed over: {passed})" if passed and len(sources) > 1 else "")
    def put_aside() -> None:
        for s in sources:
            s.put_aside(out.step, {step: w for (t, step), w in out.why.items() if t == s.name})

    if not any(s.newer_than(out.step) for s in sources):
        return out  # the survey, the same on every rank, saw nothing to put aside: no round

    agree(put_aside, f"putting aside the steps newer than {out.step} of "
          + " and ".join(s.where for s in sources))
    return out


# ------------------------------------------------------------------------ a run directory


class RunDirSource:
    """The committed checkpoints of a run directory (``manager``) as resume candidates.

    Rank 0 lists and checks them (manifest and sizes, or every checksum with ``full_verify``;
    with ``needs_optimizer``, a checkpoint retention thinned into weights only is ``lacking``);
    ``load(candidate)`` (None: the caller loads the one chosen afterwards) loads one on every
    rank and says how it went. With ``settle``, the steps newer than the one loaded are put
    aside and ``latest`` names the newest left."""

    name = "durable"

    def __init__(self, manager: CheckpointManager, *, full_verify: bool = False,
                 needs_optimizer: bool = False, load: Callable[[Candidate], Outcome] | None = None,
                 settle: bool = False) -> None:
        self.manager, self.full_verify, self.needs_optimizer = manager, full_verify, needs_optimizer
        self.load, self.settle = load, settle
        self.committed: list[int] = []  # the survey's (rank 0's listing, on every rank)

    @property
    def where(self) -> str:
        return self.manager.url

    def survey(self) -> list[int] | None:
        """Rank 0 lists the committed steps (the others: None)."""
        return [f.step for f in self.manager.committed()] if rank_and_world()[0] == 0 else None

    def candidates(self, surveyed: list[Any]) -> list[Candidate]:
        self.committed = list(surveyed[0] or [])
        return [Candidate(s, self.name, self.manager.url_for(s)) for s in reversed(self.committed)]

    def newer_than(self, above: int) -> bool:
        return self.settle and any(s > above for s in self.committed)

    def attempt(self, candidate: Candidate, last_resort: bool) -> Outcome:
        m, step = self.manager, candidate.step

        def check() -> list[str]:
            found = Found(step, m.dir_name(step), m.url_for(step))
            problems = m.check(found, self.full_verify)
            if problems:
                return [PASSED, problems[0]]
            lacks = [] if last_resort else m.lacks(found, self.needs_optimizer)
            return [LACKING, lacks[0]] if lacks else [LOADED, ""]

        try:
            status, why = _agreed(check, f"check of {candidate.url}")
        except CollectiveError as e:
            if not e.failures:  # a rank lost: no outcome to agree on
                raise
            status, why = PASSED, str(e)
        if status != LOADED:
            if rank_and_world()[0] == 0:
                log.warning("passing over %s: %s", candidate.url, why)
            return Outcome(status, why)
        return self.load(candidate) if self.load is not None else Outcome(LOADED)

    def put_aside(self, above: int, why: Mapping[int, str]) -> None:
        """Rank 0 alone moves them (inside the policy's agreement: the others wait, and none may
        write a step being moved)."""
        if self.settle and rank_and_world()[0] == 0:
            put_aside_run(self.manager, above, why)


def _agreed(fn: Callable[[], Any], what: str) -> Any:
    """Rank 0's ``fn()`` on every rank (an agreement: its error is every rank's)."""
    rank = rank_and_world()[0]
    return agree(lambda: fn() if rank == 0 else None, what)[1][0]["payload"]


def put_aside_run(manager: CheckpointManager, above: int, why: Mapping[int, str]) -> None:
    """Rank 0, after a resume at step ``above``: put aside the run's committed checkpoints newer
    than it (``why``: step -> why it was passed over), and point ``latest`` at the newest one
    left (or remove it), so that no save references a passed-over checkpoint's files."""
    try:
        committed = manager.committed()
        newer = {f.name: why.get(f.step) or _problem(manager, f) for f in committed if f.step > above}
        if not newer:
            return
        put_aside_all(manager.storage, newer, manager.url)
        left = [f.name for f in committed if f.step <= above]
        if manager.read_latest() in newer:
            if left:
                manager.storage.put(LATEST, (left[-1] + "\n").encode())
            else:
                manager.storage.remove_inside(LATEST)
    except ShardckptError as e:
        log.warning("%s: could not put aside the checkpoints newer than step %d: %s",
                    manager.url, above, e)


def _problem(manager: CheckpointManager, found: Found) -> str:
    problems = manager.check(found)
    return problems[0] if problems else "it was not loaded (see the resume's warnings)"


def pick_committed(manager: CheckpointManager, full_verify: bool = False,
                   load: Callable[[Candidate], Outcome] | None = None) -> Candidate | None:
    """The newest committed checkpoint of ``manager``'s run that passes the check (and loads,
    with ``load``), the same on every rank; None where there is none. What an integration
    calls, naming its run directory; errors are raised alike on every rank."""
    try:
        return resume_newest([RunDirSource(manager, full_verify=full_verify, load=load)]).candidate
    except CollectiveError as e:
        raise same_error(e, f"resume from {manager.url}") from e
