"""A consolidated synthetic checkpoint of a tiny Llama loads in ``transformers`` as it is.

The checkpoint is written with the exact parameter names and shapes of ``LlamaForCausalLM`` for a
tiny ``LlamaConfig`` (tied embeddings: ``lm_head.weight`` is an alias), with synthetic values, on 3
shards, and the model's config in the manifest (``extras["hf_config"]``). After ``consolidate``
(which writes ``config.json`` from it), ``from_pretrained`` of the folder alone must report no
missing, unexpected or mismatched keys, and every weight must equal the synthetic fp32 values.
No network: the hub is switched off before transformers is imported.
"""

from __future__ import annotations

import json
import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from shardckpt.tools import synth  # noqa: E402
from shardckpt.checkpoint.reader import as_storage
from shardckpt.checkpoint.writer import CheckpointSpec, CheckpointWriter  # noqa: E402
from shardckpt.tools.consolidate import consolidate  # noqa: E402
from shardckpt.format.layout import Mesh, ParamInfo, build_layout  # noqa: E402
from shardckpt.format.manifest import Component, default_states  # noqa: E402

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

SEED = 11


def tiny_config():  # noqa: ANN201
    return transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=256, max_position_embeddings=128,
        tie_word_embeddings=True)


def write_llama_checkpoint(dst: str, config, ranks: int = 3,  # noqa: ANN001
                           with_config: bool = False) -> dict[str, tuple[int, ...]]:
    """Write a shardckpt checkpoint with the parameters of ``LlamaForCausalLM(config)``.

    Names and shapes come from the module (built on the meta device), so the test follows
    transformers; unit policy: one unit per decoder layer, the rest in the root unit.
    """
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}  # tied params appear once
    assert "lm_head.weight" not in shapes
    infos = [ParamInfo(n, s, "float32", True, ".".join(n.split(".")[:3]) if ".layers." in n else "")
             for n, s in shapes.items()]
    mesh = Mesh.for_world(ranks)
    layout = build_layout(infos, mesh, prefix="model.")
    states = {g.name: default_states(g, synth.ADAMW_KINDS) for g in layout.groups}
    comp = Component("model", layout, states, {"lm_head.weight": "model.embed_tokens.weight"})
    extras = {"step": 1, **({"hf_config": json.loads(config.to_json_string())} if with_config else {})}
    writer = CheckpointWriter(as_storage(dst), CheckpointSpec(mesh, {"model": comp}, extras=extras))
    entries = [writer.write_shard(s, synth.shard_producer(layout, SEED, s)) for s in range(ranks)]
    writer.commit(entries)
    return shapes


def test_from_pretrained_loads_consolidated_llama(tmp_path: Path) -> None:
    config = tiny_config()
    src, dst = str(tmp_path / "ckpt"), tmp_path / "hf"
    shapes = write_llama_checkpoint(src, config, with_config=True)
    consolidate(src, str(dst), dtype="fp32", max_shard_size=100_000)  # several files + index
    assert json.loads((dst / "config.json").read_text())["torch_dtype"] == "float32"
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        str(dst), output_loading_info=True, local_files_only=True)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert not info.get("mismatched_keys"), info
    state = model.state_dict()
    for name, shape in shapes.items():
        want = synth.values(SEED, name, "master", 0, int(np.prod(shape))).reshape(shape)
        got = state[name]
        assert got.dtype == torch.float32 and tuple(got.shape) == shape
        np.testing.assert_array_equal(got.numpy(), want, err_msg=name)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    with torch.no_grad():
        logits = model(torch.tensor([[1, 2, 3]])).logits
    assert logits.shape == (1, 3, 256) and torch.isfinite(logits).all()


def test_from_pretrained_loads_bf16(tmp_path: Path) -> None:
    config = tiny_config()
    src, dst = str(tmp_path / "ckpt"), tmp_path / "hf"
    shapes = write_llama_checkpoint(src, config, ranks=4)
    consolidate(src, str(dst))  # bf16, a single file + index
    config.save_pretrained(str(dst))
    model, info = transformers.LlamaForCausalLM.from_pretrained(
        str(dst), dtype=torch.bfloat16, output_loading_info=True, local_files_only=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    name = "model.layers.1.mlp.down_proj.weight"
    want = torch.from_numpy(synth.values(SEED, name, "master", 0, int(np.prod(shapes[name])))).to(torch.bfloat16)
    assert torch.equal(model.state_dict()[name].view(torch.int16).flatten(), want.view(torch.int16))
