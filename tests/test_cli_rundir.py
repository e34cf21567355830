"""A run directory (``latest`` and ``step-XXXXXXXX`` checkpoints) given where a checkpoint is
expected: ``inspect``, ``verify``, ``consolidate`` and ``reshard`` use the checkpoint ``latest``
names and say so on stderr; without a usable ``latest`` they say what the directory holds."""

from __future__ import annotations

import json
import shutil
import uuid
from pathlib import Path

import pytest

from testing.ckpts import TINY_PARAMS, make_run_dir
from testing.cli import cli, one_line_error
from shardckpt.errors import IncompleteCheckpointError
from shardckpt.checkpoint.run_dir import resolve_checkpoint
from shardckpt.storage import Storage
from shardckpt.tools.synth import synthesize

NOTE = "run directory: using latest -> step-00000200\n"


@pytest.fixture
def run(tmp_path: Path) -> Path:
    root = make_run_dir(tmp_path / "run")
    (root / "latest").write_text("step-00000200\n")
    return root


def test_every_command_uses_latest_and_says_so(run: Path, tmp_path: Path) -> None:
    r = cli("inspect", str(run), "--json")
    assert r.exit_code == 0 and r.stderr == NOTE, (r.output, r.exception)
    doc = json.loads(r.stdout)
    assert doc["step"] == 200 and doc["url"] == f"{run}/step-00000200"
    r = cli("inspect", str(run))
    assert r.exit_code == 0 and r.stderr == NOTE and "step 200" in r.stdout
    r = cli("verify", str(run))
    assert r.exit_code == 0 and r.stderr == NOTE, (r.output, r.exception)
    assert r.stdout.startswith(f"ok: {run}/step-00000200")
    r = cli("consolidate", str(run), str(tmp_path / "hf"), "--keep-buffers")
    # the note, then the one line on adding a config (this synthetic run records none)
    assert r.exit_code == 0 and r.stderr.startswith(NOTE), (r.output, r.exception)
    assert r.stderr[len(NOTE):].startswith("note: no config.json written"), r.stderr
    prov = json.loads((tmp_path / "hf" / "shardckpt_consolidated.json").read_text())
    assert prov["source"] == f"{run}/step-00000200" and prov["step"] == 200
    r = cli("reshard", str(run), str(tmp_path / "one"), "--to", "1")
    assert r.exit_code == 0 and r.stderr == NOTE, (r.output, r.exception)
    assert json.loads(cli("inspect", str(tmp_path / "one"), "--json").stdout)["step"] == 200


def test_without_latest_the_committed_checkpoints_are_listed(run: Path, tmp_path: Path) -> None:
    (run / "latest").unlink()
    shutil.rmtree(run / "step-00000200")
    (run / "step-00000300").mkdir()  # a save that never committed
    for args in (["inspect", str(run)], ["verify", str(run)], ["consolidate", str(run), str(tmp_path / "o")],
                 ["reshard", str(run), str(tmp_path / "o"), "--to", "1"]):
        line = one_line_error(cli(*args), f"{run} is a run directory", "no latest pointer",
                              "step-00000100", f"{run}/step-00000100")
        assert "never committed" not in line and "step-00000300" not in line
    assert not (tmp_path / "o").exists()


def test_latest_naming_an_uncommitted_save(run: Path) -> None:
    (run / "step-00000200" / "manifest.json").unlink()
    one_line_error(cli("inspect", str(run)), "latest names step-00000200, which has no manifest.json",
                   "step-00000100")
    (run / "step-00000100" / "manifest.json").unlink()
    one_line_error(cli("verify", str(run)), "no committed checkpoint", "2 step directories")


def test_resolve_checkpoint_in_the_library() -> None:
    url = f"memory://resolve-{uuid.uuid4().hex}"
    try:
        synthesize(f"{url}/run/step-00000007", TINY_PARAMS, 1, step=7)
        Storage(url).put("run/latest", b"step-00000007\n")
        for where, url_, note in [
                ("run", f"{url}/run/step-00000007", "run directory: using latest -> step-00000007"),
                ("run/step-00000007", f"{url}/run/step-00000007", None),
                ("nothing", f"{url}/nothing", None)]:  # nothing: the reader says why
            r = resolve_checkpoint(f"{url}/{where}")
            assert (r.url, r.storage.url, r.note) == (url_, url_, note)
        Storage(url).rm("run/latest")
        with pytest.raises(IncompleteCheckpointError, match="run directory"):
            resolve_checkpoint(f"{url}/run")
    finally:
        Storage(url).rm("", recursive=True)
