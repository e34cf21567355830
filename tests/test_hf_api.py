"""``shardckpt.hf``: a ``transformers`` model or a state dict from any shardckpt checkpoint, with
no files written, equal bit for bit to ``from_pretrained`` of what ``consolidate`` writes; the
model prefix of DCP, Trainer and Lightning checkpoints found by itself; ``architectures`` from
the model class the run recorded; one line on how to add a missing config."""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

import json  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import pytest  # noqa: E402

from testing.cli import cli, ok, one_line_error  # noqa: E402

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.usefixtures("one_thread")


def hf_llama(tied: bool = False) -> Any:
    """A tiny transformers Llama built from a config (no download), trained a little by hand."""
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=32, tie_word_embeddings=tied)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 1e-3)  # not bf16-representable: the cast is exercised
    return model


def _tokens() -> Any:
    return torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(5))


def save_dcp(model: Any, url: str, names: dict[str, Any], extras: dict[str, Any]) -> None:
    """``names`` (a DCP state dict) saved by one process through ShardckptWriter."""
    import torch.distributed.checkpoint as dcp

    from shardckpt.interop.dcp.storage import ShardckptWriter

    dcp.save(names, storage_writer=ShardckptWriter(url, extras=extras), no_dist=True)


def logits(model: Any) -> Any:
    with torch.no_grad():
        return model(_tokens()).logits


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_from_pretrained_equals_the_consolidated_folder(tmp_path: Path, dtype: str) -> None:
    """A ZeRO checkpoint (flat groups): streamed into the model, bit for bit what
    ``from_pretrained`` of ``consolidate --dtype`` gives; the state dict equals the files."""
    import shardckpt.hf
    from safetensors.torch import load_file
    from tests.test_consolidate_hf import save_llama

    src = str(tmp_path / "ck")
    save_llama(src)
    out = tmp_path / "hf"
    ok(cli("consolidate", src, str(out), "--dtype", dtype))
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=getattr(torch, dtype))
    got = shardckpt.hf.from_pretrained(src, transformers.LlamaForCausalLM, dtype=dtype)
    assert type(got) is transformers.LlamaForCausalLM and got.dtype == getattr(torch, dtype)
    assert torch.equal(logits(got), logits(ref))
    files = {}
    for name in set(json.loads((out / "model.safetensors.index.json").read_text())["weight_map"].values()):
        files.update(load_file(str(out / name)))
    sd = shardckpt.hf.state_dict(src, dtype=getattr(torch, dtype))
    assert sorted(sd) == sorted(files) and all(torch.equal(sd[k], files[k]) for k in sd)
    assert not [p for p in tmp_path.rglob("*") if p.is_file() and "hf" not in p.parts
                and "ck" not in p.parts]  # nothing written anywhere else


