"""DCP state as ``ZeroEngine`` flat groups: ``shardckpt import dcp SRC DST --ranks N``.

A DCP checkpoint of a model and its Adam-family optimizer (or SGD with momentum), in the layout
``torch.distributed.checkpoint.state_dict.get_state_dict`` gives (``{"model": ..., "optim": ...}``
or torchtitan's ``{<model keys>, "optimizer", "lr_scheduler", "dataloader", "train_state"}``), is
first imported with its chunks (:func:`shardckpt.interop.dcp.import_.import_dcp`, every check of that
import) into a local staging folder, then streamed from there into flat groups for ``N`` ranks:
fp32 masters, ``exp_avg``, ``exp_avg_sq`` (SGD: ``momentum_buffer``, when the optimizer state
holds no ``exp_avg``), the step and the hyper-parameters of each param group.

Which tensor is what: :func:`~shardckpt.interop.dcp.model_state.read_model`. Memory: one band of
at most ``buffer_bytes`` bytes of one tensor at a time.
"""

from __future__ import annotations

import logging
import tempfile
from contextlib import ExitStack
from typing import Any
from collections.abc import Callable, Iterator, Mapping, Sequence

from shardckpt.checkpoint.reader import CheckpointReader, as_storage

from shardckpt.checkpoint.writer import CheckpointSpec
from shardckpt.format.chunked import ChunkedTensor
from shardckpt.checkpoint.chunked_read import RangeSource, iter_elements
from shardckpt.errors import ConfigError, IntegrityError
from shardckpt.storage import DEFAULT_BATCH
from shardckpt.interop.dcp.config import DcpConfig, DcpOrigin
from shardckpt.interop.dcp.model_state import DcpModel, as_tensor, read_model
from shardckpt.interop.importer import ImportOptions, ImportPlan, get_importer, run_importer
from shardckpt.interop.importing import BLOCK_UNITS, compile_units, unit_of
from shardckpt.format.dtypes import itemsize
from shardckpt.format.layout import Layout, Mesh, ParamInfo, build_layout
from shardckpt.format.manifest import (
    MANIFEST_NAME, BufferSpec, Component, Manifest, default_states,
)
from shardckpt.format.records import PerRankState, RunExtras, param_groups, run_extras

log = logging.getLogger(__name__)

__all__ = ["import_dcp_flat", "plan_flat", "flat_spec", "flat_producer"]


