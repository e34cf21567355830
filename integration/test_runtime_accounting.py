"""Accounting of the ZeRO runtime, measured independently of its counters, against the estimator.

Shares the job of each world size with the other runtime suites (``testing.ranks.shared_reports``) and
the tiny Llama of ``test_runtime_stages.py``. Three measurements, none of which reads the
engine's counters:

* **communication**: every ``torch.distributed`` collective is wrapped and the bytes it moves are
  counted by type, then turned into elements with the dtype the step moves (compute dtype for
  all-gathers of parameters, reduce dtype for gradients). Logical volume as in the estimator: an
  all-gather counts its output, a reduce-scatter and an all-to-all their input, an all-reduce
  twice its buffer. Counted over one steady-state step (the second; the first also records the
  prefetch order, and in stages 1 and 2 gathers for the first forward). Ψ is the **padded**
  parameter count (every flat group is padded to a multiple of 16·S elements), slightly more
  than the number of parameters; the figures are exact in padded Ψ. Counted in the default mode
  and in deterministic mode: with R = 1 the deterministic gradient exchange is an all-to-all of
  the same volume as the reduce-scatter; HSDP's deterministic exchange sums all R·S
  contributions on each rank and moves R·Ψ instead (checked separately);
* **model-state bytes**: the distinct storages reachable from the engine and its optimizer
  (walking Python references, each storage once, module buffers left out), after a step and
  before ``zero_grad()``;
* **gathered weights**: the storages of every all-gather's output, summed over those still
  holding bytes right after each all-gather (the moment a peak can occur); at most the root
  unit (its forward spans the whole model, so it stays gathered) and two blocks with prefetch,
  one without.

Expected per step: stage 3 sends 3Ψ with ``reshard_root_after_forward=True`` (all-gather in
forward, all-gather in backward, reduce-scatter); by default the root stays gathered from forward
to backward, 3Ψ − Ψ_root; ``reshard_after_forward=False``, stage 2 and stage 1 send 2Ψ (stages
1 and 2, the estimator's figure: reduce-scatter of the gradient, Ψ, then all-gather of the
updated parameters, Ψ). Stage 1 differs from stage 2 in memory only: its whole-size gradient
buffer stays resident, which the model-state bytes (and the estimator's ZeRO-1 figure) count.
"""

from __future__ import annotations

import gc
import types
from typing import Any, Callable

import pytest
import torch

from testing.engines import tiny_engine, tiny_step
from testing.ranks import case_suite, check_case
from testing.wire import wire

pytestmark = pytest.mark.slow


_OPAQUE = (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType,
           types.CodeType, types.FrameType, types.MethodWrapperType, str, bytes)


def held_bytes(*roots: Any, exclude: list[torch.Tensor] = ()) -> int:
    """Bytes of the distinct storages reachable from ``roots`` through Python references
    (``gc.get_referents``; classes, modules and functions are not followed), except those of
    ``exclude``. Independent of any counter of the code under test."""
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    storages: dict[int, int] = {}
    seen: set[int] = set()
    stack = list(roots)
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, _OPAQUE):
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            st = obj.untyped_storage()
            if st.nbytes() and st.data_ptr() not in skip:
                storages[st.data_ptr()] = st.nbytes()
            if obj.grad is not None:
                stack.append(obj.grad)
        stack.extend(gc.get_referents(obj))
    return sum(storages.values())


def padded(engine) -> tuple[int, int, int]:
    """Ψ (padded), the root unit's padded size, the largest block's padded size."""
    units: dict[str, int] = {}
    for g in engine.layout.groups:
        units[g.unit] = units.get(g.unit, 0) + g.padded_numel
    return sum(units.values()), units.get("", 0), max(v for u, v in units.items() if u)


# ------------------------------------------------------------------------------- the cases

BF16 = "bf16"


def _policy(precision: str | None):
    from shardckpt.runtime import MixedPrecisionPolicy

    return MixedPrecisionPolicy(torch.bfloat16, torch.float32) if precision == BF16 else None