def test_trainer_and_lightning_layouts_need_no_prefix(tmp_path: Path) -> None:
    """DCP checkpoints as ShardckptTrainer (``model.``, recorded) and the Lightning strategies
    (``state_dict.<attr>.``, here unrecorded: an older checkpoint) write them: consolidate and
    from_pretrained find the model's tensors; a tied model loads from its one tensor."""
    import shardckpt.hf
    from shardckpt.training.hf_record import hf_config_dict

    model = hf_llama(tied=True)
    config = hf_config_dict(model.config, model=model)
    assert config["architectures"] == ["LlamaForCausalLM"]  # from the class: the config had none
    sd = model.state_dict()
    save_dcp(model, str(tmp_path / "trainer"), {"model": sd},
             {"step": 1, "hf_config": config, "hf_prefix": "model."})
    lightning = {"state_dict": {f"model.{k}": v for k, v in sd.items()}}
    lightning["state_dict"]["loss_scale"] = torch.ones(1)  # a LightningModule's own (no dot: no attr)
    save_dcp(model, str(tmp_path / "lightning"), lightning,
             {"step": 1, "hf_config": config, "app": {"lightning": {"version": 1, "state": {}}}})
    for name in ("trainer", "lightning"):
        ok(cli("consolidate", str(tmp_path / name), str(tmp_path / f"{name}-hf"), "--dtype", "fp32"))
        ref = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / f"{name}-hf"))
        cfg = json.loads((tmp_path / f"{name}-hf" / "config.json").read_text())
        assert cfg["architectures"] == ["LlamaForCausalLM"]
        got = shardckpt.hf.from_pretrained(str(tmp_path / name))  # class and config recorded
        assert torch.equal(logits(got), logits(model)) and torch.equal(logits(ref), logits(model))
    # two attributes of the LightningModule hold tensors: the exact prefixes are named
    lightning["state_dict"]["ema.weight"] = lightning["state_dict"].pop("loss_scale")
    lightning["state_dict"]["ema.inner.bias"] = torch.zeros(2)
    save_dcp(model, str(tmp_path / "two"), lightning,
             {"step": 1, "app": {"lightning": {"version": 1, "state": {}}}})
    one_line_error(cli("consolidate", str(tmp_path / "two"), str(tmp_path / "two-hf")),
                   "--prefix state_dict.ema.", "--prefix state_dict.model.", code=2)
    ok(cli("consolidate", str(tmp_path / "two"), str(tmp_path / "two-hf"), "--prefix", "state_dict.model."))


def test_the_mistakes_a_new_user_makes(tmp_path: Path) -> None:
    """No recorded config: from_pretrained says to pass one, consolidate says how to add one; a
    checkpoint of another model is one error naming what differs; nothing is written."""
    import shardckpt.hf
    from shardckpt.errors import ConfigError

    model = hf_llama()
    save_dcp(model, str(tmp_path / "bare"), {"model": model.state_dict()}, {"step": 1})
    with pytest.raises(ConfigError, match="records no Hugging Face config; pass a config"):
        shardckpt.hf.from_pretrained(str(tmp_path / "bare"), transformers.LlamaForCausalLM)
    got = shardckpt.hf.from_pretrained(str(tmp_path / "bare"), model.config)  # names no class:
    assert type(got) is transformers.LlamaForCausalLM  # the causal LM of its model type
    assert torch.equal(logits(got), logits(model))
    r = ok(cli("consolidate", str(tmp_path / "bare"), str(tmp_path / "bare-hf")))
    assert "no config.json written" in r.stderr and "--copy-from" in r.stderr and "hf_config=" in r.stderr
    assert len([x for x in r.stderr.splitlines() if "config" in x]) == 1
    small = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=48,
                                     num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2)
    with pytest.raises(ConfigError, match=r"shapes differ: model.layers.0.mlp.gate_proj.weight "
                                          r"\[64, 32\] \(the model's: \[48, 32\]\).*; the model has no model.layers.1"):
        shardckpt.hf.load_into(transformers.LlamaForCausalLM(small), str(tmp_path / "bare"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bare", "bare-hf"]


def test_lightning_records_the_config_and_where_the_model_sits() -> None:
    """What a Lightning save records: the Hugging Face model found inside the LightningModule
    (its config, architectures from its class, its attribute path as the prefix), or the
    strategy's ``hf_config=``; the strategies take the keyword."""
    from shardckpt.integrations.lightning_hf import hf_extras

    wrapper = torch.nn.Module()
    wrapper.head = torch.nn.Linear(2, 2)
    wrapper.model = hf_llama()
    got = hf_extras(wrapper, None)
    assert got["hf_prefix"] == "state_dict.model."
    assert got["hf_config"]["architectures"] == ["LlamaForCausalLM"]
    assert hf_extras(torch.nn.Linear(2, 2), {"model_type": "mlp"}) == {"hf_config": {"model_type": "mlp"}}
    assert hf_extras(torch.nn.Linear(2, 2), None) == {}
    pytest.importorskip("lightning")
    from shardckpt.integrations.lightning import ShardckptModelParallelStrategy

    strategy = ShardckptModelParallelStrategy(hf_config={"model_type": "mlp"})
    assert strategy.hf_config == {"model_type": "mlp"}
