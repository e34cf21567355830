"""Tilings of a box for the property tests of chunk lookups and DCP's tiling checks."""

from __future__ import annotations


Box = tuple[tuple[int, ...], tuple[int, ...]]  # offsets, lengths


def split_tiling(lo: tuple[int, ...], hi: tuple[int, ...], cuts: list[int]) -> list[Box]:
    """Boxes ``(offsets, lengths)`` tiling ``[lo, hi)``: split recursively at the dims and points
    ``cuts`` gives."""
    dims = [d for d in range(len(lo)) if hi[d] - lo[d] > 1]
    if not cuts or not dims:
        return [(lo, tuple(b - a for a, b in zip(lo, hi, strict=True)))]
    c, rest = cuts[0], cuts[1:]
    d = dims[c % len(dims)]
    at = lo[d] + 1 + (c // len(dims)) % (hi[d] - lo[d] - 1)
    left_hi, right_lo = list(hi), list(lo)
    left_hi[d], right_lo[d] = at, at
    half = len(rest) // 2
    return (split_tiling(lo, tuple(left_hi), rest[:half])
            + split_tiling(tuple(right_lo), hi, rest[half:]))
