"""The Checkpointer in one process: an async save holds exactly the step it is labelled with,
whatever the order in which the checkpointer and the optimizer were built; the Hugging Face
config of the model is recorded in every manifest."""

from __future__ import annotations

import logging
import threading

import pytest
import torch

from shardckpt.checkpoint.reader import CheckpointReader
from shardckpt.training.checkpointer import Checkpointer
from shardckpt.runtime import ShardedAdamW, ZeroEngine, decay_param_groups
from shardckpt.runtime.models.llama import LLAMA_POLICY, LlamaConfig, LlamaForCausalLM, causal_lm_loss
from shardckpt.runtime.mesh import ProcessMesh
from shardckpt.training.save_load import SaveJob

CFG = LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2)

pytestmark = pytest.mark.usefixtures("one_thread")


def _engine(cfg: LlamaConfig = CFG) -> ZeroEngine:
    torch.manual_seed(0)
    return ZeroEngine(LlamaForCausalLM(cfg), policy=LLAMA_POLICY, process_mesh=ProcessMesh.single())


def _step(engine: ZeroEngine, opt: ShardedAdamW, step: int) -> None:
    tokens = torch.randint(0, CFG.vocab_size, (2, 8), generator=torch.Generator().manual_seed(step))
    causal_lm_loss(engine(tokens), tokens).backward()
    opt.step()
    opt.zero_grad()


class PlainSharded:
    """The save/load protocol alone (no engine update hooks): the optimizer gets hooked."""

    def __init__(self, engine: ZeroEngine) -> None:
        self._engine = engine
        self.layout, self.tied_aliases = engine.layout, engine.tied_aliases
        self.local_shards, self.refresh_params = engine.local_shards, engine.refresh_params
        self.buffers, self.load_buffers = engine.buffers, engine.load_buffers

    @property
    def optimizer(self):
        return self._engine.optimizer


@pytest.mark.parametrize("hooked", ["engine", "optimizer"])
def test_async_save_built_before_the_optimizer_holds_exactly_its_step(tmp_path, monkeypatch,
                                                                      hooked):
    engine = _engine()
    target = engine if hooked == "engine" else PlainSharded(engine)
    ckpt = Checkpointer(str(tmp_path / "run"), target, async_save=True)  # no optimizer yet
    opt = ShardedAdamW(engine, decay_param_groups(engine, 0.1), lr=1e-2)
    _step(engine, opt, 0)
    at_step_1 = {g: {k: t.clone() for k, t in kinds.items()}
                 for g, kinds in engine.local_shards().items()}
    stepped = threading.Event()
    stage = SaveJob.stage

    def slow_stage(job: SaveJob) -> None:
        # hold the staging copy until the next optimizer step is done; a step that waits for
        # the copy (as it must) lets this go on after the timeout instead
        stepped.wait(timeout=3)
        stage(job)

    monkeypatch.setattr(SaveJob, "stage", slow_stage)
    ckpt.save(1)
    _step(engine, opt, 1)
    stepped.set()
    ckpt.close()
    reader = CheckpointReader(ckpt.manager.url_for(1))
    assert reader.manifest.optimizer.param_groups[0]["step"] == 1
    for g, kinds in at_step_1.items():
        assert set(kinds) == {"master", "exp_avg", "exp_avg_sq"}
        for k, t in kinds.items():
            assert bytes(reader.read_state(0, g, k)) == t.numpy().tobytes(), (g, k)


def test_manifest_records_the_hugging_face_config(tmp_path):
    transformers = pytest.importorskip("transformers")
    engine = _engine()
    ckpt = Checkpointer(str(tmp_path / "run"), engine)
    ckpt.save(1)
    hf = CheckpointReader(ckpt.manager.url_for(1)).manifest.extras["hf_config"]
    assert hf["architectures"] == ["LlamaForCausalLM"] and hf["model_type"] == "llama"
    config = transformers.LlamaConfig(**hf)
    with torch.device("meta"):
        theirs = transformers.LlamaForCausalLM(config)
    ours = {k: tuple(v.shape) for k, v in LlamaForCausalLM(CFG).state_dict().items()}
    assert {k: tuple(v.shape) for k, v in theirs.state_dict().items()} == ours


def test_hf_config_given_explicitly(tmp_path):
    transformers = pytest.importorskip("transformers")
    from shardckpt.errors import ConfigError

    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2,
                                      vocab_size=256, tie_word_embeddings=True)
    engine = _engine()
    ckpt = Checkpointer(str(tmp_path / "run"), engine, hf_config=config)
    ckpt.save(3)
    hf = CheckpointReader(ckpt.manager.url_for(3)).manifest.extras["hf_config"]
    assert hf["model_type"] == "llama" and hf["hidden_size"] == 32
    assert transformers.LlamaConfig(**hf).num_key_value_heads == 2
    Checkpointer(str(tmp_path / "run"), engine, hf_config={"model_type": "llama", "a": 1})
    with pytest.raises(ConfigError, match="hf_config has no 'model_type'"):
        Checkpointer(str(tmp_path / "run"), engine, hf_config={"hidden_size": 32})
    with pytest.raises(ConfigError, match="hf_config is a int"):
        Checkpointer(str(tmp_path / "run"), engine, hf_config=3)