def flat_producer(reader: RangeSource, model: DcpModel, layout: Layout, shard: int,
                  buffer_bytes: int) -> Callable[[Any], Iterator[Any]]:
    """Shard ``shard``'s ``<group>.<kind>`` states: masters in the group's master dtype (fp32;
    a frozen group's own dtype), moments fp32, then the padding."""
    import torch

    def cast(t: ChunkedTensor, a: int, b: int, dtype: str) -> Iterator[Any]:
        budget = max(1, buffer_bytes * itemsize(t.dtype) // itemsize(dtype))
        for data in iter_elements(reader, t, a, b, budget):
            if t.dtype == dtype:
                yield data
            else:
                yield as_tensor(data, t.dtype).to(getattr(torch, dtype)).view(torch.uint8).numpy()

    def produce(slot: Any) -> Iterator[Any]:
        gname, kind = slot.name.rsplit(".", 1)
        g = layout.group(gname)
        dtype = g.master_dtype if kind == "master" else "float32"
        pieces, padding = layout.shard_pieces(g, shard)
        for p, a, b in pieces:
            if kind != "master":
                t = model.moments[p.fqn][kind]
            else:
                t = model.params[p.fqn] if p.fqn in model.params else model.frozen[p.fqn]
            yield from cast(t, a, b, dtype)
        if padding:
            yield bytes(padding * itemsize(dtype))

    return produce


def _buffers(reader: CheckpointReader, model: DcpModel) -> Callable[[Any], Iterator[Any]]:
    def produce(slot: Any) -> Iterator[Any]:
        t = model.buffers[slot.name]
        yield from iter_elements(reader, t, 0, t.numel, 1 << 24)
    return produce


def import_dcp_flat(src: str, dst: str, ranks: int, replicate: int = 1,
                    units: Sequence[str] | None = None, model_key: str = "model",
                    optim_key: str | None = None,
                    storage_options: Mapping[str, Any] | None = None,
                    dst_storage_options: Mapping[str, Any] | None = None,
                    buffer_bytes: int = DEFAULT_BATCH, tmp_dir: str | None = None,
                    frozen: Sequence[str] = (), job: Any = None) -> Manifest:
    """Write the DCP checkpoint ``src`` as ``ZeroEngine`` flat groups for ``ranks`` ranks at
    ``dst`` (masters, Adam moments, step, hyper-parameters, frozen parameters, buffers; ``frozen``:
    the patterns of :func:`read_model`). Refuses a ``dst`` that
    holds a checkpoint; on any error nothing is committed. The source is staged, with its chunks,
    below ``tmp_dir`` (default: the system's temporary folder; about the source's size). The
    ``dcp`` importer (:mod:`shardckpt.interop.dcp.importer`) with ``ranks``."""

    options = ImportOptions(src, dst, ranks, replicate, None if units is None else tuple(units),
                            buffer_bytes, storage_options, dst_storage_options,
                            DcpConfig(model_key, optim_key, tuple(frozen), tmp_dir))
    return run_importer(get_importer("dcp"), options, job)


def flat_spec(reader: CheckpointReader, model: DcpModel, mesh: Mesh,
              units: Sequence[str] | None, src: str) -> tuple[CheckpointSpec, Layout]:
    """The spec (and layout) of ``model`` (:func:`read_model` of the chunked checkpoint of
    ``reader``) as flat groups for ``mesh``, its units by the patterns ``units`` (None: one per
    block); the extras name ``src`` as the source. What ``import dcp --ranks`` and
    ``reshard --format flat`` write."""
    pats = compile_units(units or BLOCK_UNITS)
    layout = build_layout([
        ParamInfo(f, t.shape, "float32" if f in model.params else t.dtype,
                  f in model.params, unit_of(f, pats))
        for f, t in model.tensors().items()], mesh, "model.")
    states = {g.name: default_states(g, model.kinds) for g in layout.groups}
    bufs = tuple(BufferSpec(f, t.shape, t.dtype) for f, t in model.buffers.items())
    steps = [g.step for g in param_groups(model.optimizer, reader.url)]
    step = model.step if model.step is not None else max(steps) if steps else None
    # source, dcp (null when the source recorded none), then step
    origin = run_extras(reader.manifest, reader.url).origin(DcpOrigin, reader.url)
    extras = RunExtras(step=step, source=str(src), other={DcpOrigin.KEY: origin and origin.to_doc()},
                       keys=("source", "dcp") + (("step",) if step is not None else ())).to_doc()
    spec = CheckpointSpec(mesh, {"model": Component("model", layout, states, model.aliases, bufs)},
                          model.optimizer, extras, PerRankState(world_size=mesh.world_size).to_doc())
    return spec, layout


def plan_flat(options: ImportOptions) -> ImportPlan:
    """The plan of :func:`import_dcp_flat`: the destination checked, the source imported with
    its chunks into a staging folder below ``config.tmp_dir`` (the plan holds it until it is
    closed) and read as a model (:func:`read_model`), the target spec; shard ``s`` and the
    buffers stream from the staged chunks. ``state`` is the :class:`DcpModel`."""
    from shardckpt.interop.dcp.import_ import import_dcp

    cfg, src, buffer_bytes = options.config, options.src, options.buffer_bytes
    assert isinstance(cfg, DcpConfig) and options.ranks is not None
    out = as_storage(options.dst, options.dst_storage_options)
    if out.exists(MANIFEST_NAME):
        raise ConfigError(f"{out.url_of(MANIFEST_NAME)} exists; import into an empty location")
    mesh = Mesh.for_world(options.ranks, options.replicate)
    with ExitStack() as stack:
        folder = stack.enter_context(tempfile.TemporaryDirectory(prefix="shardckpt-dcp-",
                                                                 dir=cfg.tmp_dir))
        import_dcp(src, f"{folder}/staged", options.storage_options)
        reader = CheckpointReader(f"{folder}/staged")
        try:
            model = read_model(reader, cfg.model_key, cfg.optim_key, cfg.frozen)
        except (ConfigError, IntegrityError) as e:  # name the source, not the staging folder
            raise type(e)(str(e).replace(reader.url, str(src))) from None
        spec, layout = flat_spec(reader, model, mesh, options.units, str(src))
        plan = ImportPlan(options, out, spec, "import dcp",
                          lambda s: flat_producer(reader, model, layout, s, buffer_bytes),
                          _buffers(reader, model), model, stack.pop_all())
    return plan
