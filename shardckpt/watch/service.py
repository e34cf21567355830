"""``shardckpt watch``: run a pipeline of steps once for every checkpoint that commits under a run.

The watcher lists the run directory (one LIST per interval), and for each checkpoint directory
with a ``manifest.json``, of any layout shardckpt writes (``step-XXXXXXXX``, the Trainer's
``checkpoint-<N>``, Lightning's ``epoch=<E>-step=<N>.ckpt``: one naming rule,
:mod:`shardckpt.checkpoint.run_names`), oldest first, runs the pipeline's steps in order. Each step
runs at most once per checkpoint, across restarts and across several watchers on one pipeline:

1. a step starts only under a won create-only claim and a renewed lease
   (:class:`~shardckpt.watch.records.StepClaim`), and only if it has no ``.done``/``.dead`` record;
2. its output commits by the step's own discipline (a manifest or an index written last);
3. then its create-only ``.done`` record is written. A watcher killed between 2 and 3 leaves a
   committed output without a record: the next watcher adopts it after checking it
   (:func:`~shardckpt.watch.steps.adopt`) instead of writing it again;
4. a step that still fails after ``retries`` retries (backoff doubling from ``backoff_s``) gets a
   ``.dead`` record with a one-line reason; that checkpoint's later steps do not run, and the
   next checkpoints are processed as usual.

"Exactly once" therefore means: every step of every committed checkpoint ends with exactly one
record, and no output that got a record is written twice. Two watchers exclude each other through
the claim while the lease is renewed (every ``lease_ttl_s / 3``); a watcher that cannot renew its
lease for a whole ``lease_ttl_s`` (a host frozen that long) can be overtaken, and then the
outputs' own create-only commits and the create-only records keep one result.

A step whose record is unreadable (:func:`~shardckpt.watch.records.read_record`: planted, damaged,
not a record) is neither run nor counted done; its checkpoint waits, and is looked at again each
pass, until someone removes that record. Names in the run directory other than checkpoint names
(:func:`~shardckpt.watch.records.checkpoint_step`) are ignored, and what the log says of the store
is one printable line. A listing without any checkpoint name (the prefix missing or mistyped, a
Lightning run saving only ``last.ckpt``) is warned about, once until one appears; a checkpoint
removed after it was listed and before it was processed (a run's own retention) is logged as
skipped, by name, and gets no record.

:meth:`Watcher.stop` (``shardckpt watch`` calls it on SIGTERM or SIGINT) starts no further step:
a step in flight runs to its end and is recorded (its output commits, then its record), and a
step waiting out a retry's backoff ends unrecorded with its claim released, so that the next
watcher runs it. Nothing is abandoned midway that a restart would not handle anyway.

Checkpoints whose every step is settled are remembered, so an idle watcher costs one LIST of the
run directory per interval. Steps run in this process, one at a time per checkpoint: memory is
that of the largest step; a step with ``processes`` > 1 runs as a torchrun job instead, which the
watcher waits for under the step's lease (:mod:`shardckpt.watch.job`: a graceful stop lets it
finish, a watcher killed takes it along). Does not import torch.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from shardckpt.watch import records as watch_records

from shardckpt.watch import steps as watch_steps
from shardckpt.checkpoint.reader import read_manifest
from shardckpt.checkpoint.trust import trusted_keys
from shardckpt.errors import ShardckptError
from shardckpt.format.manifest import MANIFEST_NAME, Manifest
from shardckpt.storage import Storage, backend_class
from shardckpt.watch.config import Pipeline, StepSpec
from shardckpt.watch.records import checkpoint_step, printable

log = logging.getLogger(__name__)

MAX_BACKOFF_S = 300.0


@dataclass
class Counters:
    """What this watcher did (for ``--serve``'s metrics): per step kind."""

    done: dict[str, int] = field(default_factory=dict)
    dead: dict[str, int] = field(default_factory=dict)
    adopted: dict[str, int] = field(default_factory=dict)
    retries: dict[str, int] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    bytes: dict[str, int] = field(default_factory=dict)
    errors: dict[str, int] = field(default_factory=dict)
    passes: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, what: str, kind: str, value: float = 1) -> None:
        with self.lock:
            d = getattr(self, what)
            d[kind] = d.get(kind, 0) + value


