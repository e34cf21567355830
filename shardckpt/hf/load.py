"""Stream a shardckpt checkpoint into a ``transformers`` model or a state dict, without files.

The tensors, names and dtypes are those of :func:`shardckpt.tools.consolidate.consolidate`'s
plan (:func:`~shardckpt.tools.consolidate_plan.plan_consolidation`): parameters by FQN from the
``master`` state, floats cast to ``dtype`` by the same code (bf16 round-to-nearest-even), tied
aliases once, the model prefix of a DCP, Trainer or Lightning checkpoint found by itself. So a
model loaded here equals, bit for bit, ``from_pretrained`` of the folder ``consolidate`` writes
in that dtype. Memory: the model (or the state dict) and about ``buffer_bytes`` of reads; each
source piece is read once (checked) and copied into the slice of the tensor it fills.
"""

from __future__ import annotations

import logging
from typing import Any
from collections.abc import Iterable, Mapping

import numpy as np
import torch

from shardckpt.checkpoint.locate import locate_checkpoint
from shardckpt.checkpoint.pieces import cast_bytes
from shardckpt.checkpoint.reader import CheckpointReader
from shardckpt.errors import ConfigError
from shardckpt.format.dtypes import FLOATS, output_dtype
from shardckpt.format.records import run_extras
from shardckpt.storage import DEFAULT_BUFFER
from shardckpt.tools.consolidate import piece_reader
from shardckpt.tools.consolidate_plan import ConsolidationPlan, OutTensor, plan_consolidation

log = logging.getLogger(__name__)

__all__ = ["from_pretrained", "load_into", "open_plan", "state_dict"]

_NO_LIMIT = 1 << 62  # one output "file": the plan's tensors in order


def _dtype_name(dtype: Any) -> str | None:
    if dtype is None or dtype == "auto":
        return None
    if isinstance(dtype, torch.dtype):
        return output_dtype(str(dtype).removeprefix("torch."))
    return output_dtype(str(dtype))


def open_plan(url: str, dtype: Any = None, *, component: str = "model", prefix: str | None = None,
              storage_options: Mapping[str, Any] | None = None,
              keep_buffers: bool = True) -> tuple[CheckpointReader, ConsolidationPlan]:
    """The checkpoint ``url`` names (a run directory: its newest) and what it consolidates to:
    floats in ``dtype`` (None: as stored, fp32 for master weights)."""
    resolved = locate_checkpoint(str(url), dict(storage_options or {}))
    if resolved.note:
        log.info("%s", resolved.note)
    reader = CheckpointReader(resolved.storage)
    m = reader.manifest
    stored = _stored_float(m)
    plan = plan_consolidation(m, _dtype_name(dtype) or stored, _NO_LIMIT, component, False,
                              resolved.url, prefix, keep_buffers)
    return reader, plan


def _stored_float(m: Any) -> str:
    """The dtype of the checkpoint's floating weights (master: fp32), for ``dtype=None``."""
    if m.chunked is not None and not m.components:
        found = [t.dtype for t in m.chunked.tensors.values() if t.dtype in FLOATS]
    else:
        found = [k for c in m.components.values() for st in c.states.values()
                 for kind, k in st if kind == "master" and k in FLOATS]
    return found[0] if found else "float32"


def _tensors(plan: ConsolidationPlan) -> list[OutTensor]:
    return [t for f in plan.files for t in f.tensors]


def _fill(reader: CheckpointReader, items: list[tuple[OutTensor, torch.Tensor]],
          buffer_bytes: int) -> int:
    """Stream every ``(tensor, target)`` of ``items`` into its target; the bytes read."""
    engine = piece_reader(reader, buffer_bytes)
    pieces = engine.pieces([(t.numel, (t.source,)) for t, _ in items])
    try:
        for p in pieces:
            t, target = items[p.index]
            raw = cast_bytes(p.data[0], t.source.dtype, t.dtype)
            flat = target.view(-1)[p.start:p.end]
            if flat.dtype == _TORCH[t.dtype] and flat.is_contiguous():
                flat.view(torch.uint8).numpy()[:] = np.frombuffer(raw, np.uint8)
            else:  # the model keeps this tensor in another dtype (_keep_in_fp32_modules)
                flat.copy_(torch.frombuffer(bytearray(raw), dtype=_TORCH[t.dtype]))
    finally:
        pieces.close()
    return int(engine.bytes_read)


_TORCH = {name: getattr(torch, name) for name in ("float32", "float16", "bfloat16", "float64",
                                                   "int8", "int16", "int32", "int64", "uint8",
                                                   "bool", "float8_e4m3fn", "float8_e5m2")}


def state_dict(url: str, dtype: Any = None, *, component: str = "model", prefix: str | None = None,
               storage_options: Mapping[str, Any] | None = None, keep_buffers: bool = False,
               buffer_bytes: int = DEFAULT_BUFFER) -> dict[str, torch.Tensor]:
    """The model's tensors of checkpoint ``url`` by Hugging Face name (what the consolidated
    files hold: tied aliases once, persistent buffers only with ``keep_buffers``), in ``dtype``
    (None: as stored), on the CPU."""
    reader, plan = open_plan(url, dtype, component=component, prefix=prefix,
                             storage_options=storage_options, keep_buffers=keep_buffers)
    out = {t.name: torch.empty(t.shape, dtype=_TORCH[t.dtype]) for t in _tensors(plan)}
    _fill(reader, [(t, out[t.name]) for t in _tensors(plan)], buffer_bytes)
    return out


