"""``diff``: equal across world sizes and meshes, changed values found with the right max abs
difference, one-sided parameters and kinds reported, bounded pieces, CLI exit codes."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest
from typer.testing import CliRunner

from shardckpt.tools import synth
from shardckpt.checkpoint.reader import as_storage
from shardckpt.checkpoint.writer import CheckpointSpec, CheckpointWriter
from shardckpt.cli.main import app
from shardckpt.tools.diff import compare_bytes, diff
from shardckpt.format.layout import Mesh, build_layout
from shardckpt.format.manifest import Component, TensorSlot, default_states

PARAMS, SEED = 50_000, 3


def write_ckpt(dst: str, ranks: int, replicate: int = 1, seed: int = SEED, drop: str | None = None,
               tweak: tuple[str, str, int, float] | None = None, units: int = 2,
               kinds: tuple[str, ...] = synth.ADAMW_KINDS, params: int = PARAMS) -> None:
    """A synthetic checkpoint like ``synth.synthesize``, optionally without parameter ``drop``,
    with other optimizer ``kinds``, or with element ``i`` of (fqn, kind) increased by ``delta``."""
    infos, buffers, aliases = synth.llama_params(params, units)
    infos = [i for i in infos if i.fqn != drop]
    mesh = Mesh.for_world(ranks, replicate)
    layout = build_layout(infos, mesh, prefix="model.")
    states = {g.name: default_states(g, kinds) for g in layout.groups}
    spec = CheckpointSpec(mesh, {"model": Component("model", layout, states, aliases, tuple(buffers))})
    writer = CheckpointWriter(as_storage(dst), spec)

    def producer(shard: int):  # noqa: ANN202
        base = synth.shard_producer(layout, seed, shard)

        def produce(slot: TensorSlot) -> Iterator[Any]:
            if tweak is None:
                yield from base(slot)
                return
            fqn, kind, i, delta = tweak
            data = bytearray(b"".join(bytes(memoryview(p).cast("B")) for p in base(slot)))
            group, k = slot.name.rsplit(".", 1)
            p = layout.param(fqn)
            lo, hi = layout.shard_range(group, shard)
            if p.group == group and k == kind and lo <= p.offset + i < hi:
                x = np.frombuffer(data, np.float32).copy()
                x[p.offset + i - lo] += np.float32(delta)
                data = bytearray(x.tobytes())
            yield bytes(data)
        return produce

    entries = [writer.write_shard(s, producer(s)) for s in range(mesh.shard_degree)]
    n = math.prod(buffers[0].shape)
    b = writer.write_buffers(lambda slot: iter([(1.0 / (10000.0 ** (np.arange(n, dtype=np.float32) / n))).astype(np.float32)]))
    writer.commit(entries + [b])


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("diff")
    write_ckpt(str(root / "n3"), 3)
    return root


def test_equal_across_world_sizes_and_meshes(base: Path, tmp_path: Path) -> None:
    synth.synthesize(str(tmp_path / "s8"), PARAMS, 8, replicate=2, seed=SEED)
    synth.synthesize(str(tmp_path / "s16"), PARAMS, 16, seed=SEED)
    r = diff(str(tmp_path / "s8"), str(tmp_path / "s16"))
    assert r.equal and not r.differences and not r.metadata
    assert r.compared == r.identical > 0 and r.elements > PARAMS
    r = diff(str(base / "n3"), str(tmp_path / "s16"))  # synth has an optimizer entry; this one not
    assert not r.differences and r.metadata and not r.equal


def test_changed_value_found_with_exact_max_abs_diff(base: Path, tmp_path: Path) -> None:
    fqn, i, delta = "model.layers.1.mlp.up_proj.weight", 1234, 0.5
    write_ckpt(str(tmp_path / "t"), 7, tweak=(fqn, "exp_avg", i, delta))
    r = diff(str(base / "n3"), str(tmp_path / "t"), buffer_bytes=4096)  # many small pieces
    assert not r.equal
    (d,) = r.differences
    v = synth.values(SEED, fqn, "exp_avg", i, i + 1)[0]
    assert (d.name, d.kind, d.status, d.differing) == (fqn, "exp_avg", "different", 1)
    assert d.max_abs_diff == abs(float(np.float32(v + np.float32(delta))) - float(v))
    assert r.compared == r.identical + 1


def test_different_seeds_differ_everywhere(base: Path, tmp_path: Path) -> None:
    write_ckpt(str(tmp_path / "s"), 4, seed=SEED + 1)
    r = diff(str(base / "n3"), str(tmp_path / "s"))
    assert not r.equal and r.identical == 1  # only the buffer (seed-independent) is equal
    d = next(d for d in r.differences if (d.name, d.kind) == ("model.norm.weight", "master"))
    a = synth.values(SEED, d.name, "master", 0, d.numel).astype(np.float64)
    b = synth.values(SEED + 1, d.name, "master", 0, d.numel).astype(np.float64)
    assert d.differing == int(np.count_nonzero(a != b)) and d.max_abs_diff == float(np.abs(a - b).max())


def test_one_sided_params_and_kinds(base: Path, tmp_path: Path) -> None:
    write_ckpt(str(tmp_path / "d"), 2, drop="model.frozen_scale")
    r = diff(str(base / "n3"), str(tmp_path / "d"))
    assert not r.equal
    assert [(d.name, d.kind, d.status) for d in r.differences] == [("model.frozen_scale", "master", "only_a")]
    write_ckpt(str(tmp_path / "sgd"), 2, kinds=("exp_avg",))
    r = diff(str(tmp_path / "sgd"), str(base / "n3"))
    statuses = {(d.kind, d.status) for d in r.differences}
    assert statuses == {("exp_avg_sq", "only_b")} and r.identical == r.compared
    write_ckpt(str(tmp_path / "u3"), 2, units=3)  # a layer more
    r = diff(str(base / "n3"), str(tmp_path / "u3"))
    assert {d.status for d in r.differences} == {"only_b"} and r.identical == r.compared
    assert {d.name.split(".")[2] for d in r.differences} == {"2"}
    write_ckpt(str(tmp_path / "wide"), 2, params=4 * PARAMS)  # other dims: every matrix reshaped
    r = diff(str(base / "n3"), str(tmp_path / "wide"))
    d = next(d for d in r.differences if d.name == "model.embed_tokens.weight")
    assert d.status == "mismatch" and d.detail.startswith("shape [768, 24] vs")


def test_compare_bytes_nan_and_dtypes() -> None:
    a = np.array([1.0, np.nan, 2.0, np.nan], np.float32)
    b = np.array([1.0, np.nan, 2.5, 3.0], np.float32)
    assert compare_bytes(a.tobytes(), b.tobytes(), "float32", "float32") == (2, math.inf)
    assert compare_bytes(a.tobytes(), a.tobytes(), "float32", "float32") == (0, 0.0)
    n, mx = compare_bytes(a.tobytes(), a.astype(np.float64).tobytes(), "float32", "float64")
    assert (n, mx) == (0, 0.0)


def test_cli_exit_codes(base: Path, tmp_path: Path) -> None:
    runner = CliRunner()
    write_ckpt(str(tmp_path / "same"), 5)
    res = runner.invoke(app, ["diff", str(base / "n3"), str(tmp_path / "same")])
    assert res.exit_code == 0 and res.output.startswith("equal:"), res.output
    write_ckpt(str(tmp_path / "t"), 5, tweak=("model.norm.weight", "master", 3, -0.25))
    res = runner.invoke(app, ["diff", str(base / "n3"), str(tmp_path / "t")])
    assert res.exit_code == 1 and "model.norm.weight" in res.output
    res = runner.invoke(app, ["diff", str(base / "n3"), str(tmp_path / "t"), "--json"])
    assert res.exit_code == 1
    doc = json.loads(res.output)
    assert doc["equal"] is False and doc["differences"][0]["differing"] == 1
    res = runner.invoke(app, ["diff", str(base / "n3"), str(tmp_path / "nothing")])
    assert res.exit_code == 1 and "nothing: no such checkpoint" in res.output


def test_cli_tolerance_for_runs_on_other_world_sizes(base: Path, tmp_path: Path) -> None:
    """Two runs on 3 and 5 ranks that differ in the last bits of a weight (another reduction
    order) are equal within --atol / --rtol, and a difference beyond them is still one."""
    runner = CliRunner()
    fqn = "model.norm.weight"
    write_ckpt(str(tmp_path / "t"), 5, tweak=(fqn, "master", 3, 1e-6))
    a, b = str(base / "n3"), str(tmp_path / "t")
    res = runner.invoke(app, ["diff", a, b])
    assert res.exit_code == 1 and fqn in res.output  # bit for bit by default
    res = runner.invoke(app, ["diff", a, b, "--atol", "1e-5"])
    assert res.exit_code == 0, res.output
    assert res.stdout.startswith("equal within atol 1e-05, rtol 0:") and "1 within the tolerance" in res.stdout
    res = runner.invoke(app, ["diff", a, b, "--rtol", "1e-3"])  # |b| is about 1: rtol covers it
    assert res.exit_code == 0, res.output
    doc = json.loads(runner.invoke(app, ["diff", a, b, "--atol", "1e-5", "--json"]).stdout)
    assert (doc["equal"], doc["close"], doc["tolerance"]) == (True, 1, {"atol": 1e-5, "rtol": 0.0})
    assert doc["identical"] == doc["compared"] - 1
    res = runner.invoke(app, ["diff", a, b, "--atol", "1e-8"])
    assert res.exit_code == 1 and "beyond atol 1e-08, rtol 0" in res.stdout and fqn in res.stdout
    res = runner.invoke(app, ["diff", a, b, "--atol", "-1"])
    assert res.exit_code == 2
