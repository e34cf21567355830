"""With the optimizer offloaded and a compute dtype narrower than the master's, the device keeps
the compute-dtype weight shard only (as DeepSpeed's ZeRO-Offload does).

The fp32 master of such a trained group lives in the offload store alone
(:class:`~shardckpt.runtime.offload.store.OffloadStore`: host memory or its file); the group's device
tensor, :attr:`FlatParamGroup.shard`, is the compute-dtype shard the all-gathers read, and
``group.master`` is ``None``. Every change of the master goes through the store, and the device
shard is then cast from it on the host with ``Tensor.to`` (round to nearest even), the cast the
resident path applies at gather time, so the gathered bits are the same. Frozen groups and groups
computing in the master dtype keep their master on the device (there it is the weights).

ZeRO++ qwZ quantizes the fp32 master shard; from the compute shard its int8 blocks and scales
would differ from a resident run's, so qwZ with such a group is refused (one ConfigError).
"""

from __future__ import annotations

from typing import Any

import torch

from shardckpt.runtime.offload.store import OffloadStore

#: A :class:`~shardckpt.runtime.flat.FlatParamGroup` (not imported: flat imports this module).
Group = Any

__all__ = ["OffloadedMaster", "master_tensor", "narrower", "offload_master", "set_shard",
           "store_master"]


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
