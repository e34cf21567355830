"""The offline tools on checkpoints of chunked tensors (format 1.2): ``inspect``, ``verify``,
``diff`` (equal across different chunkings of the same state), ``consolidate`` (streamed in
bands, the model's tensors under ``--prefix``) and ``clean``."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.numpy import load_file
from typer.testing import CliRunner

from shardckpt.cli.main import app
from shardckpt.interop.dcp.storage import ShardckptWriter
from shardckpt.tools.diff import diff
from testing.cli import cli

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

HERE = Path(__file__).resolve().parent / "golden"
GOLDEN = HERE / "v1_2_chunked"
sys.path.insert(0, str(HERE))
from make_golden_chunked import golden_state  # noqa: E402


def _resave(path: Path, change: bool = False, lr: float = 0.5) -> str:
    """The golden's state saved from one process (one chunk per tensor), optionally changed."""
    sd = golden_state()
    if change:
        sd["t"]["w"][2, 3] += 1
    sd["meta"]["lr"] = lr
    dcp.save(sd, storage_writer=ShardckptWriter(str(path)))
    return str(path)


def test_inspect_lists_chunked_tensors_and_blobs() -> None:
    r = cli("inspect", str(GOLDEN))
    assert r.exit_code == 0, r.output
    assert "format 1.2" in r.output and "4 tensors, 60 elements" in r.output
    assert "2 opaque blobs" in r.output and "t.v" in r.output and "bfloat16" in r.output
    doc = json.loads(cli("inspect", "--json", str(GOLDEN)).output)
    t = {x["fqn"]: x for x in doc["chunked"]["tensors"]}
    assert t["t.w"] == {"fqn": "t.w", "shape": [6, 5], "dtype": "float32", "numel": 30,
                        "bytes": 120, "chunks": 2}


def test_verify_ok_and_damage_named(tmp_path: Path) -> None:
    assert cli("verify", str(GOLDEN)).exit_code == 0
    ck = tmp_path / "ck"
    shutil.copytree(GOLDEN, ck)
    victim = sorted(ck.rglob("chunks-00001.safetensors"))[0]
    data = bytearray(victim.read_bytes())
    data[200] ^= 1
    victim.write_bytes(bytes(data))
    r = CliRunner().invoke(app, ["verify", str(ck)])
    assert r.exit_code != 0 and "chunks-00001.safetensors" in r.output and "CRC32C" in r.output


def test_diff_equal_across_chunkings_and_names_differences(tmp_path: Path) -> None:
    one = _resave(tmp_path / "one")
    result = diff(str(GOLDEN), one)
    assert result.equal and result.compared == 6 and result.elements == 60
    changed = diff(str(GOLDEN), _resave(tmp_path / "changed", change=True, lr=0.25))
    assert not changed.equal
    by_name = {d.name: d for d in changed.differences}
    assert by_name["t.w"].differing == 1 and by_name["t.w"].max_abs_diff == 1.0
    assert by_name["meta.lr"].kind == "blob" and by_name["meta.lr"].status == "different"
    assert set(by_name) == {"t.w", "meta.lr"}
    assert cli("diff", str(GOLDEN), one).exit_code == 0


def test_consolidate_streams_bands_under_prefix(tmp_path: Path) -> None:
    dst = tmp_path / "hf"
    r = cli("consolidate", str(GOLDEN), str(dst), "--prefix", "t.", "--dtype", "fp32",
            "--buffer", "16B")  # bands of one row: every tensor is assembled piece by piece
    assert r.exit_code == 0, r.output
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    out = {}
    for name in set(index["weight_map"].values()):
        out.update(load_file(str(dst / name)))
    want = golden_state()["t"]
    assert set(out) == set(want)
    for k, v in want.items():
        expect = v.float() if v.dtype == torch.bfloat16 else v
        assert np.array_equal(out[k], expect.numpy()), k


def test_consolidate_default_prefix_explains(tmp_path: Path) -> None:
    r = cli("consolidate", str(GOLDEN), str(tmp_path / "hf"))
    assert r.exit_code != 0 and "no tensor name starts with 'model.'" in r.output
    assert not (tmp_path / "hf" / "model.safetensors.index.json").exists()


def test_clean_removes_an_uncommitted_attempt_only(tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    shutil.copytree(GOLDEN, ck)
    debris = ck / "20200101T000000Z-deadbeef"
    debris.mkdir()
    (debris / "chunks-00000.safetensors").write_bytes(b"partial")
    r = cli("clean", str(ck), "--min-age", "0")
    assert r.exit_code == 0, r.output
    assert not debris.exists() and cli("verify", str(ck)).exit_code == 0


def test_reshard_keeps_chunked_tensors_and_blobs(tmp_path: Path) -> None:
    """Resharding a DCP checkpoint drops nothing (tests/test_reshard_chunked.py has the rest)."""
    r = cli("reshard", str(GOLDEN), str(tmp_path / "out"), "--to", "3")
    assert r.exit_code == 0, r.output
    assert diff(str(GOLDEN), str(tmp_path / "out")).equal
