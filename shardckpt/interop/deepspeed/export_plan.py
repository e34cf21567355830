"""The planning of a DeepSpeed export: what each file of ``DST/<tag>/`` holds, built from the
source one rank at a time (:mod:`shardckpt.interop.deepspeed.export` writes them; its docstring
describes the files).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from shardckpt.checkpoint.reader import CheckpointReader
from shardckpt.errors import ConfigError, ManifestError
from shardckpt.format.layout import prod
from shardckpt.format.records import param_groups, run_extras
from shardckpt.interop.deepspeed.ds_pickle import FragmentAddress, LossScaler, make, zero_stage
from shardckpt.interop.deepspeed.files import MODEL_FILE, folder_name

log = logging.getLogger(__name__)

__all__ = ["ExportPlan", "plan_export", "DS_VERSION", "SUB_GROUP_SIZE"]

#: The DeepSpeed version the files are laid out as (its loader checks that one is recorded).
DS_VERSION = "0.19.8"
#: DeepSpeed's default ``zero_optimization.sub_group_size`` (ZeRO-3 splits a param group into
#: sub-groups of about this many elements per rank).
SUB_GROUP_SIZE = 1_000_000_000
ALIGN = 2  # DeepSpeed's nccl_start_alignment_factor: groups pad to a multiple of 2 x world
ADAM_KINDS = ("exp_avg", "exp_avg_sq")
#: torch.optim.AdamW's param-group keys, in its order, with the defaults for what is not recorded.
ADAMW_KEYS = {"weight_decay": 0.0, "lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8,
              "amsgrad": False, "maximize": False, "foreach": None, "capturable": False,
              "differentiable": False, "fused": None}


# --------------------------------------------------------------------------- the source's data


@dataclass
class _Param:
    fqn: str
    shape: tuple[int, ...]
    numel: int


class _Source:
    """A flat-group checkpoint's parameters as DeepSpeed sees them: trained ones per param group,
    frozen ones, tied aliases, buffers; element ranges read checked from the shards."""

    def __init__(self, reader: CheckpointReader) -> None:
        m = reader.manifest
        if "model" not in m.components:
            raise ManifestError(f"{reader.url}: no 'model' component (flat groups); a checkpoint "
                                "of chunked tensors goes to DeepSpeed through `import dcp --ranks`")
        if m.optimizer is None or m.optimizer.name not in ("adam", "adamw"):
            name = "none" if m.optimizer is None else m.optimizer.name
            raise ConfigError(f"{reader.url}: optimizer {name!r}: DeepSpeed's ZeRO checkpoint is "
                              "exported with Adam / AdamW state (exp_avg, exp_avg_sq) only")
        self.reader, self.comp = reader, m.components["model"]
        lay = self.comp.layout
        self.params = {p.fqn: p for p in lay.params}
        self.optimizer = m.optimizer
        self.groups = param_groups(m.optimizer, reader.url)
        grouped = {f for g in self.groups for f in g.params}
        self.trained = [[self._param(f) for f in g.params] for g in self.groups]
        self.frozen = [self._param(p.fqn) for p in lay.params
                       if not lay.group(p.group).requires_grad]
        missing = [p.fqn for p in lay.params
                   if lay.group(p.group).requires_grad and p.fqn not in grouped]
        if missing:
            raise ManifestError(f"{reader.url}: trained parameters in no param group: "
                                f"{', '.join(missing[:5])}")
        self.aliases = dict(self.comp.aliases)
        self.buffers = [b.fqn for b in self.comp.buffers]
        extras = run_extras(m, reader.url)
        self.step = int(extras.step if extras.step is not None
                        else max((g.step for g in self.groups), default=0))
        self.samples = int(extras.samples_seen or 0)

    def _param(self, fqn: str) -> _Param:
        p = self.params[fqn]
        return _Param(fqn, tuple(p.shape), prod(p.shape))

    def module_order(self) -> list[str]:
        """The parameters in the layout's order (a strict ``load_state_dict`` takes any order)."""
        return [p.fqn for p in self.comp.layout.params]

    def elements(self, fqn: str, kind: str, first: int, last: int, dtype: Any) -> Any:
        """Elements ``[first, last)`` of parameter ``fqn``'s ``kind`` as a 1-D tensor of
        ``dtype`` (read in the stored dtype, checked, then cast)."""
        import torch

        from shardckpt.interop.dcp.model_state import as_tensor

        if first >= last:
            return torch.zeros(0, dtype=dtype)
        p = self.params[fqn]
        stored = dict(self.comp.states[p.group])[kind]
        data = self.reader.param_elements(self.comp.layout, p.group, p.offset, kind, first, last)
        return as_tensor(data, stored).reshape(-1).to(dtype)

    def whole(self, fqn: str, dtype: Any) -> Any:
        p = self.params[fqn]
        return self.elements(fqn, "master", 0, prod(p.shape), dtype).reshape(p.shape).clone()

    def buffer(self, fqn: str) -> Any:
        import torch

        from shardckpt.interop.dcp.model_state import as_tensor

        slot, view = self.reader.read_buffer(fqn)
        spec = next(b for b in self.comp.buffers if b.fqn == fqn)
        if not prod(spec.shape):
            return torch.zeros(spec.shape, dtype=getattr(torch, spec.dtype))
        return as_tensor(bytes(view), spec.dtype).reshape(spec.shape).clone()


