"""Where the model's tensors lie in a checkpoint of chunked tensors (a DCP state dict), so that
consolidate and :mod:`shardckpt.hf` give Hugging Face names without being told. Pure.

* ``extras.hf_prefix``, when the writer recorded it: ``ShardckptTrainer`` (``model.``, from
  ``get_state_dict``) and the Lightning strategies (``state_dict.`` and the attribute path of the
  Hugging Face model inside the ``LightningModule``, e.g. ``state_dict.model.``).
* A Lightning checkpoint (``extras.app.lightning``) without it: ``state_dict.`` followed by the
  one attribute every model tensor's name continues with (``state_dict.model.`` for a
  ``LightningModule`` holding ``self.model``); where they continue with several, the error lists
  the exact prefixes to choose from.
* Anything else: ``model.`` (``get_state_dict``'s ``{"model": ..., "optim": ...}``).
"""

from __future__ import annotations

from collections.abc import Iterable

from shardckpt.errors import ConfigError
from shardckpt.format.manifest import Manifest
from shardckpt.format.records import run_extras

__all__ = ["DEFAULT_PREFIX", "LIGHTNING_PREFIX", "model_prefix"]

DEFAULT_PREFIX = "model."
LIGHTNING_PREFIX = "state_dict."


def model_prefix(m: Manifest, source: str = "") -> str:
    """The prefix of the model's tensor names in ``m`` (see the module doc)."""
    extras = run_extras(m, source or "the manifest")
    if extras.hf_prefix is not None:
        return extras.hf_prefix
    if "lightning" not in (extras.app or {}):
        return DEFAULT_PREFIX
    names = list(m.chunked.tensors) if m.chunked is not None else []
    return lightning_prefix(names, source)


def lightning_prefix(names: Iterable[str], source: str = "") -> str:
    """``state_dict.<attr>.`` where every model tensor (``state_dict.*``) continues with one
    ``<attr>``; one :class:`ConfigError` naming the candidates where they do not."""
    heads = sorted({n[len(LIGHTNING_PREFIX):].split(".", 1)[0] for n in names
                    if n.startswith(LIGHTNING_PREFIX) and "." in n[len(LIGHTNING_PREFIX):]})
    if len(heads) == 1:
        return f"{LIGHTNING_PREFIX}{heads[0]}."
    where = source or "the checkpoint"
    if not heads:
        raise ConfigError(f"{where} is a Lightning checkpoint with no model tensor "
                          f"({LIGHTNING_PREFIX}<name>); nothing to consolidate")
    choices = ", ".join(f"--prefix {LIGHTNING_PREFIX}{h}." for h in heads[:5])
    raise ConfigError(f"{where} is a Lightning checkpoint whose model tensors lie under "
                      f"{len(heads)} attributes of the LightningModule; pass the one that holds "
                      f"the Hugging Face model: {choices} (or --prefix {LIGHTNING_PREFIX} for all)")
