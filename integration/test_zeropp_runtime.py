"""ZeRO++ (qwZ, hpZ, qgZ) on 4 gloo ranks seen as 2 simulated nodes x 2 ranks: quantization
errors, loss, checkpoints (bytes: ``test_zeropp_bytes.py``, which uses the helpers here).

One spawned job (shared with the other runtime suites at world size 4) runs every case on a
``ProcessMesh`` with ``ranks_per_node=2``.

**Loss** (``case_loss``): 50 SGD steps of the tiny Llama on the synthetic corpus, each option
and all three against plain ZeRO-3 from the same start. hpZ moves the forward's bytes unchanged:
its run equals plain ZeRO-3 bit for bit. For qwZ and qgZ the tolerance at step ``t`` is derived
from the quantization error, to first order (:func:`tolerances`)::

    tol_t = sum_{τ <= t} B_τ,    B_τ = sum_i |g_τ,i| · (e^w_τ,i + lr · e^g_τ,i)

``e^w`` (qwZ) is the per-element bound of the int8 weight quantization, ``absmax(block) / 254``
(:func:`shardckpt.runtime.zeropp.quant.error_bound`, of the masters the plain run holds at that step);
``e^g`` (qgZ) the bound of the two-stage int4 gradient reduction: rank ``r``'s local gradient
is quantized with error at most ``a_r / 14`` (``a_r``: the absmax of its block), the node sums
(block absmax at most ``(1 + 1/14)`` times the sum of their ranks' ``a_r``) once more, and the
mean divides by ``W = N·K``, so ``e^g <= (sum_r a_r / W) / 14 · (2 + 1/14)``. A weight perturbation ``δ`` changes the loss by
``g · δ`` to first order; an SGD step turns a gradient error ``ε`` into a weight error
``lr · ε``; and a perturbation made at step ``τ`` is counted again at every later step
(``lr·‖H‖ <= 1``: the drift it causes per step is no larger than itself, and the gradient norm
does not grow), hence the running sum. The per-step bounds are checked on their own too, from
the same state: at every step of the plain run, the loss with qwZ's weights, and the loss one
step later after a step with qgZ's gradient, each within its ``B_τ``. ``case_errors`` measures
both quantization errors directly against their element-wise bounds.

**Checkpoints** (``case_checkpoint``): saved with all three on, loaded with them off, and the
other way round: the shards are the same bits, and the next step too.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist

from testing.ranks import case_suite, check_case
from testing.zeropp_job import LR, STEPS, batches, build, forward_backward, node_mesh, zeropp_configs

pytestmark = pytest.mark.slow


# ------------------------------------------------------------------------------- the cases


def case_errors(pm) -> list[str]:
    """The quantized gather and the quantized reduction, measured against their bounds."""
    from shardckpt.runtime import collectives
    from shardckpt.runtime.zeropp import comm, quant

    pm2, problems = node_mesh(), []
    data = batches(pm.rank, pm.world_size)
    engine, opt = build(pm2, zeropp_configs()["all"])
    real = comm.start_qgz_mean
    measured: list[float] = []

    def checked(pm_, grad, bits, block, acct=None):
        exact = collectives.reduce_scatter_mean(pm_, grad.clone(), True)
        amax = grad.abs().max().reshape(1)
        dist.all_reduce(amax, op=dist.ReduceOp.MAX)
        q = quant.qmax(bits)
        bound = float(amax) / (2 * q) * (2 + 1 / (2 * q)) * (1 + 1e-5)
        got = real(pm_, grad, bits, block, acct).result()
        err = float((got - exact).abs().max())
        measured.append(err / bound if bound else 0.0)
        if err > bound:
            problems.append(f"qgZ gradient error {err:.3g} > bound {bound:.3g}")
        return collectives.PendingMean(lambda: got)

    comm.start_qgz_mean = checked
    try:
        for i in range(3):
            forward_backward(engine, data.batch(i))
            opt.step()
            opt.zero_grad()
            for g in engine.groups.values():  # the qwZ gather, outside forward
                exact = collectives.all_gather_flat(pm2, g.master)
                bound = torch.cat([quant.error_bound(m.view(1, -1), 8, 256)[0]
                                   for m in exact.view(pm2.world_size, -1)])
                with torch.no_grad():
                    g.gather()
                err = (g.full - exact).abs()
                if (err > bound).any():
                    problems.append(f"qwZ gather of {g.name}: error {float(err.max()):.3g} "
                                    f"above its bound")
                g.free()
    finally:
        comm.start_qgz_mean = real
    if not measured or max(measured) == 0:
        problems.append("no qgZ reduction was measured")
    return problems


def _copy_masters(src, dst) -> None:
    """Give ``dst`` the fp32 state of ``src`` (same layout), locally."""
    theirs = dst.local_shards()
    for name, kinds in src.local_shards().items():
        theirs[name]["master"].copy_(kinds["master"])
    dst.refresh_params()


def tolerances(pm2, data) -> dict[str, Any]:
    """The plain run: its losses, the per-step bounds ``bw`` (qwZ) and ``bg`` (qgZ) of the
    module docstring, and the same-state check of each bound: from the plain run's state at
    step t, the loss with qwZ's weights (``dw``), and the loss at t + 1 after one step with
    qgZ's gradient (``dg``), each against the plain run's."""
    from shardckpt.runtime import collectives
    from shardckpt.runtime.zeropp import quant
    from shardckpt.runtime.models.llama import causal_lm_loss

    engine, opt = build(pm2, None)
    qw, _ = build(pm2, zeropp_configs()["qwz"])
    qg, opt_qg = build(pm2, zeropp_configs()["qgz"])
    W, q = pm2.world_size, quant.qmax(4)
    out: dict[str, list[float]] = {"losses": [], "bw": [], "bg": [], "dw": [], "dg": [],
                                   "bg_next": []}
    prev: dict[str, torch.Tensor] = {}  # each group's e^g of the previous step (this shard)
    real = collectives.start_reduce_scatter_mean
    e_g: list[torch.Tensor] = []

    def spy(pm_, grad, *args: Any, **kwargs: Any):
        # qgZ's blocks: 256 elements inside each rank's slice; sum the ranks' block maxima
        amax = quant.error_bound(grad.view(W, -1), 4, 256).reshape(-1) * (2 * q)
        dist.all_reduce(amax)
        e_g.append(amax / (W * 2 * q) * (2 + 1 / (2 * q)))
        return real(pm_, grad, *args, **kwargs)

    collectives.start_reduce_scatter_mean = spy
    try:
        for i in range(STEPS):
            tokens = data.batch(i)
            _copy_masters(engine, qw)
            with torch.no_grad():
                out["dw"].append(float(causal_lm_loss(qw(tokens), tokens)))
            if i:  # qg took one qgZ step from the plain run's state at i - 1
                with torch.no_grad():
                    out["dg"].append(float(causal_lm_loss(qg(tokens), tokens)))
            _copy_masters(engine, qg)
            e_g.clear()
            out["losses"].append(forward_backward(engine, tokens))
            bound_g: dict[int, torch.Tensor] = {}  # groups of one size share the larger bound
            for full in e_g:
                n = full.numel()
                bound_g[n] = torch.maximum(bound_g[n], full) if n in bound_g else full
            sums = torch.zeros(3, dtype=torch.float64)
            for g in engine.groups.values():
                grad = g.grad.double().abs()
                e_w = quant.error_bound(g.master.view(1, -1), 8, 256)[0].double()
                eg = bound_g[g.spec.padded_numel][g.shard_start:g.shard_end].double()
                before = prev.get(g.name, torch.zeros_like(eg))
                sums += torch.stack([(grad * e_w).sum(), (grad * eg).sum(),
                                     (grad * before).sum()])
                prev[g.name] = eg
            dist.all_reduce(sums)
            out["bw"].append(float(sums[0]))
            out["bg"].append(LR * float(sums[1]))
            if i:
                out["bg_next"].append(LR * float(sums[2]))
            opt.step()
            opt.zero_grad()
            forward_backward(qg, tokens)
            opt_qg.step()
            opt_qg.zero_grad()
    finally:
        collectives.start_reduce_scatter_mean = real
    return out


def case_loss(pm) -> dict[str, Any]:
    """Per step from the same state, each quantization's loss change within its bound; over 50
    steps, hpZ bit-exact and qwZ / qgZ / all within the running sum of the per-step bounds."""
    pm2, problems, curves = node_mesh(), [], {}
    data = batches(pm.rank, pm.world_size)
    plain = tolerances(pm2, data)
    ref, bw, bg = plain["losses"], plain["bw"], plain["bg"]
    same_state = {"qwz": [(abs(d - ref[t]), bw[t]) for t, d in enumerate(plain["dw"])],
                  # the qgZ step at t moves the weights the loss at t + 1 sees: bounded with
                  # the gradient at t + 1 and the reduction's error bound at t
                  "qgz": [(abs(d - ref[t + 1]), b)
                          for t, (d, b) in enumerate(zip(plain["dg"], plain["bg_next"]))]}
    for label, pairs in same_state.items():
        used = max(diff / bound for diff, bound in pairs)
        curves[f"{label} same state"] = {"used": used,
                                         "max_abs_diff": max(d for d, _ in pairs)}
        if used > 1:
            problems.append(f"{label}: from the same state a step's loss moved beyond its "
                            f"first-order bound ({used:.3g} of it)")
    for label, cfg in zeropp_configs().items():
        if label == "plain":
            continue
        engine, opt = build(pm2, cfg)
        losses = []
        for i in range(STEPS):
            losses.append(forward_backward(engine, data.batch(i)))
            opt.step()
            opt.zero_grad()
        per_step = {"hpz": [0.0] * STEPS, "qwz": bw, "qgz": bg,
                    "all": [a + b for a, b in zip(bw, bg)]}[label]
        tol, worst = 0.0, 0.0
        for t, (a, b) in enumerate(zip(losses, ref)):
            tol += per_step[t]
            if abs(a - b) > tol:
                problems.append(f"{label}: step {t} loss {a!r} vs ZeRO-3 {b!r}, beyond the "
                                f"tolerance {tol:.3g}")
                break
            worst = max(worst, abs(a - b) / tol if tol else 0.0)
        curves[label] = {"max_abs_diff": max(abs(a - b) for a, b in zip(losses, ref)),
                         "tol_last": tol, "used": worst, "last": losses[-1]}
    if not ref[-1] < ref[0] - 0.1:
        problems.append(f"the plain run did not learn: {ref[0]:.3f} -> {ref[-1]:.3f}")
    curves["plain"] = {"first": ref[0], "last": ref[-1]}
    return {"problems": problems, "curves": curves}


def case_checkpoint(pm) -> list[str]:
    """Saved with ZeRO++ on, loaded with it off (and the other way round): same bits."""
    from shardckpt.training.save_load import load, save

    pm2, problems = node_mesh(), []
    data = batches(pm.rank, pm.world_size)
    root = os.path.join(tempfile.gettempdir(), f"zeropp-ckpt-{os.environ['MASTER_PORT']}")
    try:
        for src, dst in (("all", "plain"), ("plain", "all")):
            a, opt_a = build(pm2, zeropp_configs()[src])
            for i in range(2):
                forward_backward(a, data.batch(i))
                opt_a.step()
                opt_a.zero_grad()
            url = f"{root}/{src}-to-{dst}"
            save(a, url)
            b, opt_b = build(pm2, zeropp_configs()[dst])
            load(b, url)
            sa, sb = a.local_shards(), b.local_shards()
            for name, kinds in sa.items():
                for kind, t in kinds.items():
                    if not torch.equal(t, sb[name][kind]):
                        problems.append(f"{src} -> {dst}: {name}.{kind} differs after load")
            b2, opt_b2 = build(pm2, zeropp_configs()[src])  # the same options continue the same way
            load(b2, url)
            for e, o in ((a, opt_a), (b2, opt_b2)):
                forward_backward(e, data.batch(2))
                o.step()
            if any(not torch.equal(x["master"], b2.local_shards()[n]["master"])
                   for n, x in a.local_shards().items()):
                problems.append(f"{src}: the step after a reload differs from the step before")
    finally:
        dist.barrier()
        if pm.rank == 0:
            shutil.rmtree(root, ignore_errors=True)
    return problems


CASES: dict[str, Callable] = {"errors": case_errors, "loss": case_loss,
                              "checkpoint": case_checkpoint}


def cases_for(world: int) -> list[str]:
    return list(CASES) if world == 4 else []


reports = case_suite(__name__, CASES, cases_for, [4], timeout_s=300, pg_timeout_s=150,
                     case_pg_timeout_s=120)


# ------------------------------------------------------------------------------- the tests


def _problems(reports, case: str) -> None:
    check_case({case: [r["problems"] if isinstance(r, dict) else r for r in reports[case]]},
               case)


def test_quantization_errors_within_their_bounds(reports):
    check_case(reports, "errors")


def test_loss_curves_within_the_quantization_tolerance(reports):
    _problems(reports, "loss")


def test_checkpoints_move_between_zeropp_on_and_off(reports):
    check_case(reports, "checkpoint")
