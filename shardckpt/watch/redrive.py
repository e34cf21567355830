"""``shardckpt watch PIPELINE --redrive CHECKPOINT [--step STEP]``: run a dead-lettered step again.

A dead-lettered step (its ``<i>-<kind>.dead`` record) holds up its checkpoint's later steps for
good: records are create-only, so no watcher runs it again. Once the cause is fixed (a store
back, a full disk emptied, a bad source replaced), the operator redrives it: the record moves
aside to ``<i>-<kind>.dead.<n>`` (kept, create-only, for the post-mortem), and the checkpoint is
processed once by this watcher, from that step on, under the usual claim and lease. Another
watcher running at the same time may take the step first; the claim keeps it to one.
"""

from __future__ import annotations

import logging
import re
from typing import TYPE_CHECKING

from shardckpt.errors import ShardckptError
from shardckpt.format.manifest import MANIFEST_NAME
from shardckpt.watch.records import (
    MAX_RECORD_BYTES, checkpoint_dir, checkpoint_step, printable, read_record, step_states,
)

if TYPE_CHECKING:
    from shardckpt.watch.service import PassReport, Watcher

log = logging.getLogger(__name__)


class RedriveError(ShardckptError):
    """Nothing to redrive: no such checkpoint, or no dead-lettered step of it."""


def pick_step(keys: list[str], step: str) -> str:
    """The key (``2-reshard``) that ``step`` names: the key itself, a kind the pipeline has
    once, or an index."""
    if step in keys:
        return step
    matches = [k for k in keys if k.split("-", 1)[1] == step or k.split("-", 1)[0] == step]
    if len(matches) != 1:
        why = "several" if matches else "none"
        raise RedriveError(f"--step {printable(step, 80)} names {why} of this pipeline's steps "
                           f"({', '.join(keys)}); name one by its key, e.g. {keys[-1]}")
    return matches[0]


def redrive(w: Watcher, checkpoint: str, step: str | None = None) -> PassReport:
    """Move the ``.dead`` record of ``checkpoint``'s step ``step`` (default: its dead one) aside
    and process the checkpoint once (:meth:`Watcher.process_checkpoint`)."""
    number = checkpoint_step(checkpoint)
    if number is None:
        raise RedriveError(f"{printable(checkpoint, 200)} is not a checkpoint name (step-00000100, "
                           "checkpoint-100, epoch=0-step=100.ckpt)")
    if not w.watch.exists(f"{checkpoint}/{MANIFEST_NAME}"):
        raise RedriveError(f"{w.watch.url_of(checkpoint)}: no committed checkpoint there")
    states = step_states(w.state, w.p.name, checkpoint, w.keys)
    if step is not None:
        key = pick_step(w.keys, step)
    else:
        dead = [k for k, s in states.items() if s.state == "dead"]
        if not dead:
            shown = ", ".join(f"{k} {s.state}" for k, s in states.items())
            raise RedriveError(f"{checkpoint} has no dead-lettered step in pipeline {w.p.name} "
                               f"({shown})")
        key = dead[0]
    if states[key].state != "dead":
        raise RedriveError(f"{checkpoint} {key} is {states[key].state}, not dead-lettered; "
                           "nothing to redrive")
    base = checkpoint_dir(w.p.name, checkpoint)
    rel = f"{base}/{key}.dead"
    read_record(w.state, rel, checkpoint, key)  # an unreadable record is not moved
    data = w.state.read_limited(rel, MAX_RECORD_BYTES)
    kept = re.compile(rf"{re.escape(key)}\.dead\.([0-9]{{1,9}})")
    n = 1 + max((int(m.group(1)) for m in map(kept.fullmatch, w.state.ls(base)) if m), default=0)
    w.state.create_only(f"{rel}.{n}", data)
    w.state.rm(rel)
    log.info("%s %s: dead-letter record kept as %s.dead.%d; running it again", checkpoint, key,
             key, n)
    return w.process_checkpoint(number, checkpoint)
