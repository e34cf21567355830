"""What the engine and its sharded optimizer ask of each other, as ``Protocol`` types.

:class:`~shardckpt.runtime.engine.ZeroEngine` implements :class:`ShardedEngine`;
:class:`~shardckpt.runtime.optim.ShardedOptimizer` implements :class:`EngineOptimizer`; an
offloaded optimizer's store registers a :class:`ReductionListener`
(:class:`~shardckpt.runtime.offload.attach.StoreListener`). Each side imports only this module,
so neither module imports the other.

Call order in one step: the optimizer calls ``check_grads_reduced()``, then ``before_update()``
(the engine runs its update hooks: an async checkpoint finishes staging), updates the trained
master shards in place, then ``after_step()`` (the engine re-derives the compute shards; in
stages 1 and 2 a collective). The engine reads the optimizer's per-element state through
``local_state()`` and releases offloaded state through ``close_offload()``. In backward, a
registered listener hears of each finished gradient reduction in order (``grad_reduced``), and is
told before the reduced gradients change in place (``before_grads_change``: a backward begins,
``zero_grad``, clipping) and after clipping scaled them (``grads_scaled``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol
from collections.abc import Iterator, Mapping

if TYPE_CHECKING:
    import torch
    from torch import nn

    from shardckpt.format.layout import Layout
    from shardckpt.runtime.flat import FlatParamGroup
    from shardckpt.runtime.mesh import ProcessMesh
    from shardckpt.runtime.offload.config import OffloadConfig


class EngineOptimizer(Protocol):
    """The optimizer side: what the engine and checkpoints call on an attached optimizer."""

    def local_state(self, group_name: str) -> dict[str, Any]:
        """State kind -> this rank's live shard of a trained flat group (a tensor, or an
        offloaded shard)."""
        ...

    def close_offload(self) -> None:
        """Release offloaded state (files removed); idempotent."""
        ...

    def optimizer_metadata(self) -> dict[str, Any]:
        """Name, state kinds and param groups (``params``, ``hparams``, ``step``) as JSON."""
        ...

    def load_optimizer_metadata(self, metadata: Mapping[str, Any]) -> None:
        """Restore hyper-parameters and steps from :meth:`optimizer_metadata`'s form."""
        ...


class ReductionListener(Protocol):
    """Told by the engine about the reduced gradient shards (an offloaded optimizer copies them
    to the host as they come). Called on the training thread."""

    def grad_reduced(self, group: FlatParamGroup) -> None:
        """``group``'s reduction finished: its ``grad`` is final for this backward."""
        ...

    def before_grads_change(self) -> None:
        """The reduced gradients are about to change in place: finish reading them."""
        ...

    def grads_scaled(self, coef: torch.Tensor) -> None:
        """Clipping multiplied every reduced gradient shard by ``coef``."""
        ...


class ShardedEngine(Protocol):
    """The engine side: what a sharded optimizer reads and calls."""

    @property
    def layout(self) -> Layout: ...

    @property
    def groups(self) -> Mapping[str, FlatParamGroup]: ...

    @property
    def process_mesh(self) -> ProcessMesh: ...

    @property
    def offload(self) -> OffloadConfig | None: ...

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]: ...

    def fqn_of(self, param: torch.Tensor) -> str: ...

    def attach_optimizer(self, optimizer: EngineOptimizer) -> None: ...

    def set_reduction_listener(self, listener: ReductionListener) -> None: ...

    def check_grads_reduced(self) -> None: ...

    def before_update(self) -> None: ...

    def after_step(self) -> None: ...

    def zero_grad(self, set_to_none: bool = True) -> None: ...
