"""A small Llama (RMSNorm, rotary attention with GQA, SwiGLU MLP, tied or untied head) for tests and demos.

Parameter names, shapes and math follow Hugging Face ``transformers``' ``LlamaForCausalLM``
(``model.embed_tokens.weight``, ``model.layers.{i}.self_attn.q_proj.weight``, ``model.norm.weight``;
``lm_head.weight`` is the embedding, tied): RMSNorm upcasts to fp32 and multiplies the weight after
casting back, rotary embeddings use the ``rotate_half`` convention with ``cos``/``sin`` of
``cat(freqs, freqs)``, attention is ``scaled_dot_product_attention`` with ``is_causal=True`` (GQA
through ``enable_gqa``), as transformers' default "sdpa" attention does without a padding mask.
Weights saved from this model load into ``LlamaForCausalLM`` with the dict of
:meth:`LlamaConfig.to_hf_config` and give the same logits.

Initialization happens in each module's ``reset_parameters`` (normal with ``initializer_range``
for linear and embedding weights, ones for norms), called once at construction, so a model built
on the meta device and initialized by :mod:`shardckpt.runtime.init` gets the same weights as an
eager one under the same seed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shardckpt.runtime.models.llama_config import LlamaConfig
from shardckpt.runtime.units import UnitPolicy, units_by_type

__all__ = ["LLAMA_POLICY", "LlamaConfig", "LlamaDecoderLayer", "LlamaForCausalLM", "LlamaModel",
           "causal_lm_loss"]


class LlamaLinear(nn.Linear):
    """``nn.Linear`` without bias, initialized normal(0, std)."""

    def __init__(self, in_features: int, out_features: int, std: float) -> None:
        self.std = std
        super().__init__(in_features, out_features, bias=False)

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=self.std)


class LlamaEmbedding(nn.Embedding):
    """``nn.Embedding`` initialized normal(0, std)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, std: float) -> None:
        self.std = std
        super().__init__(num_embeddings, embedding_dim)

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=self.std)


class LlamaRMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden_size))
        self.variance_epsilon = eps
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


class LlamaRotaryEmbedding(nn.Module):
    """cos/sin tables; ``inv_freq`` is a non-persistent buffer (recomputed, never saved)."""

    inv_freq: torch.Tensor

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.base, self.dim = config.rope_theta, config.head_dim
        self.attention_scaling = 1.0
        self.register_buffer("inv_freq", torch.empty(self.dim // 2), persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Recompute ``inv_freq`` (no randomness; meta initialization calls it)."""
        with torch.no_grad():
            inv = 1.0 / (self.base ** (torch.arange(0, self.dim, 2, dtype=torch.float) / self.dim))
            self.inv_freq.copy_(inv)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos() * self.attention_scaling
        sin = emb.sin() * self.attention_scaling
        return cos.to(dtype=x.dtype), sin.to(dtype=x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                         sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


class LlamaAttention(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        h, d, std = config.hidden_size, config.head_dim, config.initializer_range
        self.head_dim = d
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = d**-0.5
        self.q_proj = LlamaLinear(h, config.num_attention_heads * d, std)
        self.k_proj = LlamaLinear(h, config.num_key_value_heads * d, std)
        self.v_proj = LlamaLinear(h, config.num_key_value_heads * d, std)
        self.o_proj = LlamaLinear(config.num_attention_heads * d, h, std)

    def forward(self, hidden_states: torch.Tensor,
                position_embeddings: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        q = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        k = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        v = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        cos, sin = position_embeddings
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        q_len = q.shape[2]
        gqa = {"enable_gqa": True} if self.num_key_value_groups > 1 else {}
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=0.0,
                                             scale=self.scaling, is_causal=q_len > 1, **gqa)
        out = out.reshape(out.shape[0], -1, q_len, v.shape[-1]).transpose(1, 2).contiguous()
        out = out.reshape(*input_shape, -1).contiguous()
        return self.o_proj(out)


class LlamaMLP(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        h, i, std = config.hidden_size, config.intermediate_size, config.initializer_range
        self.gate_proj = LlamaLinear(h, i, std)
        self.up_proj = LlamaLinear(h, i, std)
        self.down_proj = LlamaLinear(i, h, std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    """One transformer block: the natural ZeRO-3 unit (:data:`LLAMA_POLICY`)."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, hidden_states: torch.Tensor,
                position_embeddings: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states = self.self_attn(hidden_states, position_embeddings=position_embeddings)
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states = self.mlp(hidden_states)
        return residual + hidden_states


class LlamaModel(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.embed_tokens = LlamaEmbedding(config.vocab_size, config.hidden_size,
                                           config.initializer_range)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config)
                                    for _ in range(config.num_hidden_layers))
        self.norm = LlamaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = LlamaRotaryEmbedding(config)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids)
        if position_ids is None:
            position_ids = torch.arange(hidden_states.shape[1], device=hidden_states.device)[None]
        position_embeddings = self.rotary_emb(hidden_states, position_ids)
        for layer in self.layers:
            hidden_states = layer(hidden_states, position_embeddings=position_embeddings)
        return self.norm(hidden_states)


class TiedLMHead(nn.Module):
    """The output projection; ``weight`` is the embedding's parameter (set by the owner)."""

    weight: torch.Tensor

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden_states, self.weight)


class LlamaForCausalLM(nn.Module):
    """``model`` (embedding, blocks, final norm) and ``lm_head``: tied to the embedding, or with
    its own weight when ``config.tie_word_embeddings`` is false (Llama 3, Mistral).

    ``forward(input_ids)`` returns logits ``[batch, seq, vocab]``; :func:`causal_lm_loss` turns
    them and the labels (the input ids) into the next-token loss.
    """

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head: nn.Module
        if config.tie_word_embeddings:
            self.lm_head = TiedLMHead()
            self.lm_head.weight = self.model.embed_tokens.weight
        else:
            self.lm_head = LlamaLinear(config.hidden_size, config.vocab_size,
                                       config.initializer_range)
        if config.dtype != torch.float32:  # parameters only: inv_freq stays fp32
            for p in self.parameters():
                p.data = p.data.to(config.dtype)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        return self.lm_head(self.model(input_ids, position_ids))


#: Unit policy "each LlamaDecoderLayer, then the root".
LLAMA_POLICY: UnitPolicy = units_by_type(LlamaDecoderLayer)


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Mean next-token cross-entropy in fp32 (labels shifted left by one, as transformers does)."""
    labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:].contiguous()
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1),
                           ignore_index=ignore_index)
