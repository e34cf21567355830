"""Tied parameters and full-parameter access of the ZeRO runtime on real gloo process groups.

Shares the job of each world size with the other runtime suites (``testing.ranks.shared_reports``)
and the helpers of ``test_runtime_stages.py``: the same tiny Llama (embedding tied to the head),
trained by ``train`` on every rank; collectives counted by wrapping ``torch.distributed``.
"""

from __future__ import annotations

import copy
from typing import Any, Callable

import pytest
import torch

from testing.engines import train_tiny
from testing.models import TINY, tiny_batch, tiny_llama
from testing.ranks import case_suite, check_case
from testing.wire import counting

pytestmark = pytest.mark.slow


def case_tied_and_collectives(pm) -> list[str]:
    """The tied embedding/head: one parameter, one gather of its unit per step, one gradient.
    Every stage reduces the gradient to an fp32 shard; stage 1 keeps it in the slice of a whole
    resident gradient buffer, 2 and 3 free theirs; 1 and 2 keep parameters."""
    problems = []
    for stage in (1, 2, 3):
        seen: dict[str, Any] = {}

        def probe(engine, seen=seen):
            root = engine.groups[engine.layout.groups[0].name]
            buf = root.grad_buffer
            in_buf = buf is not None and root.grad.data_ptr() == buf[root.shard_start:].data_ptr()
            seen.update(root=root.spec, kept=all(g.gathered for g in engine.groups.values()),
                        grad=(root.grad.numel(), getattr(buf, "shape", None), in_buf),
                        aliases=dict(engine.tied_aliases),
                        layout=[p.fqn for p in engine.layout.params])

        with counting("all_gather_into_tensor", "all_gather_single") as gathers:
            train_tiny(pm, stage, steps=2, after_backward=probe)
        if "lm_head.weight" in seen["layout"] or seen["aliases"] != {
                "lm_head.weight": "model.embed_tokens.weight"}:
            problems.append(f"stage {stage}: tied head not an alias: {seen['aliases']}")
        full = seen["root"].padded_numel
        want = (full // pm.world_size, (full,) if stage == 1 else None, stage == 1)
        if seen["grad"] != want:
            problems.append(f"stage {stage}: root gradient (shard, resident buffer, shard in "
                            f"the buffer) {seen['grad']}, expected {want}")
        if seen["kept"] != (stage < 3):
            problems.append(f"stage {stage}: parameters kept gathered after backward: "
                            f"{seen['kept']}")
        # stage 3: once per step (the root stays gathered for its backward); stages 1 and 2:
        # in the first forward and after each step (no gradient is all-gathered).
        expected = {3: 2, 2: 3, 1: 3}[stage] if pm.world_size > 1 else 0
        if gathers.count(full * 4) != expected:
            problems.append(f"stage {stage}: {gathers.count(full * 4)} all-gathers of the tied "
                            f"unit's {full * 4} bytes in 2 steps, expected {expected}")
    return problems


def case_full_params(pm) -> list[str]:
    """summon_full_params gives whole tensors; writeback changes the masters (and the model);
    full_state_dict equals the eager model's state_dict and loads back."""
    from shardckpt.runtime import MixedPrecisionPolicy

    problems = []
    eager = tiny_llama()
    tokens = tiny_batch(0, 0, 0)
    for stage, mp in ((3, None), (1, None), (2, MixedPrecisionPolicy())):
        engine, _ = train_tiny(pm, stage, mp=mp, steps=0)
        label = f"stage {stage}{' bf16' if mp else ''}"
        with engine.summon_full_params() as full:
            bad = [n for n, p in eager.state_dict().items()
                   if n in full and not torch.equal(full[n], p)]
            if bad or set(full) != {n for n, _ in eager.named_parameters(remove_duplicate=False)}:
                problems.append(f"{label}: summoned tensors differ: {bad[:3]}")
        with engine.summon_full_params(writeback=True) as full, torch.no_grad():
            for p in {id(t): t for t in full.values()}.values():  # the tied one once
                p.mul_(2)
            full["model.norm.weight"].data = torch.full((TINY["hidden_size"],), 3.0)
        expected = {n: p.detach() * 2 for n, p in eager.named_parameters()}
        expected["model.norm.weight"] = torch.full((TINY["hidden_size"],), 3.0)
        after = engine.gather_full_params()
        bad = [n for n, p in expected.items() if not torch.equal(after[n], p)]
        if bad:
            problems.append(f"{label}: writeback did not reach the masters: {bad[:3]}")
        twin = copy.deepcopy(eager)
        twin.load_state_dict({**expected, "lm_head.weight": expected["model.embed_tokens.weight"]})
        if mp is not None:
            for p in twin.parameters():
                p.data = p.data.bfloat16()
        with torch.no_grad():
            if not torch.equal(engine(tokens), twin(tokens)):
                problems.append(f"{label}: the forward after writeback does not use the masters")
        sd = engine.full_state_dict()
        if list(sd) != list(twin.state_dict()) or sd["lm_head.weight"] is not sd[
                "model.embed_tokens.weight"]:
            problems.append(f"{label}: full_state_dict keys {list(sd)[:4]}...")
        engine.load_full_state_dict(eager.state_dict())
        if any(not torch.equal(engine.gather_full_params()[n], p)
               for n, p in eager.named_parameters()):
            problems.append(f"{label}: load_full_state_dict did not restore the masters")
    return problems


CASES: dict[str, Callable] = {
    "tied": case_tied_and_collectives,
    "full_params": case_full_params,
}


def cases_for(world: int) -> list[str]:
    if world >= 4:
        return []
    return ["full_params", "tied"] if world > 1 else ["full_params"]


reports = case_suite(__name__, CASES, cases_for, [1, 2, 3], timeout_s=120, pg_timeout_s=150,
                     case_pg_timeout_s=120)


_check = check_case


def test_tied_parameters_one_gather_one_gradient(reports):
    _check(reports, "tied")


def test_summon_full_params_and_full_state_dict(reports):
    _check(reports, "full_params")
