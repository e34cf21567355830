"""Process topology of the runtime: the torchrun environment, the device, and process groups per mesh axis.

All rank arithmetic comes from :class:`shardckpt.format.layout.Mesh`; this module only turns it into live
``torch.distributed`` process groups. A :class:`ProcessMesh` without a backend is a single process
that never calls ``torch.distributed`` (the fast path for single-process tests and tools).
"""

from __future__ import annotations

import datetime
import logging
import os
from dataclasses import dataclass, field
from typing import Any
from collections.abc import Mapping

import torch
import torch.distributed as dist

from shardckpt.checkpoint.rendezvous import init_default_group
from shardckpt.errors import ConfigError
from shardckpt.format.layout import REPLICATE_AXIS, SHARD_AXIS, Mesh

log = logging.getLogger(__name__)

#: Environment variables set by ``torchrun`` (and by :mod:`shardckpt.training.launch`).
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")

#: Default process-group timeout: a collective that waits longer raises on every waiting rank.
DEFAULT_TIMEOUT_S = 300.0


@dataclass(frozen=True, slots=True)
class TorchrunEnv:
    """The launcher's view of this process: ranks and the rendezvous address."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29500

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ConfigError(f"WORLD_SIZE is {self.world_size}; it must be >= 1")
        if not 0 <= self.rank < self.world_size:
            raise ConfigError(f"RANK is {self.rank}; it must be in [0, WORLD_SIZE={self.world_size})")
        if self.local_rank < 0:
            raise ConfigError(f"LOCAL_RANK is {self.local_rank}; it must be >= 0")
        if not 0 < self.master_port < 65536:
            raise ConfigError(f"MASTER_PORT is {self.master_port}; it must be a TCP port (1..65535)")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> TorchrunEnv:
        """Read ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``.

        Absent variables take the single-process defaults; malformed ones raise one
        :class:`ConfigError` that names every offender.
        """
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        bad = []
        for var, field_name in (("RANK", "rank"), ("WORLD_SIZE", "world_size"),
                                ("LOCAL_RANK", "local_rank"), ("MASTER_PORT", "master_port")):
            if var in env:
                try:
                    values[field_name] = int(env[var])
                except ValueError:
                    bad.append(f"{var}={env[var]!r}")
        if bad:
            raise ConfigError(f"torchrun variables are not integers: {', '.join(bad)}")
        if "MASTER_ADDR" in env:
            values["master_addr"] = env["MASTER_ADDR"]
        return cls(**values)

    @property
    def is_launched(self) -> bool:
        return self.world_size > 1


def pick_device(local_rank: int, backend: str | None = None) -> torch.device:
    """``cuda:LOCAL_RANK`` when CUDA is available (and the backend is not gloo), else CPU."""
    if backend != "gloo" and torch.cuda.is_available():
        return torch.device("cuda", local_rank % max(1, torch.cuda.device_count()))
    return torch.device("cpu")


def default_backend(device: torch.device) -> str:
    """NCCL on CUDA, gloo on CPU."""
    return "nccl" if device.type == "cuda" else "gloo"


@dataclass(eq=False)
class ProcessMesh:
    """A :class:`Mesh` made live on this rank: its device and one process group per mesh axis.

    Invariants: ``mesh.world_size`` equals the process-group world size; ``shard_group`` holds
    ``mesh.ranks_along("dp_shard", rank)`` in shard-rank order (so shard rank == rank inside it);
    ``backend is None`` means a single process that never calls ``torch.distributed``.
    """

    mesh: Mesh
    rank: int
    device: torch.device
    backend: str | None = None
    timeout_s: float = DEFAULT_TIMEOUT_S
    shard_group: Any = None
    replicate_group: Any = None
    world_group: Any = None
    #: Ranks per node (a node holds ranks ``[n * K, (n + 1) * K)``); ``None``: one node. Decides
    #: which collectives count as cross-node traffic and the groups of the ZeRO++ options.
    ranks_per_node: int | None = None
    _node_groups: Any = None
    _spans: dict[str, bool] = field(default_factory=dict)

    def __post_init__(self) -> None:
        k = self.ranks_per_node
        if k is not None and (not isinstance(k, int) or isinstance(k, bool) or k < 1):
            raise ConfigError(f"ranks_per_node is {k!r}; it must be a whole number >= 1")

    @classmethod
    def single(cls, device: torch.device | str = "cpu") -> ProcessMesh:
        """One process, no ``torch.distributed``: every collective is a local copy."""
        return cls(Mesh.for_world(1), 0, torch.device(device))

    @classmethod
    def from_process_group(cls, mesh: Mesh | None = None, device: torch.device | None = None,
                           timeout_s: float | None = None,
                           ranks_per_node: int | None = None) -> ProcessMesh:
        """Build on the initialized default group; creates the per-axis subgroups when R > 1.

        ``timeout_s`` (for the subgroups) defaults to the default group's own timeout.
        ``ranks_per_node`` defaults to ``LOCAL_WORLD_SIZE`` (torchrun's ranks per node) when
        set, else the whole world is one node. Called on every rank (``new_group`` is
        collective).
        """
        if not dist.is_initialized():
            raise ConfigError("torch.distributed is not initialized; call init_distributed() first")
        world, rank = dist.get_world_size(), dist.get_rank()
        mesh = mesh or Mesh.for_world(world)
        if mesh.world_size != world:
            raise ConfigError(f"mesh {mesh.describe()} has {mesh.world_size} ranks but the process "
                              f"group has {world}")
        backend = str(dist.get_backend())
        device = device or pick_device(int(os.environ.get("LOCAL_RANK", "0")), backend)
        if timeout_s is None:
            timeout_s = _group_timeout_s(device)
        if ranks_per_node is None:
            ranks_per_node = _env_ranks_per_node()
        pm = cls(mesh, rank, device, backend, timeout_s, world_group=dist.group.WORLD,
                 ranks_per_node=ranks_per_node)
        pm.shard_group = pm._axis_group(SHARD_AXIS)
        pm.replicate_group = pm._axis_group(REPLICATE_AXIS)
        return pm

    def _axis_group(self, axis: str) -> Any:
        if self.mesh.size(axis) == self.mesh.world_size:
            return dist.group.WORLD
        if self.mesh.size(axis) == 1:
            return None
        mine = None
        seen: set[tuple[int, ...]] = set()
        for r in range(self.mesh.world_size):  # every rank creates every group, in one order
            ranks = tuple(self.mesh.ranks_along(axis, r))
            if ranks in seen:
                continue
            seen.add(ranks)
            group = dist.new_group(list(ranks), timeout=datetime.timedelta(seconds=self.timeout_s))
            if self.rank in ranks:
                mine = group
        return mine

    @property
    def world_size(self) -> int:
        return self.mesh.world_size

    @property
    def shard_degree(self) -> int:
        return self.mesh.shard_degree

    @property
    def shard_rank(self) -> int:
        return self.mesh.shard_rank(self.rank)

    @property
    def replicate_rank(self) -> int:
        return self.mesh.replicate_rank(self.rank)

    @property
    def is_distributed(self) -> bool:
        return self.backend is not None

    @property
    def node_size(self) -> int:
        """Ranks per node (the whole world when no node size was given)."""
        return self.ranks_per_node or self.world_size

    def node_of(self, rank: int) -> int:
        return rank // self.node_size

    def spans_nodes(self, ranks: list[int] | tuple[int, ...]) -> bool:
        """True if the group of global ``ranks`` holds ranks of more than one node."""
        return len({self.node_of(r) for r in ranks}) > 1

    def axis_spans_nodes(self, axis: str) -> bool:
        """True if this rank's group along mesh ``axis`` spans nodes (its traffic is cross-node)."""
        if axis not in self._spans:
            self._spans[axis] = self.spans_nodes(self.mesh.ranks_along(axis, self.rank))
        return self._spans[axis]

    @property
    def world_spans_nodes(self) -> bool:
        return self.node_size < self.world_size

    def node_groups(self) -> tuple[Any, Any]:
        """(this rank's node group, its cross-node group: the ranks of every node with the same
        local index), created on first use and cached; ``None`` for a group of one rank.

        Called on every rank, in the same order (``new_group`` is collective); the world size
        must be a multiple of :attr:`node_size`.
        """
        if self._node_groups is None:
            k, world = self.node_size, self.world_size
            if world % k:
                raise ConfigError(f"world size {world} is not a multiple of ranks_per_node {k}")
            nodes = [list(range(n * k, (n + 1) * k)) for n in range(world // k)]
            cross = [list(range(j, world, k)) for j in range(k)]
            self._node_groups = (self._subgroup(nodes), self._subgroup(cross))
        return self._node_groups

    def _subgroup(self, partition: list[list[int]]) -> Any:
        """Every rank creates every group of ``partition`` in one order; returns its own."""
        if len(partition[0]) == 1:
            return None
        if len(partition) == 1 and self.is_distributed:
            return dist.group.WORLD
        mine = None
        for ranks in partition:
            group = dist.new_group(ranks, timeout=datetime.timedelta(seconds=self.timeout_s))
            if self.rank in ranks:
                mine = group
        return mine

    @property
    def node_rank(self) -> int:
        """This rank's index inside its node."""
        return self.rank % self.node_size

    def describe(self) -> str:
        nodes = (f", {self.world_size // self.node_size} nodes x {self.node_size}"
                 if self.ranks_per_node else "")
        return (f"rank {self.rank}/{self.world_size} on {self.device} "
                f"({self.backend or 'no backend'}, mesh {self.mesh.describe()}{nodes})")


def _group_timeout_s(device: torch.device) -> float:
    """The default group's collective timeout, where the backend exposes it."""
    try:
        backend = dist.group.WORLD._get_backend(device)  # type: ignore[union-attr]
        return float(backend.options._timeout.total_seconds())
    except (AttributeError, RuntimeError):
        return DEFAULT_TIMEOUT_S


def _env_ranks_per_node(environ: Mapping[str, str] | None = None) -> int | None:
    """``LOCAL_WORLD_SIZE`` (set by torchrun) as ranks per node, if set and a positive integer."""
    value = (os.environ if environ is None else environ).get("LOCAL_WORLD_SIZE", "")
    try:
        k = int(value)
    except ValueError:
        return None
    return k if k >= 1 else None


def init_distributed(*, backend: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S,
                     replicate: int = 1, environ: Mapping[str, str] | None = None,
                     ranks_per_node: int | None = None) -> ProcessMesh:
    """Initialize ``torch.distributed`` from the torchrun variables and return the :class:`ProcessMesh`.

    ``ranks_per_node`` (default ``LOCAL_WORLD_SIZE``, else one node) says which ranks share a
    node: it decides which traffic counts as cross-node and the groups of the ZeRO++ options.

    The device comes from ``LOCAL_RANK`` (``cuda:LOCAL_RANK`` with NCCL when CUDA exists, else CPU
    with gloo). A collective that waits longer than ``timeout_s`` raises on every waiting rank
    (surfaced as :class:`shardckpt.errors.CollectiveError`). Without ``WORLD_SIZE`` in the
    environment and no initialized group, returns :meth:`ProcessMesh.single`. Called on every rank.
    """
    env = TorchrunEnv.from_env(environ)
    device = pick_device(env.local_rank, backend)
    backend = backend or default_backend(device)
    if not dist.is_initialized():
        source = os.environ if environ is None else environ
        if "WORLD_SIZE" not in source:
            return ProcessMesh.single(device)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        init_default_group(backend, env.master_addr, env.master_port, env.rank, env.world_size,
                           datetime.timedelta(seconds=timeout_s))  # its store on MASTER_ADDR only
        log.info("initialized %s process group: rank %d of %d on %s", backend, env.rank,
                 env.world_size, device)
    if ranks_per_node is None:
        ranks_per_node = _env_ranks_per_node(environ)
    return ProcessMesh.from_process_group(Mesh.for_world(dist.get_world_size(), replicate),
                                          device, ranks_per_node=ranks_per_node)


def current_process_mesh() -> ProcessMesh:
    """The default group as a plain ZeRO mesh if ``torch.distributed`` is up, else a single process."""
    if dist.is_available() and dist.is_initialized():
        return ProcessMesh.from_process_group()
    return ProcessMesh.single()
