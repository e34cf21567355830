"""The package's small Llama: Hugging Face names, config.json, and logits equal to transformers'."""

from __future__ import annotations

import pytest
import torch

from shardckpt.errors import ConfigError
from shardckpt.runtime.models.llama import LlamaConfig, LlamaForCausalLM, causal_lm_loss


def test_parameter_names_follow_hugging_face_and_the_head_is_tied():
    model = LlamaForCausalLM(LlamaConfig(num_hidden_layers=1))
    names = [n for n, _ in model.named_parameters()]
    assert names[0] == "model.embed_tokens.weight" and names[-1] == "model.norm.weight"
    assert "model.layers.0.self_attn.q_proj.weight" in names
    assert "model.layers.0.mlp.down_proj.weight" in names
    assert "model.layers.0.post_attention_layernorm.weight" in names
    assert "lm_head.weight" not in names  # tied: listed once, under the embedding
    sd = model.state_dict()
    assert sd["lm_head.weight"].data_ptr() == sd["model.embed_tokens.weight"].data_ptr()
    assert "model.rotary_emb.inv_freq" not in sd  # non-persistent
    assert sum(p.numel() for p in model.parameters()) == model.config.num_params()


def test_default_config_makes_the_root_unit_the_largest():
    cfg = LlamaConfig()
    h, kv = cfg.hidden_size, cfg.num_key_value_heads * cfg.head_dim
    layer = 2 * h * h + 2 * h * kv + 3 * h * cfg.intermediate_size + 2 * h
    assert cfg.vocab_size * h + h > layer


def test_hf_config_dict_and_back():
    cfg = LlamaConfig(vocab_size=300, num_hidden_layers=3, rope_theta=5e5)
    d = cfg.to_hf_config()
    assert d["architectures"] == ["LlamaForCausalLM"] and d["model_type"] == "llama"
    assert d["tie_word_embeddings"] is True and d["torch_dtype"] == "float32"
    for key in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                "num_hidden_layers", "rms_norm_eps", "rope_theta", "vocab_size",
                "max_position_embeddings"):
        assert d[key] == getattr(cfg, key)
    assert LlamaConfig.from_hf_config(d) == cfg
    assert not LlamaConfig.from_hf_config({**d, "tie_word_embeddings": False}).tie_word_embeddings


@pytest.mark.parametrize("bad", [dict(hidden_size=30), dict(num_key_value_heads=3),
                                 dict(vocab_size=0), dict(torch_dtype="int8")])
def test_invalid_configs_are_refused(bad):
    with pytest.raises(ConfigError):
        LlamaConfig(**bad)


def test_logits_and_loss_equal_transformers():
    transformers = pytest.importorskip("transformers")
    cfg = LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2)
    torch.manual_seed(0)
    ours = LlamaForCausalLM(cfg).eval()
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig.from_dict(cfg.to_hf_config()))
    result = hf.load_state_dict(ours.state_dict(), strict=False)
    assert not result.missing_keys and not result.unexpected_keys
    hf.eval()
    tokens = torch.randint(0, cfg.vocab_size, (2, 13), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = ours(tokens)
        out = hf(tokens, labels=tokens)
    assert torch.equal(logits, out.logits)
    assert torch.allclose(causal_lm_loss(logits, tokens), out.loss)
