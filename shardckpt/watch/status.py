"""What a pipeline's records say: each checkpoint and the state of each of its steps.

States of a step: ``done`` (with seconds, bytes, output), ``dead`` (with the one-line reason),
``running`` (a live claim or lease), ``pending`` (not started), ``blocked`` (an earlier step of
the checkpoint is dead), ``waiting`` (the checkpoint has not committed). A checkpoint that has
records but is no longer in the run (retention removed it) is listed with ``present: false``.
Reads only; one listing of the run, of the records and of each checkpoint's records.
"""

from __future__ import annotations

from typing import Any

from shardckpt.checkpoint.run_dir import STEP_DIR
from shardckpt.format.manifest import MANIFEST_NAME
from shardckpt.storage import Storage
from shardckpt.watch.config import Pipeline
from shardckpt.watch.records import record_names, step_states

STATES = ("done", "dead", "running", "pending", "blocked", "waiting")


def pipeline_status(p: Pipeline, watch: Storage | None = None, state: Storage | None = None) -> dict[str, Any]:
    """The status document of ``p`` (what ``--status --json`` prints and ``/status.json`` serves)."""
    watch = watch or Storage(p.watch, p.storage_options)
    state = state or Storage(p.state, p.storage_options)
    keys = [s.key for s in p.steps]
    present = {n for n in watch.ls("") if STEP_DIR.match(n)}
    recorded = {n for n in record_names(state, p.name) if STEP_DIR.match(n)}
    checkpoints = []
    totals = {s: 0 for s in STATES}
    for name in sorted(present | recorded, key=lambda n: int(STEP_DIR.match(n).group(1))):  # type: ignore[union-attr]
        committed = name in present and watch.exists(f"{name}/{MANIFEST_NAME}")
        states = step_states(state, p.name, name, keys, bodies=True) if name in recorded else {}
        steps, blocked = [], False
        for spec in p.steps:
            st = states.get(spec.key)
            rec = (st.record or {}) if st else {}
            s = st.state if st else "pending"
            if s == "pending" and not committed and name in present:
                s = "waiting"
            if blocked and s == "pending":
                s = "blocked"
            blocked = blocked or s == "dead"
            totals[s] += 1
            steps.append({"key": spec.key, "kind": spec.kind, "state": s,
                          "seconds": rec.get("seconds"), "bytes": rec.get("bytes"),
                          "output": rec.get("output"), "reason": rec.get("reason"),
                          "tries": rec.get("tries"), "adopted": bool(rec.get("adopted")),
                          "finished": rec.get("finished")})
        checkpoints.append({"checkpoint": name, "step": int(name.split("-", 1)[1]),
                            "present": name in present, "committed": committed, "steps": steps})
    return {"pipeline": p.name, "watch": watch.url, "state": state.url,
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
            out.append(f"  {s['key']:<16} {s['state']:<8}{extra}")
    t = doc["totals"]
    out.append(", ".join(f"{t[s]} {s}" for s in STATES if t[s]) or "nothing to do")
    return out
