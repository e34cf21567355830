"""Import a DeepSpeed ZeRO-1/2/3 checkpoint (weights, Adam state, buffers) as a shardckpt one.

Reads what ``engine.save_checkpoint(dir)`` writes: ``latest``, ``<tag>/mp_rank_00_model_states.pt``
(``zero_pp_rank_<r>_mp_rank_00_model_states.pt`` for ZeRO-3) and
``<tag>/[bf16_]zero_pp_rank_<r>_mp_rank_00_optim_states.pt``, through the allow-listed loader of
:mod:`shardckpt.interop.deepspeed.files`, one file at a time
(:mod:`shardckpt.interop.deepspeed.rank_files` says what each holds). Torch is needed (imported
lazily) to read them; DeepSpeed is not.

How DeepSpeed lays its fp32 state out (what :func:`~shardckpt.interop.deepspeed.files.segments_12` and
:func:`~shardckpt.interop.deepspeed.files.segments_3` undo):

* ZeRO-1/2: per param group, the trained parameters (``param_shapes[j]`` order, with
  ``param_alignment_paddings`` after each) are flattened, padded to a multiple of 2 x world, and
  cut into world equal partitions; each rank saves its partition with the group's tail padding
  removed, so the saved partitions, concatenated in rank order, are the group. ``exp_avg`` and
  ``exp_avg_sq`` have the same positions (their padded tail is dropped). Frozen parameters are
  whole, in ``frozen_param_fragments`` (ZeRO-2) or in ``module`` (ZeRO-1).
* ZeRO-3: every parameter is cut on its own into world pieces of ``ceil(numel / world)``
  elements (the last padded); a rank's flat (its sub-groups concatenated) holds its piece of each
  parameter in ``param_shapes`` order. Frozen parameters are cut the same way, per rank, in each
  rank's ``frozen_param_fragments``.

Memory: one DeepSpeed rank file at a time is loaded, checked before its values are read so
that it holds no more than its tensors' own bytes (:func:`~shardckpt.interop.deepspeed.files.load_pt`);
its partitions are staged as raw fp32 in a local temporary folder, and each target shard is then
streamed from there in pieces of at most ``buffer_bytes``. What is staged and held is bounded by
twice the source files' bytes (bf16 widened to fp32): a tensor used under many names is refused.
Every file is read only if it resolves inside the source folder. ``manifest.json`` is
created last; on any error nothing is committed and the attempt's files are removed.
"""

from __future__ import annotations

import logging
import os
import tempfile
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any
from collections.abc import Callable, Iterator, Mapping, Sequence

from shardckpt.checkpoint.job import Job
from shardckpt.checkpoint.reader import as_storage

from shardckpt.checkpoint.writer import CheckpointSpec
from shardckpt.interop.deepspeed.files import (
    MODEL_FILE, Segment, Staged, find_files, segments_12, segments_3, tag_folder_source,
)
from shardckpt.interop.deepspeed.rank_files import RankInfo, read_models, stage_rank, structure
from shardckpt.interop.foreign import check_link, source_root
from shardckpt.errors import ConfigError, IntegrityError
from shardckpt.storage import DEFAULT_BATCH
from shardckpt.interop.deepspeed.config import DeepSpeedConfig, DeepSpeedOrigin
from shardckpt.interop.importer import ImportOptions, ImportPlan, get_importer, run_importer
from shardckpt.interop.importing import ADAM_HPARAMS, BLOCK_UNITS, compile_units, unit_of
from shardckpt.format.layout import Layout, Mesh, ParamInfo, build_layout
from shardckpt.format.manifest import MANIFEST_NAME, BufferSpec, Component, Manifest, OptimizerInfo
from shardckpt.format.records import ParamGroupRecord, PerRankState, RunExtras
from shardckpt.storage import NotFoundError, Storage

log = logging.getLogger(__name__)


@dataclass
class DeepSpeedSource:
    """A DeepSpeed checkpoint, read and staged: parameters, their segments, optimizer, buffers."""

    url: str
    tag: str
    stage: int
    world_size: int
    order: list[str]                                   # parameters, module order
    shapes: dict[str, tuple[int, ...]]
    trained: dict[str, int]                            # fqn -> DeepSpeed param group
    segments: dict[str, list[Segment]]
    aliases: dict[str, str]
    buffers: dict[str, Any]                            # fqn -> numpy array
    optimizer: OptimizerInfo
    extras: dict[str, Any]
    staged: Staged


