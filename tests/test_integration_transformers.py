"""The parts of ``shardckpt.integrations.transformers`` that need neither Trainer nor torch: the
run's ``checkpoint-<step>`` folders (resume point, retention) and the trainer record's checks.
The Trainer runs themselves are in ``integration/test_trainer.py``."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from shardckpt.errors import ManifestError
from shardckpt.integrations.transformers import TrainerRun, read_trainer_record
from shardckpt.tools.synth import synthesize
from testing.ckpts import TINY_PARAMS


def _committed(path: Path, step: int) -> None:
    synthesize(str(path), TINY_PARAMS, 2, step=step, seed=step)


def test_only_committed_checkpoints_count(tmp_path: Path) -> None:
    for step in (2, 4, 6):
        _committed(tmp_path / f"checkpoint-{step}", step)
    (tmp_path / "checkpoint-8").mkdir()  # a save that never committed: newest, no manifest
    (tmp_path / "checkpoint-8" / "chunks-00000.safetensors").write_bytes(b"half")
    (tmp_path / "step-00000010").mkdir()  # not a Trainer folder
    (tmp_path / "checkpoint-x").mkdir()
    run = TrainerRun(str(tmp_path), keep_last=2)
    assert [f.step for f in run.committed()] == [2, 4, 6]
    assert run.resume_point().url == str(tmp_path / "checkpoint-6")
    assert run.apply_retention() == [str(tmp_path / "checkpoint-2")]
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-4", "checkpoint-6", "checkpoint-8",
                                            "checkpoint-x", "step-00000010"]
    assert run.url_for(12) == str(tmp_path / "checkpoint-12")


def test_resume_point_skips_a_damaged_checkpoint(tmp_path: Path) -> None:
    for step in (2, 4):
        _committed(tmp_path / f"checkpoint-{step}", step)
    m = json.loads((tmp_path / "checkpoint-4" / "manifest.json").read_text())
    victim = tmp_path / "checkpoint-4" / m["files"][0]["path"]
    victim.write_bytes(victim.read_bytes()[:-1])
    assert TrainerRun(str(tmp_path)).resume_point().url == str(tmp_path / "checkpoint-2")


def test_trainer_record_missing_is_one_clear_error(tmp_path: Path) -> None:
    _committed(tmp_path / "checkpoint-2", 2)
    with pytest.raises(ManifestError, match=r"checkpoint-2/manifest.json: extras.app.trainer is missing"):
        read_trainer_record(str(tmp_path / "checkpoint-2"))


def test_importing_the_module_imports_neither_torch_nor_transformers() -> None:
    import subprocess

    code = ("import sys, shardckpt.integrations.transformers as t; "
            "print(sorted({'torch', 'transformers', 'accelerate'} & set(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parent.parent)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr
