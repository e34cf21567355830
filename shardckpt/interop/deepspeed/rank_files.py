"""What one file of a DeepSpeed ZeRO checkpoint says, read one file at a time: each rank's optimizer
file (its fp32 partitions and Adam moments, staged; :func:`stage_rank`) and the model states
file(s) (parameter shapes, buffers, frozen parameters, the run's counters; :func:`read_models`).
:mod:`shardckpt.interop.deepspeed.import_` puts them together into one source. A field that is not
what DeepSpeed writes is one :class:`~shardckpt.errors.IntegrityError` naming the file
(:func:`structure`).
"""

from __future__ import annotations

import logging
import os
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any
from collections.abc import Callable, Iterator, Mapping, Sequence

from shardckpt.errors import IntegrityError, ShardckptError
from shardckpt.format.layout import prod
from shardckpt.interop.deepspeed.files import (
    MODEL_FILE, Segment, Staged, check_world, load_pt, segments_3, shape_of,
)
from shardckpt.interop.foreign import escaped, shown
from shardckpt.storage import Storage

log = logging.getLogger(__name__)

#: The per-element state kinds imported, in file order.
KINDS = ("master", "exp_avg", "exp_avg_sq")


@dataclass
class RankInfo:
    """What one rank's optimizer file says besides its staged numbers."""

    stage: int
    lengths: list[int]                 # fp32 elements per flat group (partition / sub-group)
    param_groups: list[dict[str, Any]]
    steps: list[int]                   # per flat group
    paddings: list[list[int]] | None   # ZeRO-1/2 param_alignment_paddings


def _moments(base: Any, lengths: Sequence[int], url: str) -> list[dict[str, Any]]:
    """Per flat group, ``exp_avg`` and ``exp_avg_sq`` (flat tensors, not yet widened) cut to the
    fp32 partition's length (the padded tail DeepSpeed keeps in the optimizer state is dropped)."""
    states = base.get("state", {}) if isinstance(base, dict) else {}
    out = []
    for i, n in enumerate(lengths):
        st = base[i] if isinstance(base, list) else states.get(i)  # a list: elastic layout
        if not isinstance(st, dict) or not all(k in st for k in KINDS[1:]):
            raise IntegrityError(f"{url}: the optimizer state of flat group {i} has no exp_avg / "
                                 "exp_avg_sq; only Adam-family optimizer state is imported")
        d = {}
        for k in KINDS[1:]:
            a = st[k].detach().reshape(-1)
            if a.numel() < n:
                raise IntegrityError(f"{url}: {k} of flat group {i} has {a.numel()} elements, "
                                     f"fewer than its {n} weights")
            d[k] = a[:n]
        out.append(d)
    return out


def stage_rank(storage: Storage, rel: str, rank: int, world: int, staged: Staged) -> RankInfo:
    """Load one rank's optimizer file and stage its fp32 partitions and moments."""
    url = storage.url_of(rel)
    sd = load_pt(storage, rel)
    osd = sd.get("optimizer_state_dict")
    if not isinstance(osd, dict) or "zero_stage" not in osd:
        raise IntegrityError(f"{url}: no ZeRO optimizer state; not a ZeRO checkpoint file")
    stage = osd["zero_stage"]
    if not isinstance(stage, int) or isinstance(stage, bool) or stage not in (1, 2, 3):
        raise IntegrityError(f"{url}: ZeRO stage {shown(repr(stage), 40)} is not 1, 2 or 3")
    check_world(storage, rel, osd.get("partition_count", world), world)
    flats = osd["fp32_flat_groups" if stage == 3 else "single_partition_of_fp32_groups"]
    base = osd.get("optimizer_state_dict" if stage == 3 else "base_optimizer_state")
    lengths = [int(t.numel()) for t in flats]
    moments = _moments(base, lengths, url)
    staged.put(f"{rank}.master", flats, url)
    for k in KINDS[1:]:
        staged.put(f"{rank}.{k}", [m[k] for m in moments], url)
    groups = base.get("param_groups", []) if isinstance(base, dict) else []
    states = base.get("state", {}) if isinstance(base, dict) else {}
    step = osd.get("base_optimizer_state_step", sd.get("global_steps", 0))
    steps = [int(float(states.get(i, {}).get("step", step))) for i in range(len(lengths))]
    paddings = osd.get("param_alignment_paddings") if stage < 3 else None
    if paddings is not None:  # per flat group, per parameter: element counts
        paddings = [[int(p) for p in g] for g in paddings]
    groups = [dict(g) for g in groups]
    for g in groups:  # indices of flat groups (ZeRO-3: of parameters' sub-groups)
        g["params"] = [int(i) for i in g.get("params") or ()]
    return RankInfo(stage, lengths, groups, steps, paddings)


@dataclass
class ModelInfo:
    """What the (rank 0) model states file says, taken out so the file can be dropped."""

    flat_shapes: list[dict[str, tuple[int, ...]]]   # trained parameters per flat group
    frozen: dict[str, tuple[int, ...]]
    module_order: list[str]
    shared: dict[str, str]
    buffers: dict[str, Any]                         # fqn -> numpy array
    extras: dict[str, Any]
    optimizer_config: dict[str, Any]


