"""The Hugging Face config a run records in ``extras["hf_config"]``, with ``architectures`` filled
in from the model class the run trains (as ``save_pretrained`` does), so that a consolidated
``config.json`` names the class ``transformers`` builds; and where, inside a wrapper (a
``LightningModule``), the Hugging Face model sits.
"""

from __future__ import annotations

import json
import logging
from typing import Any
from collections.abc import Mapping

from shardckpt.errors import ConfigError

log = logging.getLogger(__name__)

__all__ = ["architectures_of", "default_hf_config", "find_hf_model", "hf_config_dict"]


def architectures_of(model: Any) -> list[str] | None:
    """``[name]`` of ``model``'s class, past the classes torch wraps it in (FSDP2's
    ``FSDP<Class>``, DDP, ``torch.compile``); None for a plain ``torch.nn`` module."""
    inner = getattr(model, "module", None) if type(model).__name__ == "DistributedDataParallel" else None
    inner = inner or getattr(model, "_orig_mod", None) or model
    for cls in type(inner).__mro__:
        if not cls.__module__.startswith(("torch.", "builtins")):
            return [cls.__name__]
    return None


def hf_config_dict(config: Any, what: str = "hf_config", model: Any = None) -> dict[str, Any]:
    """A Hugging Face ``config.json`` dict from a dict, a ``transformers`` config (``to_dict()``)
    or the built-in Llama's config (``to_hf_config()``); JSON-checked. With ``model``, an absent
    or empty ``architectures`` is that model's class."""
    if isinstance(config, Mapping):
        out = dict(config)
    elif callable(getattr(config, "to_hf_config", None)):
        out = dict(config.to_hf_config())
    elif callable(getattr(config, "to_dict", None)):
        out = dict(config.to_dict())
    else:
        raise ConfigError(f"{what} is a {type(config).__name__}; pass a dict or an object with "
                          "to_dict() (a transformers config)")

    def dtype_name(o: Any) -> str:
        if type(o).__name__ == "dtype":  # torch.float32 in older transformers' to_dict()
            return str(o).removeprefix("torch.")
        raise TypeError(f"{type(o).__name__} is not JSON-serializable")

    try:
        out = json.loads(json.dumps(out, default=dtype_name, allow_nan=False))
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{what} is not JSON-serializable: {e}") from e
    if "model_type" not in out:
        raise ConfigError(f"{what} has no 'model_type'; transformers cannot load a config.json "
                          "without it")
    if model is not None and not out.get("architectures"):
        names = architectures_of(model)
        if names:
            out["architectures"] = names
    return out


def default_hf_config(engine: Any) -> dict[str, Any] | None:
    """The wrapped module's own Hugging Face config, if it has one (else None)."""
    module = getattr(engine, "module", None)
    config = getattr(module, "config", None)
    if config is None or not (callable(getattr(config, "to_hf_config", None))
                              or hasattr(config, "model_type")):
        return None
    try:
        return hf_config_dict(config, f"{type(module).__name__}.config", module)
    except ConfigError as e:
        log.info("not recording a Hugging Face config: %s", e)
        return None


def find_hf_model(root: Any) -> tuple[str, Any] | None:
    """(attribute path, module) of the outermost module below ``root`` (``root`` itself
    included, path ``""``) that carries a Hugging Face config; None if none does."""
    for name, module in root.named_modules():
        config = getattr(module, "config", None)
        if config is not None and isinstance(getattr(config, "model_type", None), str) \
                and callable(getattr(config, "to_dict", None)):
            return name, module
    return None