def case_comm(pm) -> list[str]:
    """Elements per step by collective type: wrapped ``torch.distributed`` == the engine's
    counters == the expected multiple of padded Ψ (== the estimator's)."""
    problems = []
    configs = {  # label -> (engine kwargs, expected elements in units of Ψ / Ψ_root)
        "stage 3": (dict(), (3, -1)),
        "stage 3, root resharded": (dict(reshard_root_after_forward=True), (3, 0)),
        "stage 3, reshard_after_forward=False": (dict(reshard_after_forward=False), (2, 0)),
        "stage 3, no prefetch": (dict(prefetch=False), (3, -1)),
        "stage 2": (dict(stage=2), (2, 0)),
        "stage 1": (dict(stage=1), (2, 0)),
    }
    for precision in (None, BF16):
        for det in (True, False):
            for label, (kwargs, (k_psi, k_root)) in configs.items():
                name = f"{label}, {precision or 'fp32'}, {'deterministic' if det else 'default'}"
                engine, opt = tiny_engine(pm, deterministic=det, mixed_precision=_policy(precision),
                                    **kwargs)
                psi, root, _ = padded(engine)
                tiny_step(engine, opt, 0, pm.rank)
                engine.accounting.reset()
                with wire() as seen:
                    tiny_step(engine, opt, 1, pm.rank)
                compute = 2 if precision == BF16 else 4
                # Parameters move in the compute dtype, gradients in fp32.
                elements = {op: b // 4 for op, b in seen["bytes"].items()}
                gathered = seen["bytes"].get("all_gather", 0)
                if gathered:
                    elements["all_gather"] = gathered // compute
                total, want = sum(elements.values()), k_psi * psi + k_root * root
                if kwargs.get("stage") in (1, 2):  # one gradient exchange, one parameter gather
                    ops = {"all_to_all" if det else "reduce_scatter": psi, "all_gather": psi}
                    if elements != ops:
                        problems.append(f"{name}: sent {elements}, expected {ops}")
                mine = engine.accounting.snapshot()
                if total != want:
                    problems.append(f"{name}: sent {elements} = {total}, expected {want} "
                                    f"({k_psi}Ψ{k_root:+d}Ψ_root, Ψ = {psi} padded)")
                if mine["comm_elements"] != total or {
                        op: n for op, n in mine["elements"].items() if n} != elements:
                    problems.append(f"{name}: engine counted {mine['elements']}, wire {elements}")
                est = engine.estimate().comm_elements
                if k_root == 0 and "reshard_after" not in label and est != total:
                    problems.append(f"{name}: estimator {est}, sent {total}")
    return problems


def case_memory(pm) -> list[str]:
    """Model-state bytes per rank after a step: reachable storages == the engine's kinds == the
    estimator's figure for the same policy (padded Ψ), per kind and in total."""
    problems = []
    for stage in (1, 2, 3):
        for precision in (None, BF16):
            name = f"stage {stage}, {precision or 'fp32'}"
            engine, opt = tiny_engine(pm, stage=stage, mixed_precision=_policy(precision))
            for i in range(2):
                tiny_step(engine, opt, i, pm.rank, zero=i == 0)
            gc.collect()
            held = held_bytes(engine, opt, exclude=list(engine.module.buffers()))
            kinds = engine.model_state_bytes()
            est = engine.estimate()
            want = {k.kind: k.bytes for k in est.kinds}
            if held != sum(kinds.values()):
                problems.append(f"{name}: {held} bytes reachable, engine counts {kinds}")
            if kinds != want or est.model_state_bytes != held:
                problems.append(f"{name}: engine {kinds}, estimator ({est.precision}) {want}")
    return problems


def case_gathered_peak(pm) -> list[str]:
    """Peak bytes of gathered weights in a stage-3 step: the all-gather outputs' live storages
    == the engine's peak; at most the root and two blocks with prefetch, one without."""
    problems = []
    for prefetch in (True, False):
        for precision in (None, BF16):
            name = f"prefetch {prefetch}, {precision or 'fp32'}"
            engine, opt = tiny_engine(pm, prefetch=prefetch, mixed_precision=_policy(precision))
            psi, root, block = padded(engine)
            tiny_step(engine, opt, 0, pm.rank)
            engine.accounting.reset()
            with wire() as seen:
                tiny_step(engine, opt, 1, pm.rank)
            size = 2 if precision == BF16 else 4
            peak, mine = max(seen["samples"]), engine.accounting.peak_gathered_bytes
            bound = (root + (2 if prefetch else 1) * block) * size
            if peak != mine:
                problems.append(f"{name}: gathered peak {peak} measured, {mine} counted")
            if peak > bound:
                problems.append(f"{name}: gathered peak {peak} > root + blocks {bound}")
            if prefetch and not seen["async"]:
                problems.append(f"{name}: no all-gather was issued asynchronously")
    return problems


def case_hsdp_comm(pm) -> list[str]:
    """HSDP 2 x 2: default mode sends the estimator's 3Ψ + 2Ψ/S (all-gathers and reduce-scatter
    in the shard group, all-reduce of the gradient shard across replicas); deterministic mode
    exchanges R·Ψ instead of Ψ + 2Ψ/S (each rank sums all R·S contributions in rank order)."""
    from shardckpt.format.layout import Mesh
    from shardckpt.runtime.mesh import ProcessMesh

    hsdp = ProcessMesh.from_process_group(Mesh.hsdp(2, 2))
    problems = []
    for det in (False, True):
        engine, opt = tiny_engine(hsdp, deterministic=det, reshard_root_after_forward=True)
        psi = padded(engine)[0]
        tiny_step(engine, opt, 0, pm.rank)
        with wire() as seen:
            tiny_step(engine, opt, 1, pm.rank)
        got = {op: b // 4 for op, b in seen["bytes"].items()}
        want = ({"all_gather": 2 * psi, "all_to_all": 2 * psi} if det else
                {"all_gather": 2 * psi, "reduce_scatter": psi, "all_reduce": 2 * psi // 2})
        if got != want:
            problems.append(f"HSDP 2x2 {'deterministic' if det else 'default'}: sent {got}, "
                            f"expected {want} (Ψ = {psi} padded)")
        est = engine.estimate()
        if not det and est.comm_elements != sum(got.values()):
            problems.append(f"HSDP 2x2: estimator {est.comm_elements}, sent {sum(got.values())}")
        gc.collect()
        tiny_step(engine, opt, 2, pm.rank, zero=False)
        held = held_bytes(engine, opt, exclude=list(engine.module.buffers()))
        if held != est.model_state_bytes:
            problems.append(f"HSDP 2x2: {held} bytes held, estimator {est.model_state_bytes}")
    return problems


CASES: dict[str, Callable] = {
    "comm": case_comm,
    "memory": case_memory,
    "gathered_peak": case_gathered_peak,
    "hsdp_comm": case_hsdp_comm,
}


def cases_for(world: int) -> list[str]:
    if world == 2:
        return ["comm", "memory", "gathered_peak"]
    return ["hsdp_comm"] if world == 4 else []


reports = case_suite(__name__, CASES, cases_for, [2, 4], timeout_s=120, pg_timeout_s=150,
                     case_pg_timeout_s=120)


# ------------------------------------------------------------------------------- the tests


_check = check_case


def test_elements_sent_per_step_match_padded_psi_and_estimator(reports):
    _check(reports, "comm")


def test_model_state_bytes_match_estimator(reports):
    _check(reports, "memory")


def test_gathered_weight_peak_is_root_plus_two_blocks(reports):
    _check(reports, "gathered_peak")


def test_hsdp_communication(reports):
    _check(reports, "hsdp_comm")
