"""A DCP checkpoint of chunked tensors read as a model and its optimizer (:func:`read_model`): what
``import dcp --ranks``, ``reshard --format flat`` and the chunked load into ``ZeroEngine`` build
their flat groups from (:mod:`shardckpt.interop.dcp.to_flat`).

Which tensor is what: ``<model_key>.<fqn>`` is a trained parameter when
``<optim_key>.state.<fqn>.exp_avg`` and ``exp_avg_sq`` exist (Adam's state; SGD's:
``momentum_buffer``); a tensor without that
state that equals a trained parameter of its shape bit for bit is that parameter, tied (saved
under both names); a tensor without state that a param group lists (an optimizer built over all
parameters never gives a ``requires_grad=False`` one state) or whose name matches a ``frozen``
pattern is a frozen parameter, stored in its own dtype; any other is a persistent buffer. A DCP
state dict cannot tell a frozen parameter the optimizer does not list from a buffer: name it.
Param groups are read from ``<optim_key>.param_groups.<i>.{params, lr, ...}``
(``get_state_dict``) or from the per-parameter
``<optim_key>.param_groups.<fqn>.<name>`` of ``flatten_optimizer_state_dict`` (torchtitan); these
values are DCP blobs, decoded only with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import io
import math
import re
import warnings
from dataclasses import dataclass
from typing import Any
from collections.abc import Callable, Collection, Sequence

from shardckpt.checkpoint.chunked_read import iter_elements, read_blob
from shardckpt.checkpoint.reader import CheckpointReader
from shardckpt.errors import ConfigError, IntegrityError
from shardckpt.format.chunked import ChunkedSection, ChunkedTensor
from shardckpt.format.dtypes import FLOATS
from shardckpt.format.manifest import OptimizerInfo
from shardckpt.format.records import ParamGroupRecord, run_extras
from shardckpt.interop.dcp.config import DcpOrigin
from shardckpt.interop.importing import ADAM_HPARAMS

__all__ = ["DcpModel", "read_model", "as_tensor"]

MOMENTS = ("exp_avg", "exp_avg_sq")
#: SGD (with momentum): its per-element state and the hyper-parameters an import keeps.
SGD_KINDS = ("momentum_buffer",)
SGD_HPARAMS = ("lr", "momentum", "dampening", "weight_decay", "nesterov", "maximize")
#: Top-level keys of torchtitan's checkpoint that are not the model.
APP_KEYS = ("lr_scheduler", "dataloader", "train_state")


@dataclass
class DcpModel:
    """Which chunked tensors are parameters, their optimizer state, and buffers."""

    params: dict[str, ChunkedTensor]                 # fqn -> weights, state-dict order
    moments: dict[str, dict[str, ChunkedTensor]]     # fqn -> kind -> tensor
    frozen: dict[str, ChunkedTensor]                 # fqn -> weights of a frozen parameter
    buffers: dict[str, ChunkedTensor]
    aliases: dict[str, str]                          # tied: alias fqn -> parameter fqn
    optimizer: OptimizerInfo
    step: int | None
    order: tuple[str, ...] = ()                      # state-dict order of params and frozen
    kinds: tuple[str, ...] = MOMENTS                 # the optimizer's per-element state

    def tensors(self) -> dict[str, ChunkedTensor]:
        """Trained and frozen parameters, in state-dict order."""
        both = {**self.params, **self.frozen}
        return {f: both[f] for f in self.order if f in both} if self.order else both


def _optim_key(section: ChunkedSection, optim_key: str | None, url: str) -> str:
    found = [k for k in ((optim_key,) if optim_key else ("optim", "optimizer"))
             if any(f.startswith(f"{k}.state.") for f in section.tensors)]
    if not found:
        raise IntegrityError(f"{url}: no optimizer state under "
                             f"{optim_key or 'optim or optimizer'!r} (keys '<key>.state.<fqn>."
                             "exp_avg'); pass --optim-key, or import without --ranks")
    return found[0]


def _value(reader: CheckpointReader, section: ChunkedSection, key: str) -> Any:
    """A non-tensor value (a blob, decoded with ``torch.load(weights_only=True)``) or a scalar
    tensor's value; None if absent."""
    import torch

    if key in section.tensors:
        t = section.tensors[key]
        data = b"".join(iter_elements(reader, t, 0, max(1, t.numel), 1 << 20))
        v = as_tensor(data, t.dtype)
        return v.tolist()[0] if v.numel() == 1 else v.tolist()
    if key not in section.blobs:
        return None
    try:
        stream = io.BytesIO(read_blob(reader, section.blobs[key]))
        v = torch.load(stream, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - a foreign value: any failure is one clear error
        raise IntegrityError(f"{reader.url}: the value {key!r} is not readable with "
                             f"torch.load(weights_only=True): {str(e).splitlines()[0]}") from None
    return v.item() if isinstance(v, torch.Tensor) and v.numel() == 1 else v


#: Hyper-parameters that are flags; every other one is a finite number (``betas``: a pair).
FLAGS = ("amsgrad", "maximize", "nesterov")

def _origin(reader: CheckpointReader, section: ChunkedSection, key: str) -> str:
    """Where the value ``key`` came from: the source's payload file (the import keeps one
    ``chunks`` file per source file, in the order of the source's sorted names)."""
    origin = run_extras(reader.manifest, reader.url).origin(DcpOrigin, reader.url)
    files = origin.files if origin is not None else ()
    where = section.blobs[key].file if key in section.blobs else \
        section.tensors[key].chunks[0].file if key in section.tensors and section.tensors[key].chunks else ""
    m = re.search(r"chunks-([0-9]+)\.safetensors\Z", where)
    i = int(m.group(1)) if m else -1
    name = files[i] if 0 <= i < len(files) else "?"
    return f"{reader.url}/{name}"


def _number(v: Any) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
            and abs(v) < 2 ** 63)


