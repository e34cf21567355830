"""The offloaded step, group by group, in a pipeline over a small ring of host slots.

Each group of the step passes three stages, each slot of the ring holding one group's host
gradient (fp32) and its updated weights in the device shard's dtype:

1. *copy in*: the reduced gradient, device → the slot (pinned, on a CUDA stream of its own);
2. *step*: the host update on the group's master and state
   (:class:`~shardckpt.runtime.offload.host_step.HostStepper`), then the updated master cast into
   the slot (``Tensor.copy_``: round to nearest even, the cast of the resident path);
3. *copy out*: the slot → the group's device shard (on a second stream, so that both directions
   of PCIe carry data at once).

The copy in of group k+1 is queued before the step of group k begins, and the copy out of group
k is queued before the step of group k+1 begins, so on CUDA the gradients of the next group and
the weights of the previous one cross PCIe while the CPU steps (a ring of two slots suffices:
group k+1 takes the slot of group k-1, whose gradient was stepped; its weights are written only
once the copy out of group k-1 has finished). On a CPU device the same code runs each copy when
it is queued, in this order, without pinned memory.

Host memory: the ring is ``depth`` x the largest group x (4 + the shard's bytes per element),
one allocation (pinned on CUDA); the masters and state stay in pageable memory, since only the
ring crosses PCIe. A failure in any stage is one :class:`~shardckpt.errors.ShardckptError` naming
the group and the stage; every copy queued has finished when :meth:`StepPipeline.run` returns or
raises.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any
from collections.abc import Callable, Generator, Mapping, Sequence

import torch

from shardckpt.errors import ShardckptError
from shardckpt.format.footprint_levers import OFFLOAD_RING_GROUPS

__all__ = ["StepPipeline"]

#: Each group's name and window (master and state kinds), in the order of the step.
Windows = Generator[tuple[str, dict[str, torch.Tensor]], None, None]

#: ``step(name, window, host_grad)``: update the group's window (master and state) on the host.
StepFn = Callable[[str, dict[str, torch.Tensor], torch.Tensor], None]


@dataclass
class _Slot:
    grad: torch.Tensor  # fp32, the largest group's numel
    out: torch.Tensor  # uint8, the largest group's numel x the widest shard dtype
    ready: Any = None  # CUDA event: the copy in landed
    free: Any = None  # CUDA event: the copy out has read ``out``

    def weights(self, dtype: torch.dtype, n: int) -> torch.Tensor:
        return self.out[:n * dtype.itemsize].view(dtype)


class StepPipeline:
    """The ring and the stages of the offloaded step (module docstring).

    ``trace``: a list to which each stage appends ``(stage, group)`` as it is queued
    (``"copy_in"``, ``"step"``, ``"copy_out"``), or ``None``.
    """

    def __init__(self, device: torch.device, pin: bool, depth: int = OFFLOAD_RING_GROUPS) -> None:
        self.device = device
        self.pin = pin
        self.depth = depth
        self._stream = torch.cuda.Stream(device) if pin else None  # copies in
        self._out_stream = torch.cuda.Stream(device) if pin else None  # copies out
        self._ring: torch.Tensor | None = None
        self._slots: list[_Slot] = []
        self.trace: list[tuple[str, str]] | None = None

    @property
    def buffer_bytes(self) -> int:
        """Bytes of the ring (allocated at the first step)."""
        return 0 if self._ring is None else self._ring.numel()

    def _ring_for(self, numel: int, itemsize: int) -> list[_Slot]:
        if self._slots and self._slots[0].grad.numel() >= numel \
                and self._slots[0].out.numel() >= numel * itemsize:
            return self._slots
        per = numel * (4 + itemsize)
        self._ring = ring = torch.empty(self.depth * per, dtype=torch.uint8, pin_memory=self.pin)
        cuda = self._stream is not None
        self._slots = [_Slot(ring[i * per:i * per + 4 * numel].view(torch.float32),
                             ring[i * per + 4 * numel:(i + 1) * per],
                             torch.cuda.Event() if cuda else None,
                             torch.cuda.Event() if cuda else None)
                       for i in range(self.depth)]
        return self._slots

    def _note(self, stage: str, name: str) -> None:
        if self.trace is not None:
            self.trace.append((stage, name))

    def _copy_in(self, slot: _Slot, name: str, grad: torch.Tensor) -> None:
        self._note("copy_in", name)
        host = slot.grad[:grad.numel()]
        if self._stream is None:
            host.copy_(grad)
            return
        with torch.cuda.stream(self._stream):
            host.copy_(grad, non_blocking=True)
            slot.ready.record(self._stream)

    def _copy_out(self, slot: _Slot, name: str, out: torch.Tensor, shard: torch.Tensor) -> None:
        self._note("copy_out", name)
        if self._out_stream is None:
            shard.copy_(out)
            return
        with torch.cuda.stream(self._out_stream):
            shard.copy_(out, non_blocking=True)
            slot.free.record(self._out_stream)

    def run(self, names: Sequence[str], windows: Windows,
            grads: Mapping[str, torch.Tensor], shards: Mapping[str, torch.Tensor],
            step: StepFn) -> None:
        """Step the groups ``names`` in order: ``windows`` yields each one's master and state
        (in that order), ``grads`` are the reduced device gradients, ``shards`` the device
        shards that receive the updated masters."""
        if not names:
            return
        slots = self._ring_for(max(grads[n].numel() for n in names),
                               max(shards[n].element_size() for n in names))
        streams = [t for t in (self._stream, self._out_stream) if t is not None]
        for t in streams:  # the reductions (and clipping), and reads of the shards, come first
            t.wait_stream(torch.cuda.current_stream(self.device))
        where = ("copy in", names[0])
        try:
            with contextlib.closing(windows):  # its pending writes land, even on failure
                self._copy_in(slots[0], names[0], grads[names[0]])
                where = ("state read", names[0])
                for k, (name, window) in enumerate(windows):  # runs the generator to its end
                    assert name == names[k], (name, names[k])
                    slot = slots[k % self.depth]
                    if k + 1 < len(names):
                        nxt = names[k + 1]
                        where = ("copy in", nxt)
                        self._copy_in(slots[(k + 1) % self.depth], nxt, grads[nxt])
                    where = ("step", name)
                    self._wait(slot.ready)
                    self._note("step", name)
                    step(name, window, slot.grad[:grads[name].numel()])
                    where = ("copy out", name)
                    self._wait(slot.free)  # the copy out of group k - depth read these bytes
                    out = slot.weights(shards[name].dtype, shards[name].numel())
                    out.copy_(window["master"])  # the host cast
                    self._copy_out(slot, name, out, shards[name])
                    where = ("state read" if k + 1 < len(names) else "state write",
                             names[min(k + 1, len(names) - 1)])
        except Exception as e:
            stage, group = where
            raise ShardckptError(f"the offloaded optimizer step failed at flat group {group} "
                                 f"({stage}): {type(e).__name__}: {e}") from e
        finally:
            for t in streams:
                t.synchronize()

    @staticmethod
    def _wait(event: Any) -> None:
        if event is not None:
            event.synchronize()
