"""Hugging Face models straight from shardckpt checkpoints, without writing files::

    import shardckpt.hf

    model = shardckpt.hf.from_pretrained("s3://bucket/run/checkpoint-800", LlamaForCausalLM,
                                         dtype="bfloat16", storage_options={...})
    sd = shardckpt.hf.state_dict("runs/llama/step-00000800")

Any shardckpt checkpoint (flat groups of the ZeRO engine, chunked tensors of DCP, Trainer and
Lightning runs; a run directory means the checkpoint its ``latest`` names) is consolidated as
``shardckpt consolidate`` would, streamed into the model's own tensors: each tensor is read once,
through checked ranged reads, into its place. See :mod:`shardckpt.hf.load`.
"""

from __future__ import annotations

from shardckpt.hf.load import from_pretrained, load_into, state_dict

__all__ = ["from_pretrained", "load_into", "state_dict"]
