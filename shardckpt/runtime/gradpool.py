"""Local gradient buffers of finished reductions, handed on to the next group that needs one."""

from __future__ import annotations

import torch


class GradBufferPool:
    """Local gradient buffers released by finished reductions, for the next group to reuse.

    In a backward pass the units' groups (the decoder layers of a transformer) mostly have the
    same size: the buffer whose reduction just finished is handed to the next group that needs
    one instead of being returned to the allocator and allocated again (on CPU every new large
    buffer costs a page fault per 4 KiB on first touch). The pool holds only what a backward
    released and is emptied at the end of each backward, so nothing stays allocated between
    steps and no more is held at once than without it. Contents of a taken buffer are undefined.
    """

    def __init__(self) -> None:
        self._free: dict[tuple[int, torch.dtype, torch.device], list[torch.Tensor]] = {}

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        bufs = self._free.get((numel, dtype, device))
        if bufs:
            return bufs.pop()
        return torch.empty(numel, dtype=dtype, device=device)

    def give(self, buf: torch.Tensor) -> None:
        self._free.setdefault((buf.numel(), buf.dtype, buf.device), []).append(buf)

    def clear(self) -> None:
        self._free.clear()
