"""What a pipeline's records say: each checkpoint and the state of each of its steps.

States of a step: ``done`` (with seconds, bytes, output), ``dead`` (with the one-line reason),
``running`` (a live claim or lease), ``pending`` (not started), ``blocked`` (an earlier step of
the checkpoint is dead or unreadable), ``waiting`` (the checkpoint has not committed), and
``unreadable``: its record fails :func:`~shardckpt.watch.records.read_record` (the reason, naming
the record, is the step's ``reason``; ``totals`` then has an ``unreadable`` count too). A
checkpoint that has records but is no longer in the run (retention removed it) is listed with
``present: false``. Names in the run or state prefix that are not checkpoint names
(:func:`~shardckpt.watch.records.checkpoint_step`) are left out. Every string that comes from the
prefix is one printable line (:func:`~shardckpt.watch.records.printable`).
Reads only; one listing of the run, of the records and of each checkpoint's records.
"""

from __future__ import annotations

from typing import Any

from shardckpt.format.manifest import MANIFEST_NAME
from shardckpt.storage import Storage
from shardckpt.watch.config import Pipeline, StepSpec
from shardckpt.watch.records import StepState, checkpoint_step, printable, record_names, step_states

STATES = ("done", "dead", "running", "pending", "blocked", "waiting")
UNREADABLE = "unreadable"


def _line(value: Any) -> str | None:
    return None if value is None else printable(value)


def step_entry(spec: StepSpec, st: StepState | None, state: str) -> dict[str, Any]:
    """One step's entry in the status document, from its (checked) records."""
    rec = (st.record or {}) if st else {}
    reason = st.problem if st is not None and state == UNREADABLE else rec.get("reason")
    return {"key": spec.key, "kind": spec.kind, "state": state,
            "seconds": rec.get("seconds"), "bytes": rec.get("bytes"),
            "output": _line(rec.get("output")), "reason": _line(reason),
            "tries": rec.get("tries"), "adopted": bool(rec.get("adopted")),
            "finished": rec.get("finished")}


def pipeline_status(p: Pipeline, watch: Storage | None = None, state: Storage | None = None) -> dict[str, Any]:
    """The status document of ``p`` (what ``--status --json`` prints and ``/status.json`` serves)."""
    watch = watch or Storage(p.watch, p.storage_options)
    state = state or Storage(p.state, p.storage_options)
    keys = [s.key for s in p.steps]
    present = {n for n in watch.ls("") if checkpoint_step(n) is not None}
    recorded = {n for n in record_names(state, p.name) if checkpoint_step(n) is not None}
    checkpoints = []
    totals = {s: 0 for s in STATES}
    unreadable = 0
    for name in sorted(present | recorded, key=lambda n: checkpoint_step(n) or 0):
        committed = name in present and watch.exists(f"{name}/{MANIFEST_NAME}")
        states = step_states(state, p.name, name, keys) if name in recorded else {}
        steps, blocked = [], False
        for spec in p.steps:
            st = states.get(spec.key)
            s = st.state if st else "pending"
            if s == "pending" and not committed and name in present:
                s = "waiting"
            if blocked and s == "pending":
                s = "blocked"
            blocked = blocked or s in ("dead", UNREADABLE)
            if s == UNREADABLE:
                unreadable += 1
            else:
                totals[s] += 1
            steps.append(step_entry(spec, st, s))
        checkpoints.append({"checkpoint": name, "step": checkpoint_step(name),
                            "present": name in present, "committed": committed, "steps": steps})
    if unreadable:
        totals[UNREADABLE] = unreadable
    return {"pipeline": p.name, "watch": printable(watch.url), "state": printable(state.url),
            "steps": [{"key": s.key, "kind": s.kind} for s in p.steps],
            "checkpoints": checkpoints, "totals": totals}


def status_lines(doc: dict[str, Any]) -> list[str]:
    """The status as text: one line per checkpoint, then one indented line per step."""
    out = [f"pipeline {doc['pipeline']}: watching {doc['watch']}, records in {doc['state']}"]
    if not doc["checkpoints"]:
        out.append("no checkpoints yet")
    for c in doc["checkpoints"]:
        note = "" if c["committed"] else (" (removed)" if not c["present"] else " (not committed)")
        out.append(f"{c['checkpoint']}{note}")
        for s in c["steps"]:
            extra = ""
            if s["state"] == "done":
                extra = f"  {s['seconds'] or 0:.2f} s, {s['bytes'] or 0} bytes"
                extra += "  (adopted)" if s["adopted"] else ""
                extra += f"  -> {s['output']}" if s["output"] else ""
            elif s["state"] == "dead":
                extra = f"  after {s['tries']} tries: {s['reason']}"
            elif s["state"] == UNREADABLE:
                extra = f"  record refused: {s['reason']}"
            out.append(f"  {s['key']:<16} {s['state']:<8}{extra}")
    t = doc["totals"]
    out.append(", ".join(f"{t[s]} {s}" for s in STATES + (UNREADABLE,) if t.get(s)) or "nothing to do")
    return out