def _optimizer(ranks: list[RankInfo], trained: Mapping[str, int],
               opt_cfg: Mapping[str, Any]) -> OptimizerInfo:
    """Name, hyper-parameters and steps per DeepSpeed param group."""
    groups = ranks[0].param_groups
    decoupled = {v for g in groups if isinstance(v := g.get("decoupled_weight_decay"), bool)}
    cfg_type = str(opt_cfg.get("type", "")).lower()
    if decoupled == {False} or (cfg_type == "adam" and not (opt_cfg.get("params") or {}).get(
            "adam_w_mode", True)):
        name = "adam"
    else:
        name = "adamw"
    out = []
    for j in sorted(set(trained.values())):
        g = groups[j] if j < len(groups) else {}
        hp: dict[str, Any] = {k: (list(g[k]) if isinstance(g[k], tuple) else g[k])
                              for k in ADAM_HPARAMS if k in g}
        hp = {k: (float(v) if hasattr(v, "item") else v) for k, v in hp.items()}
        step = ranks[0].steps[_first_flat(ranks[0], g, j)] if ranks[0].steps else 0
        out.append(ParamGroupRecord(tuple(f for f, gj in trained.items() if gj == j), hp,
                                    int(step)).to_doc())
    return OptimizerInfo(name, tuple(out))


def _first_flat(rank: RankInfo, group: Mapping[str, Any], j: int) -> int:
    ids = group.get("params") or [j]
    return min(int(ids[0]), len(rank.steps) - 1)


def read_deepspeed(location: str | Storage, staged: Staged, tag: str | None = None,
                   storage_options: Mapping[str, Any] | None = None) -> DeepSpeedSource:
    """Read a DeepSpeed checkpoint one file at a time, staging its numbers in ``staged``."""
    storage, tag = tag_folder_source(as_storage(location, storage_options), tag)
    tag, optim, models = find_files(storage, tag)
    world, url = len(optim), storage.url_of(tag)
    root = source_root(storage)
    # What the files' tensors can yield, at most: bf16 widened to fp32 doubles it.
    sizes = 0
    for rel in optim + models:
        check_link(storage, rel, root)
        try:
            sizes += storage.size(rel)
        except NotFoundError:
            raise IntegrityError(f"{storage.url_of(rel)}: missing") from None
    staged.limit, staged.source = 2 * sizes + (1 << 20), storage.url_of(tag)
    info, frozen_segs = read_models(storage, models, world, staged)
    ranks = []
    for r, rel in enumerate(optim):
        with structure(storage.url_of(rel)):
            ranks.append(stage_rank(storage, rel, r, world, staged))
        log.info("import deepspeed: staged rank %d of %d", r + 1, world)
    stage = ranks[0].stage
    odd = [optim[r] for r, rk in enumerate(ranks) if rk.stage != stage]
    if odd or (stage == 3) != (os.path.basename(models[0]) != MODEL_FILE):
        bad = storage.url_of(odd[0] if odd else models[0])
        raise IntegrityError(f"{bad}: does not match the ZeRO stage {stage} of "
                             f"{storage.url_of(optim[0])}; the files come from different saves")
    flat = info.flat_shapes
    if stage == 3:
        owner = {int(i): j for j, g in enumerate(ranks[0].param_groups)
                 for i in g.get("params", [])}
        trained = {f: owner.get(k, 0) for k, g in enumerate(flat) for f in g}
        params = [(f, s) for g in flat for f, s in g.items()]
        segments = segments_3(url, params, [sum(r.lengths) for r in ranks], world)
    else:
        trained = {f: j for j, g in enumerate(flat) for f in g}
        segments = segments_12(url, flat, ranks, world)
    shapes = {f: s for g in flat for f, s in g.items()}
    shapes.update(info.frozen)
    segments.update(frozen_segs)
    known = set(info.module_order)
    order = [f for f in info.module_order if f in shapes] + [f for f in shapes if f not in known]
    aliases = {a: c for a, c in info.shared.items() if c in shapes and a not in shapes}
    prec = "bf16" if any(os.path.basename(f).startswith("bf16_") for f in optim) else "fp32"
    extras = RunExtras(step=info.extras["step"], samples_seen=info.extras["samples_seen"],
                       source=storage.url,
                       other=DeepSpeedOrigin(info.extras["version"], stage, world, tag, prec).entry()).to_doc()
    return DeepSpeedSource(storage.url, tag, stage, world, order, shapes, trained, segments,
                           aliases, info.buffers, _optimizer(ranks, trained, info.optimizer_config),
                           extras, staged)


def import_layout(source: DeepSpeedSource, mesh: Mesh, units: Sequence[str] | None = None,
                  prefix: str = "model.") -> Layout:
    """The target layout: fp32 parameters in module order, one unit per match of ``units``."""
    pats = compile_units(units or BLOCK_UNITS)
    infos = [ParamInfo(f, source.shapes[f], "float32", f in source.trained, unit_of(f, pats))
             for f in source.order]
    return build_layout(infos, mesh, prefix)


