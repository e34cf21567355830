"""A flat-group (``ZeroEngine``) checkpoint as DCP sees it: per-parameter tensors and values.

:class:`shardckpt.interop.dcp.storage.ShardckptReader` uses this view for a checkpoint without chunked tensors,
so that ``dcp.load`` + ``set_state_dict`` load a ``ZeroEngine`` checkpoint into an FSDP2 model and
optimizer at any world size, without a conversion step. The state dict it presents is the one
``get_state_dict(model, optimizer)`` gives, under ``{model_key: ..., optim_key: ...}``:

* ``<model_key>.<fqn>``: every parameter (its fp32 master; a frozen one in its own dtype), every
  tied alias (the same values), every persistent buffer;
* ``<optim_key>.state.<fqn>.<kind>`` for each optimizer state kind (``exp_avg``, ``exp_avg_sq``)
  and ``<optim_key>.state.<fqn>.step`` (a 0-d fp32 tensor, the param group's step);
* ``<optim_key>.param_groups.<i>.<name>``: the recorded hyper-parameters, ``params`` (the FQNs),
  and torch's AdamW defaults for the flags shardckpt does not record (``foreach``, ``fused``,
  ``capturable``, ``differentiable``, ``decoupled_weight_decay``).

Each parameter is presented as one chunk covering the whole tensor; the box DCP's planner asks for
(a row band for FSDP2's ``Shard(0)``) is read as the smallest element range of the flat groups that
holds it, from the shards that hold that range, CRC-checked. Memory: the requested box.
"""

from __future__ import annotations

import io
import warnings
from dataclasses import dataclass
from typing import Any

from shardckpt.checkpoint.reader import CheckpointReader
from shardckpt.errors import ManifestError
from shardckpt.format.layout import prod
from shardckpt.format.records import param_groups

__all__ = ["FlatView"]

#: torch.optim.AdamW's param-group flags shardckpt does not record, at their defaults.
ADAMW_FLAGS = {"foreach": None, "capturable": False, "differentiable": False, "fused": None}


@dataclass(frozen=True)
class _Entry:
    shape: tuple[int, ...]
    dtype: str
    kind: str             # "state" (fqn, kind), "buffer" (fqn), "scalar" (value)
    fqn: str = ""
    state: str = ""
    value: float = 0.0


