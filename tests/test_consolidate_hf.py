"""A consolidated checkpoint is a Hugging Face model folder: ``config.json`` from the manifest's
``hf_config`` (dtype set to the output's), tokenizer and generation files copied on request,
``AutoModelForCausalLM.from_pretrained(path)`` giving the sharded model's logits; other files
in the destination do not need ``--overwrite``; free space is checked before anything is written."""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

import json  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import pytest  # noqa: E402

from testing.ckpts import make_ckpt  # noqa: E402
from testing.cli import cli, ok, one_line_error  # noqa: E402
from shardckpt.interop.hf.files import COPY_ALLOWED  # noqa: E402

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.usefixtures("one_thread")


def save_llama(dst: str) -> tuple[Any, Any]:
    """The package's Llama, trained one step with ZeRO on one process, saved with its config."""
    from shardckpt.runtime import ShardedAdamW, ZeroEngine, decay_param_groups
    from shardckpt.runtime.models.llama import LLAMA_POLICY, LlamaConfig, LlamaForCausalLM, causal_lm_loss
    from shardckpt.runtime.mesh import ProcessMesh
    from shardckpt.training.save_load import save

    cfg = LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2)
    torch.manual_seed(0)
    engine = ZeroEngine(LlamaForCausalLM(cfg), policy=LLAMA_POLICY, process_mesh=ProcessMesh.single(),
                        deterministic=True)
    opt = ShardedAdamW(engine, decay_param_groups(engine, 0.1), lr=1e-2)
    tokens = torch.randint(0, cfg.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))
    causal_lm_loss(engine(tokens), tokens).backward()
    opt.step()
    opt.zero_grad()
    save(engine, dst, extras={"step": 1, "hf_config": cfg.to_hf_config()})
    return engine, cfg


def test_from_pretrained_with_only_the_path(tmp_path: Path) -> None:
    src, out = str(tmp_path / "ck"), tmp_path / "hf"
    engine, cfg = save_llama(src)
    ok(cli("consolidate", src, str(out), "--dtype", "fp32", "--max-shard-size", "20KB"))
    config = json.loads((out / "config.json").read_text())
    assert config["torch_dtype"] == config["dtype"] == "float32"
    assert config["architectures"] == ["LlamaForCausalLM"] and config["vocab_size"] == 256
    model = transformers.AutoModelForCausalLM.from_pretrained(str(out))
    assert type(model).__name__ == "LlamaForCausalLM" and model.dtype == torch.float32
    tokens = torch.randint(0, cfg.vocab_size, (2, 11), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = engine(tokens)
        got = model(tokens).logits
    assert torch.equal(got, want)
    ok(cli("consolidate", src, str(tmp_path / "bf16")))  # the default dtype is recorded too
    config = json.loads((tmp_path / "bf16" / "config.json").read_text())
    assert config["torch_dtype"] == config["dtype"] == "bfloat16"


def model_folder(root: Path) -> Path:
    """A Hugging Face model folder: tokenizer, generation settings, config, weights, a README."""
    folder = root / "upstream"
    folder.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                 "generation_config.json", "merges.txt", "vocab.json"):
        (folder / name).write_text(json.dumps({"from": name}))
    (folder / "config.json").write_text(json.dumps({"model_type": "upstream"}))
    for name in ("model.safetensors", "pytorch_model.bin", "README.md", "modeling_evil.py"):
        (folder / name).write_bytes(b"not to be copied")
    return folder


def test_copy_from_takes_tokenizer_and_generation_files_only(tmp_path: Path) -> None:
    folder = model_folder(tmp_path)
    src, out = str(tmp_path / "ck"), tmp_path / "hf"
    save_llama(src)
    ok(cli("consolidate", src, str(out), "--copy-from", str(folder)))
    names = set(os.listdir(out))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                 "generation_config.json", "merges.txt", "vocab.json"):
        assert (out / name).read_bytes() == (folder / name).read_bytes(), name
    assert not names & {"model.safetensors", "pytorch_model.bin", "README.md", "modeling_evil.py"}
    assert json.loads((out / "config.json").read_text())["model_type"] == "llama"  # the checkpoint's
    # a checkpoint without a config: the folder's config.json is copied
    plain, _ = make_ckpt(tmp_path, "plain")
    ok(cli("consolidate", plain, str(tmp_path / "hf2"), "--copy-from", str(folder)))
    assert json.loads((tmp_path / "hf2" / "config.json").read_text()) == {"model_type": "upstream"}
    assert "config.json" not in COPY_ALLOWED
    one_line_error(cli("consolidate", plain, str(tmp_path / "hf3"), "--copy-from", str(tmp_path / "none")),
                   "no such model folder", code=2)
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "README.md").write_text("hi")
    one_line_error(cli("consolidate", plain, str(tmp_path / "hf3"), "--copy-from", str(tmp_path / "empty")),
                   "holds none of the files", "tokenizer.json", code=2)
    assert not (tmp_path / "hf3").exists()


