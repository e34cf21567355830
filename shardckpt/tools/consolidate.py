"""Consolidate a sharded checkpoint into Hugging Face safetensors, streaming with bounded memory.

Output in ``DST`` (component ``model`` by default):

* ``model-0000i-of-0000K.safetensors``: parameters by FQN in their original shapes, then persistent
  buffers; each file at most ``max_shard_size`` bytes, header included (a single larger tensor gets
  a file of its own). Always with an index, even for K = 1: ``transformers`` loads either form,
  and one commit rule serves both.
* ``model.safetensors.index.json`` (``metadata.total_size`` = tensor bytes, ``weight_map``):
  **written last, it commits DST**; a failed or killed run leaves no new index.
* ``config.json`` when the manifest carries ``extras["hf_config"]``, with ``torch_dtype`` and
  ``dtype`` set to the output dtype; tokenizer and generation files copied from a model folder
  on request (:mod:`shardckpt.interop.hf.files`).
* ``--optimizer``: ``optimizer-0000i-of-0000K.safetensors`` with ``"<fqn>.<kind>"`` in fp32, and
  ``optimizer.safetensors.index.json`` whose metadata adds the optimizer name and param groups
  (``params``, ``hparams``, ``step``).
* ``shardckpt_consolidated.json``: provenance (source, save id, step, dtype, omitted aliases,
  the persistent buffers left out: written only with ``keep_buffers``, see
  :func:`~shardckpt.tools.consolidate_plan.plan_consolidation`).

Replacing an earlier consolidation never leaves DST without a loadable one: the new weights are
written beside the old ones under names the old index does not use, the index is replaced in one
atomic step (local: rename; object stores: one PUT, the last), and only then are the old weight
files that the new index does not name removed.

Invariants:

* Values come from the ``master`` state (fp32; frozen groups: their own dtype). Floating tensors,
  buffers included, are cast to the requested dtype, as ``model.to(dtype).save_pretrained()``
  does; integer and bool tensors keep theirs. bf16 is round-to-nearest-even on the float32 bit
  pattern, bit-identical to torch's CPU cast, NaN included (``0xFFFF``); float64 goes through
  float32 first, as torch does.
* Tied parameters are written once, under the canonical FQN; aliases (``lm_head.weight``) are not
  written, as ``save_pretrained`` does, and are listed in the provenance file.
* The output depends only on the tensors, not on the world size, mesh or unit policy.
* Memory is about ``buffer_bytes`` (plus up to two checksum chunks per range being read), never a
  tensor: a file's header is written first (shapes are known from the manifest), then tensors
  are streamed in pieces read with checked ranged reads.

Does not import torch.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import time
import uuid
from dataclasses import dataclass
from typing import Any
from collections.abc import Callable, Mapping, Sequence

from shardckpt.checkpoint.chunked_read import ChunkedPieces
from shardckpt.checkpoint.job import Job, open_readers
from shardckpt.checkpoint.pieces import PieceReader, cast_bytes
from shardckpt.checkpoint.reader import CheckpointReader, as_storage
from shardckpt.errors import ConfigError, ShardckptError
from shardckpt.format.dtypes import itemsize
from shardckpt.format.manifest import DEFAULT_CHUNK_SIZE
from shardckpt.interop.hf.files import CONFIG, WEIGHT_NAME, config_bytes, copy_files, files_to_copy
from shardckpt.storage import DEFAULT_BUFFER, Storage
from shardckpt.tools.consolidate_plan import (
    DEFAULT_MAX_SHARD_SIZE, ConsolidationPlan, OutFile, plan_consolidation,
)

__all__ = [
    "MODEL_INDEX", "OPTIMIZER_INDEX", "PROVENANCE", "ConsolidateResult", "Installed", "OutputNames",
    "Target", "commit_target", "consolidate", "piece_reader", "prepare_target", "result_of",
    "write_consolidation",
]

log = logging.getLogger(__name__)

MODEL_INDEX = "model.safetensors.index.json"
OPTIMIZER_INDEX = "optimizer.safetensors.index.json"
PROVENANCE = "shardckpt_consolidated.json"
_OUTPUT_NAME = re.compile(r"^(model|optimizer)(-[0-9]{5}-of-[0-9]{5})?(-[0-9a-f]{8})?\.safetensors"
                          r"(\.index\.json|\.partial-[0-9a-f]+)?\Z|^shardckpt_consolidated\.json\Z")


# --------------------------------------------------------------------------------- write (effectful)


@dataclass(frozen=True)
class ConsolidateResult:
    url: str
    source: str
    save_id: str
    step: int | None
    dtype: str
    component: str
    files: tuple[tuple[str, int], ...]            # (name, bytes)
    optimizer_files: tuple[tuple[str, int], ...]
    tensors: int
    total_size: int                               # tensor bytes of the model set (index total_size)
    omitted_aliases: Mapping[str, str]
    bytes_read: int
    bytes_written: int
    seconds: float
    left_out_buffers: tuple[str, ...] = ()        # persistent buffers not written
    has_config: bool = True                       # a config.json was written (or copied)


def _index(files: Sequence[OutFile], extra: Mapping[str, Any] | None = None) -> bytes:
    meta = {"total_size": sum(f.data_bytes for f in files), **(extra or {})}
    wmap = {t.name: f.name for f in files for t in f.tensors}
    return json.dumps({"metadata": meta, "weight_map": wmap}, indent=2).encode()


def _write_file(storage: Storage, rel: str, f: OutFile, engine: PieceReader,
                progress: Callable[[int], None] | None) -> int:
    items = [(t.numel, (t.source,)) for t in f.tensors]
    with storage.writer(rel, DEFAULT_CHUNK_SIZE) as w:
        w.write(f.header)
        pieces = engine.pieces(items)
        try:
            for p in pieces:
                t = f.tensors[p.index]
                w.write(cast_bytes(p.data[0], t.source.dtype, t.dtype))
                if progress:
                    progress(len(p.data[0]))
        finally:
            pieces.close()  # type: ignore[attr-defined]
        size, _, _ = w.close()
    if size != f.size:
        raise ShardckptError(f"{storage.url_of(rel)}: wrote {size} bytes, planned {f.size}")
    return size


def _fresh_names(files: Sequence[OutFile], existing: Sequence[str], token: str) -> tuple[OutFile, ...]:
    """``files`` under their usual names, or, when one of those is taken in DST (an earlier
    consolidation's), all under names carrying ``token``: the old files stay whole until the new
    index is in place."""
    if not set(f.name for f in files) & set(existing):
        return tuple(files)
    return tuple(dataclasses.replace(f, name=f.name.replace(".safetensors", f"-{token}.safetensors"))
                 for f in files)


def _install(storage: Storage, files: Sequence[OutFile], engine: PieceReader, token: str,
             progress: Callable[[int], None] | None) -> int:
    """Write ``files`` under their staging names (local: ``<name>.partial-<token>``; object
    stores: their own, an upload becoming visible only when complete), then give each its name
    once all are complete. On failure, remove what was written."""
    staged = [storage.staging_name(f.name, token) for f in files]
    done: list[str] = []
    written = 0
    try:
        for f, rel in zip(files, staged, strict=True):
            done.append(rel)
            written += _write_file(storage, rel, f, engine, progress)
        for f, rel in zip(files, staged, strict=True):
            if rel != f.name:
                storage.install(rel, f.name)
                done[done.index(rel)] = f.name
    except BaseException:
        _remove_quietly(storage, done)
        raise
    return written


def _remove_quietly(storage: Storage, names: Sequence[str]) -> None:
    for rel in names:
        try:
            storage.rm(rel)
        except ShardckptError:
            log.warning("could not remove partial %s", storage.url_of(rel))


@dataclass
class Target:
    """Where a consolidation goes and under which names: :func:`prepare_target`'s answer."""

    storage: Storage
    existing: list[str]
    token: str
    model_files: tuple[OutFile, ...]
    opt_files: tuple[OutFile, ...]
    copy_source: Storage | None
    copies: list[str]


def prepare_target(reader: CheckpointReader, plan: ConsolidationPlan, dst: str | Storage,
                   overwrite: bool, storage_options: Mapping[str, Any] | None,
                   copy_from: str | Storage | None, token: str | None = None) -> Target:
    """Guard ``dst`` and name the output files (see :func:`write_consolidation`)."""
    storage = as_storage(dst, storage_options)
    if storage.url.rstrip("/") == reader.url.rstrip("/"):
        raise ConfigError(f"{storage.url}: the destination is the source; choose another directory")
    existing = storage.ls("")
    weights = [n for n in existing if WEIGHT_NAME.search(n) or _OUTPUT_NAME.match(n)]
    if weights and not overwrite:
        raise ConfigError(f"{storage.url} already holds weights ({', '.join(weights[:3])}"
                          f"{', ...' if len(weights) > 3 else ''}); pass --overwrite to replace "
                          "its consolidated files")
    source = as_storage(copy_from, storage_options) if copy_from is not None else None
    copies = files_to_copy(source, plan.hf_config is None) if source is not None else []
    token = token or uuid.uuid4().hex[:8]
    model_files = _fresh_names(plan.files, existing, token)
    opt_files = _fresh_names(plan.optimizer_files, existing, token)
    storage.ensure_free_space("", plan.output_bytes, "consolidate")
    return Target(storage, existing, token, model_files, opt_files, source, copies)


def piece_reader(reader: CheckpointReader, buffer_bytes: int) -> Any:
    """The engine that reads (and checks) the source's pieces of each output file."""
    m = reader.manifest
    if m.chunked is not None and not m.components:
        return ChunkedPieces(reader, buffer_bytes)
    return PieceReader([reader], buffer_bytes)


@dataclass(frozen=True)
class OutputNames:
    """The names rank 0 chose for the output files (what every process writes under)."""

    token: str
    model: tuple[str, ...]
    optimizer: tuple[str, ...]

    @classmethod
    def of(cls, target: Target) -> OutputNames:
        return cls(target.token, tuple(f.name for f in target.model_files),
                   tuple(f.name for f in target.opt_files))

    def to_doc(self) -> dict[str, Any]:
        return {"token": self.token, "model": list(self.model), "opt": list(self.optimizer)}

    @classmethod
    def from_doc(cls, doc: Mapping[str, Any]) -> OutputNames:
        return cls(doc["token"], tuple(doc["model"]), tuple(doc["opt"]))

    def target(self, storage: Storage, plan: ConsolidationPlan) -> Target:
        """The target of a process other than rank 0: the names alone (rank 0 commits)."""
        def named(files: Sequence[OutFile], names: Sequence[str]) -> tuple[OutFile, ...]:
            return tuple(dataclasses.replace(f, name=n) for f, n in zip(files, names, strict=True))

        return Target(storage, [], self.token, named(plan.files, self.model),
                      named(plan.optimizer_files, self.optimizer), None, [])


@dataclass(frozen=True)
class Installed:
    """What one process wrote: weight-file bytes written, source bytes read."""

    written: int
    read: int

    def to_doc(self) -> dict[str, int]:
        return {"written": self.written, "read": self.read}


def write_consolidation(reader: CheckpointReader, plan: ConsolidationPlan, dst: str | Storage,
                        overwrite: bool = False, storage_options: Mapping[str, Any] | None = None,
                        buffer_bytes: int = DEFAULT_BUFFER,
                        progress: Callable[[int], None] | None = None,
                        copy_from: str | Storage | None = None,
                        job: Job | None = None) -> ConsolidateResult:
    """Write ``plan`` to ``dst``; the model index is replaced last and commits DST.

    Refuses a DST holding weights or an index unless ``overwrite``; other files (a README,
    tokenizer files) are kept and do not need it. The new weights go beside the old ones, the
    index is replaced atomically, then our old outputs that the new index does not name are
    removed: a kill at any point leaves the old consolidation loadable or the new one complete.
    ``config.json`` is written from the manifest's ``hf_config``; ``copy_from`` names a model
    folder whose tokenizer and generation files (and ``config.json``, if the checkpoint has
    none) are copied. On failure, every weight file this run wrote is removed.

    Every process of ``job`` (one process alone: a job of one) calls it: rank 0 guards DST and
    names the files; each process writes its share of the weight files (balanced by bytes read
    and written); rank 0 writes the index, which commits DST, once every file is written.
    """
    job = job or Job.single()
    t0 = time.perf_counter()
    storage = as_storage(dst, storage_options)
    prepared, said = job.gather(
        lambda: prepare_target(reader, plan, storage, overwrite, storage_options, copy_from),
        lambda t: OutputNames.of(t).to_doc(), "consolidate: preparing the destination",
        root_only=True)
    target = prepared or OutputNames.from_doc(said[0]).target(storage, plan)
    files = target.model_files + target.opt_files
    costs = [f.size + sum(t.numel * itemsize(t.source.dtype) for t in f.tensors) for f in files]
    mine = [files[i] for i in job.share(costs)]
    engine = piece_reader(reader, buffer_bytes)
    installed: list[OutFile] = []

    def write() -> Installed:
        written = _install(storage, mine, engine, target.token, progress)
        installed.extend(mine)
        return Installed(written, engine.bytes_read)

    try:
        _, reports = job.gather(write, Installed.to_doc, "consolidate: writing the weight files")
    except BaseException:
        # written here, not committed (another process failed); a failed install removed its own
        _remove_quietly(storage, [f.name for f in installed])
        raise
    job.on_root(lambda: commit_target(reader, plan, target), "consolidate: committing")
    done = [Installed(**r) for r in reports]
    return result_of(reader, plan, target, sum(d.read for d in done),
                     sum(d.written for d in done), t0)


def commit_target(reader: CheckpointReader, plan: ConsolidationPlan, target: Target) -> None:
    """Once every weight file is written: copied files, config, the indexes (the model index
    last: the commit), provenance; then the earlier consolidation's files go. On failure before
    the commit, every new weight file is removed."""
    storage, model_files, opt_files = target.storage, target.model_files, target.opt_files
    try:
        if target.copy_source is not None:
            copy_files(target.copy_source, storage, target.copies)
        if plan.hf_config is not None:
            storage.put(CONFIG, config_bytes(plan.hf_config))
        if opt_files:
            storage.put(OPTIMIZER_INDEX, _index(opt_files, plan.optimizer_meta))
        storage.put(MODEL_INDEX, _index(model_files))  # the commit: atomic, the last weight file
    except BaseException:
        _remove_quietly(storage, [f.name for f in model_files + opt_files])  # none is the old output's
        raise
    provenance = {"source": plan.source or reader.url, "save_id": plan.save_id, "step": plan.step,
                  "component": plan.component, "dtype": plan.dtype,
                  "files": [f.name for f in model_files],
                  "optimizer_files": [f.name for f in opt_files],
                  "omitted_aliases": dict(plan.omitted_aliases),
                  "left_out_buffers": list(plan.left_out_buffers)}
    storage.put(PROVENANCE, json.dumps(provenance, indent=2).encode())
    keep = {f.name for f in model_files + opt_files} | {MODEL_INDEX, PROVENANCE}
    keep |= {OPTIMIZER_INDEX} if opt_files else set()
    for name in target.existing:
        if _OUTPUT_NAME.match(name) and name not in keep:
            storage.rm(name)


def result_of(reader: CheckpointReader, plan: ConsolidationPlan, target: Target, bytes_read: int,
              written: int, t0: float) -> ConsolidateResult:
    model_files, opt_files = target.model_files, target.opt_files
    secs = time.perf_counter() - t0
    log.info("consolidated %s -> %s: %d files, %d bytes in %.2f s", reader.url, target.storage.url,
             len(model_files) + len(opt_files), written, secs)
    return ConsolidateResult(target.storage.url, plan.source or reader.url, plan.save_id, plan.step,
                             plan.dtype, plan.component,
                             tuple((f.name, f.size) for f in model_files),
                             tuple((f.name, f.size) for f in opt_files),
                             sum(len(f.tensors) for f in plan.files), sum(f.data_bytes for f in plan.files),
                             dict(plan.omitted_aliases), bytes_read, written, secs,
                             plan.left_out_buffers, plan.hf_config is not None or CONFIG in target.copies)


def consolidate(src: str | CheckpointReader, dst: str | Storage, dtype: str = "bfloat16",
                max_shard_size: int = DEFAULT_MAX_SHARD_SIZE, component: str = "model",
                optimizer: bool = False, storage_options: Mapping[str, Any] | None = None,
                buffer_bytes: int = DEFAULT_BUFFER, progress: Callable[[int], None] | None = None,
                overwrite: bool = False, copy_from: str | Storage | None = None,
                prefix: str | None = None, job: Job | None = None,
                keep_buffers: bool = False) -> ConsolidateResult:
    """Consolidate checkpoint ``src`` into Hugging Face safetensors at ``dst`` (see the module
    doc): the source opened once (unless ``src`` is a reader already), planned, then
    :func:`write_consolidation`."""
    job = job or Job.single()
    reader = src if isinstance(src, CheckpointReader) else open_readers(
        job, [src], storage_options, "consolidate: opening the source")[0]
    plan = plan_consolidation(reader.manifest, dtype, max_shard_size, component, optimizer, reader.url,
                              prefix, keep_buffers)
    return write_consolidation(reader, plan, dst, overwrite, storage_options, buffer_bytes, progress,
                               copy_from, job)
