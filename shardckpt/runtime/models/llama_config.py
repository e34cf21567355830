"""The shape of the package's small Llama and its Hugging Face ``config.json``; no torch import.

Kept apart from :mod:`shardckpt.runtime.models.llama` so that offline tools (which do not import torch)
can write or read the ``config.json`` of a consolidated checkpoint.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any
from collections.abc import Mapping

from shardckpt.errors import ConfigError

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True, slots=True, kw_only=True)
class LlamaConfig:
    """Shape of the model. Defaults: ~0.16M parameters, the root unit (embedding) the largest."""

    vocab_size: int = 1024
    hidden_size: int = 64
    intermediate_size: int = 176
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 256
    initializer_range: float = 0.02
    torch_dtype: str = "float32"
    #: ``lm_head.weight`` is the embedding (one parameter); ``False`` gives the head its own
    #: weight, as Llama 3 and Mistral have.
    tie_word_embeddings: bool = True

    def __post_init__(self) -> None:
        bad = [f"{k}={v}" for k, v in asdict(self).items()
               if isinstance(v, int) and not isinstance(v, bool) and v < 1]
        if bad:
            raise ConfigError(f"LlamaConfig sizes must be >= 1: {', '.join(bad)}")
        if self.hidden_size % self.num_attention_heads:
            raise ConfigError(f"hidden_size {self.hidden_size} is not divisible by "
                              f"num_attention_heads {self.num_attention_heads}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(f"num_attention_heads {self.num_attention_heads} is not divisible "
                              f"by num_key_value_heads {self.num_key_value_heads}")
        if self.head_dim % 2:
            raise ConfigError(f"head_dim {self.head_dim} must be even for rotary embeddings")
        if self.torch_dtype not in ("float32", "bfloat16", "float16"):
            raise ConfigError(f"torch_dtype {self.torch_dtype!r}: use float32, bfloat16 or float16")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def dtype(self) -> torch.dtype:
        import torch

        return getattr(torch, self.torch_dtype)

    def num_params(self) -> int:
        """Distinct parameters (a tied head counted once)."""
        h, kv = self.hidden_size, self.num_key_value_heads * self.head_dim
        layer = 2 * h * h + 2 * h * kv + 3 * h * self.intermediate_size + 2 * h
        head = 0 if self.tie_word_embeddings else self.vocab_size * h
        return self.vocab_size * h + self.num_hidden_layers * layer + h + head

    def to_hf_config(self) -> dict[str, Any]:
        """The ``config.json`` dict with which ``transformers`` loads this model as LlamaForCausalLM."""
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": None,
            "max_position_embeddings": self.max_position_embeddings,
            "initializer_range": self.initializer_range,
            "attention_bias": False,
            "attention_dropout": 0.0,
            "mlp_bias": False,
            "tie_word_embeddings": self.tie_word_embeddings,
            "torch_dtype": self.torch_dtype,
            "use_cache": True,
        }

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any]) -> LlamaConfig:
        """Read a ``config.json`` dict as ``transformers`` writes it (tied or untied Llama).

        Refuses, all at once, what this model cannot compute the same way: another model type,
        an activation other than SiLU, biases, a ``head_dim`` other than hidden / heads, or rope
        scaling.
        """
        if config.get("model_type") != "llama":
            raise ConfigError(f"config.json has model_type {config.get('model_type')!r}, not 'llama'")
        rope = config.get("rope_parameters") or {}
        scaling = config.get("rope_scaling") or {}
        bad = []
        if config.get("hidden_act", "silu") != "silu":
            bad.append(f"hidden_act {config['hidden_act']!r} (only 'silu')")
        bad += [f"{k} true" for k in ("attention_bias", "mlp_bias") if config.get(k)]
        kinds = {r.get("rope_type", r.get("type", "default")) for r in (rope, scaling) if r}
        if kinds - {"default"}:
            bad.append(f"rope scaling {sorted(kinds - {'default'})} (only the default)")
        names = [f for f in cls.__dataclass_fields__ if f != "rope_theta"]
        kwargs = {k: config[k] for k in names if k in config and config[k] is not None}
        kwargs["rope_theta"] = float(config.get("rope_theta", rope.get("rope_theta", 10000.0)))
        kwargs.setdefault("torch_dtype", config.get("dtype") or "float32")
        kwargs["tie_word_embeddings"] = bool(config.get("tie_word_embeddings", False))
        out = cls(**kwargs)
        head_dim = config.get("head_dim")
        if head_dim is not None and head_dim != out.head_dim:
            bad.append(f"head_dim {head_dim} (this model uses hidden_size / num_attention_heads "
                       f"= {out.head_dim})")
        if bad:
            raise ConfigError(f"config.json describes a Llama this model cannot be: {'; '.join(bad)}")
        return out