@dataclass
class PassReport:
    """One pass over the run: steps recorded done or dead by this watcher, checkpoints left to
    another watcher (held), not yet committed, waiting behind an unreadable record, or removed
    before they were processed (skipped); ``found``: checkpoint directories listed."""

    done: int = 0
    dead: int = 0
    held: int = 0
    uncommitted: int = 0
    unreadable: int = 0
    skipped: int = 0
    found: int = 0


class Watcher:
    """Runs ``pipeline`` over the checkpoints of its run directory (see the module doc)."""

    def __init__(self, pipeline: Pipeline) -> None:
        self.p = pipeline
        opts = dict(pipeline.storage_options)
        self.watch = Storage(pipeline.watch, _fresh_listings(pipeline.watch, opts))
        self.state = Storage(pipeline.state, _fresh_listings(pipeline.state, opts))
        self.keys = [s.key for s in pipeline.steps]
        self.counters = Counters()
        self.stop_event = threading.Event()
        self._settled: set[str] = set()
        self._lock = threading.Lock()
        self._warned_empty = False
        self.found = 0  # checkpoint directories in the last listing

    # ---------------------------------------------------------------------------- loop

    def run(self, once: bool = False) -> PassReport:
        """Process what is there, then (unless ``once``) poll every ``interval_s`` until
        :meth:`stop`. Returns the last pass's report."""
        if once:
            return self.process_pass()
        log.info("watching %s for pipeline %s, every %g s", printable(self.watch.url), self.p.name,
                 self.p.interval_s)
        report = self._pass_or_log()
        while not self.stop_event.wait(self.p.interval_s):
            report = self._pass_or_log()
        log.info("stopped watching %s", printable(self.watch.url))
        return report

    def _pass_or_log(self) -> PassReport:
        """A pass of a long-running watcher: a storage failure (the store unreachable, a record
        that cannot be written) is logged and the pass is tried again after the interval; what
        was not recorded is found again then (a committed output is adopted)."""
        try:
            return self.process_pass()
        except ShardckptError as e:
            self.counters.add("errors", "pass")
            log.error("a pass over %s failed (%s); trying again in %g s", self.watch.url,
                      printable(e, 1000), self.p.interval_s)
            return PassReport()

    def stop(self) -> None:
        self.stop_event.set()

    def pending(self) -> list[tuple[int, str]]:
        """(step, name) of the checkpoint directories not yet settled, oldest first: one LIST
        (:attr:`found` counts them all; none at all is warned about, see :func:`empty_note`)."""
        names = self.watch.ls("")
        listed = [(step, n) for n in names if (step := checkpoint_step(n)) is not None]
        self.found = len(listed)
        if not listed and not self._warned_empty:
            log.warning("%s", empty_note(self.watch, names))
        self._warned_empty = not listed
        return sorted((step, n) for step, n in listed if n not in self._settled)

    def process_pass(self) -> PassReport:
        report = PassReport()
        todo = []
        for step, name in self.pending():
            if self.stop_event.is_set():
                break
            if not self.watch.exists(f"{name}/{MANIFEST_NAME}"):
                if self.watch.exists(name):
                    report.uncommitted += 1
                else:
                    report.skipped += 1
                    log.warning("skipped %s: it was removed before it was processed", printable(name))
                continue
            todo.append((step, name))
        if self.p.concurrency <= 1 or len(todo) <= 1:
            results = [self._isolated(step, name) for step, name in todo]
        else:
            with ThreadPoolExecutor(self.p.concurrency, thread_name_prefix="shardckpt-watch") as pool:
                results = list(pool.map(lambda sn: self._isolated(*sn), todo))
        failed = [r for r in results if isinstance(r, ShardckptError)]
        for r in results:
            if isinstance(r, PassReport):
                report.done += r.done
                report.dead += r.dead
                report.held += r.held
                report.unreadable += r.unreadable
                report.skipped += r.skipped
        report.found = self.found
        if failed:  # after the other checkpoints had their turn: one bad one holds up no other
            for e in failed[1:]:
                log.error("%s", printable(e, 1000))
            raise failed[0]
        self.counters.passes += 1
        return report

    def _isolated(self, step: int, name: str) -> PassReport | ShardckptError:
        """:meth:`process_checkpoint`, its storage failure returned instead of ending the pass
        before the next checkpoints (a file planted where a record directory goes fails only
        its own checkpoint)."""
        try:
            return self.process_checkpoint(step, name)
        except ShardckptError as e:
            return e

    # ------------------------------------------------------------------------ checkpoint

    def process_checkpoint(self, step: int, name: str) -> PassReport:
        """Run the steps of one committed checkpoint that are not settled, in order."""
        report = PassReport()
        if self.stop_event.is_set():
            return report
        src = self.watch.child(name)
        states = watch_records.step_states(self.state, self.p.name, name, self.keys)
        manifest: Manifest | ShardckptError | None = None
        for spec in self.p.steps:
            st = states[spec.key].state
            if st == "done":
                continue
            if st == "dead":
                self._settle(name)
                return report
            if st == "unreadable":  # warned by read_record; not settled: looked at again next pass
                report.unreadable += 1
                return report
            if st == "running" or self.stop_event.is_set():
                report.held += st == "running"
                return report
            if manifest is None:
                manifest = _read(src, self.p.trust)
            outcome = self.run_step(spec, src, manifest, name, step)
            if outcome == "held":
                report.held += 1
                return report
            if outcome in ("unreadable", "skipped"):
                setattr(report, outcome, getattr(report, outcome) + 1)
                return report
            if outcome == "dead":
                report.dead += 1
                self._settle(name)
                return report
            report.done += outcome == "done"
            if outcome == "stopped":
                return report
        self._settle(name)
        return report

    def _settle(self, name: str) -> None:
        with self._lock:
            self._settled.add(name)

    def is_settled(self, name: str, before: int) -> bool:
        """Whether every step of ``name`` before step index ``before`` has a readable record."""
        if name in self._settled:
            return True
        states = watch_records.step_states(self.state, self.p.name, name, self.keys[:before - 1])
        return all(s.state in ("done", "dead") for s in states.values())

    # ------------------------------------------------------------------------------ step

    def run_step(self, spec: StepSpec, src: Storage, manifest: Manifest | ShardckptError,
                 name: str, step: int) -> str:
        """Claim, run (with retries) and record one step: "done", "dead", "held", "stopped",
        "unreadable" (a record that fails its checks appeared meanwhile) or "skipped" (the
        checkpoint was removed; nothing is recorded)."""
        claim = watch_records.StepClaim(self.state, self.p.name, name, spec.key, self.p.lease_ttl_s)
        if not claim.try_claim():
            settled = claim.settled()
            return settled if settled in ("done", "unreadable") else "held"
        try:
            return self._attempts(claim, spec, src, manifest, name, step)
        finally:
            claim.release()

    def _attempts(self, claim: watch_records.StepClaim, spec: StepSpec, src: Storage,
                  manifest: Manifest | ShardckptError, name: str, step: int) -> str:
        base = {"pipeline": self.p.name, "checkpoint": name, "step": step, "kind": spec.kind,
                "index": spec.index, "claim": claim.attempt, "host": socket.gethostname(),
                "pid": os.getpid()}
        reason = ""
        for attempt in range(self.p.retries + 1):
            if attempt:
                self.counters.add("retries", spec.kind)
                delay = min(MAX_BACKOFF_S, self.p.backoff_s * 2 ** (attempt - 1))
                if self.stop_event.wait(delay):
                    return "stopped"
            if isinstance(manifest, ShardckptError):
                manifest = _read(src, self.p.trust)
            started = time.time()
            try:
                if isinstance(manifest, ShardckptError):
                    raise manifest
                ctx = watch_steps.StepContext(spec, src, manifest, name, step, self.watch,
                                              self.p.storage_options,
                                              lambda n: self.is_settled(n, spec.index),
                                              self.p.steps, self.p.trust, self.p.signing_key)
                facts = watch_steps.adopt(ctx) or _execute(ctx)
            except Exception as e:  # noqa: BLE001 - any failure of a step is recorded, not fatal
                if _removed(src):
                    log.warning("skipped %s: it was removed before it was processed (%s left "
                                "unrecorded)", name, spec.key)
                    return "skipped"
                reason = _one_line(e)
                log.warning("%s %s (try %d of %d): %s", name, spec.key, attempt + 1,
                            self.p.retries + 1, reason)
                continue
            secs = time.time() - started
            doc = {**base, **facts, "source_save_id": manifest.save_id, "started": started,
                   "finished": time.time(), "seconds": secs, "tries": attempt + 1}
            watch_records.write_done(self.state, self.p.name, name, spec.key, doc)
            self.counters.add("done", spec.kind)
            self.counters.add("seconds", spec.kind, secs)
            self.counters.add("bytes", spec.kind, int(facts.get("bytes") or 0))
            if facts.get("adopted"):
                self.counters.add("adopted", spec.kind)
            log.info("%s %s done in %.2f s", name, spec.key, secs)
            return "done"
        doc = {**base, "reason": reason, "tries": self.p.retries + 1, "finished": time.time()}
        watch_records.write_dead(self.state, self.p.name, name, spec.key, doc)
        self.counters.add("dead", spec.kind)
        log.error("%s %s failed after %d tries; recorded as dead: %s", name, spec.key,
                  self.p.retries + 1, reason)
        return "dead"


