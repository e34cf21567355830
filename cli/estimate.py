"""``shardckpt estimate``: model-state memory per GPU and communication per step (ZeRO paper).

Thin: parse the options, call :func:`shardckpt.estimate.estimate_all`, print a table or JSON.
Bad input prints one line on stderr naming the option and its value, and exits with code 2.
Imports nothing heavy (no torch, no numpy); rich is imported only when a table is printed.
"""

from __future__ import annotations

import json
from typing import Optional

import typer

from shardckpt.cli.app import app
from shardckpt.estimate import (GB, EstimateError, Estimate, Precision, estimate_all, parse_count,
                                precision_preset)

_FLAG = {"params": "--params", "ranks": "--ranks", "replicate": "--replicate",
         "precision": "--precision", "largest_unit": "--largest-unit"}

COMM_CONVENTION = (
    "elements per step, logical volume summed over collectives: reduce-scatter / all-gather of "
    "a buffer of n elements count n, all-reduce counts 2n, a group of one rank counts 0 "
    "(DDP 2Ψ, ZeRO-1/2 2Ψ, ZeRO-3 3Ψ, HSDP 3Ψ + 2Ψ/S); comm_sent_per_rank is what one rank "
    "sends with ring algorithms, n·(g−1)/g per collective over g ranks"
)


def _fail(option: str, value: object, reason: str) -> typer.Exit:
    typer.echo(f"error: {_FLAG.get(option, option)} {value}: {reason}", err=True)
    return typer.Exit(2)


def _whole(option: str, text: str) -> int:
    try:
        return int(text.strip())
    except ValueError:
        raise _fail(option, text, "not a whole number") from None


def _precision_dict(p: Precision) -> dict[str, object]:
    return {"name": p.name, "bytes_per_param": {"params": p.params, "grads": p.grads,
                                                "master": p.master, "optim": p.optim},
            "k": p.k, "transient_params": p.transient_params, "description": p.description}


@app.command()
def estimate(
    params: str = typer.Option(..., "--params", "-p",
                               help="Parameter count Ψ: 7.5e9, 7.5B, 70B, 125M."),
    ranks: str = typer.Option(..., "--ranks", "-n", help="Data-parallel GPUs N (world size)."),
    replicate: str = typer.Option("1", "--replicate", "-r",
                                  help="HSDP replicate degree R (divides N); adds an HSDP row."),
    precision: str = typer.Option("paper", "--precision",
                                  help="paper | fsdp2-bf16 | fsdp2-fp32 | fp32 (bytes per kind of state)."),
    largest_unit: Optional[str] = typer.Option(
        None, "--largest-unit",
        help="Parameters in the largest unit: adds gathered working memory for ZeRO-3 / HSDP."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
) -> None:
    """Model-state memory per GPU and communication per step: DDP, ZeRO-1/2/3, HSDP (GB = 1e9 B)."""
    try:
        psi = parse_count(params, "params")
        unit = parse_count(largest_unit, "largest_unit") if largest_unit is not None else None
        n, r = _whole("ranks", ranks), _whole("replicate", replicate)
        prec = precision_preset(precision)
        rows = estimate_all(psi, n, replicate=r, precision=prec.name, largest_unit=unit)
    except EstimateError as e:
        given = {"params": params, "ranks": ranks, "replicate": replicate,
                 "precision": precision, "largest_unit": largest_unit}
        raise _fail(e.option, given.get(e.option, e.value), e.reason) from None
    if as_json:
        typer.echo(json.dumps({
            "params": psi, "ranks": n, "replicate": r, "precision": _precision_dict(prec),
            "gb_bytes": GB, "comm_convention": COMM_CONVENTION,
            "strategies": [row.to_dict() for row in rows],
        }, indent=2))
        return
    _print_table(rows, prec, unit is not None)


def _print_table(rows: tuple[Estimate, ...], prec: Precision, gathered: bool) -> None:
    from rich.console import Console
    from rich.table import Table

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
    console = Console()
    console.print(table)
    console.print(
        f"bytes/param: params {prec.params}, grads {prec.grads}, master {prec.master}, "
        f"optim {prec.optim} (K = {prec.k}); comm = logical volume summed over collectives",
        highlight=False,
    )
