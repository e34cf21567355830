"""The local tier belongs to its user and its run (one process, a real ``Checkpointer``):
resume takes only the steps this run wrote, from a directory this user owns and nobody else may
write; tier files are created 0600 and directories 0700; a planted ``step-N`` link is never
written through. The tests run as root, who can chown a directory to another uid (65534)."""

from __future__ import annotations

import logging
import os
import stat

import pytest
import torch

from shardckpt.checkpoint.tiers import LocalTier
from shardckpt.errors import ConfigError, ShardckptError
from shardckpt.runtime import ShardedAdamW, ZeroEngine, decay_param_groups
from shardckpt.runtime.mesh import ProcessMesh
from shardckpt.runtime.models.llama import LLAMA_POLICY, LlamaConfig, LlamaForCausalLM
from shardckpt.training.checkpointer import Checkpointer

CFG = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                  num_attention_heads=2, num_key_value_heads=1)
NOBODY = 65534

pytestmark = pytest.mark.usefixtures("one_thread")


def _ckpt(run: str, tier: str) -> Checkpointer:
    torch.manual_seed(0)
    engine = ZeroEngine(LlamaForCausalLM(CFG), policy=LLAMA_POLICY, process_mesh=ProcessMesh.single())
    ShardedAdamW(engine, decay_param_groups(engine, 0.0), lr=1e-3)
    return Checkpointer(run, engine, local=LocalTier(path=tier, every=1, peers=0),
                        durable_every=100)


def _save(ckpt: Checkpointer, *steps: int) -> None:
    for s in steps:
        ckpt.save(s)
    ckpt.close()


def test_resume_skips_the_local_steps_of_another_run(tmp_path, caplog):
    tier = str(tmp_path / "shm")
    _save(_ckpt(str(tmp_path / "run-a"), tier), 5, 6)
    assert _ckpt(str(tmp_path / "run-a"), tier).resume() == 6  # its own run resumes
    caplog.set_level(logging.WARNING)
    other = _ckpt(str(tmp_path / "run-b"), tier)
    assert other.resume() == 0
    said = [r.getMessage() for r in caplog.records if "not resuming from" in r.getMessage()]
    assert len(said) == 2 and all(f"belongs to run {str(tmp_path / 'run-a')!r}" in m for m in said), said
    # run a's steps are newer than the step b resumed (none): put aside, not deleted, so that
    # b can save those numbers itself; the note says whose they are
    aside = sorted(os.listdir(os.path.join(tier, "passed-over")))
    assert [n.split(".")[0] for n in aside] == [f"step-{s:08d}" for s in (5, 6)], aside
    note = open(os.path.join(tier, "passed-over", aside[0], "passed-over.json")).read()
    assert "belongs to run" in note, note
    # run b saves in the same directory, its pruning (keep=2) leaves run a's steps where they
    # are, and b resumes its own
    _save(other, 1, 2, 5)
    assert sorted(os.listdir(tier)) == ["passed-over"] + [f"step-{s:08d}" for s in (2, 5)]
    assert len(os.listdir(os.path.join(tier, "passed-over"))) == 2
    assert _ckpt(str(tmp_path / "run-b"), tier).resume() == 5


def test_a_newer_local_step_whose_manifest_does_not_parse_is_put_aside(tmp_path):
    """The resume's put-aside round is left out only where the survey saw nothing newer than
    the step loaded: a manifest that does not parse counts as seen."""
    tier = str(tmp_path / "shm")
    _save(_ckpt(str(tmp_path / "run"), tier), 5, 6)
    with open(os.path.join(tier, "step-00000006", "manifest.json"), "wb") as f:
        f.write(b"{not json")
    assert _ckpt(str(tmp_path / "run"), tier).resume() == 5
    aside = os.listdir(os.path.join(tier, "passed-over"))
    assert len(aside) == 1 and aside[0].startswith("step-00000006."), aside
    assert sorted(n for n in os.listdir(tier) if n.startswith("step-")) == ["step-00000005"]


def test_tier_files_are_0600_and_directories_0700(tmp_path):
    tier = tmp_path / "shm" / "tier"
    _save(_ckpt(str(tmp_path / "run"), str(tier)), 1)
    modes = {}
    for d, dirs, files in os.walk(tier):
        modes[d] = stat.S_IMODE(os.stat(d).st_mode)
        modes.update({os.path.join(d, f): stat.S_IMODE(os.stat(os.path.join(d, f)).st_mode) for f in files})
    files = [p for p in modes if os.path.isfile(p)]
    assert any(p.endswith(".safetensors") for p in files) and any(p.endswith("manifest.json") for p in files)
    assert {modes[p] for p in files} == {0o600}, modes
    assert {modes[p] for p in modes if p not in files} == {0o700}, modes


@pytest.mark.parametrize("attack", ["owner", "group-writable", "other-writable", "parent-owner",
                                    "parent-writable"])
def test_a_tier_directory_another_user_controls_is_refused(tmp_path, attack):
    parent = tmp_path / "shared"
    tier = parent / "tier"
    tier.mkdir(parents=True)
    os.chmod(tier, 0o700)
    if attack == "owner":
        os.chown(tier, NOBODY, NOBODY)
    elif attack == "group-writable":
        os.chmod(tier, 0o770)
    elif attack == "other-writable":
        os.chmod(tier, 0o702)
    elif attack == "parent-owner":
        os.chown(parent, NOBODY, NOBODY)
    else:
        os.chmod(parent, 0o777)
    with pytest.raises(ConfigError) as e:
        _ckpt(str(tmp_path / "run"), str(tier))
    msg = str(e.value)
    where = str(parent) if attack.startswith("parent") else str(tier)
    assert where in msg and "refus" in msg, msg
    assert ("uid 65534" in msg) if "owner" in attack else ("writable by others" in msg), msg


def test_a_sticky_world_writable_parent_is_fine_and_the_tier_is_created_0700(tmp_path):
    parent = tmp_path / "shm"
    parent.mkdir()
    os.chmod(parent, 0o1777)  # as /dev/shm
    _ckpt(str(tmp_path / "run"), str(parent / "tier"))
    assert stat.S_IMODE(os.stat(parent / "tier").st_mode) == 0o700


def test_a_planted_step_link_is_not_written_through(tmp_path):
    tier, elsewhere = tmp_path / "shm", tmp_path / "elsewhere"
    tier.mkdir(mode=0o700)
    elsewhere.mkdir()
    os.symlink(elsewhere, tier / "step-00000001")
    ckpt = _ckpt(str(tmp_path / "run"), str(tier))
    with pytest.raises(ShardckptError) as e:
        _save(ckpt, 1)
    assert "symbolic link" in str(e.value), e.value
    assert os.listdir(elsewhere) == []