def _model_info(sd: Mapping[str, Any], url: str,
                spend: Callable[[int, str], None] = lambda n, url: None) -> ModelInfo:
    if "param_shapes" not in sd:
        raise IntegrityError(f"{url}: no param_shapes; not a DeepSpeed ZeRO model states file")
    flat = [{k: shape_of(v) for k, v in g.items()} for g in sd["param_shapes"]]
    module = sd.get("module") or {}
    names = set(sd.get("buffer_names") or ())
    shared = {str(a): str(c) for a, c in (sd.get("shared_params") or {}).items()}
    trained = {f for g in flat for f in g}
    if sd.get("frozen_param_shapes") is None:  # ZeRO-1: frozen parameters are in the module
        frozen = {k: shape_of(v.shape) for k, v in module.items()
                  if k not in trained and k not in names and k not in shared}
    else:
        frozen = {k: shape_of(v) for k, v in sd["frozen_param_shapes"].items()}
    unknown = [k for k in module if k not in trained and k not in frozen and k not in names
               and k not in shared]
    if unknown:  # e.g. a tied weight ZeRO-3 did not record as shared: nothing to import it from
        log.warning("%s: module entries that are neither parameters, buffers nor shared are not "
                    "imported: %s", url, ", ".join(unknown[:10]))
    buffers = {}
    for name in names:  # floating buffers in fp32, as DeepSpeed's own consolidation gives them
        if name in module:
            t = module[name].detach()
            spend(int(t.numel()) * 4, url)
            buffers[name] = (t.float() if t.is_floating_point() else t).numpy().copy()
    extras = {"step": int(sd.get("global_steps", 0) or 0),
              "samples_seen": int(sd.get("global_samples", 0) or 0),
              "version": str(sd.get("ds_version", "")), "world": sd.get("dp_world_size")}
    return ModelInfo(flat, frozen, list(module), shared, buffers, extras,
                     dict((sd.get("ds_config") or {}).get("optimizer") or {}))


def _frozen_values(sd: Mapping[str, Any], info: ModelInfo, url: str, whole: bool) -> list[Any]:
    """The frozen parameters' values (tensors, not yet widened) in ``info.frozen`` order: whole
    (ZeRO-1: ``module``; ZeRO-2: ``frozen_param_fragments``) or this rank's pieces (ZeRO-3)."""
    frags = sd.get("frozen_param_fragments") or sd.get("module") or {}
    out = []
    for f, shape in info.frozen.items():
        n = prod(shape)
        want = n if whole else -(-n // max(1, int(info.extras["world"] or 1)))
        have = prod(frags[f].shape) if f in frags else -1
        if have < 0 or (whole and have != n) or have > want:
            raise IntegrityError(f"{url}: no value of frozen parameter {f!r} ({list(shape)})")
        out.append(frags[f])
    return out


@contextmanager
def structure(url: str) -> Iterator[None]:
    """A file whose fields are not what DeepSpeed writes: one error naming it."""
    try:
        yield
    except ShardckptError:
        raise
    except (KeyError, TypeError, AttributeError, ValueError, IndexError, ArithmeticError,
            RecursionError) as e:
        raise IntegrityError(f"{url}: not laid out as a DeepSpeed ZeRO checkpoint file "
                             f"({type(e).__name__}: {escaped(str(e))})") from None


def read_models(storage: Storage, models: list[str], world: int,
                 staged: Staged) -> tuple[ModelInfo, dict[str, list[Segment]]]:
    """The model states file(s), one at a time: metadata, buffers, frozen parameters staged."""
    url0 = storage.url_of(models[0])
    whole = os.path.basename(models[0]) == MODEL_FILE
    sd = load_pt(storage, models[0])
    with structure(url0):
        info = _model_info(sd, url0, staged.spend)
        check_world(storage, models[0], info.extras["world"] or world, world)
        values = _frozen_values(sd, info, url0, whole)
    del sd
    if whole:
        segs, pos = {}, 0
        for f, shape in info.frozen.items():
            segs[f] = [Segment(0, prod(shape), "frozen", pos)] if prod(shape) else []
            pos += prod(shape)
        with structure(url0):
            staged.put("frozen.master", values, url0)
        return info, segs
    with structure(url0):
        staged.put("0f.master", values, url0)
    lengths = [sum(int(v.numel()) for v in values)]
    del values
    for r, rel in enumerate(models[1:], 1):
        sd = load_pt(storage, rel)
        with structure(storage.url_of(rel)):
            values = _frozen_values(sd, info, storage.url_of(rel), False)
            staged.put(f"{r}f.master", values, storage.url_of(rel))
        del sd
        lengths.append(sum(int(v.numel()) for v in values))
        del values
    return info, segments_3(url0, list(info.frozen.items()), lengths, world, "f")