def _producer(source: DeepSpeedSource, layout: Layout, shard: int,
              buffer_bytes: int) -> Callable[[Any], Iterator[Any]]:
    step = max(1, buffer_bytes // 4)

    def produce(slot: Any) -> Iterator[Any]:
        gname, kind = slot.name.rsplit(".", 1)
        pieces, padding = layout.shard_pieces(gname, shard)
        for p, a, b in pieces:
            for s in source.segments[p.fqn]:
                x, y = max(a, s.start), min(b, s.end)
                for u in range(x, y, step):
                    v = min(y, u + step)
                    yield source.staged.read(f"{s.src}.{kind}", s.pos + u - s.start, v - u)
        if padding:
            yield bytes(padding * 4)

    return produce


def _spec(source: DeepSpeedSource, mesh: Mesh, units: Sequence[str] | None
          ) -> tuple[Layout, CheckpointSpec]:
    """The target layout and checkpoint spec of a staged source."""
    layout = import_layout(source, mesh, units)
    states = {g.name: (("master", "float32"),) + ((("exp_avg", "float32"),
              ("exp_avg_sq", "float32")) if g.requires_grad else ()) for g in layout.groups}
    bufs = tuple(BufferSpec(k, tuple(v.shape), str(v.dtype)) for k, v in source.buffers.items())
    comp = Component("model", layout, states, source.aliases, bufs)
    return layout, CheckpointSpec(mesh, {"model": comp}, source.optimizer, source.extras,
                                  PerRankState(world_size=mesh.world_size).to_doc())


def plan_deepspeed(options: ImportOptions) -> ImportPlan:
    """The plan of :func:`import_deepspeed`: the destination checked, the source read one file
    at a time and staged below ``config.tmp_dir`` (the plan holds the staging folder until it is
    closed), the target spec; shard ``s`` and the buffers stream from the staged source."""
    cfg = options.config
    assert isinstance(cfg, DeepSpeedConfig) and options.ranks is not None
    out = as_storage(options.dst, options.dst_storage_options)
    if out.exists(MANIFEST_NAME):
        raise ConfigError(f"{out.url_of(MANIFEST_NAME)} exists; import into an empty location")
    mesh = Mesh.for_world(options.ranks, options.replicate)
    buffer_bytes = options.buffer_bytes
    with ExitStack() as stack:
        folder = stack.enter_context(tempfile.TemporaryDirectory(prefix="shardckpt-ds-",
                                                                 dir=cfg.tmp_dir))
        staged = Staged(folder)
        stack.callback(staged.close)
        source = read_deepspeed(options.src, staged, cfg.tag, options.storage_options)
        layout, spec = _spec(source, mesh, options.units)
        plan = ImportPlan(options, out, spec, "import deepspeed",
                          lambda s: _producer(source, layout, s, buffer_bytes),
                          lambda slot: [source.buffers[slot.name].tobytes()], source,
                          stack.pop_all())
    return plan


def import_deepspeed(src: str | Storage, dst: str | Storage, ranks: int, replicate: int = 1,
                     units: Sequence[str] | None = None, tag: str | None = None,
                     storage_options: Mapping[str, Any] | None = None,
                     dst_storage_options: Mapping[str, Any] | None = None,
                     buffer_bytes: int = DEFAULT_BATCH, tmp_dir: str | None = None,
                     job: Job | None = None) -> Manifest:
    """Write DeepSpeed checkpoint ``src`` as a shardckpt checkpoint at ``dst`` for ``ranks`` ranks.

    fp32 masters, ``exp_avg`` and ``exp_avg_sq`` of every trained parameter, frozen parameters
    (fp32), persistent buffers, tied aliases, the optimizer's param groups and step. Refuses a
    ``dst`` that holds a checkpoint; on any error nothing is committed. The source's fp32 numbers
    are staged in a temporary folder under ``tmp_dir`` (default: the system's; about the size of
    the source's optimizer files), removed when done. In a ``torchrun`` job (``job``) every
    process stages the source (each target shard takes a piece of every DeepSpeed partition) and
    writes its share of the target files (:func:`shardckpt.interop.importing.write_import`).
    The ``deepspeed`` importer (:mod:`shardckpt.interop.deepspeed.importer`) with these options.
    """
    options = ImportOptions(src, dst, ranks, replicate, None if units is None else tuple(units),
                            buffer_bytes, storage_options, dst_storage_options,
                            DeepSpeedConfig(tag, tmp_dir))
    return run_importer(get_importer("deepspeed"), options, job)
