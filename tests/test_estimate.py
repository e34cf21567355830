"""The memory / communication estimator against the ZeRO paper, its limits, and its CLI."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest
import typer
from hypothesis import given
from hypothesis import strategies as st
from typer.testing import CliRunner, Result

from shardckpt.errors import ConfigError
from shardckpt.tools.estimate import (GB, PRECISIONS, EstimateError, estimate, estimate_all, offload_split,
                                      parse_count, zeropp_traffic)

PSI = 7_500_000_000
ZERO = ("ddp", "zero1", "zero2", "zero3")


# ------------------------------------------------------------------------------------ memory


def test_paper_figure_1() -> None:
    """Ψ = 7.5B, N = 64, K = 12: 120, 31.4, 16.6 and 1.9 GB (ZeRO paper, Figure 1)."""
    rows = estimate_all(7.5e9, 64)
    assert [r.label for r in rows] == ["DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3"]
    assert [round(r.model_state_gb, 1) for r in rows] == [120.0, 31.4, 16.6, 1.9]
    assert [r.model_state_bytes for r in rows] == [120e9, 31.40625e9, 16.640625e9, 1.875e9]


def test_paper_breakdown_per_kind() -> None:
    z1 = estimate(PSI, "zero1", 64)
    assert [(k.kind, k.bytes_per_param, k.placement, k.divisor) for k in z1.kinds] == [
        ("params", 2, "replicated", 1), ("grads", 2, "replicated", 1),
        ("master", 4, "sharded", 64), ("optim", 8, "sharded", 64),
    ]
    assert z1.kind("params").bytes == 2 * PSI
    assert z1.kind("optim").bytes == 8 * PSI / 64
    z2 = estimate(PSI, "zero2", 64)
    assert z2.kind("grads").placement == "sharded" and z2.kind("params").placement == "replicated"
    z3 = estimate(PSI, "zero3", 64)
    assert all(k.placement == "sharded" for k in z3.kinds)
    assert PRECISIONS["paper"].k == 12


def test_fsdp2_bf16_holds_fp32_shards_and_gathers_bf16_units() -> None:
    z3 = estimate(PSI, "zero3", 64, precision="fsdp2-bf16", largest_unit=200_000_000)
    assert z3.model_state_bytes == 16 * PSI / 64
    assert z3.kind("params").placement == "transient" and z3.kind("params").bytes == 0
    assert z3.kind("master").bytes == 4 * PSI / 64 and z3.kind("grads").bytes == 4 * PSI / 64
    assert z3.kind("optim").bytes == 8 * PSI / 64
    assert z3.gathered_bytes == 2 * 200_000_000
    # While params are replicated, the bf16 compute copy is resident: 18Ψ, 6Ψ + 12Ψ/N, 2Ψ + 16Ψ/N.
    got = [estimate(PSI, s, 64, precision="fsdp2-bf16").model_state_bytes for s in ZERO[:3]]
    assert got == [18 * PSI, 6 * PSI + 12 * PSI / 64, 2 * PSI + 16 * PSI / 64]
    assert estimate(PSI, "zero2", 64, precision="fsdp2-bf16", largest_unit=10).gathered_bytes == 0


def test_fp32_has_no_master() -> None:
    rows = estimate_all(PSI, 8, precision="fp32", largest_unit=1000)
    assert [r.model_state_bytes for r in rows] == [16 * PSI, 8 * PSI + PSI, 4 * PSI + 1.5 * PSI,
                                                   2 * PSI]
    assert all(r.kind("master").placement == "absent" for r in rows)
    assert rows[3].gathered_bytes == 4000 and PRECISIONS["fp32"].k == 8


def test_hsdp_shards_over_s_only() -> None:
    h = estimate(PSI, "hsdp", 64, replicate=4)
    assert (h.label, h.replicate, h.shard, h.world_size) == ("HSDP-4×16", 4, 16, 64)
    assert h.model_state_bytes == estimate(PSI, "zero3", 16).model_state_bytes == PSI
    assert estimate_all(PSI, 64, replicate=4)[-1] == h


# ------------------------------------------------------------------------------ communication


def test_comm_headline_is_logical_volume() -> None:
    assert estimate(PSI, "ddp", 64).comm_elements == 2 * PSI
    assert estimate(PSI, "zero1", 64).comm_elements == 2 * PSI
    assert estimate(PSI, "zero2", 64).comm_elements == 2 * PSI
    z3 = estimate(PSI, "zero3", 64)
    assert z3.comm_elements == 3 * PSI
    assert [c.op for c in z3.collectives] == ["all_gather", "all_gather", "reduce_scatter"]
    h = estimate(PSI, "hsdp", 64, replicate=4)
    assert h.comm_elements == 3 * PSI + 2 * PSI / 16
    assert h.collectives[-1].op == "all_reduce" and h.collectives[-1].axis == "dp_replicate"


def test_comm_sent_per_rank_ring() -> None:
    assert estimate(PSI, "ddp", 64).comm_sent_per_rank == 2 * PSI * 63 / 64
    assert estimate(PSI, "zero3", 64).comm_sent_per_rank == 3 * PSI * 63 / 64
    h = estimate(1600, "hsdp", 8, replicate=2)
    assert h.comm_sent_per_rank == 3 * 1600 * 3 / 4 + 2 * 400 * 1 / 2


def test_one_rank_communicates_nothing() -> None:
    assert all(estimate(PSI, s, 1).comm_elements == 0 for s in ZERO)
    # HSDP R×1 is DDP: only the all-reduce over R moves data.
    hsdp_8x1 = estimate(PSI, "hsdp", 8, replicate=8)
    assert hsdp_8x1.comm_elements == estimate(PSI, "ddp", 8).comm_elements == 2 * PSI


# --------------------------------------------------------------------------------- properties

counts = st.integers(min_value=1, max_value=10**13)
ranks = st.integers(min_value=1, max_value=1 << 16)
presets = st.sampled_from(sorted(PRECISIONS))


@given(counts, ranks, presets)
def test_sharding_never_costs_memory(psi: int, n: int, precision: str) -> None:
    ddp, z1, z2, z3 = (estimate(psi, s, n, precision=precision).model_state_bytes for s in ZERO)
    assert z3 <= z2 <= z1 <= ddp


@given(counts, presets)
def test_one_rank_all_strategies_equal(psi: int, precision: str) -> None:
    ddp, z1, z2, z3 = (estimate(psi, s, 1, precision=precision) for s in ZERO)
    assert ddp.model_state_bytes == z1.model_state_bytes == z2.model_state_bytes
    # fsdp2-bf16 alone drops the resident compute copy once params are sharded.
    transient = PRECISIONS[precision].params * psi if PRECISIONS[precision].transient_params else 0
    assert z3.model_state_bytes == ddp.model_state_bytes - transient


@given(counts, ranks, presets, st.one_of(st.none(), st.integers(min_value=1, max_value=10**6)))
def test_hsdp_with_one_replica_is_zero3(psi: int, n: int, precision: str, unit: int | None) -> None:
    unit = min(unit, psi) if unit is not None else None
    h = estimate(psi, "hsdp", n, replicate=1, precision=precision, largest_unit=unit)
    z3 = estimate(psi, "zero3", n, precision=precision, largest_unit=unit)
    assert h.kinds == z3.kinds and h.gathered_bytes == z3.gathered_bytes
    assert h.comm_elements == z3.comm_elements == (3 * psi if n > 1 else 0)


# ----------------------------------------------------------------------------- inputs, values


@pytest.mark.parametrize("text,value", [
    ("7.5e9", 7_500_000_000), ("7.5B", 7_500_000_000), ("70B", 70_000_000_000),
    ("125M", 125_000_000), ("125m", 125_000_000), ("1.2T", 1_200_000_000_000), ("350k", 350_000),
    ("1_000", 1000), (" 42 ", 42), ("7.5G", 7_500_000_000),
])
def test_parse_count(text: str, value: int) -> None:
    assert parse_count(text) == value


@pytest.mark.parametrize("text", ["", "abc", "0", "-5", "7.5X", "1e999", "B", "0.1"])
def test_parse_count_refuses(text: str) -> None:
    with pytest.raises(EstimateError) as info:
        parse_count(text)
    assert info.value.option == "params" and isinstance(info.value, ConfigError)


@pytest.mark.parametrize("kwargs,option", [
    (dict(params=0, strategy="ddp", ranks=4), "params"),
    (dict(params=10, strategy="ddp", ranks=0), "ranks"),
    (dict(params=10, strategy="hsdp", ranks=6, replicate=4), "replicate"),
    (dict(params=10, strategy="zero3", ranks=8, replicate=2), "replicate"),
    (dict(params=10, strategy="zero3", ranks=8, precision="fp8"), "precision"),
    (dict(params=10, strategy="zero4", ranks=8), "strategy"),
    (dict(params=10, strategy="zero3", ranks=8, largest_unit=11), "largest_unit"),
    (dict(params=10, strategy="zero3", ranks=True), "ranks"),
])
def test_estimate_refuses(kwargs: dict, option: str) -> None:
    with pytest.raises(EstimateError) as info:
        estimate(**kwargs)
    assert info.value.option == option


# ------------------------------------------------------------------------------------ ZeRO++


def test_zeropp_traffic_formula() -> None:
    """Ψ = 1e9 on 4 nodes × 8 (paper preset: 2-byte weights and gradients, B = 256, int4)."""
    rows = {r.variant: r for r in zeropp_traffic(10**9, 32, 8, precision="paper")}
    psi, gq, wq = 1e9, 1e9 * (0.5 + 4 / 256), 1e9 * (1 + 4 / 256)
    assert rows["zero3"].cross_node_bytes == 6 * psi and rows["zero3"].in_node_bytes == 0
    assert rows["qwz"].cross_node_bytes == 2 * wq + 2 * psi
    assert (rows["hpz"].cross_node_bytes, rows["hpz"].in_node_bytes) == (4 * psi, 2 * psi)
    assert rows["hpz"].secondary_bytes == 2 * psi / 8
    assert rows["qgz"].cross_node_bytes == 4 * psi + gq / 8 and rows["qgz"].in_node_bytes == gq
    allx = rows["zeropp"]
    assert allx.cross_node_bytes == wq + gq / 8 and allx.in_node_bytes == 2 * psi + gq
    assert allx.vs_zero3 == pytest.approx(6 * psi / (wq + gq / 8))
    assert allx.vs_zero3 > 4  # the paper's "about 4x less" cross-node traffic


def test_zeropp_one_node_has_no_cross_node_traffic() -> None:
    for r in zeropp_traffic(10**6, 8, 8):
        assert r.cross_node_bytes == 0 and r.in_node_bytes > 0


@pytest.mark.parametrize("kwargs,option", [
    (dict(ranks_per_node=3), "ranks_per_node"), (dict(ranks_per_node=0), "ranks_per_node"),
    (dict(ranks_per_node=2, block_size=0), "block_size"),
    (dict(ranks_per_node=2, grad_bits=2), "grad_bits"),
])
def test_zeropp_traffic_refuses(kwargs: dict, option: str) -> None:
    with pytest.raises(EstimateError) as info:
        zeropp_traffic(10**6, 8, **kwargs)
    assert info.value.option == option


def test_cli_zeropp_rows() -> None:
    table = run_cli("-p", "7.5B", "-n", "64", "--ranks-per-node", "8")
    assert table.exit_code == 0, table.output
    for text in ("ZeRO++", "8 nodes × 8", "hpZ memory", "Cross-node"):
        assert text in table.stdout
    doc = json.loads(run_cli("-p", "1B", "-n", "16", "-k", "4", "--json").stdout)
    want = [r.to_dict() for r in zeropp_traffic(10**9, 16, 4, precision="paper")]
    assert doc["zeropp"]["variants"] == json.loads(json.dumps(want))
    assert "zeropp" not in json.loads(run_cli("-p", "1B", "-n", "16", "--json").stdout)


def test_offload_moves_master_copy_and_optimizer_state_off_the_device() -> None:
    z3 = estimate(PSI, "zero3", 64, precision="fsdp2-bf16", largest_unit=10**8)
    cpu, nvme = offload_split(z3, "cpu"), offload_split(z3, "nvme")
    moved = (4 + 8) * PSI / 64  # fp32 master copy + two Adam moments, this rank's shard
    # the device keeps the bf16 weight shard alone: the optimizer state and (4 - 2) bytes of
    # the fp32 master leave it (fsdp2-bf16: the compute copy is gathered per unit)
    assert cpu.device_bytes == nvme.device_bytes == z3.model_state_bytes - (8 + 2) * PSI / 64
    grads = 2 * (4 + 2) * 10**8 / 64  # the pipelined step's ring: two slots of fp32 + bf16
    assert (cpu.host_bytes, cpu.disk_bytes) == (moved + grads, 0.0)
    unpipelined = offload_split(z3, "cpu", pipeline=False)  # copies of every group's gradient
    assert unpipelined.host_bytes == moved + 4 * PSI / 64
    assert nvme.disk_bytes == moved
    assert nvme.host_bytes == 3 * 12 * 10**8 / 64 + grads  # window of three groups
    early = offload_split(z3, "nvme", overlap_step=True)  # one gradient buffer, reused
    assert early.host_bytes == 3 * 12 * 10**8 / 64 + 4 * 10**8 / 64
    assert offload_split(z3, "cpu", overlap_step=True).host_bytes == moved + 4 * 10**8 / 64
    z1 = offload_split(estimate(PSI, "zero1", 64), "cpu", pipeline=False)
    assert z1.host_bytes == moved + 4 * PSI / 64 and z1.device_bytes == (2 + 2) * PSI + 2 * PSI / 64
    fp32 = estimate(PSI, "zero3", 64, precision="fsdp2-fp32")  # there the shard is the master
    assert offload_split(fp32, "cpu").device_bytes == fp32.model_state_bytes - 8 * PSI / 64
    with pytest.raises(EstimateError, match="offload"):
        offload_split(z3, "gpu")
    with pytest.raises(EstimateError, match="ZeRO"):
        offload_split(estimate(PSI, "ddp", 64), "cpu")


#: Device bytes per rank with the optimizer offloaded, derived by hand: (a, b) for a·Ψ + b·Ψ/S.
#: paper (fp16 params and grads held): at ZeRO-3 the fp16 params shard is what the device
#: computes from, so params + grads = 4Ψ/S (ZeRO-Offload's figure); at ZeRO-1/2 the replicated
#: fp16 copy, the grads, and the fp16 shard the all-gathers read (2Ψ/S) beside it.
#: fsdp2-bf16 (the runtime's bf16 policy): bf16 shard (2) + fp32 grads (4) at ZeRO-3, as the
#: runtime measures (tests/test_offload_single.py). fp32 presets: the weights are the master,
#: which stays; only the optimizer state leaves.
OFFLOAD_DEVICE = {
    "paper": {"zero1": (4, 2), "zero2": (2, 4), "zero3": (0, 4), "hsdp": (0, 4)},
    "fsdp2-bf16": {"zero1": (6, 2), "zero2": (2, 6), "zero3": (0, 6), "hsdp": (0, 6)},
    "fp32": {"zero1": (8, 0), "zero2": (4, 4), "zero3": (0, 8), "hsdp": (0, 8)},
    "fsdp2-fp32": {"zero1": (8, 4), "zero2": (4, 8), "zero3": (0, 8), "hsdp": (0, 8)},
}


@pytest.mark.parametrize("precision", sorted(OFFLOAD_DEVICE))
def test_offload_device_bytes_against_a_hand_derived_table(precision: str) -> None:
    psi, n, r, unit = 64 * 10**9, 64, 4, 10**9
    for strategy, (a, b) in OFFLOAD_DEVICE[precision].items():
        row = estimate(psi, strategy, n, replicate=r if strategy == "hsdp" else 1,
                       precision=precision, largest_unit=unit)
        s = row.shard
        for mode in ("cpu", "nvme"):
            for overlap in (False, True):
                got = offload_split(row, mode, overlap)
                assert got.device_bytes == a * psi + b * psi / s, (precision, strategy, mode)
                shard = 2 if precision in ("paper", "fsdp2-bf16") else 4  # the device shard
                # one fp32 buffer (overlap), else the ring: two slots of fp32 grad + shard
                grads = (4 if overlap else 2 * (4 + shard)) * unit / s
                moved = 12 * psi / s                        # fp32 master + two Adam moments
                if mode == "cpu":
                    assert (got.host_bytes, got.disk_bytes) == (moved + grads, 0.0)
                else:
                    assert (got.host_bytes, got.disk_bytes) == (3 * 12 * unit / s + grads, moved)


def test_zeropp_against_a_hand_derived_table() -> None:
    """Ψ = 1e9 on 4 nodes × 4, paper (fp16 params and grads), blocks of 256, 4-bit gradients:
    a gather moves 2Ψ, quantized Ψ(1 + 4/256) = 1.015625Ψ; the gradient reduce-scatter 2Ψ,
    quantized Ψ(0.5 + 4/256) = 0.515625Ψ in-node and a quarter of that across nodes."""
    g = 1e9
    want = {  # variant: (cross-node, in-node, hpZ secondary) bytes per rank per step
        "zero3": (6 * g, 0.0, 0.0),
        "qwz": (2 * 1.015625 * g + 2 * g, 0.0, 0.0),
        "hpz": (2 * g + 2 * g, 2 * g, 0.5 * g),
        "qgz": (4 * g + 0.515625 * g / 4, 0.515625 * g, 0.0),
        "zeropp": (1.015625 * g + 0.515625 * g / 4, 2 * g + 0.515625 * g, 0.5 * g),
    }
    rows = {z.variant: z for z in zeropp_traffic(10**9, 16, 4, precision="paper")}
    for variant, (cross, local, secondary) in want.items():
        z = rows[variant]
        assert (z.cross_node_bytes, z.in_node_bytes, z.secondary_bytes) == \
            pytest.approx((cross, local, secondary), rel=1e-12), variant
        assert z.vs_zero3 == pytest.approx(6 * g / cross, rel=1e-12)
    one_node = {z.variant: z for z in zeropp_traffic(10**9, 4, 4, precision="paper")}
    assert all(z.cross_node_bytes == 0 for z in one_node.values())  # nothing leaves the node


def test_cli_offload_70b_on_64_reports_zero_offload_figures() -> None:
    """The issue's case: 70B on 64 ranks, paper precision: 4Ψ/N = 4.375 GB at ZeRO-3, and
    ZeRO-1/2 keep the 2Ψ/N shard beside their replicated copy (the note says so)."""
    doc = json.loads(run_cli("-p", "70B", "-n", "64", "--offload", "cpu", "--json").stdout)
    device = {o["strategy"]: o["device_bytes"] for o in doc["offload"]["strategies"]}
    psi = 70e9
    assert device == {"zero1": 4 * psi + 2 * psi / 64, "zero2": 2 * psi + 4 * psi / 64,
                      "zero3": 4 * psi / 64}
    note = doc["offload"]["convention"]
    assert "4Ψ/S" in note and "beside the replicated compute copy" in note


def test_cli_params_without_a_unit_warns() -> None:
    r = run_cli("-p", "70", "-n", "8")
    assert r.exit_code == 0, r.output
    assert "--params 70 means 70 parameters" in r.stderr and "70B" in r.stderr
    for fine in ("70B", "7e10", "125M", "5_000_000"):
        r = run_cli("-p", fine, "-n", "8")
        assert r.exit_code == 0 and "warning" not in r.stderr, (fine, r.stderr)


def test_cli_offload_rows() -> None:
    table = run_cli("-p", "7B", "-n", "8", "--largest-unit", "200M", "--offload", "nvme")
    assert table.exit_code == 0, table.output
    for text in ("Optimizer offload nvme", "Device GB", "Host GB", "Disk GB"):
        assert text in table.stdout
    doc = json.loads(run_cli("-p", "1B", "-n", "16", "--offload", "cpu", "--json").stdout)
    rows = estimate_all(10**9, 16)[1:]
    assert doc["offload"]["strategies"] == json.loads(json.dumps(
        [offload_split(r, "cpu").to_dict() for r in rows]))
    assert "offload" not in json.loads(run_cli("-p", "1B", "-n", "16", "--json").stdout)
    bad = run_cli("-p", "1B", "-n", "8", "--offload", "gpu")
    assert bad.exit_code == 2 and bad.stderr.strip().count("\n") == 0
    assert "--offload gpu" in bad.stderr


def test_results_are_frozen_values() -> None:
    e = estimate(PSI, "zero3", 64)
    with pytest.raises(dataclasses.FrozenInstanceError):
        e.params = 1  # type: ignore[misc]
    assert e == estimate(7.5e9, "zero3", 64)
    assert json.loads(json.dumps(e.to_dict()))["comm_elements"] == 3 * PSI


# ------------------------------------------------------------------------------------------ CLI

runner = CliRunner()


def run_cli(*args: str) -> Result:
    from shardckpt.cli.main import app  # registers every command

    # Typer runs a lone command as the app itself; mounting the app's commands under a root with a
    # callback keeps `shardckpt estimate ...` a subcommand however many commands exist yet.
    root = typer.Typer(callback=lambda: None)
    root.registered_commands.extend(app.registered_commands)
    return runner.invoke(root, ["estimate", *args])


def test_cli_table() -> None:
    result = run_cli("--params", "7.5B", "--ranks", "64")
    assert result.exit_code == 0, result.output
    for text in ("DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3", "120.0", "31.4", "16.6", "1.9", "2.25e+10"):
        assert text in result.stdout
    assert "HSDP" not in result.stdout
    hsdp = run_cli("-p", "7.5e9", "-n", "64", "--replicate", "4")
    assert hsdp.exit_code == 0 and "HSDP-4×16" in hsdp.stdout


def test_cli_json() -> None:
    result = run_cli("--params", "70B", "--ranks", "1024", "--replicate", "8",
                     "--precision", "fsdp2-bf16", "--largest-unit", "1B", "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert (doc["params"], doc["ranks"], doc["replicate"]) == (70 * 10**9, 1024, 8)
    assert doc["precision"]["bytes_per_param"] == {"params": 2, "grads": 4, "master": 4, "optim": 8}
    assert [s["label"] for s in doc["strategies"]] == ["DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3",
                                                      "HSDP-8×128"]
    z3 = doc["strategies"][3]
    assert z3["model_state_bytes"] == 16 * 70e9 / 1024 and z3["comm_elements"] == 3 * 70e9
    assert z3["gathered_bytes"] == 2e9 and doc["gb_bytes"] == GB


@pytest.mark.parametrize("args,needle", [
    (["--params", "1B", "--ranks", "0"], "--ranks 0"),
    (["--params", "1B", "--ranks", "-3"], "--ranks -3"),
    (["--params", "1B", "--ranks", "many"], "--ranks many"),
    (["--params", "1B", "--ranks", "6", "--replicate", "4"], "--replicate 4"),
    (["--params", "0", "--ranks", "8"], "--params 0"),
    (["--params", "lots", "--ranks", "8"], "--params lots"),
    (["--params", "1B", "--ranks", "8", "--precision", "fp8"], "--precision fp8"),
    (["--params", "1B", "--ranks", "8", "--largest-unit", "2B"], "--largest-unit 2B"),
    (["--params", "1B", "--ranks", "8", "--ranks-per-node", "3"], "--ranks-per-node 3"),
    (["--params", "1B", "--ranks", "8", "-k", "2", "--grad-bits", "2"], "--grad-bits 2"),
    (["--params", "1B", "--ranks", "8", "-k", "2", "--block-size", "0"], "--block-size 0"),
])
def test_cli_bad_input_exits_2_with_one_line(args: list[str], needle: str) -> None:
    result = run_cli(*args)
    assert result.exit_code == 2
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], result.stderr


def test_cli_module_imports_nothing_heavy() -> None:
    code = ("import sys, shardckpt.cli.estimate; "
            "heavy = {'torch', 'numpy'} & set(sys.modules); assert not heavy, heavy")
    subprocess.run([sys.executable, "-c", code], check=True)