def _recordable(name: str, v: Any) -> bool:
    """Whether ``v`` can be kept as hyper-parameter ``name`` (plain JSON, finite)."""
    if name in FLAGS:
        return isinstance(v, bool)
    if name == "betas":
        return isinstance(v, (tuple, list)) and len(v) == 2 and all(_number(x) for x in v)
    return _number(v)


def _show(v: Any) -> str:
    if isinstance(v, int) and not isinstance(v, bool) and abs(v) >= 2 ** 63:
        return f"an integer of {v.bit_length()} bits"
    try:
        r = repr(v)
    except Exception:  # noqa: BLE001 - a foreign value whose repr fails
        r = ""
    return f"a {type(v).__name__}" + (f" {r[:60]}" if r and len(r) <= 60 else "")


def _hparams(get: Callable[[str], Any], prefix: str,
             keys: Sequence[str] = ADAM_HPARAMS,
             bad: Callable[[str, Any], Exception] | None = None) -> dict[str, Any]:
    out = {}
    for k in keys:
        v = get(f"{prefix}.{k}")
        if v is not None:
            if not _recordable(k, v):
                raise (bad or _bad_value)(f"{prefix}.{k}", v)
            out[k] = list(v) if isinstance(v, (tuple, list)) else v
    return out


def _bad_value(key: str, v: Any) -> Exception:
    return IntegrityError(f"the value {key!r} is {_show(v)}, not a finite number, flag or pair")


