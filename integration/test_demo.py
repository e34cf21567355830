"""`shardckpt demo` runs in the suite with small settings, and its checks pass."""

from __future__ import annotations

import json
import os

import pytest

from testing.cli import cli_process

pytestmark = pytest.mark.slow


def test_demo_small(tmp_path):
    work = str(tmp_path / "demo")
    r = cli_process("demo", "--workdir", work, "--ranks", "2", "--to", "1", "--steps", "2", "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    s = json.loads(r.stdout)
    assert s["bit_exact"] and s["sharded_loss"] == s["plain_loss"]
    assert [p["ranks"] for p in s["phases"]] == [2, 1]
    assert s["phases"][1]["start"] == 2 and s["phases"][1]["samples_seen"] == 32
    assert os.path.exists(os.path.join(s["paths"]["consolidated"], "model.safetensors.index.json"))
    assert s["kept"] and s["cleanup"] == f"files kept in {work} (remove them with: rm -rf {work})"


def test_demo_refuses_bad_options(tmp_path):
    r = cli_process("demo", "--ranks", "3", timeout=60)
    assert r.returncode == 2 and "--ranks 3" in r.stderr
    (tmp_path / "x").write_text("occupied")
    r = cli_process("demo", "--workdir", str(tmp_path), timeout=60)
    assert r.returncode == 2 and "not empty" in r.stderr
