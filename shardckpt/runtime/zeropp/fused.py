"""Fused ZeRO++ quantization: the math of :mod:`shardckpt.runtime.zeropp.quant` written as one
traceable function each way and compiled by ``torch.compile`` (inductor: Triton on CUDA, C++ on
CPU), so a quantize or a dequantize reads its input once and writes its output once instead of
the reference's half-dozen eager passes.

The bytes are the reference's, bit for bit, on CPU (``tests/test_zeropp_single.py`` checks it over
ragged shapes, zeros, int4 and int8, bf16 and fp32): the same fp32 division, round half to even
and product; the scales are written into the wire as their four little-endian bytes by integer
shifts (the reference copies their native bytes; :func:`usable` refuses big-endian hosts).

Compilation is lazy, once per kernel (:func:`compiled`: quantize or dequantize, bits, block size,
dtypes) and shape class, with dynamic shapes: a graph serves every row length, ragged or whole,
and every row count of its class. The classes are the ones torch's 0/1 specialization and
contiguity checks make (one row or several; one block or several; the last block ragged or
whole; a single pair of elements), so a job compiles each kernel a few times in its first steps,
then never again. Each compilation is logged (INFO) with its duration and counted
(:func:`compilations`; ``tests/test_zeropp_single.py`` holds the count).
"""

from __future__ import annotations

import logging
import sys
import time
import types
from typing import Any

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

_CACHE: dict[tuple[Any, ...], _Kernel] = {}


def usable() -> bool:
    """The scales' bytes are written little-endian; elsewhere only the eager reference runs."""
    return sys.byteorder == "little"


def _blocks(v: torch.Tensor, block: int) -> torch.Tensor:
    """``n x s`` as ``n x nb x block``, the last block of each row padded with zeros.

    Written as the reference does it, a pad and a view: the elementwise work then indexes the
    blocks by ``j // block`` and ``j % block`` together. Spread instead by an index
    (``scale[:, arange(s) // block]``), inductor's C++ loop split (``try_loop_split``, torch 2.13)
    cuts a row of ``s`` elements into ``s // block`` whole blocks and drops the ragged tail."""
    n, s = v.shape
    nb = (s + block - 1) // block
    return F.pad(v, (0, nb * block - s)).view(n, nb, block)


def _quantize(x: torch.Tensor, *, block: int, q: int, bits: int) -> torch.Tensor:
    n, s = x.shape
    xb = _blocks(x.float(), block)
    nb = xb.shape[1]
    scale = xb.abs().amax(dim=2) / q                                  # n x nb, as the reference
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    v = torch.clamp(torch.round(xb / safe.unsqueeze(2)), -q, q).view(n, nb * block)
    if bits == 8:  # converted whole-row (contiguous), cut to s by the concatenation
        payload = v.to(torch.int8).view(torch.uint8)[:, :s]
    else:
        u = (v[:, :s] + 8).to(torch.uint8).view(n, s // 2, 2)
        payload = u[:, :, 0] | (u[:, :, 1] << 4)
    i = scale.view(torch.int32)
    sb = torch.stack([(i >> k) & 0xFF for k in (0, 8, 16, 24)], dim=2).to(torch.uint8)
    return torch.cat([payload, sb.view(n, 4 * nb)], dim=1)


def _dequantize(packed: torch.Tensor, out: torch.Tensor, *, block: int, bits: int) -> None:
    n, s = out.shape
    nb = (s + block - 1) // block
    pb = s * bits // 8
    b = packed[:, pb:].view(n, nb, 4).to(torch.int32)
    scale = (b[:, :, 0] | (b[:, :, 1] << 8) | (b[:, :, 2] << 16) | (b[:, :, 3] << 24)
             ).view(torch.float32)
    payload = packed[:, :pb]
    if bits == 8:
        v = payload.view(torch.int8).float()
    else:
        v = torch.stack([payload & 0xF, payload >> 4], dim=2).view(n, s).float() - 8
    out.copy_((_blocks(v, block) * scale.unsqueeze(2)).view(n, nb * block)[:, :s])


def compiled(kind: str, bits: int, block: int, in_dtype: torch.dtype,
             out_dtype: torch.dtype | None = None) -> _Kernel:
    """The compiled ``kind`` ("quantize" or "dequantize") for these widths and dtypes, compiled
    on its first call with dynamic shapes (any row count, any row length, ragged or not)."""
    key = (kind, bits, block, in_dtype, out_dtype)
    fn = _CACHE.get(key)
    if fn is None:
        fn = _CACHE[key] = _Kernel(key)
    return fn


def compilations() -> int:
    """Graphs compiled so far in this process (a recompilation counts once more)."""
    return sum(k.compiles for k in _CACHE.values())


class _Kernel:
    """One key's compiled function: its own copy of the code object (dynamo keeps compiled
    graphs and counts recompilations per code object, so the keys do not share a limit), the
    key's constants bound; each compilation counted and logged with its duration."""

    def __init__(self, key: tuple[Any, ...]) -> None:
        kind, bits, block, _, out_dtype = key
        src = _quantize if kind == "quantize" else _dequantize
        name = f"zeropp_{kind}_int{bits}"
        own = types.FunctionType(src.__code__.replace(co_name=name), src.__globals__, name)
        own.__kwdefaults__ = (dict(block=block, q=2 ** (bits - 1) - 1, bits=bits)
                              if kind == "quantize" else dict(block=block, bits=bits))
        self.key, self.compiles = key, 0
        self.fn = torch.compile(own, backend=self._backend, fullgraph=True)

    def _backend(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        from torch._inductor.compile_fx import compile_fx

        t0 = time.perf_counter()
        out = compile_fx(gm, example_inputs)
        self.compiles += 1
        log.info("ZeRO++ %s kernel (int%d, block %d, %s -> %s) compiled in %.1f s "
                 "(graph %d of this kernel)", *self.key, time.perf_counter() - t0, self.compiles)
        return out

    def __call__(self, *args: torch.Tensor) -> Any:
        for t in args:  # one graph for any row length, ragged or not, and any number of rows
            torch._dynamo.maybe_mark_dynamic(t, 0)  # (one row is a class of its own)
            torch._dynamo.maybe_mark_dynamic(t, 1)
        with torch.no_grad():  # never differentiated: one graph whatever the caller's mode
            return self.fn(*args)


def quantize(x: torch.Tensor, bits: int, block: int) -> torch.Tensor:
    return compiled("quantize", bits, block, x.dtype)(x)


def dequantize(packed: torch.Tensor, out: torch.Tensor, bits: int, block: int) -> torch.Tensor:
    compiled("dequantize", bits, block, packed.dtype, out.dtype)(packed, out)
    return out
