"""The bytes of a save, from live shards on any device, for the parallel positioned write of
:mod:`shardckpt.storage.pwrite` (a shard file on a local disk) or a stream (any other storage).

:class:`ShardBytes` is the producer a :class:`~shardckpt.checkpoint.writer.CheckpointWriter`
gets for shard and frozen files. Written in parallel, CPU shards go to the disk straight from
their own memory; CUDA shards are copied window by window into a small ring of pinned buffers on
a side stream per worker (each copy waits for the work queued on the device when the save
began: :func:`device_events`), so device-to-host copies overlap the checksums and writes of
other windows, and no full-size host copy of the state is made. Streamed (object stores), device shards go to the host
in pieces of at most :data:`PIECE_BYTES`. State in offload files streams from its file.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from shardckpt.errors import ShardckptError
from shardckpt.format.manifest import TensorSlot
from shardckpt.storage import IOConfig, Slot, Staged, write_positioned
from shardckpt.training.device_load import byte_view, host_ring

PIECE_BYTES = 64 << 20
_STREAMS = threading.local()


def _side_stream(device: Any) -> Any:
    """This thread's side stream on ``device`` (one per worker thread and device)."""
    import torch

    streams = getattr(_STREAMS, "by_device", None)
    if streams is None:
        streams = _STREAMS.by_device = {}
    s = streams.get(device)
    if s is None:
        s = streams[device] = torch.cuda.Stream(device)
    return s


class DeviceBytes(Staged):
    """A device tensor's bytes, copied to the host window by window."""

    def __init__(self, u8: Any, ready: Any) -> None:
        self.u8, self.ready, self.nbytes = u8, ready, int(u8.numel())

    def stage(self, a: int, b: int, slot: Slot, lo: int) -> None:
        import torch

        src, dst = self.u8[a:b], slot.handle[lo:lo + b - a]
        if not src.is_cuda:
            dst.copy_(src)
            return
        s = _side_stream(src.device)
        s.wait_event(self.ready)
        with torch.cuda.stream(s):
            dst.copy_(src, non_blocking=True)
        s.synchronize()


def device_events(shards: Mapping[str, Mapping[str, Any]]) -> dict[Any, Any]:
    """An event on each CUDA device that ``shards`` live on, recorded now on its current
    stream: what the save's device-to-host copies wait for, however much later they run (an
    async save's write in the background, while the next forward is queued). Empty on CPU."""
    out: dict[Any, Any] = {}
    for kinds in shards.values():
        for t in kinds.values():
            dev = getattr(t, "device", None)
            if getattr(dev, "type", None) == "cuda" and dev not in out:
                import torch

                out[dev] = torch.cuda.current_stream(dev).record_event()
    return out


class ShardBytes:
    """``produce(slot)`` of a shard's tensors (group -> kind -> tensor), and their parallel
    positioned write (:meth:`write_positioned`). ``ready``: :func:`device_events` taken when the
    save began (else each device's current stream when the write starts)."""

    def __init__(self, shards: Mapping[str, Mapping[str, Any]], config: IOConfig | None = None,
                 ready: Mapping[Any, Any] | None = None) -> None:
        self.shards, self.config, self.ready = shards, config, dict(ready or {})

    def tensor(self, slot: TensorSlot) -> Any:
        gname, kind = slot.name.rsplit(".", 1)
        return self.shards[gname][kind]

    def __call__(self, slot: TensorSlot) -> Iterator[Any]:
        t = self.tensor(slot)
        if hasattr(t, "iter_bytes"):  # state in an offload file: streamed from it
            yield from t.iter_bytes()
            return
        u8 = byte_view(t)
        if u8.device.type == "cpu":
            yield u8.numpy()
            return
        for a in range(0, int(u8.numel()), PIECE_BYTES):
            yield u8[a:a + PIECE_BYTES].cpu().numpy()

    def write_positioned(self, path: str, url: str, header: bytes, slots: Sequence[TensorSlot],
                         chunk_size: int, open_fd: Callable[[], int] | None = None,
                         hasher: Any = None) -> tuple[int, int, tuple[int, ...]] | None:
        """Write the file (``header``, then every slot's bytes) at ``path`` in parallel, opened by
        ``open_fd`` where given (its storage's way); None where a slot's state lives in an
        offload file (the caller streams it instead; nothing is opened). ``hasher``: a
        :class:`~shardckpt.storage.digest.ChunkHasher` that takes each chunk's SHA-256."""
        import torch

        tensors = [self.tensor(s) for s in slots]
        if any(hasattr(t, "iter_bytes") for t in tensors):
            return None
        cfg = self.config or IOConfig.from_env()
        parts: list[Any] = [header]
        ready: dict[Any, Any] = dict(self.ready)
        for slot, t in zip(slots, tensors, strict=True):
            u8 = byte_view(t)
            if int(u8.numel()) != slot.end - slot.begin:
                raise ShardckptError(f"{url}: {slot.name} holds {int(u8.numel())} bytes, its slot "
                                     f"{slot.end - slot.begin}")
            if u8.device.type == "cpu":
                parts.append(u8.numpy())
                continue
            if u8.is_cuda and u8.device not in ready:  # what the device was doing: done first
                ready[u8.device] = torch.cuda.current_stream(u8.device).record_event()
            parts.append(DeviceBytes(u8, ready.get(u8.device)))
        staged = any(isinstance(p, DeviceBytes) for p in parts)
        ring = host_ring(cfg, cfg.slot_bytes(chunk_size), torch.cuda.is_available()) if staged else None
        return write_positioned(path, url, parts, chunk_size, cfg, ring, open_fd, hasher)
