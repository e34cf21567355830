"""An offload store between a sharded optimizer and its engine.

:func:`open_store` makes the store of the trained groups, moves the masters that the device need
not keep into it (:mod:`~shardckpt.runtime.offload.master`) and registers a
:class:`StoreListener` with the engine, the
:class:`~shardckpt.runtime.contracts.ReductionListener` that hands each reduced gradient to the
store (and, with ``offload_overlap_step``, runs that group's step on the store's worker).
:func:`store_state` and :func:`store_step` are what the optimizer reads and runs through it.
"""

from __future__ import annotations

from typing import Any
from collections.abc import Callable, Mapping, Sequence

import torch

from shardckpt.errors import ConfigError
from shardckpt.runtime.contracts import ShardedEngine
from shardckpt.runtime.offload.master import Group, narrower, offload_master
from shardckpt.runtime.offload.store import OffloadStore, UpdateFn

__all__ = ["StoreListener", "open_store", "store_state", "store_step"]


class StoreListener:
    """The engine's reduction listener for an offloaded optimizer.

    ``update`` is the optimizer's update of one group (master, grad, state kinds, work items);
    ``items(name)`` the work items of group ``name`` with the hyper-parameters as they are now.
    """

    def __init__(self, engine: ShardedEngine, store: OffloadStore, update: UpdateFn,
                 items: Callable[[str], Any]) -> None:
        self.engine = engine
        self.store = store
        self.update = update
        self.items = items

    def grad_reduced(self, group: Group) -> None:
        """``group``'s reduction finished in backward: its gradient goes to the host, and with
        ``offload_overlap_step`` its step runs (:mod:`shardckpt.runtime.offload.store`)."""
        store = self.store
        if group.grad is None:
            return
        offload = self.engine.offload
        if offload is None or not offload.overlap_step:
            store.grad_ready(group.name, group.grad)
            return
        if not store.early_names:
            self.engine.before_update()  # the first change of this step's shards
        if group.master_changed and group.offloaded is None:
            store.pull_master(group.name, group.master)
        store.grad_ready(group.name, group.grad, group.shard, self.update,
                         self.items(group.name))

    def before_grads_change(self) -> None:
        """The host copies of the reduced gradients are done (the store's worker drained)."""
        self.store.drain()

    def grads_scaled(self, coef: torch.Tensor) -> None:
        """Clipping scaled the reduced gradients: scale the host copies alike."""
        self.store.scale_grads(coef)


def open_store(engine: ShardedEngine, trained: Mapping[str, Group], kinds: Sequence[str],
               update: UpdateFn, items: Callable[[str], Any]) -> OffloadStore:
    """The offload store of ``engine``'s ``trained`` groups, its :class:`StoreListener`
    registered with the engine and the masters of the groups computing in a narrower dtype
    moved into it (:func:`~shardckpt.runtime.offload.master.offload_master`)."""
    qwz = [n for n, g in trained.items() if narrower(g) and g.zeropp is not None and g.zeropp.qwz]
    if qwz:
        raise ConfigError(
            f"ZeRO++ qwZ with offload_optimizer and a compute dtype narrower than the fp32 master "
            f"(flat groups {qwz[:3]}): qwZ quantizes the master shard, which offload keeps off "
            "the device, and quantizing the compute shard instead would not give a resident "
            "run's bits; turn qwZ off, or compute in fp32")
    pm = engine.process_mesh
    assert engine.offload is not None
    store = OffloadStore(engine.offload, {n: g.shard_numel for n, g in trained.items()},
                         kinds, pm.device, pm.rank)
    engine.set_reduction_listener(StoreListener(engine, store, update, items))
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