def _execute(ctx: watch_steps.StepContext) -> dict[str, Any]:
    """Run a step here, or as a torchrun job where it asks for several processes."""
    if ctx.spec.processes > 1:
        from shardckpt.watch.job import run_job

        return run_job(ctx)
    return watch_steps.run_step(ctx)


def _read(src: Storage, trust: tuple[str, ...] = ()) -> Manifest | ShardckptError:
    """``src``'s manifest (with ``trust``: signed by one of those keys), or the error that gave."""
    try:
        return read_manifest(src, trusted_keys(trust or None))
    except ShardckptError as e:
        return e


def _removed(src: Storage) -> bool:
    """Whether the checkpoint at ``src`` is gone (its manifest removed: a run's own retention)."""
    try:
        return not src.exists(MANIFEST_NAME)
    except ShardckptError:
        return False


def empty_note(watch: Storage, names: list[str]) -> str:
    """Why a listing of the watched prefix holds no checkpoint, in one line."""
    from shardckpt.checkpoint.run_names import LAYOUTS, stepless_checkpoints

    expected = ", ".join(layout.example for layout in LAYOUTS)
    url = printable(watch.url)
    if not names:
        return f"no checkpoint under {url}: it does not exist or is empty (checkpoint " \
               f"directories are named like {expected})"
    stepless = stepless_checkpoints(names)
    if stepless:
        return (f"no checkpoint under {url} whose name carries its step: {printable(stepless[0])} "
                "is rewritten in place at every save; give ModelCheckpoint a filename with "
                "{step} (its default, epoch={epoch}-step={step}, has it)")
    return (f"no checkpoint under {url}: its {len(names)} entries have none of the names "
            f"checkpoint directories have ({expected})")


def _one_line(e: BaseException) -> str:
    """A failure as one printable line (what a ``.dead`` record keeps and the log shows)."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return printable(f"{type(e).__name__}: {text}" if text else type(e).__name__)


def _fresh_listings(url: str, opts: dict[str, Any]) -> dict[str, Any]:
    """A watcher polls: listings must not come from a cache (the backend says how to ask)."""
    return backend_class(url).fresh_listings(opts)
