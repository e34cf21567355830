"""The reshard plan: every byte-range copy that turns shards of one layout into shards of another.

Pure; no I/O, no torch. Parameters are matched by FQN on their global element ranges, so a plan
works across shard degrees, meshes, unit policies and parameter orders.

Invariant (property-tested in ``tests/test_layout_props.py``): a :class:`ReshardPlan` between
two layouts covers every unpadded target element of every shared parameter exactly once, and
each copy reads the same parameter elements it writes.
"""

from __future__ import annotations

from bisect import bisect_right
from functools import lru_cache
from dataclasses import dataclass, field
from typing import NamedTuple

from shardckpt.errors import IncompatibleLayoutError
from shardckpt.format.layout import Layout


class Copy(NamedTuple):
    """Copy ``numel`` elements from a source shard slice to a target shard slice.

    Offsets are element offsets inside the shard's slice of the named group (multiply by the state
    kind's itemsize for bytes; both sides hold the same dtype for a given state kind).
    """

    dst_shard: int
    dst_group: str
    dst_offset: int
    src_shard: int
    src_group: str
    src_offset: int
    numel: int


@dataclass(frozen=True)
class ReshardPlan:
    """Every copy that turns shards of ``src`` into shards of ``dst``, sorted by target.

    Sorted by (dst_shard, dst group order, dst_offset): a target shard is written front to back.
    """

    src: Layout
    dst: Layout
    copies: tuple[Copy, ...]
    missing: tuple[str, ...] = ()      # in dst, absent from src
    unexpected: tuple[str, ...] = ()   # in src, absent from dst
    mismatched: tuple[str, ...] = ()   # in both, different shape / dtype / requires_grad
    _by_dst: dict[int, tuple[int, int]] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        index: dict[int, tuple[int, int]] = {}
        start = 0
        for i in range(1, len(self.copies) + 1):
            if i == len(self.copies) or self.copies[i].dst_shard != self.copies[start].dst_shard:
                index[self.copies[start].dst_shard] = (start, i)
                start = i
        object.__setattr__(self, "_by_dst", index)

    def for_dst_shard(self, shard: int) -> tuple[Copy, ...]:
        lo, hi = self._by_dst.get(shard, (0, 0))
        return self.copies[lo:hi]

    def src_shards_for(self, dst_shard: int) -> set[int]:
        return {c.src_shard for c in self.for_dst_shard(dst_shard)}


def _compatibility(src: Layout, dst: Layout) -> tuple[list[str], list[str], list[str]]:
    missing = [p.fqn for p in dst.params if not src.has_param(p.fqn)]
    unexpected = [p.fqn for p in src.params if not dst.has_param(p.fqn)]
    mismatched = []
    for p in dst.params:
        if not src.has_param(p.fqn):
            continue
        q = src.param(p.fqn)
        pg, qg = dst.group(p.group), src.group(q.group)
        if p.shape != q.shape or pg.master_dtype != qg.master_dtype or pg.requires_grad != qg.requires_grad:
            mismatched.append(
                f"{p.fqn} (source {list(q.shape)} {qg.master_dtype}"
                f"{'' if qg.requires_grad else ' frozen'}, target {list(p.shape)} "
                f"{pg.master_dtype}{'' if pg.requires_grad else ' frozen'})"
            )
    return missing, unexpected, mismatched


def plan_reshard(src: Layout, dst: Layout, strict: bool = True) -> ReshardPlan:
    """Plan the copies from ``src`` shards to ``dst`` shards, matching parameters by FQN.

    Works across shard degrees, meshes, unit policies and parameter orders. With ``strict``, any
    missing, unexpected or mismatched parameter raises one :class:`IncompatibleLayoutError` that
    lists all of them; otherwise only the parameters both layouts share are planned.
    """
    missing, unexpected, mismatched = _compatibility(src, dst)
    if strict and (missing or unexpected or mismatched):
        parts = []
        if missing:
            parts.append(f"missing from the source: {', '.join(missing)}")
        if unexpected:
            parts.append(f"not in the target: {', '.join(unexpected)}")
        if mismatched:
            parts.append(f"different shape or dtype: {', '.join(mismatched)}")
        raise IncompatibleLayoutError(
            "layouts do not match; " + "; ".join(parts),
            tuple(missing), tuple(unexpected), tuple(m.split(" ", 1)[0] for m in mismatched),
        )
    return _planned(src, dst)


@lru_cache(maxsize=1)
def _planned(src: Layout, dst: Layout) -> ReshardPlan:
    """The plan of the parameters ``src`` and ``dst`` share. Pure, so the last one is kept: a
    resume that asks which files each rank reads, then loads, plans once. At 70B parameters
    from 1024 to 768 ranks a plan takes 0.2–0.3 s and holds 29 MB (145,597 copies); a layout
    hashes and compares in under a millisecond."""
    missing, unexpected, mismatched = _compatibility(src, dst)
    skip = set(missing) | {m.split(" ", 1)[0] for m in mismatched}
    copies: list[Copy] = []
    append = copies.append
    S_dst = dst.shard_degree
    # Per target group: param offsets (sorted) for bisecting, and each param's source position.
    prepared = []
    for g in dst.groups:
        specs = [dst.param(f) for f in g.params if f not in skip]
        offsets = [p.offset for p in specs]
        sources = []
        for p in specs:
            q = src.param(p.fqn)
            sources.append((q.group, q.offset, src.shard_numel(q.group)))
        prepared.append((g, specs, offsets, sources, dst.shard_numel(g)))
    for t in range(S_dst):
        for g, specs, offsets, sources, s_dst in prepared:
            lo, hi = t * s_dst, min((t + 1) * s_dst, g.numel)
            if lo >= hi or not specs:
                continue
            i = max(0, bisect_right(offsets, lo) - 1)
            last: Copy | None = None
            while i < len(specs) and specs[i].offset < hi:
                p = specs[i]
                a, b = max(lo, p.offset), min(hi, p.offset + p.numel)
                src_group, src_base, s_src = sources[i]
                x = a
                while x < b:
                    src_flat = src_base + (x - p.offset)
                    src_shard = src_flat // s_src
                    n = min(b - x, (src_shard + 1) * s_src - src_flat)
                    dst_off, src_off = x - lo, src_flat - src_shard * s_src
                    if (
                        last is not None and last.src_shard == src_shard
                        and last.src_group == src_group
                        and last.dst_offset + last.numel == dst_off
                        and last.src_offset + last.numel == src_off
                    ):
                        last = copies[-1] = last._replace(numel=last.numel + n)
                    else:
                        last = Copy(t, g.name, dst_off, src_shard, src_group, src_off, n)
                        append(last)
                    x += n
                i += 1
    return ReshardPlan(src, dst, tuple(copies), tuple(missing), tuple(unexpected),
                       tuple(m.split(" ", 1)[0] for m in mismatched))
