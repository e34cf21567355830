"""With the optimizer offloaded and a compute dtype narrower than the master's, the device keeps
the compute-dtype weight shard only (as DeepSpeed's ZeRO-Offload does).

The fp32 master of such a trained group lives in the offload store alone
(:class:`~shardckpt.runtime.offload.OffloadStore`: host memory or its file); the group's device
tensor, :attr:`FlatParamGroup.shard`, is the compute-dtype shard the all-gathers read, and
``group.master`` is ``None``. Every change of the master goes through the store, and the device
shard is then cast from it on the host with ``Tensor.to`` (round to nearest even), the cast the
resident path applies at gather time, so the gathered bits are the same. Frozen groups and groups
computing in the master dtype keep their master on the device (there it is the weights).

ZeRO++ qwZ quantizes the fp32 master shard; from the compute shard its int8 blocks and scales
would differ from a resident run's, so qwZ with such a group is refused (one ConfigError).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import torch

from shardckpt.errors import ConfigError
from shardckpt.runtime.offload import OffloadStore, UpdateFn

#: A :class:`~shardckpt.runtime.flat.FlatParamGroup` (not imported: flat imports this module).
Group = Any

__all__ = ["OffloadedMaster", "master_tensor", "offload_master", "open_store", "store_master",
           "store_state", "store_step"]


class OffloadedMaster:
    """The binding of one flat group to its master in the offload store."""

    def __init__(self, store: OffloadStore, name: str) -> None:
        self.store = store
        self.name = name

    def live(self) -> Any:
        """The store's master: the live host tensor (``"cpu"``) or its ``OffloadedShard``."""
        return self.store.local_master(self.name)

    def read(self) -> torch.Tensor:
        """The fp32 master on the host (the live tensor with ``"cpu"``, a fresh copy else)."""
        return self.store.read_master(self.name)

    def write(self, values: torch.Tensor) -> None:
        """Make ``values`` (fp32, any device) the master."""
        self.store.pull_master(self.name, values)


def narrower(group: Group) -> bool:
    """True if ``group`` is trained, its master on the device, and computes in fewer bytes."""
    master = group.master
    return (master is not None and group.trainable
            and group.dtype.itemsize < master.dtype.itemsize)


def offload_master(group: Group, store: OffloadStore) -> None:
    """Move ``group``'s master into ``store`` and keep the compute-dtype shard on the device, if
    it is :func:`narrower`; else leave it alone."""
    if not narrower(group):
        return
    master = group.master
    binding = OffloadedMaster(store, group.name)
    host = master.detach().to("cpu", copy=True)
    binding.write(host)
    group.offloaded = binding
    group.shard = host.to(group.dtype).to(master.device)
    group.master = None
    group.master_changed = False


def master_tensor(group: Group) -> torch.Tensor:
    """``group``'s master shard on the device: ``master``, or a copy of the store's."""
    if group.offloaded is None:
        return group.master
    return group.offloaded.read().to(group.shard.device)


def store_master(group: Group, master: torch.Tensor) -> None:
    """``master`` (from :func:`master_tensor`, written) becomes ``group``'s master; the compute
    shard is re-derived."""
    if group.offloaded is not None:
        group.offloaded.write(master)
    group.refresh(reload=True)


def set_shard(group: Group, master: torch.Tensor) -> None:
    """Cast the fp32 ``master`` on the host into ``group``'s device compute shard."""
    with torch.no_grad():
        group.shard.copy_(master.to("cpu").to(group.dtype))


def open_store(engine: Any, trained: Mapping[str, Group], kinds: Sequence[str],
               on_reduced: Callable[[Group], None]) -> OffloadStore:
    """The offload store of ``engine``'s ``trained`` groups, its hooks set and the masters of
    the groups computing in a narrower dtype moved into it (:func:`offload_master`)."""
    qwz = [n for n, g in trained.items() if narrower(g) and g.zeropp is not None and g.zeropp.qwz]
    if qwz:
        raise ConfigError(
            f"ZeRO++ qwZ with offload_optimizer and a compute dtype narrower than the fp32 master "
            f"(flat groups {qwz[:3]}): qwZ quantizes the master shard, which offload keeps off "
            "the device, and quantizing the compute shard instead would not give a resident "
            "run's bits; turn qwZ off, or compute in fp32")
    pm = engine.process_mesh
    store = OffloadStore(engine.offload, {n: g.shard_numel for n, g in trained.items()},
                         kinds, pm.device, pm.rank)
    engine.set_offload_hooks(on_reduced, store.drain, store.scale_grads)
    for g in trained.values():
        offload_master(g, store)
    return store


def store_state(store: OffloadStore, group: Group | None) -> dict[str, Any]:
    """``group``'s kinds in ``store``, its ``master`` first when the store alone holds it."""
    name = "" if group is None else group.name
    master = {} if group is None or group.offloaded is None else {"master": group.offloaded.live()}
    return {**master, **store.local_state(name)}


def store_step(store: OffloadStore, groups: Mapping[str, Group],
               work: Mapping[str, Any], update: UpdateFn) -> None:
    """The offloaded step of ``work``'s groups: a device master changed since the last step (a
    load, ...) goes into the store first; the updated masters come back into the shards."""
    early = store.early_names
    for name in work:
        g = groups[name]
        if g.master_changed and g.offloaded is None and name not in early:
            store.pull_master(name, g.master)
    store.step(work, {n: groups[n].shard for n in work}, {n: groups[n].grad for n in work},
               update)
