"""Tiny models for the multi-process tests, with their batches and losses.

- ``Toy``: embedding, blocks, head; optional bf16 block and frozen parameters, one buffer.
- The tiny Llama (``TINY``, :func:`tiny_llama`) of the ZeRO-stage suites, with the hyper-parameters
  (``LR``, ``BETAS``, ``WD``, ``TINY_STEPS``) its engines and references share.
- ``LLAMA``: the small Llama of the parity and save/load suites.
"""

from __future__ import annotations

from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn



class ToyBlock(nn.Module):
    def __init__(self, d: int, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 2 * d, dtype=dtype)
        self.fc2 = nn.Linear(2 * d, d, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x).to(self.fc1.weight.dtype)
        return x + self.fc2(F.gelu(self.fc1(h))).to(x.dtype)


class Toy(nn.Module):
    """Embedding, blocks, head with bias; optional bf16 block and frozen ``blocks.0.fc1``.

    Has one persistent buffer (``scale``) so buffer handling is exercised.
    """

    def __init__(self, d: int = 16, n: int = 2, vocab: int = 48, bf16_block: int | None = None,
                 freeze: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(
            ToyBlock(d, torch.bfloat16 if i == bf16_block else torch.float32) for i in range(n))
        self.head = nn.Linear(d, vocab)
        self.register_buffer("scale", torch.tensor([1.0]))
        if freeze:
            self.blocks[0].fc1.requires_grad_(False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids) * self.scale
        for b in self.blocks:
            h = b(h)
        return self.head(h)


def toy_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def toy_batch(step: int, rank: int, vocab: int = 48, mb: int = 2, seq: int = 12) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, vocab, (mb, seq), generator=g)


def two_groups(named: Iterable[tuple[str, nn.Parameter]], wd: float) -> list[dict]:
    """Decay for matrices, none for norms and biases (the reference's own grouping)."""
    named = [(n, p) for n, p in named if p.requires_grad]
    return [{"params": [p for n, p in named if p.ndim >= 2 and "norm" not in n], "weight_decay": wd},
            {"params": [p for n, p in named if p.ndim < 2 or "norm" in n], "weight_decay": 0.0}]


#: The small Llama of the parity and save/load suites.
LLAMA = dict(vocab_size=512, hidden_size=32, intermediate_size=88, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2)

#: The tiny Llama of the ZeRO-stage suites, and the steps and AdamW hyper-parameters of its runs.
TINY = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=1)
TINY_STEPS = 3
LR, BETAS, WD = 1e-2, (0.9, 0.95), 0.1


def tiny_batch(step: int, micro: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(10_000 * step + 100 * micro + rank)
    return torch.randint(0, TINY["vocab_size"], (2, 8), generator=g)


def tiny_llama(seed: int = 0):
    from shardckpt.runtime.models.llama import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**TINY))


def tiny_loss(logits: torch.Tensor, tokens: torch.Tensor, micro: int) -> torch.Tensor:
    from shardckpt.runtime.models.llama import causal_lm_loss

    return causal_lm_loss(logits, tokens) / micro
