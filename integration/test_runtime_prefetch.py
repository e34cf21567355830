"""Prefetch, ``reshard_after_forward=False`` and HSDP meshes, bit for bit against plain ZeRO-3.

Shares the job of each world size with the other runtime suites (``testing.ranks.shared_reports``)
and the tiny Llama of ``test_runtime_stages.py``. In deterministic mode every configuration below
must end with the same fp32 masters and AdamW states, bit for bit, as ZeRO-3 on the same number
of ranks without prefetch (itself checked against plain PyTorch in ``test_runtime_parity.py`` and
``test_runtime_stages.py``):

* prefetch on (the default) and off; ``reshard_after_forward=False``;
* HSDP 2 x 1 on 2 ranks and HSDP 2 x 2 on 4 ranks (gathers and reduce-scatters in the shard
  group; the deterministic reduction sums all R·S contributions in global rank order), with and
  without prefetch, in fp32 and with bf16 compute.

States are all-gathered over each engine's shard group with plain ``torch.distributed``
(``test_runtime_stages.gathered``), so every rank compares whole tensors.
"""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch

from testing.engines import tiny_engine, tiny_step
from testing.ranks import case_suite, check_case
from testing.reference import differences, gathered
from testing.wire import wire

pytestmark = pytest.mark.slow

STEPS = 3


def train_states(pm, **kwargs: Any) -> tuple[dict[str, dict[str, torch.Tensor]], list[str], Any]:
    """Train ``STEPS`` steps; whole masters and AdamW states, padding problems, the engine."""
    engine, opt = tiny_engine(pm, deterministic=True, **kwargs)
    for i in range(STEPS):
        tiny_step(engine, opt, i, pm.rank)
    states, bad = gathered(engine)
    return states, bad, engine


def compare(pm, runs: dict[str, dict[str, Any]], base: dict[str, Any]) -> list[str]:
    """Every run in ``runs`` (engine kwargs; ``mesh`` picks another process mesh) against the
    ``base`` run on ``pm``, bit for bit."""
    ref, problems, _ = train_states(pm, **base)
    for label, kwargs in runs.items():
        kwargs = dict(kwargs)
        got, bad, engine = train_states(kwargs.pop("mesh", pm), **kwargs)
        problems += [f"{label}: {b}" for b in bad]
        problems += differences(label, got, ref)
        if kwargs.get("prefetch", True) and not engine._schedule.prefetcher.prefetches:
            problems.append(f"{label}: nothing was prefetched")
    return problems


def _hsdp(replicate: int, shard: int):
    from shardckpt.format.layout import Mesh
    from shardckpt.runtime.mesh import ProcessMesh

    return ProcessMesh.from_process_group(Mesh.hsdp(replicate, shard))


def case_prefetch_bits(pm) -> list[str]:
    """Prefetch on/off, ``reshard_after_forward=False``, HSDP 2 x (W/2), equal to ZeRO-3 on W."""
    from shardckpt.runtime import MixedPrecisionPolicy

    hsdp = _hsdp(2, pm.world_size // 2)
    shape = f"HSDP 2x{pm.world_size // 2}"
    problems = []
    for precision, mp in (("fp32", None),
                          ("bf16", MixedPrecisionPolicy(torch.bfloat16, torch.float32))):
        runs = {f"{precision} prefetch": dict(mixed_precision=mp),
                f"{precision} reshard_after_forward=False":
                    dict(mixed_precision=mp, reshard_after_forward=False, prefetch=False),
                f"{precision} {shape}": dict(mixed_precision=mp, mesh=hsdp),
                f"{precision} {shape} no prefetch": dict(mixed_precision=mp, mesh=hsdp,
                                                         prefetch=False)}
        problems += compare(pm, runs, dict(mixed_precision=mp, prefetch=False))
    return problems


def case_prefetch_overlaps(pm) -> list[str]:
    """In a steady-state step with prefetch, every block's all-gather is already issued (in
    flight or done) when its forward and its backward need it, and issued asynchronously;
    without prefetch none is."""
    problems = []
    for prefetch in (True, False):
        engine, opt = tiny_engine(pm, prefetch=prefetch)
        needed: list[tuple[str, str, bool]] = []  # (unit, phase, issued ahead)
        for unit in engine.units:
            def probe(unit=unit, gather=unit.gather):
                needed.append((unit.name, "backward" if engine.in_backward else "forward",
                               unit.gathered))
                gather()
            unit.gather = probe
        tiny_step(engine, opt, 0, pm.rank)
        needed.clear()
        with wire() as seen:
            tiny_step(engine, opt, 1, pm.rank)
        blocks = [u.name for u in engine.units if u.name]
        got = [(n, phase, ahead) for n, phase, ahead in needed if n in blocks]
        want = ([(b, "forward", prefetch) for b in blocks]
                + [(b, "backward", prefetch) for b in reversed(blocks)])
        if got != want:
            problems.append(f"prefetch={prefetch}: blocks needed (unit, phase, issued ahead) "
                            f"{got}, expected {want}")
        if prefetch and seen["async"] < 2 * len(blocks):
            problems.append(f"{seen['async']} asynchronous all-gathers, expected at least "
                            f"{2 * len(blocks)}")
    return problems


CASES: dict[str, Callable] = {
    "prefetch_bits": case_prefetch_bits,
    "prefetch_overlaps": case_prefetch_overlaps,
}


def cases_for(world: int) -> list[str]:
    if world == 2:
        return ["prefetch_bits", "prefetch_overlaps"]
    return ["prefetch_bits"] if world == 4 else []


reports = case_suite(__name__, CASES, cases_for, [2, 4], timeout_s=120, pg_timeout_s=150,
                     case_pg_timeout_s=120)


_check = check_case


def test_prefetch_hsdp_and_reshard_after_forward_bit_exact_with_zero3(reports):
    _check(reports, "prefetch_bits")


def test_prefetch_issues_the_next_units_gather_ahead(reports):
    _check(reports, "prefetch_overlaps")
