"""One flat group at run time: the master shard, the gathered buffer, and the gradient on its way out.

Invariants of a :class:`FlatParamGroup` on shard rank ``r`` (``s = layout.shard_numel(group)``):

* ``master`` is 1-D, ``s`` elements, ``group.master_dtype`` (fp32 if trained, the param's dtype if
  frozen); ``master[i]`` is element ``r * s + i`` of the flat group. Padding elements are zero.
* ``compute`` is the shard in the param dtype that all-gathers read: ``master`` itself when the
  dtypes agree, else a copy that :meth:`refresh` re-derives from ``master``.
* ``full`` is 1-D with ``padded_numel`` elements in the param dtype. Its storage holds 0 bytes
  unless the group is gathered. While gathered, each parameter's ``.data`` is a view of its
  ``[offset, offset + numel)`` elements; otherwise a 0-element placeholder. Autograd's saved views
  keep pointing at the same storage object, which a re-gather refills.
* ``grad`` (trained groups only) is ``None`` or the fp32 shard of the mean gradient over ranks.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from shardckpt.errors import ConfigError
from shardckpt.layout import FlatGroup, Layout
from shardckpt.runtime import collectives
from shardckpt.runtime.mesh import ProcessMesh


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype for a layout dtype name (``"bfloat16"`` -> ``torch.bfloat16``)."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ConfigError(f"unknown dtype {name!r}")
    return dtype


def dtype_name(dtype: torch.dtype) -> str:
    """The layout name of a torch dtype (``torch.float32`` -> ``"float32"``)."""
    return str(dtype).removeprefix("torch.")


class FlatParamGroup:
    """Runtime state of one :class:`~shardckpt.layout.FlatGroup` on this rank (see module docstring)."""

    def __init__(self, spec: FlatGroup, layout: Layout, params: Sequence[nn.Parameter],
                 pm: ProcessMesh) -> None:
        self.spec = spec
        self.pm = pm
        self.param_specs = layout.group_params(spec)
        self.params = list(params)
        if len(self.params) != len(self.param_specs):
            raise ConfigError(f"flat group {spec.name} has {len(self.param_specs)} specs but "
                              f"{len(self.params)} parameters")
        self.dtype = torch_dtype(spec.dtype)
        self.shard_numel = layout.shard_numel(spec)
        self.shard_start, self.shard_end = layout.shard_range(spec, pm.shard_rank)
        device = pm.device
        self.master = torch.zeros(self.shard_numel, dtype=torch_dtype(spec.master_dtype),
                                  device=device)
        self.compute = (self.master if self.master.dtype == self.dtype
                        else torch.zeros(self.shard_numel, dtype=self.dtype, device=device))
        self.full = torch.empty(spec.padded_numel, dtype=self.dtype, device=device)
        self._full_nbytes = self.full.untyped_storage().nbytes()
        self.full.untyped_storage().resize_(0)
        self._placeholder = torch.empty(0, dtype=self.dtype, device=device)
        self.gathered = False
        self.grad: torch.Tensor | None = None
        self._grad_full: torch.Tensor | None = None
        self._arrived = 0

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def trainable(self) -> bool:
        return self.spec.requires_grad

    # ------------------------------------------------------------------ gather / free

    def allocate(self) -> None:
        """Give ``full`` its storage back (contents undefined) and point the params into it."""
        if not self.gathered:
            self.full.untyped_storage().resize_(self._full_nbytes)
            self._point_params()
            self.gathered = True

    def gather(self) -> None:
        """All-gather ``compute`` from every shard rank into ``full``. Collective; idempotent."""
        if self.gathered:
            return
        self.allocate()
        with torch.no_grad():
            collectives.all_gather_shard(self.pm, self.full, self.compute)

    def free(self) -> None:
        """Drop the non-owned part: params become placeholders and ``full`` holds no bytes."""
        if not self.gathered:
            return
        for p in self.params:
            p.data = self._placeholder
        self.full.untyped_storage().resize_(0)
        self.gathered = False

    def _point_params(self) -> None:
        for p, spec in zip(self.params, self.param_specs):
            p.data = self.full[spec.offset:spec.offset + spec.numel].view(spec.shape)

    def shard_from_full(self) -> None:
        """Copy this rank's slice of the gathered ``full`` into ``master`` (and ``compute``)."""
        with torch.no_grad():
            owned = self.full[self.shard_start:self.shard_end]
            self.master.copy_(owned)
            if self.compute is not self.master:
                self.compute.copy_(owned)
            pad_from = max(0, self.spec.numel - self.shard_start)
            if pad_from < self.shard_numel:  # padding means nothing and is zero
                self.master[pad_from:].zero_()
                self.compute[pad_from:].zero_()

    def refresh(self) -> None:
        """Re-derive the compute shard from ``master`` (a no-op when they are one tensor)."""
        if self.compute is not self.master:
            with torch.no_grad():
                self.compute.copy_(self.master)

    # ---------------------------------------------------------------------- gradients

    def add_param_grad(self, index: int, grad: torch.Tensor) -> bool:
        """Copy one parameter's local gradient into the flat buffer; True once all have arrived."""
        if self._grad_full is None:
            self._grad_full = torch.zeros(self.spec.padded_numel, dtype=self.dtype,
                                          device=self.master.device)
        spec = self.param_specs[index]
        with torch.no_grad():
            self._grad_full[spec.offset:spec.offset + spec.numel].view(spec.shape).copy_(grad)
        self._arrived += 1
        return self._arrived == len(self.params)

    @property
    def has_pending_grad(self) -> bool:
        return self._grad_full is not None

    def reduce_grad(self, deterministic: bool) -> None:
        """Reduce-scatter the local flat gradient into ``grad`` (adding to it) and free the buffer.

        Collective: every rank calls it for the same groups in the same order.
        """
        if self._grad_full is None:
            return
        reduced = collectives.reduce_scatter_mean(self.pm, self._grad_full, deterministic)
        self._grad_full = None
        self._arrived = 0
        if self.grad is None:
            self.grad = reduced
        else:
            self.grad.add_(reduced)

    def zero_grad(self, set_to_none: bool = True) -> None:
        if set_to_none or self.grad is None:
            self.grad = None
        else:
            self.grad.zero_()
