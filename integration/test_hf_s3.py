"""Hugging Face weights on S3 (moto on loopback): ``load_hf`` into a meta-built engine and
``import_hf`` from the bucket into the bucket, through ranged GETs only."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import dataclasses  # noqa: E402
import json  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

pytestmark = [pytest.mark.slow, pytest.mark.s3]


def test_load_and_import_from_s3(moto_server, s3_bucket, tmp_path: Path) -> None:  # noqa: ANN001
    from shardckpt.interop.hf.import_ import import_hf
    from shardckpt.runtime import ZeroEngine
    from shardckpt.training.hf_load import load_hf
    from shardckpt.runtime.models.llama import LLAMA_POLICY, LlamaConfig, LlamaForCausalLM
    from shardckpt.training.save_load import load

    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=80,
                                   tie_word_embeddings=False)
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
    hf.save_pretrained(tmp_path / "m", max_shard_size="20KB")
    bucket = s3_bucket(moto_server)
    fs = bucket.filesystem()
    for f in (tmp_path / "m").iterdir():
        fs.pipe_file(f"{bucket.name}/llama/{f.name}", f.read_bytes())
    ref = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "m", dtype=torch.float32).eval()
    ids = torch.randint(0, 80, (2, 7))

    def engine() -> ZeroEngine:
        ours = LlamaConfig.from_hf_config(json.loads((tmp_path / "m" / "config.json").read_text()))
        with torch.device("meta"):
            model = LlamaForCausalLM(dataclasses.replace(ours, torch_dtype="float32"))
        return ZeroEngine(model, policy=LLAMA_POLICY)

    e = engine()
    load_hf(e, f"{bucket.url}/llama", storage_options=bucket.storage_options)
    with torch.no_grad():
        assert torch.equal(e(ids), ref(ids).logits)
    import_hf(f"{bucket.url}/llama", f"{bucket.url}/ck", 2, storage_options=bucket.storage_options,
              dst_storage_options=bucket.storage_options)
    e2 = engine()
    load(e2, f"{bucket.url}/ck", storage_options=bucket.storage_options)
    with torch.no_grad():
        assert torch.equal(e2(ids), ref(ids).logits)
