"""``shardckpt estimate``: model-state memory per GPU and communication per step (ZeRO paper).

Thin: parse the options, call :func:`shardckpt.tools.estimate.estimate_all`, print a table or JSON.
Bad input is a usage error naming the option and its value: ``guarded`` prints it as one line on
stderr and exits with code 2, as for every command.
Imports nothing heavy (no torch, no numpy); rich is imported only when a table is printed.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import typer

from .app import app
from .common import console, echo, guarded
from shardckpt.errors import ConfigError

if TYPE_CHECKING:  # the estimator is imported when `estimate` runs, not when any command starts
    from shardckpt.tools.estimate import Estimate, OffloadSplit, Precision, ZeroPPTraffic

_FLAG = {"params": "--params", "ranks": "--ranks", "replicate": "--replicate",
         "precision": "--precision", "largest_unit": "--largest-unit",
         "ranks_per_node": "--ranks-per-node", "block_size": "--block-size",
         "grad_bits": "--grad-bits", "offload": "--offload"}

ZEROPP_CONVENTION = (
    "bytes per rank per ZeRO-3 step, logical volume (all-gather output, reduce-scatter and "
    "all-to-all input), cross-node when the collective's group spans nodes; qwZ gathers int8 "
    "weights plus an fp32 scale per block, hpZ gathers the backward's weights inside the node "
    "and holds secondary_bytes (Ψ·p/K) per rank, qgZ reduces int4/int8 gradients through an "
    "in-node then a cross-node all-to-all"
)

COMM_CONVENTION = (
    "elements per step, logical volume summed over collectives: reduce-scatter / all-gather of "
    "a buffer of n elements count n, all-reduce counts 2n, a group of one rank counts 0 "
    "(DDP 2Ψ, ZeRO-1/2 2Ψ, ZeRO-3 3Ψ, HSDP 3Ψ + 2Ψ/S); comm_sent_per_rank is what one rank "
    "sends with ring algorithms, n·(g−1)/g per collective over g ranks"
)


OFFLOAD_CONVENTION = (
    "bytes per rank: the per-element optimizer state and an fp32 master copy ((4 + optim)·Ψ/S) "
    "leave the device, which keeps its gradients and its weight shard in the compute dtype "
    "(p·Ψ/S, what the gathers read): at ZeRO-3 with held params (paper) that shard is the "
    "params, so fp16 params + grads = 4Ψ/S; with fsdp2-bf16 bf16 shard + fp32 grads = 6Ψ/S; "
    "at ZeRO-1/2 the shard (p·Ψ/S) sits beside the replicated compute copy; cpu holds them in host "
    "memory, nvme on disk with a host window of three groups of the largest unit "
    "(--largest-unit); host memory also holds the pipelined step's ring, two slots of the "
    "largest unit's shard ((4 + p) bytes each), or one fp32 buffer of it with --overlap-step"
)


def _usage(option: str, value: object, reason: str) -> ConfigError:
    """A usage error naming the command-line flag; ``guarded`` prints it and exits with 2."""
    return ConfigError(f"{_FLAG.get(option, option)} {value}: {reason}")


#: Below this, a count typed without a unit is more likely "70" meant as 70B than a model.
BARE_COUNT_WARN_BELOW = 1_000_000


def _count(text: str, flag: str) -> int:
    """A parameter count; one warning on stderr when it has no unit and is small (``--params
    70`` is 70 parameters, not 70 billion)."""
    from shardckpt.format.quantities import parse_count

    value = parse_count(text, flag)  # a QuantityError is the usage error as it stands
    bare = text.strip().replace("_", "")
    if bare.isdigit() and value < BARE_COUNT_WARN_BELOW:
        echo(f"warning: {flag} {text.strip()} means {value:,} parameters (no unit); for "
             f"{value} billion write {flag} {value}B (units: K, M, B, T)", err=True)
    return value


def _whole(option: str, text: str) -> int:
    try:
        return int(text.strip())
    except ValueError:
        raise _usage(option, text, "not a whole number") from None


def _precision_dict(p: Precision) -> dict[str, object]:
    return {"name": p.name, "bytes_per_param": {"params": p.params, "grads": p.grads,
                                                "master": p.master, "optim": p.optim},
            "k": p.k, "transient_params": p.transient_params, "description": p.description}


@app.command()
@guarded
def estimate(
    params: str = typer.Option(..., "--params", "-p",
                               help="Parameter count Ψ: 7.5e9, 7.5B, 70B, 125M."),
    ranks: str = typer.Option(..., "--ranks", "-n", help="Data-parallel GPUs N (world size)."),
    replicate: str = typer.Option("1", "--replicate", "-r",
                                  help="HSDP replicate degree R (divides N); adds an HSDP row."),
    precision: str = typer.Option("paper", "--precision",
                                  help="paper | fsdp2-bf16 | fsdp2-fp32 | fp32 (bytes per kind of state)."),
    largest_unit: str | None = typer.Option(
        None, "--largest-unit",
        help="Parameters in the largest unit: adds gathered working memory for ZeRO-3 / HSDP."),
    ranks_per_node: str | None = typer.Option(
        None, "--ranks-per-node", "-k",
        help="GPUs per node K (divides N): adds ZeRO++ rows (cross-node bytes, hpZ memory)."),
    block_size: str = typer.Option("256", "--block-size",
                                   help="ZeRO++ quantization block (elements per fp32 scale)."),
    grad_bits: str = typer.Option("4", "--grad-bits", help="ZeRO++ qgZ gradient bits: 4 or 8."),
    offload: str | None = typer.Option(
        None, "--offload",
        help="cpu | nvme: adds device, host and disk bytes per rank with the optimizer offloaded."),
    overlap_step: bool = typer.Option(
        False, "--overlap-step",
        help="With --offload: the host step overlaps backward (offload_overlap_step=True), so host "
             "memory holds one fp32 gradient buffer instead of the step's ring of two."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
) -> None:
    """Model-state memory per GPU and communication per step: DDP, ZeRO-1/2/3, HSDP, and with
    --ranks-per-node the ZeRO++ traffic (GB = 1e9 B)."""
    from shardckpt.tools.estimate import (GB, EstimateError, estimate_all, offload_split,
                                          precision_preset, zeropp_traffic)

    given = {"params": params, "ranks": ranks, "replicate": replicate, "precision": precision,
             "largest_unit": largest_unit, "ranks_per_node": ranks_per_node,
             "block_size": block_size, "grad_bits": grad_bits, "offload": offload}
    zpp: tuple[ZeroPPTraffic, ...] = ()
    off: list[OffloadSplit] = []
    psi = _count(params, "--params")
    unit = _count(largest_unit, "--largest-unit") if largest_unit is not None else None
    try:
        n, r = _whole("ranks", ranks), _whole("replicate", replicate)
        prec = precision_preset(precision)
        rows = estimate_all(psi, n, replicate=r, precision=prec.name, largest_unit=unit)
        if ranks_per_node is not None:
            zpp = zeropp_traffic(psi, n, _whole("ranks_per_node", ranks_per_node),
                                 precision=prec.name,
                                 block_size=_whole("block_size", block_size),
                                 grad_bits=_whole("grad_bits", grad_bits))
        if offload is not None:
            off = [offload_split(row, offload, overlap_step) for row in rows if row.strategy != "ddp"]
    except EstimateError as e:
        raise _usage(e.option, given.get(e.option, e.value), e.reason) from None
    if as_json:
        doc = {"params": psi, "ranks": n, "replicate": r, "precision": _precision_dict(prec),
               "gb_bytes": GB, "comm_convention": COMM_CONVENTION,
               "strategies": [row.to_dict() for row in rows]}
        if zpp:
            doc["zeropp"] = {"ranks_per_node": int(ranks_per_node or 0),
                             "block_size": int(block_size), "grad_bits": int(grad_bits),
                             "convention": ZEROPP_CONVENTION,
                             "variants": [z.to_dict() for z in zpp]}
        if offload is not None:
            doc["offload"] = {"mode": offload, "overlap_step": overlap_step, "convention": OFFLOAD_CONVENTION,
                              "strategies": [o.to_dict() for o in off]}
        typer.echo(json.dumps(doc, indent=2))
        return
    _print_table(rows, prec, unit is not None)
    if zpp:
        _print_zeropp(zpp, psi, n, int(ranks_per_node or 0))
    if off:
        _print_offload(off)


def _print_table(rows: tuple[Estimate, ...], prec: Precision, gathered: bool) -> None:
    from rich.table import Table

    from shardckpt.tools.estimate import GB

    psi = rows[0].params
    table = Table(title=f"Ψ = {psi:,} parameters on {rows[0].world_size} GPUs, precision "
                        f"{prec.name}")
    table.add_column("Strategy")
    table.add_column("Mesh R×S")
    table.add_column("Model state GB/GPU", justify="right")
    table.add_column("Comm elements/step", justify="right")
    table.add_column("× Ψ", justify="right")
    if gathered:
        table.add_column("Gathered GB", justify="right")
    for r in rows:
        cells = [r.label, f"{r.replicate}×{r.shard}", f"{r.model_state_gb:,.1f}",
                 f"{r.comm_elements:.4g}", f"{r.comm_elements / psi:.4g}"]
        if gathered:
            sharded = r.strategy in ("zero3", "hsdp")
            cells.append(f"{r.gathered_bytes / GB:,.2f}" if sharded else "-")
        table.add_row(*cells)
    con = console()
    con.print(table)
    con.print(
        f"bytes/param: params {prec.params}, grads {prec.grads}, master {prec.master}, "
        f"optim {prec.optim} (K = {prec.k}); comm = logical volume summed over collectives",
        highlight=False,
    )


def _print_zeropp(rows: tuple[ZeroPPTraffic, ...], psi: int, n: int, k: int) -> None:
    from rich.table import Table

    from shardckpt.tools.estimate import GB

    table = Table(title=f"ZeRO++: bytes per rank per step, {n // k} nodes × {k} GPUs")
    for col in ("Variant", "Cross-node GB/step", "In-node GB/step", "vs ZeRO-3 cross-node",
                "hpZ memory GB/GPU"):
        table.add_column(col, justify="left" if col == "Variant" else "right")
    for z in rows:
        table.add_row(z.label, f"{z.cross_node_bytes / GB:,.3g}", f"{z.in_node_bytes / GB:,.3g}",
                      f"{z.vs_zero3:.2f}×", f"{z.secondary_bytes / GB:,.3g}")
    con = console()
    con.print(table)
    con.print("ZeRO++ bytes: logical volume per rank; cross-node = the collective's group spans "
              "nodes", highlight=False)


def _print_offload(rows: list[OffloadSplit]) -> None:
    from rich.table import Table

    from shardckpt.tools.estimate import GB

    table = Table(title=f"Optimizer offload {rows[0].mode}: bytes per rank")
    for col in ("Strategy", "Device GB", "Host GB", "Disk GB"):
        table.add_column(col, justify="left" if col == "Strategy" else "right")
    for o in rows:
        table.add_row(o.label, f"{o.device_bytes / GB:,.2f}", f"{o.host_bytes / GB:,.2f}",
                      f"{o.disk_bytes / GB:,.2f}")
    con = console()
    con.print(table)
    con.print("offload: " + OFFLOAD_CONVENTION, highlight=False)