def test_resume_passes_over_a_thinned_newest_checkpoint_and_says_why(tmp_path, caplog):
    """A job with an optimizer needs optimizer state: a checkpoint that retention thinned is
    passed over for the newest one that holds it, with a log line saying why; its weights still
    load bit for bit with weights_only. With no checkpoint holding optimizer state, the newest
    weights are taken and the optimizer starts fresh."""
    from shardckpt.checkpoint.thin import thin
    from shardckpt.storage import Storage

    engine = _engine()
    opt = ShardedAdamW(engine, decay_param_groups(engine, 0.1), lr=1e-2)
    ckpt = Checkpointer(str(tmp_path / "run"), engine, keep_last=3, keep_optimizer_last=2)
    states = {}
    for step in (1, 2, 3):
        _step(engine, opt, step)
        ckpt.save(step)
        states[step] = {g: {k: t.clone() for k, t in kinds.items()}
                        for g, kinds in engine.local_shards().items()}
    assert ckpt.manager.thinned == [ckpt.manager.url_for(1)]
    assert thin(Storage(ckpt.manager.url_for(3))) is not None  # the newest, thinned as well
    fresh = _engine()
    ShardedAdamW(fresh, decay_param_groups(fresh, 0.1), lr=1e-2)
    again = Checkpointer(str(tmp_path / "run"), fresh, keep_last=3, keep_optimizer_last=2)
    # weights only: the thinned checkpoint's masters, bit for bit
    again.load(again.manager.url_for(3), weights_only=True)
    for g, kinds in fresh.local_shards().items():
        assert torch.equal(kinds["master"], states[3][g]["master"]), g
    with caplog.at_level(logging.WARNING):
        assert again.resume() == 2
    assert f"passing over {again.manager.url_for(3)}: it holds weights only (retention thinned it" in caplog.text
    assert "this job needs optimizer state" in caplog.text
    for g, kinds in fresh.local_shards().items():
        for k, t in kinds.items():
            assert torch.equal(t, states[2][g][k]), (g, k)
    # no checkpoint with optimizer state: the newest weights, a fresh optimizer
    assert thin(Storage(again.manager.url_for(2))) is not None
    last = _engine()
    ShardedAdamW(last, decay_param_groups(last, 0.1), lr=1e-2)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert Checkpointer(str(tmp_path / "run"), last).resume() == 2
    assert "holds optimizer state; resuming from the weights of" in caplog.text
    for g, kinds in last.local_shards().items():
        assert torch.equal(kinds["master"], states[2][g]["master"]), g
        assert all(not t.any() for k, t in kinds.items() if k != "master"), g


def test_weights_only_last_resort_that_fails_its_checksums_falls_back_to_an_older_one(tmp_path, caplog):
    """No checkpoint holds optimizer state and the newest weights fail their checksums while
    loading: the next older weights load (a fresh optimizer), and the damaged step is put
    aside. (It was tried again and again, for ever, before.)"""
    import os

    from testing.ckpt_runs import flip_bit
    from shardckpt.checkpoint.thin import thin
    from shardckpt.storage import Storage

    engine = _engine()
    opt = ShardedAdamW(engine, decay_param_groups(engine, 0.1), lr=1e-2)
    ckpt = Checkpointer(str(tmp_path / "run"), engine, keep_last=None)
    masters = {}
    for step in (1, 2):
        _step(engine, opt, step)
        ckpt.save(step)
        masters[step] = {g: kinds["master"].clone() for g, kinds in engine.local_shards().items()}
    for step in (1, 2):
        thin(Storage(ckpt.manager.url_for(step)))
    flip_bit(ckpt.manager.url_for(2), "shard-")
    fresh = _engine()
    ShardedAdamW(fresh, decay_param_groups(fresh, 0.1), lr=1e-2)
    again = Checkpointer(str(tmp_path / "run"), fresh)
    with caplog.at_level(logging.WARNING):
        assert again.resume() == 1
    assert f"{again.manager.url_for(2)} fails its checksums" in caplog.text
    assert f"resuming from the weights of {again.manager.url_for(1)}" in caplog.text
    for g, kinds in fresh.local_shards().items():
        assert torch.equal(kinds["master"], masters[1][g]), g
    assert [f.step for f in again.manager.committed()] == [1]
    assert [n.split(".")[0] for n in os.listdir(tmp_path / "run" / "passed-over")] == ["step-00000002"]
