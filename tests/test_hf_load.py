"""``load_hf`` on one process: real ``transformers`` files into a meta-built ``ZeroEngine``.

Multi-rank loads, HSDP, training parity and per-rank bytes are in integration/test_hf_load.py.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import dataclasses  # noqa: E402
import json  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import pytest  # noqa: E402

from shardckpt.errors import CollectiveError, ConfigError  # noqa: E402

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from shardckpt.runtime import ShardedAdamW, ZeroEngine  # noqa: E402
from shardckpt.training.hf_load import load_hf  # noqa: E402
from shardckpt.runtime.models.llama import LLAMA_POLICY, LlamaConfig, LlamaForCausalLM, causal_lm_loss  # noqa: E402

VOCAB = 96


def save_tiny(path: Path, tied: bool, dtype: str = "float32", shard: str = "16KB", **kw: Any) -> Path:
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                                   tie_word_embeddings=tied, **kw)
    torch.manual_seed(3)
    transformers.LlamaForCausalLM(cfg).to(getattr(torch, dtype)).save_pretrained(path, max_shard_size=shard)
    return path


def engine_for(path: Path, **overrides: Any) -> ZeroEngine:
    cfg = LlamaConfig.from_hf_config(json.loads((path / "config.json").read_text()))
    with torch.device("meta"):
        model = LlamaForCausalLM(dataclasses.replace(cfg, torch_dtype="float32", **overrides))
    return ZeroEngine(model, policy=LLAMA_POLICY, deterministic=True)


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("shard", ["16KB", "1GB"], ids=["index", "single"])
def test_logits_equal_transformers(tmp_path: Path, tied: bool, dtype: str, shard: str,
                                   one_thread: None) -> None:
    path = save_tiny(tmp_path / "m", tied, dtype, shard)
    assert (path / "model.safetensors.index.json").exists() == (shard == "16KB")
    engine = engine_for(path)
    result = load_hf(engine, str(path), buffer_bytes=1000)
    assert result.missing == result.unexpected == result.mismatched == ()
    assert result.config["tie_word_embeddings"] is tied
    hf = transformers.LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(engine(ids), hf(ids).logits)


def test_untied_config_from_transformers(tmp_path: Path) -> None:
    path = save_tiny(tmp_path / "m", tied=False)
    cfg = LlamaConfig.from_hf_config(json.loads((path / "config.json").read_text()))
    assert cfg.tie_word_embeddings is False and cfg.vocab_size == VOCAB
    model = LlamaForCausalLM(cfg)
    assert "lm_head.weight" in dict(model.named_parameters())
    assert sum(p.numel() for p in model.parameters()) == cfg.num_params()


@pytest.mark.parametrize("bad,needle", [({"hidden_act": "gelu"}, "hidden_act"),
                                        ({"attention_bias": True}, "attention_bias"),
                                        ({"head_dim": 4}, "head_dim 4"),
                                        ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}},
                                         "rope scaling")])
def test_configs_this_llama_cannot_be_are_refused(bad: dict, needle: str) -> None:
    d = {**LlamaConfig(tie_word_embeddings=False).to_hf_config(), **bad}
    with pytest.raises(ConfigError, match=needle):
        LlamaConfig.from_hf_config(d)


def test_untied_file_into_a_tied_model_is_refused_by_value(tmp_path: Path) -> None:
    path = save_tiny(tmp_path / "m", tied=False)
    engine = engine_for(path, tie_word_embeddings=True)
    with pytest.raises(CollectiveError, match=r"lm_head\.weight differs from model\.embed_tokens"):
        load_hf(engine, str(path))


def test_tied_head_stored_and_equal_loads(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    path = save_tiny(tmp_path / "m", tied=True, shard="1GB")
    sd = load_file(str(path / "model.safetensors"))
    sd["lm_head.weight"] = sd["model.embed_tokens.weight"].clone()
    save_file(sd, str(path / "model.safetensors"))
    result = load_hf(engine_for(path), str(path))
    assert result.unexpected == ()


def test_strict_lists_everything_and_non_strict_returns_it(tmp_path: Path) -> None:
    path = save_tiny(tmp_path / "m", tied=True)  # no lm_head in the file
    engine = engine_for(path, tie_word_embeddings=False, vocab_size=VOCAB)
    with pytest.raises(CollectiveError, match=r"missing from the file: lm_head\.weight") as e:
        load_hf(engine, str(path))
    assert str(path) in str(e.value)
    result = load_hf(engine, str(path), strict=False)
    assert result.missing == ("lm_head.weight",) and result.unexpected == ()
    small = engine_for(path, vocab_size=VOCAB - 1)
    with pytest.raises(CollectiveError, match=r"model\.embed_tokens\.weight \(model-\d+-of-\d+\.safetensors: "
                                              r"\[96, 32\] float32; model: \[95, 32\] float32\)"):
        load_hf(small, str(path), strict=False)  # shapes: refused even when not strict


def test_a_dtype_the_masters_cannot_take(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    path = save_tiny(tmp_path / "m", tied=True, shard="1GB")
    sd = load_file(str(path / "model.safetensors"))
    sd["model.norm.weight"] = sd["model.norm.weight"].to(torch.int32)
    save_file(sd, str(path / "model.safetensors"))
    with pytest.raises(CollectiveError, match=r"model\.norm\.weight \(model\.safetensors: \[32\] "
                                              r"int32; model: \[32\] float32\)"):
        load_hf(engine_for(path), str(path))


def test_a_name_map_renames_file_keys(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    path = save_tiny(tmp_path / "m", tied=False, shard="1GB")
    sd = load_file(str(path / "model.safetensors"))
    save_file({f"base.{k}": v for k, v in sd.items()}, str(path / "model.safetensors"))
    engine = engine_for(path)
    load_hf(engine, str(path), name_map=lambda n: n.removeprefix("base."))
    full = engine.gather_full_params()
    assert all(torch.equal(full[k], v.float()) for k, v in sd.items())
    with pytest.raises(CollectiveError, match="not in the model: base.lm_head.weight"):
        load_hf(engine, str(path), name_map={"base.model.norm.weight": "model.norm.weight"})


def test_an_attached_optimizer_starts_fresh(tmp_path: Path, one_thread: None) -> None:
    path = save_tiny(tmp_path / "m", tied=True)
    engine = engine_for(path)
    opt = ShardedAdamW(engine, lr=1e-2)
    ids = torch.randint(0, VOCAB, (2, 9))
    causal_lm_loss(engine(ids), ids).backward()
    opt.step()
    opt.zero_grad()
    load_hf(engine, str(path))
    assert [g["step"] for g in opt.optimizer_metadata()["param_groups"]] == [0]
    for kinds in engine.local_shards().values():
        assert all(not t.any() for k, t in kinds.items() if k != "master")
    hf = transformers.LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        assert torch.equal(engine(ids), hf(ids).logits)


def test_a_run_resumes_from_an_offline_import(tmp_path: Path, one_thread: None) -> None:
    """``import hf`` into ``<run>/step-00000000``: ``Checkpointer.resume()`` starts from it, and
    the optimizer built afterwards starts fresh."""
    from shardckpt.training.checkpointer import Checkpointer
    from shardckpt.interop.hf.import_ import import_hf

    path = save_tiny(tmp_path / "m", tied=False, dtype="bfloat16")
    import_hf(str(path), str(tmp_path / "run" / "step-00000000"), ranks=3)
    engine = engine_for(path)
    ckpt = Checkpointer(str(tmp_path / "run"), engine)
    try:
        assert ckpt.resume() == 0
    finally:
        ckpt.close()
    hf = transformers.LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.randint(0, VOCAB, (2, 9))
    with torch.no_grad():
        assert torch.equal(engine(ids), hf(ids).logits)
    opt = ShardedAdamW(engine, lr=1e-2)
    causal_lm_loss(engine(ids), ids).backward()
    opt.step()
    assert [g["step"] for g in opt.optimizer_metadata()["param_groups"]] == [1]


def test_a_run_with_its_optimizer_built_first_resumes_from_an_import(tmp_path: Path,
                                                                     one_thread: None) -> None:
    """The usual loop builds engine, optimizer and Checkpointer, then resumes: a weights-only
    checkpoint loads the weights and the optimizer state starts fresh, moments zero, step 0."""
    from shardckpt.training.checkpointer import Checkpointer
    from shardckpt.interop.hf.import_ import import_hf

    path = save_tiny(tmp_path / "m", tied=True)
    import_hf(str(path), str(tmp_path / "run" / "step-00000000"), ranks=2)
    engine = engine_for(path)
    opt = ShardedAdamW(engine, lr=1e-2)
    ids = torch.randint(0, VOCAB, (2, 9))
    causal_lm_loss(engine(ids), ids).backward()
    opt.step()
    opt.zero_grad()
    ckpt = Checkpointer(str(tmp_path / "run"), engine)
    try:
        assert ckpt.resume() == 0
    finally:
        ckpt.close()
    assert [g["step"] for g in opt.optimizer_metadata()["param_groups"]] == [0]
    for kinds in engine.local_shards().values():
        assert all(not t.any() for k, t in kinds.items() if k != "master")
    hf = transformers.LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        assert torch.equal(engine(ids), hf(ids).logits)


@pytest.mark.parametrize("mode", ["cpu", "nvme"])
def test_hf_weights_into_an_offloaded_bf16_engine(tmp_path: Path, mode: str) -> None:
    """With the optimizer offloaded and bf16 compute, the fp32 masters live in the offload store
    (host memory or its files): ``load_hf`` writes them there, bit for bit what a resident
    engine loads, and the device keeps only their bf16 cast."""
    from shardckpt.runtime.precision import MixedPrecisionPolicy
    from testing.engines import shard_state

    path = save_tiny(tmp_path / "m", tied=False)

    def build(**kw: Any) -> ZeroEngine:
        cfg = LlamaConfig.from_hf_config(json.loads((path / "config.json").read_text()))
        with torch.device("meta"):
            model = LlamaForCausalLM(dataclasses.replace(cfg, torch_dtype="float32"))
        e = ZeroEngine(model, policy=LLAMA_POLICY, deterministic=True,
                       mixed_precision=MixedPrecisionPolicy(torch.bfloat16), **kw)
        ShardedAdamW(e, lr=1e-3)
        load_hf(e, str(path))
        return e

    def masters(e: ZeroEngine) -> dict[str, Any]:
        return {g: t for (g, kind), t in shard_state(e).items() if kind == "master"}

    resident = build()
    kw: dict[str, Any] = {"offload_optimizer": mode}
    if mode == "nvme":
        kw["offload_dir"] = str(tmp_path / "off")
    offloaded = build(**kw)
    want, got = masters(resident), masters(offloaded)
    assert want.keys() == got.keys() and all(torch.equal(want[g], got[g]) for g in want)
    for name, g in offloaded.groups.items():
        assert g.shard.dtype == torch.bfloat16
        assert torch.equal(g.shard, want[name].to(torch.bfloat16))
    offloaded.close()
    resident.close()
