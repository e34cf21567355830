"""Hostile peer reports and requests (one process, seeded): what one rank tells another in a
local save and a peer copy, mutated as :mod:`testing.fuzz` mutates any untrusted document. Each
check returns or raises one ``ShardckptError``, never another exception; a report it accepts
names only files a copy may write (inside the step: a frozen reference to another step is
refused by the receiver); spans it accepts tile the file in pieces it can hold."""

from __future__ import annotations

import random

from shardckpt.format.manifest import FileEntry
from shardckpt.training.peer_checks import (
    MAX_SPANS, checked_count, checked_spans, outside_step, report_entries,
)
from testing.fuzz import HOSTILE, expect_clean, materialize, mutations

SEED = 39
CS = 64


def _report() -> list:
    from shardckpt.format.integrity import crc32c

    data = bytes(range(200))
    chunks = tuple(crc32c(data[i:i + CS]) for i in range(0, len(data), CS))
    return [FileEntry("ab12cd34/shard-00000-of-00002.safetensors", "shard", len(data), 0,
                      crc32c(data), chunks, 0).to_doc(),
            FileEntry("ab12cd34/rank-00000.safetensors", "rank", len(data), 0, crc32c(data),
                      chunks, 0).to_doc()]


def test_hostile_reports_are_one_error_or_files_inside_the_step():
    base = _report()
    cases = [(i, c) for i, c in mutations(base, SEED, 600)] + [(-1, v) for v in HOSTILE]
    accepted = 0
    for i, case in cases:
        got: list = []
        err = expect_clean(lambda c=case: got.extend(report_entries(materialize(c), 1, "save")),
                           f"seed {SEED} case {i}")
        if err is None:
            accepted += 1
            for e in got:  # what a receiver would be asked to write: inside the step, or refused
                assert outside_step(e.path) is None or (e.role == "frozen" and e.path.startswith("../")), e
        else:
            assert "rank 1" in str(err), err
    assert 0 < accepted < len(cases)


def test_a_frozen_reference_in_a_report_is_never_a_place_to_write():
    ref = "../step-00000001/ab12cd34/frozen-00000-of-00002.safetensors"
    assert outside_step(ref) is not None
    for path in ("a/../../b", "/etc/passwd", "a//b", "./a", "a\\b", "", "a\x00b"):
        assert outside_step(path) is not None, path
    assert outside_step("ab12cd34/shard-00000-of-00002.safetensors") is None


def test_hostile_span_requests_are_refused_before_allocating():
    rng = random.Random(SEED)
    size, piece = 1000, 256
    hostile_ints = [v for v in HOSTILE if isinstance(v, int)] + [MAX_SPANS + 1, size + 1]
    for count in hostile_ints:
        err = expect_clean(lambda c=count: checked_count(c, size, 1, "f"), f"count {count}")
        assert (err is None) == (0 <= count <= size), count
    for i in range(400):
        lengths = [rng.choice([*hostile_ints, rng.randint(1, piece)]) for _ in range(rng.randint(0, 6))]
        err = expect_clean(lambda n=lengths: checked_spans(n, size, piece, 1, "f"), f"spans {i}")
        ok = all(isinstance(n, int) and 0 < n <= piece for n in lengths) and sum(lengths) == size
        assert (err is None) == ok, lengths
    assert checked_spans([256, 256, 256, 232], size, piece, 1, "f") == [256, 256, 256, 232]
