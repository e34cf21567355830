"""Pure layout math: meshes, flat groups, padding and shard ranges.

No I/O, no torch, no torch.distributed. Everything here is a value.

Invariants (property-tested in ``tests/test_layout_props.py``):

* every flat group's ``padded_numel`` is a multiple of ``16 * S`` and at least its ``numel``;
  shard rank ``r`` owns elements ``[r * s, (r + 1) * s)`` of every group, ``s = padded_numel / S``;
* the parameters of a group are disjoint and tile ``[0, numel)`` in order; ``[numel, padded)`` is
  padding (zero, meaningless).

The reshard plan between two layouts is in :mod:`shardckpt.format.reshard_plan`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from collections.abc import Iterable, Mapping, Sequence

from shardckpt.errors import ConfigError
from shardckpt.format.dtypes import MASTER_DTYPE, itemsize

#: Shards are padded to a multiple of this many elements (alignment for vectorised kernels and
#: for the safetensors data section).
SHARD_ALIGN = 16

SHARD_AXIS = "dp_shard"
REPLICATE_AXIS = "dp_replicate"


def prod(shape: Iterable[int]) -> int:
    return math.prod(shape)


def padded_numel(numel: int, shard_degree: int) -> int:
    """Smallest multiple of ``16 * S`` that is at least ``numel`` (and at least one multiple)."""
    quantum = SHARD_ALIGN * shard_degree
    return max(1, -(-numel // quantum)) * quantum


# --------------------------------------------------------------------------------------- mesh


@dataclass(frozen=True, slots=True)
class Mesh:
    """Named axes, outermost first. Rank = row-major index over the axes (like ``init_device_mesh``).

    Plain ZeRO/FSDP is ``(("dp_replicate", 1), ("dp_shard", S))``; HSDP has replicate > 1.
    """

    axes: tuple[tuple[str, int], ...]

    def __post_init__(self) -> None:
        names = [name for name, _ in self.axes]
        if len(set(names)) != len(names):
            raise ConfigError(f"mesh axis names repeat: {names}")
        for name, size in self.axes:
            if not isinstance(size, int) or isinstance(size, bool) or size < 1:
                raise ConfigError(f"mesh axis {name!r} has size {size!r}; sizes are integers >= 1")
        if SHARD_AXIS not in names:
            raise ConfigError(f"a mesh needs a {SHARD_AXIS!r} axis; got {names}")

    @classmethod
    def hsdp(cls, replicate: int, shard: int) -> Mesh:
        return cls(((REPLICATE_AXIS, replicate), (SHARD_AXIS, shard)))

    @classmethod
    def for_world(cls, world_size: int, replicate: int = 1) -> Mesh:
        """The mesh R x (world / R); refuses a world size not divisible by R."""
        if world_size < 1:
            raise ConfigError(f"world size must be >= 1; got {world_size}")
        if replicate < 1 or world_size % replicate:
            raise ConfigError(
                f"world size {world_size} is not divisible by the replicate degree {replicate}"
            )
        return cls.hsdp(replicate, world_size // replicate)

    def size(self, axis: str) -> int:
        for name, size in self.axes:
            if name == axis:
                return size
        return 1

    @property
    def shard_degree(self) -> int:
        return self.size(SHARD_AXIS)

    @property
    def replicate_degree(self) -> int:
        return self.size(REPLICATE_AXIS)

    @property
    def world_size(self) -> int:
        return prod(size for _, size in self.axes)

    def coords(self, rank: int) -> dict[str, int]:
        """Axis name -> index of ``rank`` along that axis."""
        if not 0 <= rank < self.world_size:
            raise ConfigError(f"rank {rank} is outside a mesh of {self.world_size}")
        out: dict[str, int] = {}
        for name, size in reversed(self.axes):
            out[name] = rank % size
            rank //= size
        return out

    def shard_rank(self, rank: int) -> int:
        return self.coords(rank)[SHARD_AXIS]

    def replicate_rank(self, rank: int) -> int:
        return self.coords(rank).get(REPLICATE_AXIS, 0)

    def ranks_along(self, axis: str, rank: int) -> list[int]:
        """Global ranks of the group along ``axis`` that contains ``rank``, in axis order."""
        names = [name for name, _ in self.axes]
        if axis not in names:
            return [rank]
        base = self.coords(rank)
        out = []
        for i in range(self.size(axis)):
            coords = dict(base, **{axis: i})
            r = 0
            for name, size in self.axes:
                r = r * size + coords[name]
            out.append(r)
        return out

    def describe(self) -> str:
        return " x ".join(f"{name}={size}" for name, size in self.axes)


# ------------------------------------------------------------------------------- param specs


@dataclass(frozen=True, slots=True)
class ParamInfo:
    """What a module says about one parameter; the input of :func:`build_layout`."""

    fqn: str
    shape: tuple[int, ...]
    dtype: str
    requires_grad: bool = True
    unit: str = ""


@dataclass(frozen=True, slots=True)
class ParamSpec:
    """One parameter inside a flat group: its elements are ``[offset, offset + numel)``."""

    fqn: str
    shape: tuple[int, ...]
    dtype: str
    group: str
    offset: int

    @property
    def numel(self) -> int:
        return prod(self.shape)


@dataclass(frozen=True, slots=True)
class FlatGroup:
    """Parameters of one unit sharing (dtype, requires_grad), flattened in order and padded."""

    name: str
    unit: str
    dtype: str
    requires_grad: bool
    numel: int
    padded_numel: int
    params: tuple[str, ...]

    @property
    def master_dtype(self) -> str:
        """dtype of the stored ``master`` state: fp32 for trained groups, own dtype if frozen."""
        return MASTER_DTYPE if self.requires_grad else self.dtype


def group_name(prefix: str, unit_index: int, dtype: str, requires_grad: bool) -> str:
    return f"{prefix}u{unit_index:04d}.{dtype}" + ("" if requires_grad else ".frozen")


@dataclass(frozen=True)
class Layout:
    """S, R, flat groups and param specs: everything needed to find any element of any tensor."""

    mesh: Mesh
    groups: tuple[FlatGroup, ...]
    params: tuple[ParamSpec, ...]
    _param_index: dict[str, ParamSpec] = field(init=False, repr=False, compare=False)
    _group_index: dict[str, FlatGroup] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_param_index", {p.fqn: p for p in self.params})
        object.__setattr__(self, "_group_index", {g.name: g for g in self.groups})

    @property
    def shard_degree(self) -> int:
        return self.mesh.shard_degree

    def param(self, fqn: str) -> ParamSpec:
        return self._param_index[fqn]

    def has_param(self, fqn: str) -> bool:
        return fqn in self._param_index

    def group(self, name: str) -> FlatGroup:
        return self._group_index[name]

    def shard_numel(self, group: FlatGroup | str) -> int:
        g = self.group(group) if isinstance(group, str) else group
        return g.padded_numel // self.shard_degree

    def shard_range(self, group: FlatGroup | str, shard_rank: int) -> tuple[int, int]:
        """Element range ``[start, end)`` of the flat group owned by ``shard_rank``."""
        s = self.shard_numel(group)
        return shard_rank * s, (shard_rank + 1) * s

    def group_params(self, group: FlatGroup | str) -> list[ParamSpec]:
        g = self.group(group) if isinstance(group, str) else group
        return [self._param_index[f] for f in g.params]

    def shard_pieces(self, group: FlatGroup | str,
                     shard_rank: int) -> tuple[list[tuple[ParamSpec, int, int]], int]:
        """What ``shard_rank``'s slice of ``group`` holds, in flat order: each parameter that
        overlaps it with the element range ``[start, end)`` *inside the parameter* that falls in
        the slice; then the number of padding elements that end the slice (the parameters tile
        ``[0, numel)``, so padding is whatever of the slice lies past ``numel``)."""
        g = self.group(group) if isinstance(group, str) else group
        lo, hi = self.shard_range(g, shard_rank)
        pieces = []
        for p in self.group_params(g):
            a, b = max(lo, p.offset), min(hi, p.offset + p.numel)
            if a < b:
                pieces.append((p, a - p.offset, b - p.offset))
        return pieces, hi - max(lo, min(hi, g.numel))

    def with_mesh(self, mesh: Mesh) -> Layout:
        """The same groups and params, padded for another mesh."""
        groups = tuple(
            FlatGroup(g.name, g.unit, g.dtype, g.requires_grad, g.numel,
                      padded_numel(g.numel, mesh.shard_degree), g.params)
            for g in self.groups
        )
        return Layout(mesh, groups, self.params)

    def param_infos(self) -> list[ParamInfo]:
        """The inputs that rebuild this layout (in group order)."""
        out = []
        for g in self.groups:
            for fqn in g.params:
                p = self._param_index[fqn]
                out.append(ParamInfo(p.fqn, p.shape, p.dtype, g.requires_grad, g.unit))
        return out


def build_layout(params: Sequence[ParamInfo], mesh: Mesh, prefix: str = "") -> Layout:
    """Group ``params`` per unit by (dtype, requires_grad) in order of first appearance.

    Units are numbered in order of first appearance; parameters keep their given order inside a
    group. ``prefix`` namespaces group names (one per checkpoint component).
    """
    seen: set[str] = set()
    dupes = sorted({p.fqn for p in params if p.fqn in seen or seen.add(p.fqn)})  # type: ignore[func-returns-value]
    if dupes:
        raise ConfigError(f"parameter names repeat: {', '.join(dupes)}")
    for p in params:
        itemsize(p.dtype)
        if any((not isinstance(d, int)) or d < 0 for d in p.shape):
            raise ConfigError(f"parameter {p.fqn!r} has an invalid shape {p.shape}")
    unit_index: dict[str, int] = {}
    members: dict[tuple[str, str, bool], list[ParamInfo]] = {}
    for p in params:
        ui = unit_index.setdefault(p.unit, len(unit_index))
        members.setdefault((p.unit, p.dtype, p.requires_grad), []).append(p)
        del ui
    groups: list[FlatGroup] = []
    specs: list[ParamSpec] = []
    for (unit, dtype, rg), plist in members.items():
        name = group_name(prefix, unit_index[unit], dtype, rg)
        offset = 0
        for p in plist:
            specs.append(ParamSpec(p.fqn, tuple(p.shape), dtype, name, offset))
            offset += prod(p.shape)
        groups.append(FlatGroup(name, unit, dtype, rg, offset,
                                padded_numel(offset, mesh.shard_degree),
                                tuple(p.fqn for p in plist)))
    return Layout(mesh, tuple(groups), tuple(specs))


def regroup(layout: Layout, unit_of: Mapping[str, str], order: Sequence[str] | None = None,
            mesh: Mesh | None = None, prefix: str = "") -> Layout:
    """Rebuild ``layout`` under another unit policy (``unit_of[fqn]``) and parameter order."""
    infos = {i.fqn: i for i in layout.param_infos()}
    names = list(order) if order is not None else list(infos)
    new = [ParamInfo(f, infos[f].shape, infos[f].dtype, infos[f].requires_grad,
                     unit_of.get(f, infos[f].unit)) for f in names]
    return build_layout(new, mesh or layout.mesh, prefix)