# ------------------------------------------------------------------------------ the rank files


def _hparams(src: _Source, j: int, params: list[int]) -> dict[str, Any]:
    g = src.groups[j]
    out: dict[str, Any] = {}
    for k, default in ADAMW_KEYS.items():
        v = g.hparams.get(k, default)
        out[k] = tuple(v) if k == "betas" else v
    out["decoupled_weight_decay"] = src.optimizer.name == "adamw"
    out["params"] = params
    return out


def _adam_state(src: _Source, j: int, moments: Mapping[str, Any]) -> dict[str, Any]:
    import torch

    return {"step": torch.tensor(float(src.groups[j].step)), **moments}


def _fill(src: _Source, params: Sequence[_Param], kind: str, start: int, size: int) -> Any:
    """Elements ``[start, start + size)`` of the params laid end to end (zero past their end)."""
    import torch

    out = torch.zeros(size, dtype=torch.float32)
    off = 0
    for p in params:
        a, b = max(off, start), min(off + p.numel, start + size)
        if a < b:
            out[a - start:b - start] = src.elements(p.fqn, kind, a - off, b - off, torch.float32)
        off += p.numel
    return out


def _optim_12(src: _Source, rank: int, world: int, stage: int) -> dict[str, Any]:
    """ZeRO-1/2: what ``DeepSpeedZeroOptimizer.state_dict()`` holds on ``rank``."""
    state: dict[int, Any] = {}
    groups, flats, paddings, mappings = [], [], [], []
    for j, params in enumerate(src.trained):
        total = sum(p.numel for p in params)
        padded = -(-total // (ALIGN * world)) * ALIGN * world
        size = padded // world
        pad = padded - total if rank == world - 1 else 0
        master = _fill(src, params, "master", rank * size, size)
        moments = {k: _fill(src, params, k, rank * size, size) for k in ADAM_KINDS}
        flats.append(master[:size - pad].clone())  # DeepSpeed's own slice of the last partition
        state[j] = _adam_state(src, j, moments)
        groups.append(_hparams(src, j, [j]))
        paddings.append(pad)
        frags: OrderedDict[str, Any] = OrderedDict()
        off, lo, hi = 0, rank * size, (rank + 1) * size
        for p in params:
            a, b = max(off, lo), min(off + p.numel, hi)
            if a < b:
                frags[p.fqn] = make(FragmentAddress, numel=b - a, start=a - lo)
            off += p.numel
        mappings.append(frags)
    return {
        "loss_scaler": make(LossScaler, cur_scale=1.0, dynamic=False),
        "dynamic_loss_scale": False, "overflow": False, "clip_grad": 0.0,
        "base_optimizer_state": {"state": state, "param_groups": groups},
        "single_partition_of_fp32_groups": flats,
        "zero_stage": zero_stage(stage),
        "group_paddings": paddings,
        "param_alignment_paddings": [[0] * len(params) for params in src.trained],
        "partition_count": [world] * len(src.trained),
        "ds_version": DS_VERSION,
        "param_slice_mappings": mappings,
    }


def _sub_groups(params: list[_Param], world: int, sub_group_size: int) -> list[list[_Param]]:
    """ZeRO-3's sub-groups of a param group (``_create_fp16_sub_groups``): consecutive params
    whose per-rank pieces add up to ``sub_group_size`` elements."""
    piece = [-(-p.numel // world) for p in params]
    if sub_group_size >= sum(piece) or not params:
        return [params]
    out, cur, n = [], [], 0
    for p, k in zip(params, piece, strict=True):
        cur.append(p)
        n += k
        if n >= sub_group_size or p is params[-1]:
            out.append(cur)
            cur, n = [], 0
    return out


def _piece(src: _Source, p: _Param, kind: str, rank: int, world: int, dtype: Any) -> Any:
    """Rank ``rank``'s piece of ``p`` (``ceil(numel / world)`` elements, zero past its end)."""
    import torch

    size = -(-p.numel // world)
    out = torch.zeros(size, dtype=dtype)
    a, b = min(p.numel, rank * size), min(p.numel, (rank + 1) * size)
    if a < b:
        out[:b - a] = src.elements(p.fqn, kind, a, b, dtype)
    return out


def _optim_3(src: _Source, rank: int, world: int, subs: list[list[list[_Param]]]) -> dict[str, Any]:
    """ZeRO-3: what ``DeepSpeedZeroOptimizer_Stage3.state_dict()`` holds on ``rank``."""
    import torch

    state: dict[int, Any] = {}
    groups: list[dict[str, Any]] = []
    flats: list[Any] = []
    for j, group_subs in enumerate(subs):
        ids = []
        for params in group_subs:
            i = len(flats)
            ids.append(i)

            def flat(kind: str, params: list[_Param] = params) -> Any:
                parts = [_piece(src, p, kind, rank, world, torch.float32) for p in params]
                return torch.cat(parts) if parts else torch.zeros(0)

            flats.append(flat("master"))
            state[i] = _adam_state(src, j, {k: flat(k) for k in ADAM_KINDS})
        groups.append(_hparams(src, j, ids))
    return {
        "zero_stage": zero_stage(3),
        "loss_scaler": make(LossScaler, cur_scale=1.0, dynamic=False),
        "dynamic_loss_scale": False, "overflow": False,
        "partition_count": world,
        "optimizer_state_dict": {"state": state, "param_groups": groups},
        "fp32_flat_groups": flats,
    }


def _model_states(src: _Source, rank: int, world: int, stage: int, dtype: Any,
                  shapes: list[list[_Param]], cfg: dict[str, Any]) -> dict[str, Any]:
    """The model states file: the module (ZeRO-3: placeholders), shapes, frozen values, steps."""
    import torch

    module: dict[str, Any] = OrderedDict()
    for b in src.buffers:
        module[b] = src.buffer(b)
    values: dict[str, Any] = {}
    for fqn in src.module_order():
        if stage == 3:
            module[fqn] = torch.zeros(0, dtype=dtype)
        else:
            module[fqn] = values[fqn] = src.whole(fqn, dtype)
    for alias, canon in src.aliases.items():
        module[alias] = values.get(canon, torch.zeros(0, dtype=dtype))
    frozen_shapes: Any = None
    fragments: Any = None  # ZeRO-1: none (an empty dict would have DeepSpeed look frozen ones up)
    if stage > 1:
        frozen_shapes = OrderedDict((p.fqn, torch.Size(p.shape)) for p in src.frozen)
        fragments = OrderedDict(
            (p.fqn, _piece(src, p, "master", rank, world, dtype) if stage == 3 else values[p.fqn])
            for p in src.frozen)
    shared = dict(src.aliases) if stage < 3 or rank == 0 else {}
    return {
        "module": module,
        "buffer_names": list(src.buffers),
        "optimizer": None,
        "param_shapes": [OrderedDict((p.fqn, torch.Size(p.shape)) for p in g) for g in shapes],
        "frozen_param_shapes": frozen_shapes,
        "shared_params": shared,
        "frozen_param_fragments": fragments,
        "lr_scheduler": None, "data_sampler": None, "random_ltd": None,
        "skipped_steps": 0,
        "global_steps": src.step,
        "global_samples": src.samples,
        "dp_world_size": world,
        "mp_world_size": 1,
        "checkpoint_parallel_dimensions": {"pp_degree": 1, "tp_degree": 1},
        "ds_config": cfg,
        "ds_version": DS_VERSION,
    }


# ------------------------------------------------------------------------------------ the plan


@dataclass(frozen=True)
class ExportPlan:
    """What an export writes: the tag folder and, in order, each file's path, what builds its
    contents (when it is written, one rank's at a time) and what to log once it is written."""

    reader: CheckpointReader
    tag: str
    stage: int
    ranks: int
    bf16: bool
    step: int
    params: int
    files: list[tuple[str, Callable[[], Any], str | None]]


def plan_export(src: str, ranks: int, stage: int, tag: str | None, bf16: bool,
                storage_options: Mapping[str, Any] | None, sub_group_size: int) -> ExportPlan:
    """Check the options, open ``src`` (nothing read through a link out of it) and plan the
    files of a ZeRO ``stage`` export at ``ranks`` data-parallel ranks."""
    import torch

    if stage not in (1, 2, 3):
        raise ConfigError(f"ZeRO stage {stage}: DeepSpeed checkpoints are exported for stage 1, "
                          "2 or 3")
    if ranks < 1:
        raise ConfigError(f"--ranks {ranks}: the data-parallel world is at least 1")
    if sub_group_size < 1:
        raise ConfigError(f"sub_group_size {sub_group_size} must be >= 1")
    reader = CheckpointReader(src, storage_options)
    for entry in reader.manifest.files:  # nothing read through a link out of the source
        reader.files.check_inside(entry.path)
    source = _Source(reader)
    if tag is None:
        tag = f"global_step{source.step}"
    if not folder_name(tag):
        raise ConfigError(f"tag {tag!r} is not a folder name")
    dtype = torch.bfloat16 if bf16 else torch.float32
    cfg: dict[str, Any] = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
           "train_batch_size": ranks, "zero_optimization": {"stage": stage},
           "bf16": {"enabled": bf16}}
    if stage == 3:
        cfg["zero_optimization"]["sub_group_size"] = sub_group_size
        subs = [_sub_groups(ps, ranks, sub_group_size) for ps in source.trained]
        shapes = [s for g in subs for s in g]
    else:
        subs, shapes = [], source.trained
    prefix = "bf16_" if bf16 else ""
    files: list[tuple[str, Callable[[], Any], str | None]] = []
    if stage < 3:
        files.append((f"{tag}/{MODEL_FILE}",
                      lambda: _model_states(source, 0, ranks, stage, dtype, shapes, cfg), None))
    for r in range(ranks):
        def model(r: int = r) -> dict[str, Any]:
            return _model_states(source, r, ranks, stage, dtype, shapes, cfg)

        def optim(r: int = r) -> dict[str, Any]:
            osd = _optim_3(source, r, ranks, subs) if stage == 3 else _optim_12(source, r, ranks, stage)
            return {"optimizer_state_dict": osd, "ds_config": cfg, "ds_version": DS_VERSION}
        if stage == 3:
            files.append((f"{tag}/zero_pp_rank_{r}_mp_rank_00_model_states.pt", model, None))
        files.append((f"{tag}/{prefix}zero_pp_rank_{r}_mp_rank_00_optim_states.pt", optim,
                      f"export deepspeed: rank {r + 1} of {ranks} written"))
    return ExportPlan(reader, tag, stage, ranks, bf16, source.step,
                      sum(len(g) for g in source.trained) + len(source.frozen), files)
