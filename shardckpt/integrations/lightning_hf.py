"""The Lightning strategies' Hugging Face record and load targets (apart from
:mod:`~shardckpt.integrations.lightning`, which stays under its size).

* :func:`hf_extras`: what a save records so that ``consolidate`` and :mod:`shardckpt.hf` need
  no flags: ``hf_config`` (``hf_config=`` of the strategy, else the config of the outermost
  Hugging Face model inside the ``LightningModule``; ``architectures`` from its class) and
  ``hf_prefix`` (``state_dict.`` and that model's attribute path, e.g. ``state_dict.model.``).
* :func:`load_targets`: what DCP loads into on a resume.
"""

from __future__ import annotations

from typing import Any
from collections.abc import Mapping

import torch

from shardckpt.errors import ConfigError, ManifestError
from shardckpt.training.hf_record import find_hf_model, hf_config_dict

__all__ = ["APP_KEY", "hf_extras", "load_targets"]

#: ``extras["app"]`` key of Lightning's state.
APP_KEY = "lightning"


def hf_extras(module: Any, given: Any) -> dict[str, Any]:
    """``hf_config`` and ``hf_prefix`` of a save of ``module`` (a LightningModule), as far as
    they are known (see the module doc)."""
    found = find_hf_model(module) if module is not None else None
    config = given if given is not None else (found[1].config if found else None)
    out: dict[str, Any] = {}
    if config is not None:
        out["hf_config"] = hf_config_dict(config, "hf_config", found[1] if found else None)
    if found is not None:
        out["hf_prefix"] = f"state_dict.{found[0]}." if found[0] else "state_dict."
    return out


def load_targets(url: str, saved: list[str], targets: Mapping[str, torch.Tensor],
                  shapes: Mapping[str, tuple[str, tuple[int, ...]]], strict: bool,
                  optimizers: bool) -> dict[str, torch.Tensor]:
    """What DCP loads into, by name: the live model's and optimizers' tensors (``targets``) for
    theirs, a new whole tensor for a callback's; a model tensor the model lacks is left out
    unless ``strict``. Raises :class:`ConfigError` for state the checkpoint or the job lacks."""
    def listed(names: list[str]) -> str:
        return ", ".join(names[:5]) + (f" (and {len(names) - 5} more)" if len(names) > 5 else "")

    missing = sorted(n for n in set(targets) - set(saved) if strict or not n.startswith("state_dict."))
    if missing:
        raise ConfigError(f"{url}: the checkpoint has no {listed(missing)}; it was saved from "
                          "another model or optimizer")
    into: dict[str, torch.Tensor] = {}
    extra: list[str] = []
    for name in saved:
        if name in targets:
            into[name] = targets[name]
        elif name.startswith("state_dict."):
            if strict:
                extra.append(name)
        elif name.startswith("optimizer_states."):
            if optimizers:
                extra.append(name)
        elif name in shapes:  # a callback's tensor: whole, on every rank
            dtype, shape = shapes[name]
            into[name] = torch.empty(shape, dtype=getattr(torch, dtype))
        else:
            raise ManifestError(f"{url}: extras.app.{APP_KEY} names tensor {name!r}, which the "
                                "checkpoint does not hold")
    if extra:
        raise ConfigError(f"{url}: the model or optimizer has no {listed(extra)}; it was saved from "
                          "another model or optimizer (strict_loading=False loads a model's rest)")
    return into
