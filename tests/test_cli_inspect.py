"""``inspect`` lists every parameter (name, shape, dtype, unit, group), in tables and in JSON,
says how many it hides and how to see them, and does not wrap or cut lines written to a pipe."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np

from testing.ckpts import make_ckpt
from testing.cli import cli
from shardckpt.checkpoint.reader import as_storage
from shardckpt.checkpoint.writer import CheckpointSpec, CheckpointWriter
from shardckpt.format.layout import Mesh, ParamInfo, build_layout
from shardckpt.format.manifest import Component, Manifest, default_states


def rows(out: str) -> dict[str, list[str]]:
    """Table rows of ``out`` by their first cell."""
    found = {}
    for line in out.splitlines():
        cells = [c.strip() for c in re.split(r"[│┃]", line)[1:-1]]
        if cells:
            found[cells[0]] = cells[1:]
    return found


def test_parameters_listed(tmp_path: Path) -> None:
    path, m = make_ckpt(tmp_path)
    layout = m.components["model"].layout
    r = cli("inspect", path)
    assert r.exit_code == 0, r.output
    table = rows(r.stdout)
    for p in layout.params:
        g = layout.group(p.group)
        assert table[p.fqn] == [str(tuple(p.shape)), p.dtype, g.unit or "(root)", g.name], p.fqn
    assert table["model.rotary_emb.inv_freq"][-1] == "(buffer)"
    assert "parameters of model" in r.stdout and "more parameters" not in r.stdout
    doc = json.loads(cli("inspect", path, "--json").stdout)
    listed = doc["components"]["model"]["params"]
    assert [p["fqn"] for p in listed] == [p.fqn for p in layout.params]
    emb = next(p for p in listed if p["fqn"] == "model.embed_tokens.weight")
    assert emb["shape"] == [256, 8] and emb["dtype"] == "float32" and emb["numel"] == 2048
    assert emb["unit"] == "" and emb["group"] == layout.param("model.embed_tokens.weight").group
    assert emb["requires_grad"] is True


def test_limit_says_how_many_are_hidden(tmp_path: Path) -> None:
    path, m = make_ckpt(tmp_path)
    n = len(m.components["model"].layout.params)
    r = cli("inspect", path, "--limit", "3")
    assert r.exit_code == 0
    listed = [k for k in rows(r.stdout) if k.startswith("model.layers") and "." in k]
    assert len([k for k in listed if k.endswith("weight")]) == 3
    assert f"{n - 3} more parameters not listed (--limit 0 lists all; --json holds all)" in r.stdout
    r = cli("inspect", path, "--no-params")
    assert r.exit_code == 0 and "parameters of model" not in r.stdout
    assert "model.layers.0.mlp.up_proj.weight" not in r.stdout
    assert "model.u0000.float32" in r.stdout  # the groups table stays


def write_long_names(dst: str) -> list[str]:
    names = [f"model.{'very_long_module_name.' * 6}{i}.weight" for i in range(3)]
    mesh = Mesh.for_world(1)
    layout = build_layout([ParamInfo(n, (2, 3), "float32") for n in names], mesh)
    states = {g.name: default_states(g, ()) for g in layout.groups}
    writer = CheckpointWriter(as_storage(dst), CheckpointSpec(mesh, {"model": Component("model", layout, states)}))
    writer.commit([writer.write_shard(0, lambda slot: iter([np.zeros((slot.end - slot.begin) // 4, np.float32)]))])
    return names


def test_piped_output_is_neither_wrapped_nor_cut(tmp_path: Path) -> None:
    """The real console script writing to a pipe, with a terminal width of 80 in the environment."""
    dst = str(tmp_path / "long")
    names = write_long_names(dst)
    exe = shutil.which("shardckpt") or os.path.join(os.path.dirname(sys.executable), "shardckpt")
    env = {**os.environ, "COLUMNS": "80"}
    r = subprocess.run([exe, "inspect", dst], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr
    for name in names:
        assert any(name in line for line in r.stdout.splitlines()), name
    assert "…" not in r.stdout
    assert max(len(line) for line in r.stdout.splitlines()) > 150
    files = [ln for ln in r.stdout.splitlines() if "shard-00000-of-00001.safetensors" in ln]
    assert len(files) == 1


def test_tiny_checkpoint_fixture(tiny_ckpt: tuple[str, Manifest]) -> None:
    path, m = tiny_ckpt
    r = cli("inspect", path, "--limit", "0")
    assert r.exit_code == 0 and all(p.fqn in r.stdout for p in m.components["model"].layout.params)