def _groups(reader: CheckpointReader, section: ChunkedSection, opt: str,
            trained: Sequence[str], names: Sequence[str], keys: Sequence[str]
            ) -> tuple[list[tuple[list[str], dict[str, Any], Any]], set[str]]:
    """(params, hparams, decoupled_weight_decay) per param group, and every name of ``names``
    the param groups list (trained or not)."""
    def get(key: str) -> Any:
        return _value(reader, section, key)

    def bad(key: str, v: Any) -> Exception:
        want = "true or false" if key.rsplit(".", 1)[-1] in FLAGS else \
            "a pair of finite numbers" if key.endswith(".betas") else "a finite number"
        return IntegrityError(f"{_origin(reader, section, key)}: the hyper-parameter {key!r} is "
                              f"{_show(v)}, not {want}")

    pat = re.compile(rf"{re.escape(opt)}\.param_groups\.([0-9]+)\.params")
    ids = sorted(int(m.group(1)) for k in section.blobs if (m := pat.fullmatch(k)))
    if ids:
        out, listed = [], set()
        for i in ids:
            names_ = get(f"{opt}.param_groups.{i}.params")
            if not isinstance(names_, list) or not all(isinstance(n, str) for n in names_):
                raise IntegrityError(f"{reader.url}: {opt}.param_groups.{i}.params is not a list "
                                     "of parameter names (save the optimizer with get_state_dict)")
            prefix = f"{opt}.param_groups.{i}"
            listed.update(names_)
            out.append(([n for n in names_ if n in trained], _hparams(get, prefix, keys, bad),
                        get(f"{prefix}.decoupled_weight_decay")))
        return out, listed & set(names)
    by_hp: dict[str, tuple[list[str], dict[str, Any], Any]] = {}
    for fqn in trained:  # flatten_optimizer_state_dict: hyper-parameters per parameter
        prefix = f"{opt}.param_groups.{fqn}"
        hp = _hparams(get, prefix, keys, bad)
        entry = by_hp.setdefault(repr(sorted(hp.items())),
                                 ([], hp, get(f"{prefix}.decoupled_weight_decay")))
        entry[0].append(fqn)
    listed = {f for f in names if f"{opt}.param_groups.{f}.lr" in section.blobs}
    return list(by_hp.values()), listed


def read_model(reader: CheckpointReader, model_key: str = "model",
               optim_key: str | None = None, frozen: Sequence[str] = (),
               frozen_names: Collection[str] = ()) -> DcpModel:
    """Which tensor of ``reader``'s chunked section is what (module docstring). ``frozen``:
    regular expressions, each matching (whole) the FQN of a frozen parameter and at least one;
    ``frozen_names``: FQNs that are frozen parameters where they are tensors without state."""
    section = reader.manifest.chunked
    if section is None:
        raise IntegrityError(f"{reader.url}: not a checkpoint of chunked tensors")
    opt = _optim_key(section, optim_key, reader.url)
    order = list(section.planner_data) or list(section.tensors)
    order += [k for k in section.tensors if k not in section.planner_data]
    if model_key:
        names = {k: k[len(model_key) + 1:] for k in order
                 if k in section.tensors and k.startswith(f"{model_key}.")}
    else:
        skip = tuple(f"{k}." for k in (opt, *APP_KEYS))
        names = {k: k for k in order if k in section.tensors and not k.startswith(skip)}
    if not names:
        raise IntegrityError(f"{reader.url}: no model tensors under {model_key!r}; pass "
                             "--model-key ('' for torchtitan's top-level model keys)")
    suffixes = {k.rsplit(".", 1)[-1] for k in section.tensors if k.startswith(f"{opt}.state.")}
    sgd = "exp_avg" not in suffixes and "momentum_buffer" in suffixes
    state_kinds = SGD_KINDS if sgd else MOMENTS
    params: dict[str, ChunkedTensor] = {}
    moments: dict[str, dict[str, ChunkedTensor]] = {}
    rest: dict[str, ChunkedTensor] = {}
    for key, fqn in names.items():
        t = section.tensors[key]
        kinds = {k: section.tensors.get(f"{opt}.state.{fqn}.{k}") for k in state_kinds}
        if any(v is None for v in kinds.values()):
            rest[fqn] = t
            continue
        present = {k: v for k, v in kinds.items() if v is not None}
        for k, v in present.items():
            if v.shape != t.shape:
                raise IntegrityError(f"{reader.url}: {opt}.state.{fqn}.{k} has shape "
                                     f"{list(v.shape)}, the parameter {list(t.shape)}")
        params[fqn], moments[fqn] = t, present
    aliases = {f: p for f, t in rest.items()
               for p in [next((p for p, pt in params.items() if _same(reader, t, pt)), None)] if p}
    groups, listed = _groups(reader, section, opt, list(params), list(names.values()),
                             SGD_HPARAMS if sgd else ADAM_HPARAMS)
    frozen_ = _frozen(reader.url, {f: t for f, t in rest.items() if f not in aliases},
                      list(params), listed | set(frozen_names), frozen)
    buffers = {f: t for f, t in rest.items() if f not in aliases and f not in frozen_}
    grouped = {f for names_, _, _ in groups for f in names_}
    if grouped != set(params):
        raise IntegrityError(f"{reader.url}: parameters with optimizer state in no param group: "
                             f"{sorted(set(params) - grouped)[:10]}")
    step = _step(reader, section, "train_state.step")
    # torch's SGD keeps no step: a momentum buffer means at least one step was taken
    steps = {f: (step or 1) if sgd else _step(reader, section, f"{opt}.state.{f}.step")
             for f in params}
    name = "sgd" if sgd else "adam" if groups and all(d is False for _, _, d in groups) else "adamw"
    info = OptimizerInfo(name, tuple(
        ParamGroupRecord(tuple(ps), hp, int(steps[ps[0]] or 0) if ps else 0).to_doc()
        for ps, hp, _ in groups))
    return DcpModel(params, moments, frozen_, buffers, aliases, info,
                    None if step is None else int(step), tuple(names.values()), state_kinds)


