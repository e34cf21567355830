"""Import a DeepSpeed ZeRO-1/2/3 checkpoint (weights, Adam state, buffers) as a shardckpt one.

Reads what ``engine.save_checkpoint(dir)`` writes: ``latest``, ``<tag>/mp_rank_00_model_states.pt``
(``zero_pp_rank_<r>_mp_rank_00_model_states.pt`` for ZeRO-3) and
``<tag>/[bf16_]zero_pp_rank_<r>_mp_rank_00_optim_states.pt``, through the allow-listed loader of
:mod:`shardckpt.interop.deepspeed.files`. Torch is needed (imported lazily) to read them; DeepSpeed is not.

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
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any
from collections.abc import Callable, Iterator, Mapping, Sequence

from shardckpt.checkpoint.job import Job
from shardckpt.checkpoint.reader import as_storage

from shardckpt.checkpoint.writer import CheckpointSpec
from shardckpt.interop.deepspeed.files import (
    MODEL_FILE, Segment, Staged, check_world, find_files, load_pt, segments_12, segments_3,
    shape_of, tag_folder_source,
)
from shardckpt.interop.foreign import check_link, escaped, shown, source_root
from shardckpt.errors import ConfigError, IntegrityError, ShardckptError
from shardckpt.storage import DEFAULT_BATCH
from shardckpt.interop.deepspeed.config import DeepSpeedConfig, DeepSpeedOrigin
from shardckpt.interop.importer import ImportOptions, ImportPlan, get_importer, run_importer
from shardckpt.interop.importing import ADAM_HPARAMS, BLOCK_UNITS, compile_units, unit_of
from shardckpt.format.layout import Layout, Mesh, ParamInfo, build_layout, prod
from shardckpt.format.manifest import MANIFEST_NAME, BufferSpec, Component, Manifest, OptimizerInfo
from shardckpt.format.records import ParamGroupRecord, PerRankState, RunExtras
from shardckpt.storage import NotFoundError, Storage

log = logging.getLogger(__name__)

KINDS = ("master", "exp_avg", "exp_avg_sq")


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


def _stage_rank(storage: Storage, rel: str, rank: int, world: int, staged: Staged) -> RankInfo:
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


@contextmanager
def _structure(url: str) -> Iterator[None]:
    """A file whose fields are not what DeepSpeed writes: one error naming it."""
    try:
        yield
    except ShardckptError:
        raise
    except (KeyError, TypeError, AttributeError, ValueError, IndexError, ArithmeticError,
            RecursionError) as e:
        raise IntegrityError(f"{url}: not laid out as a DeepSpeed ZeRO checkpoint file "
                             f"({type(e).__name__}: {escaped(str(e))})") from None


def _read_models(storage: Storage, models: list[str], world: int,
                 staged: Staged) -> tuple[ModelInfo, dict[str, list[Segment]]]:
    """The model states file(s), one at a time: metadata, buffers, frozen parameters staged."""
    url0 = storage.url_of(models[0])
    whole = os.path.basename(models[0]) == MODEL_FILE
    sd = load_pt(storage, models[0])
    with _structure(url0):
        info = _model_info(sd, url0, staged.spend)
        check_world(storage, models[0], info.extras["world"] or world, world)
        values = _frozen_values(sd, info, url0, whole)
    del sd
    if whole:
        segs, pos = {}, 0
        for f, shape in info.frozen.items():
            segs[f] = [Segment(0, prod(shape), "frozen", pos)] if prod(shape) else []
            pos += prod(shape)
        with _structure(url0):
            staged.put("frozen.master", values, url0)
        return info, segs
    with _structure(url0):
        staged.put("0f.master", values, url0)
    lengths = [sum(int(v.numel()) for v in values)]
    del values
    for r, rel in enumerate(models[1:], 1):
        sd = load_pt(storage, rel)
        with _structure(storage.url_of(rel)):
            values = _frozen_values(sd, info, storage.url_of(rel), False)
            staged.put(f"{r}f.master", values, storage.url_of(rel))
        del sd
        lengths.append(sum(int(v.numel()) for v in values))
        del values
    return info, segments_3(url0, list(info.frozen.items()), lengths, world, "f")


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
    info, frozen_segs = _read_models(storage, models, world, staged)
    ranks = []
    for r, rel in enumerate(optim):
        with _structure(storage.url_of(rel)):
            ranks.append(_stage_rank(storage, rel, r, world, staged))
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