def load_into(model: Any, url: str, dtype: Any = None, *, component: str = "model",
              prefix: str | None = None, storage_options: Mapping[str, Any] | None = None,
              strict: bool = True, buffer_bytes: int = DEFAULT_BUFFER) -> Any:
    """Stream checkpoint ``url`` into ``model``'s own tensors (in place; ``dtype`` as in
    :func:`state_dict`, None: the model's). ``strict``: every parameter of the model is loaded
    and every one of the checkpoint has a place (one error naming them otherwise); buffers the
    model lacks are skipped. Returns ``model``."""
    if dtype is None:
        dtype = next(iter(model.parameters())).dtype
    reader, plan = open_plan(url, dtype, component=component, prefix=prefix,
                             storage_options=storage_options, keep_buffers=True)
    targets = model.state_dict(keep_vars=True)
    buffers = {n for n, _ in model.named_buffers()}
    items, unexpected, wrong = [], [], []
    for t in _tensors(plan):
        target = targets.get(t.name)
        if target is None:
            if t.source.kind != "buffer":
                unexpected.append(t.name)
            continue
        if tuple(target.shape) != tuple(t.shape):
            wrong.append(f"{t.name} {list(t.shape)} (the model's: {list(target.shape)})")
            continue
        items.append((t, target.data))
    loaded = {t.name for t, _ in items}
    held = {x.data_ptr() for _, x in items}
    # a tied alias the checkpoint stores once: filled from its canonical tensor unless tied here
    aliases = {a: c for a, c in plan.omitted_aliases.items() if a in targets and c in loaded}
    missing = [n for n, x in targets.items() if n not in loaded and n not in buffers
               and n not in aliases and x.data_ptr() not in held]
    _refuse(plan.source, strict, missing, unexpected, wrong)
    with torch.no_grad():
        read = _fill(reader, items, buffer_bytes)
        for alias, canonical in aliases.items():
            if targets[alias].data_ptr() != targets[canonical].data_ptr():
                targets[alias].data.copy_(targets[canonical].data)
    log.info("loaded %d tensors from %s (%d bytes read)", len(items), plan.source, read)
    return model


def _refuse(source: str, strict: bool, missing: Iterable[str], unexpected: Iterable[str],
            wrong: Iterable[str]) -> None:
    def listed(names: list[str]) -> str:
        return ", ".join(names[:5]) + (f" (and {len(names) - 5} more)" if len(names) > 5 else "")

    problems = [f"shapes differ: {listed(list(wrong))}"] if wrong else []
    if strict and missing:
        problems.append(f"the checkpoint has no {listed(sorted(missing))}")
    if strict and unexpected:
        problems.append(f"the model has no {listed(sorted(unexpected))}")
    if problems:
        raise ConfigError(f"{source}: {'; '.join(problems)}; it was saved from another model "
                          "(strict=False loads what matches; prefix= chooses where the model's "
                          "tensors start)")


def from_pretrained(url: str, model_cls_or_config: Any = None, dtype: Any = None, *,
                    component: str = "model", prefix: str | None = None,
                    storage_options: Mapping[str, Any] | None = None, strict: bool = True,
                    buffer_bytes: int = DEFAULT_BUFFER) -> Any:
    """A ``transformers`` model with the weights of checkpoint ``url``, streamed (no files).

    ``model_cls_or_config``: a model class (its config from the checkpoint's recorded
    ``hf_config``), a config (its ``architectures`` name the class, else the checkpoint's), or
    None (both from the checkpoint). ``dtype``: the model's, as in ``from_pretrained`` (None or
    ``"auto"``: as stored, fp32 for master weights). The model is in eval mode, as
    ``from_pretrained`` returns it."""
    import transformers

    reader, plan = open_plan(url, None, component=component, prefix=prefix,
                             storage_options=storage_options)
    recorded = run_extras(reader.manifest, plan.source).hf_config
    cls, config = _class_and_config(transformers, model_cls_or_config, recorded, plan.source)
    name = _dtype_name(dtype) or plan.dtype
    from transformers.initialization import no_init_weights

    with no_init_weights():  # every weight is overwritten below
        try:
            build = getattr(cls, "_from_config", None) or cls.from_config  # a class, or an Auto class
            model = build(config, dtype=_TORCH[name])
        except ValueError as e:  # AutoModelForCausalLM: a config of no causal LM
            raise ConfigError(f"{plan.source}: {e}; pass the model class, e.g. "
                              "shardckpt.hf.from_pretrained(url, LlamaForCausalLM)") from e
    model.tie_weights()
    load_into(model, url, name, component=component, prefix=prefix,
              storage_options=storage_options, strict=strict, buffer_bytes=buffer_bytes)
    return model.eval()


def _class_and_config(transformers: Any, given: Any, recorded: Mapping[str, Any] | None,
                      source: str) -> tuple[Any, Any]:
    if isinstance(given, type):
        cls: Any = given
        if recorded is None:
            raise ConfigError(f"{source} records no Hugging Face config; pass a config "
                              f"({given.__name__}.config_class(...)) instead of the class")
        return cls, cls.config_class.from_dict(dict(recorded))
    config = given
    if config is None:
        if recorded is None:
            raise ConfigError(f"{source} records no Hugging Face config; pass the model's config "
                              "(save with hf_config= to record one)")
        config = transformers.AutoConfig.for_model(**dict(recorded))
    names = list(getattr(config, "architectures", None) or (recorded or {}).get("architectures") or [])
    if not names:  # no class named anywhere: the causal LM of the config's model type
        return transformers.AutoModelForCausalLM, config
    cls = getattr(transformers, names[0], None)
    if cls is None:
        raise ConfigError(f"{source}: architectures {names} names no transformers class; pass "
                          "the class, e.g. shardckpt.hf.from_pretrained(url, LlamaForCausalLM)")
    return cls, config