def _step(reader: CheckpointReader, section: ChunkedSection, key: str) -> int | None:
    """A step count (a whole number, float or not, from 0 to 2**63), or None if absent."""
    v = _value(reader, section, key)
    if v is None:
        return None
    if not _number(v) or v < 0 or v != int(v):
        raise IntegrityError(f"{_origin(reader, section, key)}: the step {key!r} is {_show(v)}, "
                             "not a whole number from 0 to 2**63")
    return int(v)


def _frozen(url: str, stateless: dict[str, ChunkedTensor], trained: Sequence[str],
            listed: set[str], patterns: Sequence[str]) -> dict[str, ChunkedTensor]:
    """The frozen parameters among the ``stateless`` tensors: listed by a param group, or named
    by a pattern. A pattern that names nothing or a trained parameter, or a frozen integer
    tensor, is one error listing them."""
    pats = [re.compile(p) for p in patterns]
    named = {f for f in (*stateless, *trained) if any(p.fullmatch(f) for p in pats)}
    bad = [f"{p.pattern!r} matches no model tensor" for p in pats
           if not any(p.fullmatch(f) for f in (*stateless, *trained))]
    bad += [f"{f} has optimizer state (a trained parameter)" for f in trained if f in named]
    out = {f: t for f, t in stateless.items() if f in named or f in listed}
    bad += [f"{f} is {t.dtype} (a parameter is floating point)" for f, t in out.items()
            if t.dtype not in FLOATS]
    if bad:
        raise ConfigError(f"{url}: frozen parameters (--frozen): " + "; ".join(bad))
    return out


def _same(reader: CheckpointReader, a: ChunkedTensor, b: ChunkedTensor) -> bool:
    """Equal dtype, shape and bytes (streamed): a tied parameter, saved under both names."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    pieces = zip(iter_elements(reader, a, 0, a.numel, 1 << 24),
                 iter_elements(reader, b, 0, b.numel, 1 << 24), strict=True)
    return all(x == y for x, y in pieces)


def as_tensor(data: Any, dtype: str) -> Any:
    """Bytes (read-only is fine: only read from) as a flat tensor of ``dtype``, without a copy."""
    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(data, dtype=torch.uint8).view(getattr(torch, dtype))