class FlatView:
    """The tensors and values of a flat-group checkpoint, keyed as DCP keys them."""

    def __init__(self, reader: CheckpointReader, model_key: str = "model",
                 optim_key: str = "optim") -> None:
        m = reader.manifest
        if "model" not in m.components:
            raise ManifestError(f"{reader.url}: no 'model' component and no chunked tensors")
        self.reader, self.comp = reader, m.components["model"]
        lay = self.comp.layout
        self.params = {p.fqn: p for p in lay.params}
        self.tensors: dict[str, _Entry] = {}
        self.values: dict[str, Any] = {}
        #: DCP's planner data: each flattened key -> its path in the nested state dict.
        self.paths: dict[str, tuple[str | int, ...]] = {}
        for p in lay.params:
            dtype = lay.group(p.group).master_dtype
            self._tensor((model_key, p.fqn), _Entry(p.shape, dtype, "state", p.fqn, "master"))
        for alias, canon in self.comp.aliases.items():
            p = self.params[canon]
            dtype = lay.group(p.group).master_dtype
            self._tensor((model_key, alias), _Entry(p.shape, dtype, "state", canon, "master"))
        for b in self.comp.buffers:
            self._tensor((model_key, b.fqn), _Entry(b.shape, b.dtype, "buffer", b.fqn))
        if m.optimizer is not None:
            self._optimizer(m.optimizer, optim_key)

    def _tensor(self, path: tuple[str | int, ...], e: _Entry) -> None:
        key = ".".join(str(x) for x in path)
        self.tensors[key], self.paths[key] = e, path

    def _optimizer(self, opt: Any, key: str) -> None:
        for i, g in enumerate(param_groups(opt)):
            for fqn in g.params:
                p = self.params[fqn]
                kinds = [k for k, _ in self.comp.states.get(p.group, ()) if k != "master"]
                for kind in kinds:
                    self._tensor((key, "state", fqn, kind), _Entry(p.shape, "float32", "state",
                                                                   fqn, kind))
                if kinds:
                    self._tensor((key, "state", fqn, "step"), _Entry((), "float32", "scalar",
                                                                     value=float(g.step)))
            hp = {k: (tuple(v) if k == "betas" else v) for k, v in g.hparams.items()}
            if opt.name in ("adamw", "adam"):
                hp = {**ADAMW_FLAGS, "decoupled_weight_decay": opt.name == "adamw", **hp}
            for name, v in {**hp, "params": list(g.params)}.items():
                self.values[f"{key}.param_groups.{i}.{name}"] = v
                self.paths[f"{key}.param_groups.{i}.{name}"] = (key, "param_groups", i, name)

    def metadata(self, checkpoint_id: str, save_id: str) -> Any:
        import torch
        from torch.distributed.checkpoint.metadata import (
            BytesStorageMetadata, ChunkStorageMetadata, Metadata, StorageMeta, TensorProperties,
            TensorStorageMetadata,
        )

        sd: dict[str, Any] = {
            k: TensorStorageMetadata(TensorProperties(dtype=getattr(torch, e.dtype)),
                                     torch.Size(e.shape),
                                     [ChunkStorageMetadata(torch.Size([0] * len(e.shape)),
                                                           torch.Size(e.shape))])
            for k, e in self.tensors.items()}
        sd.update({k: BytesStorageMetadata() for k in self.values})
        return Metadata(sd, planner_data=dict(self.paths),
                        storage_meta=StorageMeta(checkpoint_id=checkpoint_id, save_id=save_id))

    def value(self, key: str) -> io.BytesIO:
        """A param-group value as DCP's planner reads values (``torch.save`` bytes)."""
        import torch

        if key not in self.values:
            raise ManifestError(f"{self.reader.url}: no value {key!r} in the checkpoint")
        buf = io.BytesIO()
        torch.save(self.values[key], buf)
        buf.seek(0)
        return buf

    def box(self, key: str, offsets: Any, lengths: Any) -> Any:
        """The box (``offsets``, ``lengths``) of tensor ``key`` as a tensor (a strided view)."""
        import torch

        e = self.tensors.get(key)
        if e is None:
            raise ManifestError(f"{self.reader.url}: no tensor {key!r} in the checkpoint")
        offsets, lengths = tuple(offsets), tuple(lengths)
        dtype = getattr(torch, e.dtype)
        if e.kind == "scalar":
            return torch.tensor(e.value, dtype=dtype)
        if prod(lengths) == 0:
            return torch.empty(lengths, dtype=dtype)
        strides = [1] * len(e.shape)
        for i in range(len(e.shape) - 2, -1, -1):
            strides[i] = strides[i + 1] * e.shape[i + 1]
        first = sum(o * s for o, s in zip(offsets, strides, strict=True))
        last = sum((o + n - 1) * s for o, n, s in zip(offsets, lengths, strides, strict=True)) + 1
        if e.kind == "buffer":
            _, view = self.reader.read_buffer(e.fqn)
            elem = dtype.itemsize
            data = bytes(view[first * elem:last * elem])
        else:
            data = self._elements(e.fqn, e.state, first, last)
        with warnings.catch_warnings():  # read-only bytes: the tensor is only copied from
            warnings.simplefilter("ignore", UserWarning)
            flat = torch.frombuffer(data, dtype=torch.uint8).view(dtype)
        return torch.as_strided(flat, lengths, tuple(strides))

    def _elements(self, fqn: str, kind: str, first: int, last: int) -> bytes:
        """Elements ``[first, last)`` of parameter ``fqn``'s ``kind``, from its shards."""
        p = self.params[fqn]
        return self.reader.param_elements(self.comp.layout, p.group, p.offset, kind, first, last)