def test_other_files_in_the_destination_need_no_overwrite(tmp_path: Path) -> None:
    src, _ = make_ckpt(tmp_path)
    out = tmp_path / "hf"
    out.mkdir()
    (out / "README.md").write_text("model card")
    (out / "tokenizer.json").write_text("{}")
    ok(cli("consolidate", src, str(out)))
    assert (out / "README.md").read_text() == "model card" and (out / "tokenizer.json").read_text() == "{}"
    assert (out / "model.safetensors.index.json").exists()
    one_line_error(cli("consolidate", src, str(out)), "already holds weights", "--overwrite", code=2)
    other = tmp_path / "other"
    other.mkdir()
    (other / "pytorch_model.bin").write_bytes(b"weights")
    one_line_error(cli("consolidate", src, str(other)), "pytorch_model.bin", "--overwrite", code=2)


def test_free_space_is_checked_first(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src, _ = make_ckpt(tmp_path)
    real = os.statvfs

    class Full:
        f_bavail, f_frsize = 1, 4096

    monkeypatch.setattr(os, "statvfs", lambda p: Full())
    out = tmp_path / "hf"
    one_line_error(cli("consolidate", src, str(out)), str(out), "needs", "nothing was written")
    assert not out.exists() or os.listdir(out) == []
    monkeypatch.setattr(os, "statvfs", real)
    ok(cli("consolidate", src, str(out)))


def test_buffer_is_a_size_in_bytes_as_in_reshard(tmp_path: Path) -> None:
    src, _ = make_ckpt(tmp_path)
    ok(cli("consolidate", src, str(tmp_path / "a"), "--buffer", "64B", "--dtype", "fp32"))
    ok(cli("consolidate", src, str(tmp_path / "b"), "--buffer", "1GiB", "--dtype", "fp32"))
    for n in json.loads((tmp_path / "a" / "model.safetensors.index.json").read_text())["weight_map"].values():
        assert (tmp_path / "a" / n).read_bytes() == (tmp_path / "b" / n).read_bytes()
    a = one_line_error(cli("consolidate", src, str(tmp_path / "c"), "--buffer", "lots"), code=2)
    b = one_line_error(cli("reshard", src, str(tmp_path / "c"), "--to", "1", "--buffer", "lots"), code=2)
    assert a == b == "error: --buffer lots: expected a size in bytes such as 65536, 64KiB, 32MB or 1GiB"


def test_persistent_buffers_are_left_out_unless_kept(tmp_path: Path) -> None:
    """A training model that keeps buffers the Hugging Face class lacks (a step counter) or
    recomputes (rotary ``inv_freq``, made persistent here): by default they are left out, so
    ``from_pretrained`` reports nothing UNEXPECTED and gives the same logits; --keep-buffers
    writes them, for classes that keep theirs."""
    from shardckpt.runtime import ZeroEngine
    from shardckpt.runtime.models.llama import LLAMA_POLICY, LlamaConfig, LlamaForCausalLM
    from shardckpt.runtime.mesh import ProcessMesh
    from shardckpt.training.save_load import save

    cfg = LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    rotary = model.model.rotary_emb
    inv_freq = rotary._buffers.pop("inv_freq")
    rotary.register_buffer("inv_freq", inv_freq, persistent=True)
    model.register_buffer("step_count", torch.zeros(1), persistent=True)
    engine = ZeroEngine(model, policy=LLAMA_POLICY, process_mesh=ProcessMesh.single(), deterministic=True)
    src = str(tmp_path / "ck")
    save(engine, src, extras={"step": 1, "hf_config": cfg.to_hf_config()})
    r = ok(cli("consolidate", src, str(tmp_path / "hf"), "--dtype", "fp32"))
    assert r.stderr == ("note: 2 persistent buffer(s) left out (step_count, "
                        "model.rotary_emb.inv_freq); --keep-buffers writes them\n")
    loaded, info = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"),
                                                                     output_loading_info=True)
    assert (info["unexpected_keys"], info["missing_keys"]) == (set(), set())
    tokens = torch.randint(0, cfg.vocab_size, (2, 7), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(loaded(tokens).logits, engine(tokens))
    ok(cli("consolidate", src, str(tmp_path / "kept"), "--dtype", "fp32", "--keep-buffers"))
    index = json.loads((tmp_path / "kept" / "model.safetensors.index.json").read_text())
    assert {"step_count", "model.rotary_emb.inv_freq"} <= set(index["weight_map"])
    _, info = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "kept"),
                                                                output_loading_info=True)
    assert info["unexpected_keys"] == {"step_count"}  # what the default spares a user
