"""Compare two checkpoints by content, whatever world sizes, meshes or unit policies wrote them.

Tensors are matched by (component, FQN, state kind) or (component, buffer FQN), never by file or
flat-group position, so a checkpoint of 64 ranks and its reshard to 7 compare equal. Each matched
pair is read in aligned pieces of global elements from both sides (each side through its own
layout) and compared bit for bit; memory is bounded by ``buffer_bytes``, not by a tensor.

Invariants:

* ``DiffResult.equal`` is True only if every matched tensor is bit-identical (or, with a
  tolerance, within it) in the same dtype,
  nothing is one-sided (component, parameter, state kind or buffer), no shape differs, and the
  metadata that shapes training (tied aliases, parameter dtypes and ``requires_grad``, optimizer
  name, each parameter's hyper-parameters and step) is the same. Extras (samples seen, user data)
  and per-rank state are not compared: they legitimately differ with the world size.
* For a differing tensor, ``differing`` counts elements whose bits differ (across dtypes: whose
  values differ, NaN equal to NaN) and ``max_abs_diff`` is the largest ``|a - b|`` in float64; a
  NaN on one side only counts as an infinite difference.
* With a :class:`Tolerance` (``--atol`` / ``--rtol``: two runs on different world sizes reduce
  gradients in another order and differ in the last bits), an element differs only where
  ``|a - b| > atol + rtol * |b|`` (``numpy.isclose``'s rule; a one-sided NaN always differs),
  ``differing`` counts those, and a tensor whose every element is within it is *close*:
  counted in ``DiffResult.close``, not a difference. Dtypes that differ still are.

Does not import torch.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from typing import Any
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from shardckpt.checkpoint.job import Job, open_readers
from shardckpt.checkpoint.reader import CheckpointReader
from shardckpt.format.chunked import iter_pairs
from shardckpt.checkpoint.chunked_read import read_blob, read_box
from shardckpt.format.dtypes import itemsize
from shardckpt.format.manifest import Component, Manifest
from shardckpt.format.records import param_groups
from shardckpt.checkpoint.pieces import PieceReader, Source, decode
from shardckpt.storage import DEFAULT_BUFFER
from shardckpt.tools.split import contiguous_split

ONLY_A, ONLY_B, MISMATCH, DIFFERENT = "only_a", "only_b", "mismatch", "different"


@dataclass(frozen=True, slots=True)
class Tolerance:
    """``|a - b| <= atol + rtol * |b|`` counts as equal (``numpy.isclose``'s rule)."""

    atol: float = 0.0
    rtol: float = 0.0

    def __post_init__(self) -> None:
        for name in ("atol", "rtol"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise ValueError(f"{name} = {v!r}: expected a finite number >= 0")


@dataclass(frozen=True, slots=True)
class TensorDiff:
    """One tensor that is not equal on both sides."""

    component: str
    name: str                 # parameter or buffer FQN
    kind: str                 # state kind ("master", "exp_avg", ...) or "buffer"
    status: str               # "different" | "only_a" | "only_b" | "mismatch" (shape)
    numel: int = 0
    differing: int = 0
    max_abs_diff: float = 0.0
    detail: str = ""

    def to_dict(self) -> dict[str, Any]:
        m = self.max_abs_diff
        return {"component": self.component, "name": self.name, "kind": self.kind,
                "status": self.status, "numel": self.numel, "differing": self.differing,
                "max_abs_diff": m if math.isfinite(m) else str(m), "detail": self.detail}


@dataclass(frozen=True, slots=True)
class Comparison:
    component: str
    name: str
    kind: str
    numel: int
    a: Source
    b: Source


@dataclass(frozen=True)
class DiffPlan:
    """What to compare element by element, and what differs already from the manifests. Pure."""

    comparisons: tuple[Comparison, ...]
    one_sided: tuple[TensorDiff, ...]
    metadata: tuple[str, ...]

    @property
    def total_bytes(self) -> int:
        return sum(c.numel * (itemsize(c.a.dtype) + itemsize(c.b.dtype)) for c in self.comparisons)


@dataclass(frozen=True)
class DiffResult:
    a: str
    b: str
    equal: bool
    compared: int                          # tensor pairs compared element by element
    identical: int                         # of which bit-identical
    differences: tuple[TensorDiff, ...]    # differing, mismatched and one-sided tensors
    metadata: tuple[str, ...] = ()         # differing aliases, dtypes, optimizer settings
    bytes_read: int = 0
    seconds: float = 0.0
    elements: int = 0                      # elements compared per side
    close: int = 0                         # of the compared, within the tolerance, not identical
    tolerance: Tolerance | None = None

    def to_dict(self) -> dict[str, Any]:
        tol = None if self.tolerance is None else {"atol": self.tolerance.atol,
                                                   "rtol": self.tolerance.rtol}
        return {"a": self.a, "b": self.b, "equal": self.equal, "compared": self.compared,
                "identical": self.identical, "close": self.close, "tolerance": tol,
                "elements": self.elements,
                "differences": [d.to_dict() for d in self.differences],
                "metadata": list(self.metadata), "bytes_read": self.bytes_read,
                "seconds": round(self.seconds, 3)}


# ------------------------------------------------------------------------------------ plan


def _entries(c: Component) -> dict[tuple[str, str], tuple[tuple[int, ...], Source]]:
    """(fqn, kind) -> (shape, source) for every state of every parameter and every buffer,
    in the order they lie in the files (groups, then kinds, then parameters; then buffers)."""
    out: dict[tuple[str, str], tuple[tuple[int, ...], Source]] = {}
    for g in c.layout.groups:
        for kind, dtype in c.states[g.name]:
            for p in c.layout.group_params(g):
                out[(p.fqn, kind)] = (p.shape, Source(dtype, g.name, kind, p.offset, p.fqn))
    for b in c.buffers:
        out[(b.fqn, "buffer")] = (b.shape, Source(b.dtype, None, "buffer", 0, b.fqn))
    return out


def _optimizer_settings(m: Manifest) -> dict[str, str]:
    out: dict[str, str] = {}
    if m.optimizer is not None:
        for pg in param_groups(m.optimizer):
            setting = json.dumps({"hparams": dict(pg.hparams), "step": pg.step}, sort_keys=True)
            for fqn in pg.params:
                out[fqn] = setting
    return out


def _metadata(ma: Manifest, mb: Manifest) -> list[str]:
    notes: list[str] = []
    for name in ma.components.keys() & mb.components.keys():
        ca, cb = ma.components[name], mb.components[name]
        if dict(ca.aliases) != dict(cb.aliases):
            notes.append(f"{name}: tied aliases differ: {dict(ca.aliases)} vs {dict(cb.aliases)}")
        for p in ca.layout.params:
            if not cb.layout.has_param(p.fqn):
                continue
            ga, gb = ca.layout.group(p.group), cb.layout.group(cb.layout.param(p.fqn).group)
            if (ga.dtype, ga.requires_grad) != (gb.dtype, gb.requires_grad):
                notes.append(f"{name}/{p.fqn}: {ga.dtype}{'' if ga.requires_grad else ' frozen'} vs "
                             f"{gb.dtype}{'' if gb.requires_grad else ' frozen'}")
    oa, ob = ma.optimizer, mb.optimizer
    if (oa is None) != (ob is None) or (oa and ob and oa.name != ob.name):
        notes.append(f"optimizer differs: {oa.name if oa else None} vs {ob.name if ob else None}")
    sa, sb = _optimizer_settings(ma), _optimizer_settings(mb)
    for fqn in sa.keys() & sb.keys():
        if sa[fqn] != sb[fqn]:
            notes.append(f"optimizer settings of {fqn} differ: {sa[fqn]} vs {sb[fqn]}")
    for fqn in sorted(sa.keys() ^ sb.keys()):
        notes.append(f"{fqn} is in an optimizer param group only in {'A' if fqn in sa else 'B'}")
    return notes


def plan_diff(ma: Manifest, mb: Manifest) -> DiffPlan:
    """Match tensors by (component, FQN, kind); list one-sided and reshaped ones. Pure."""
    comparisons: list[Comparison] = []
    one_sided: list[TensorDiff] = []
    names = list(ma.components) + [n for n in mb.components if n not in ma.components]
    for name in names:
        ea = _entries(ma.components[name]) if name in ma.components else {}
        eb = _entries(mb.components[name]) if name in mb.components else {}
        for key, (shape, src) in ea.items():
            numel = math.prod(shape)
            if key not in eb:
                one_sided.append(TensorDiff(name, key[0], key[1], ONLY_A, numel))
            elif eb[key][0] != shape:
                one_sided.append(TensorDiff(name, key[0], key[1], MISMATCH, numel,
                                            detail=f"shape {list(shape)} vs {list(eb[key][0])}"))
            else:
                comparisons.append(Comparison(name, key[0], key[1], numel, src, eb[key][1]))
        one_sided += [TensorDiff(name, k[0], k[1], ONLY_B, math.prod(shape))
                      for k, (shape, _) in eb.items() if k not in ea]
    return DiffPlan(tuple(comparisons), tuple(one_sided), tuple(_metadata(ma, mb)))


# ------------------------------------------------------------------------------------ compare


def compare_bytes(a: bytes | memoryview, b: bytes | memoryview, dtype_a: str, dtype_b: str,
                  tolerance: Tolerance | None = None) -> tuple[int, float]:
    """(differing elements, max |a - b|) of two equally long pieces; (0, 0.0) if bit-identical.
    With ``tolerance``, only elements beyond it count as differing (the max is over all)."""
    if dtype_a == dtype_b:
        if a == b:
            return 0, 0.0
        width = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[itemsize(dtype_a)]
        mask = np.frombuffer(a, width) != np.frombuffer(b, width)
        va = decode(a, dtype_a)[mask].astype(np.float64)
        vb = decode(b, dtype_b)[mask].astype(np.float64)
    else:
        va, vb = decode(a, dtype_a).astype(np.float64), decode(b, dtype_b).astype(np.float64)
        both_nan = np.isnan(va) & np.isnan(vb)
        mask = ~((va == vb) | both_nan)
        va, vb = va[mask], vb[mask]
    n = int(np.count_nonzero(mask))
    if n == 0:
        return 0, 0.0
    with np.errstate(invalid="ignore", over="ignore"):
        d = np.abs(va - vb)
    one_nan = np.isnan(va) != np.isnan(vb)
    d[one_nan] = np.inf
    d[np.isnan(d)] = 0.0  # both NaN (different payloads), or inf - inf of one sign
    if tolerance is not None:
        with np.errstate(invalid="ignore", over="ignore"):
            n = int(np.count_nonzero(~(d <= tolerance.atol + tolerance.rtol * np.abs(vb))))
    return n, float(d.max())


@dataclass(frozen=True)
class DiffPart:
    """What one process compared: its pairs (or the chunked tensors and blobs)."""

    compared: int
    identical: int
    elements: int
    bytes_read: int
    differences: tuple[TensorDiff, ...]
    close: int = 0

    def to_doc(self) -> dict[str, Any]:
        return {"compared": self.compared, "identical": self.identical, "elements": self.elements,
                "read": self.bytes_read, "diffs": [d.to_dict() for d in self.differences],
                "close": self.close}

    @classmethod
    def from_doc(cls, doc: Mapping[str, Any]) -> DiffPart:
        diffs = tuple(TensorDiff(**{**d, "max_abs_diff": float(d["max_abs_diff"])})
                      for d in doc["diffs"])
        return cls(doc["compared"], doc["identical"], doc["elements"], doc["read"], diffs,
                   doc["close"])


def run_diff(ra: CheckpointReader, rb: CheckpointReader, plan: DiffPlan | None = None,
             buffer_bytes: int = DEFAULT_BUFFER,
             progress: Callable[[int], None] | None = None,
             job: Job | None = None, tolerance: Tolerance | None = None) -> DiffResult:
    """Compare every planned pair in aligned pieces, then the chunked tensors and blobs;
    ``progress(nbytes)`` as pieces are compared; ``tolerance``: see the module doc.

    Every process of ``job`` (one process alone: a job of one) calls it and compares a run of
    the planned pairs (balanced by bytes); rank 0 compares the chunked tensors too. Every
    process gets the whole result."""
    job = job or Job.single()
    t0 = time.perf_counter()
    plan = plan or plan_diff(ra.manifest, rb.manifest)
    costs = [c.numel * (itemsize(c.a.dtype) + itemsize(c.b.dtype)) for c in plan.comparisons]
    mine = [plan.comparisons[i] for i in contiguous_split(costs, job.world_size)[job.rank]]
    chunked = ra.manifest.chunked is not None or rb.manifest.chunked is not None

    def compare() -> list[dict[str, Any]]:
        parts = [_compare_pairs(ra, rb, mine, buffer_bytes, progress, tolerance)]
        if job.is_root and chunked:
            parts.append(_chunked_diff(ra, rb, buffer_bytes, progress, tolerance))
        return [p.to_doc() for p in parts]

    parts = [DiffPart.from_doc(d) for r in job.agree(compare, "diff: comparing") for d in r]
    differences = tuple(d for p in parts for d in p.differences) + plan.one_sided
    return DiffResult(ra.url, rb.url, not differences and not plan.metadata,
                      sum(p.compared for p in parts), sum(p.identical for p in parts),
                      differences, plan.metadata, sum(p.bytes_read for p in parts),
                      time.perf_counter() - t0, sum(p.elements for p in parts),
                      sum(p.close for p in parts), tolerance)


def _compare_pairs(ra: CheckpointReader, rb: CheckpointReader, comparisons: Sequence[Comparison],
                   buffer_bytes: int, progress: Callable[[int], None] | None,
                   tolerance: Tolerance | None = None) -> DiffPart:
    """Compare ``comparisons`` in aligned pieces read from both sides."""
    engine = PieceReader([ra, rb], buffer_bytes)
    stats = [[0, 0.0] for _ in comparisons]
    items = [(c.numel, (c.a, c.b)) for c in comparisons]
    pieces = engine.pieces(items)
    try:
        for p in pieces:
            c = comparisons[p.index]
            n, mx = compare_bytes(p.data[0], p.data[1], c.a.dtype, c.b.dtype, tolerance)
            s = stats[p.index]
            s[0] += n
            s[1] = max(s[1], mx)
            if progress:
                progress(len(p.data[0]) + len(p.data[1]))
    finally:
        pieces.close()  # type: ignore[attr-defined]
    diffs: list[TensorDiff] = []
    close = 0
    for c, (count, worst) in zip(comparisons, stats, strict=True):
        if count or c.a.dtype != c.b.dtype:
            detail = f"dtype {c.a.dtype} vs {c.b.dtype}" if c.a.dtype != c.b.dtype else ""
            diffs.append(TensorDiff(c.component, c.name, c.kind, DIFFERENT, c.numel, int(count),
                                    float(worst), detail))
        elif worst:
            close += 1
    return DiffPart(len(comparisons), len(comparisons) - len(diffs) - close,
                    sum(c.numel for c in comparisons), engine.bytes_read, tuple(diffs), close)


def _chunked_diff(ra: CheckpointReader, rb: CheckpointReader, buffer_bytes: int,
                  progress: Callable[[int], None] | None,
                  tolerance: Tolerance | None = None) -> DiffPart:
    """Chunked tensors matched by FQN, compared on the boxes both sides' chunks share (in bands
    of at most half the buffer per side), and blobs matched by key, compared as opaque bytes."""
    sa, sb = ra.manifest.chunked, rb.manifest.chunked
    ta, tb = (dict(sa.tensors) if sa else {}), (dict(sb.tensors) if sb else {})
    diffs: list[TensorDiff] = []
    compared = elements = nbytes = close = 0
    for fqn, a in ta.items():
        b = tb.get(fqn)
        if b is None or a.shape != b.shape:
            diffs.append(TensorDiff("chunked", fqn, "tensor", ONLY_A if b is None else MISMATCH, a.numel,
                                    detail="" if b is None else f"shape {list(a.shape)} vs {list(b.shape)}"))
            continue
        compared, elements, n, mx = compared + 1, elements + a.numel, 0, 0.0
        for ca, cb, off, size in iter_pairs(a, b, max(1, buffer_bytes // 2)):
            xa, xb = read_box(ra, a, ca, off, size), read_box(rb, b, cb, off, size)
            k, m = compare_bytes(xa, xb, a.dtype, b.dtype, tolerance)
            n, mx, nbytes = n + k, max(mx, m), nbytes + len(xa) + len(xb)
            if progress:
                progress(len(xa) + len(xb))
        if n or a.dtype != b.dtype:
            detail = f"dtype {a.dtype} vs {b.dtype}" if a.dtype != b.dtype else ""
            diffs.append(TensorDiff("chunked", fqn, "tensor", DIFFERENT, a.numel, n, mx, detail))
        elif mx:
            close += 1
    diffs += [TensorDiff("chunked", f, "tensor", ONLY_B, t.numel) for f, t in tb.items() if f not in ta]
    ba, bb = (dict(sa.blobs) if sa else {}), (dict(sb.blobs) if sb else {})
    for key in list(ba) + [k for k in bb if k not in ba]:
        if key not in ba or key not in bb:
            diffs.append(TensorDiff("chunked", key, "blob", ONLY_A if key in ba else ONLY_B))
            continue
        compared += 1
        xa, xb = read_blob(ra, ba[key]), read_blob(rb, bb[key])
        nbytes += len(xa) + len(xb)
        if xa != xb:
            diffs.append(TensorDiff("chunked", key, "blob", DIFFERENT, detail="opaque bytes differ"))
    return DiffPart(compared, compared - len([d for d in diffs if d.status == DIFFERENT]) - close,
                    elements, nbytes, tuple(diffs), close)


def diff(a: str | CheckpointReader, b: str | CheckpointReader,
         storage_options: Mapping[str, Any] | None = None, buffer_bytes: int = DEFAULT_BUFFER,
         progress: Callable[[int], None] | None = None, job: Job | None = None,
         tolerance: Tolerance | None = None) -> DiffResult:
    """Compare checkpoints ``a`` and ``b`` by content (see the module doc): each opened once
    (unless it is a reader already), planned, then :func:`run_diff`."""
    job = job or Job.single()
    urls = [x for x in (a, b) if not isinstance(x, CheckpointReader)]
    opened = iter(open_readers(job, urls, storage_options, "diff: opening the checkpoints")
                  if urls else [])
    ra = a if isinstance(a, CheckpointReader) else next(opened)
    rb = b if isinstance(b, CheckpointReader) else next(opened)
    return run_diff(ra, rb, plan_diff(ra.manifest, rb.manifest), buffer_bytes, progress, job,
                    tolerance)
