"""Blockwise symmetric integer quantization for the ZeRO++ collectives (pure tensor math, no I/O).

A tensor of ``n`` rows of ``s`` elements is cut, row by row, into blocks of ``block`` elements
(the last block of a row may be shorter; blocks never cross rows, so each row travels on its own
through an all-gather or an all-to-all). Each block gets one fp32 scale, its absolute maximum
over ``qmax = 2**(bits-1) - 1`` (127 for int8, 7 for int4), and each element the integer
``round(x / scale)`` in ``[-qmax, qmax]`` (round half to even). Dequantized, an element differs
from its input by at most half a step::

    |x - q * scale| <= scale / 2 = absmax(block) / (2 * qmax)     (1/254 of the absmax for int8,
                                                                   1/14 for int4)

plus the rounding of the fp32 division and product (a relative ``2**-23`` of the absmax each).
A block of zeros has scale 0 and dequantizes to zeros. Non-finite inputs are not supported (the
block's scale becomes non-finite).

Wire format of one row (:func:`packed_size` bytes, ``uint8``): the payload (``s`` int8 bytes, or
``s / 2`` bytes of two int4 nibbles, low nibble first, each stored as ``q + 8``), then the
``ceil(s / block)`` fp32 scales in native byte order. Every rank of a job runs on the same
architecture, so native order is what the peer reads.

Two implementations write the same bytes: the eager reference below (:func:`quantize_reference`,
:func:`dequantize_reference`, a few passes of torch operations each) and the fused kernels of
:mod:`shardckpt.runtime.zeropp.fused` (``torch.compile`` of the same math: one pass each way, bit
for bit the reference's on CPU, within :func:`error_bound` on a GPU). :func:`quantize` and
:func:`dequantize` run the fused kernels unless ``SHARDCKPT_ZEROPP_KERNEL=eager`` (or
``kernel="eager"``) asks for the reference.
"""

from __future__ import annotations

import logging
import os

import torch
import torch.nn.functional as F
from torch._dynamo.exc import BackendCompilerFailed

from shardckpt.errors import ConfigError
from shardckpt.runtime.zeropp import fused

log = logging.getLogger(__name__)


#: Supported integer widths.
BITS = (4, 8)

#: The environment variable that picks the implementation, and its values.
KERNEL_ENV = "SHARDCKPT_ZEROPP_KERNEL"
KERNELS = ("fused", "eager")


def num_blocks(s: int, block: int) -> int:
    """Blocks in a row of ``s`` elements (the last may be shorter)."""
    return -(-s // block)


def payload_size(s: int, bits: int) -> int:
    """Bytes of the integers of one row (``s`` must be even for int4)."""
    return s * bits // 8


def packed_size(s: int, bits: int, block: int) -> int:
    """Bytes of one packed row: the integers, then one fp32 scale per block."""
    return payload_size(s, bits) + 4 * num_blocks(s, block)


def qmax(bits: int) -> int:
    return 2 ** (bits - 1) - 1


def kernel_choice(kernel: str | None = None) -> str:
    """``kernel``, else ``$SHARDCKPT_ZEROPP_KERNEL``, else "fused"; "eager" where the fused
    kernels cannot run (a big-endian host)."""
    choice = kernel or os.environ.get(KERNEL_ENV) or "fused"
    if choice not in KERNELS:
        where = "kernel" if kernel else KERNEL_ENV
        raise ConfigError(f"{where}={choice!r}: the ZeRO++ quantization kernels are "
                          f"{' or '.join(KERNELS)}")
    return choice if fused.usable() and not _FUSED_FAILED else "eager"


_FUSED_FAILED: list[str] = []


def _fused_failed(exc: Exception) -> None:
    """A fused kernel did not compile (no C++ compiler for inductor on this host, say): say so
    once and run the reference from now on; its bytes are the same."""
    _FUSED_FAILED.append(repr(exc))
    log.warning("ZeRO++ quantization: the fused kernels did not compile (%s); using the eager "
                "reference (set %s=eager to skip the attempt)", exc, KERNEL_ENV)


def quantize(x: torch.Tensor, bits: int, block: int, kernel: str | None = None) -> torch.Tensor:
    """Pack ``x`` (``n x s``, any float dtype) row by row into ``n x packed_size`` bytes."""
    if kernel_choice(kernel) == "fused":
        try:
            return fused.quantize(x.contiguous(), bits, block)
        except BackendCompilerFailed as exc:
            _fused_failed(exc)
    return quantize_reference(x, bits, block)


def dequantize(packed: torch.Tensor, s: int, bits: int, block: int,
               dtype: torch.dtype = torch.float32, *, out: torch.Tensor | None = None,
               kernel: str | None = None) -> torch.Tensor:
    """Unpack ``n x packed_size`` bytes into ``n x s`` values of ``dtype`` (computed in fp32),
    written into ``out`` (contiguous, ``n x s`` of ``dtype``) when given."""
    if kernel_choice(kernel) == "fused" and (out is None or out.is_contiguous()):
        if out is None:
            out = torch.empty(packed.shape[0], s, dtype=dtype, device=packed.device)
        try:
            return fused.dequantize(packed.contiguous(), out, bits, block)
        except BackendCompilerFailed as exc:
            _fused_failed(exc)
    back = dequantize_reference(packed, s, bits, block, dtype)
    return back if out is None else out.copy_(back)


def quantize_reference(x: torch.Tensor, bits: int, block: int) -> torch.Tensor:
    """:func:`quantize`, eager: the definition the fused kernel is checked against."""
    n, s = x.shape
    nb = num_blocks(s, block)
    xf = x.float()
    if nb * block != s:
        xf = F.pad(xf, (0, nb * block - s))
    xb = xf.view(n, nb, block)
    scale = xb.abs().amax(dim=2).div_(qmax(bits))                    # n x nb
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.div(xb, safe.unsqueeze(2)).round_().clamp_(-qmax(bits), qmax(bits))
    q = q.view(n, nb * block)[:, :s]
    pb = payload_size(s, bits)
    out = torch.empty(n, pb + 4 * nb, dtype=torch.uint8, device=x.device)
    if bits == 8:
        out[:, :pb] = q.to(torch.int8).view(torch.uint8)
    else:
        u = q.add_(8).to(torch.uint8)                                # 1..15
        out[:, :pb] = u[:, 0::2] | (u[:, 1::2] << 4)
    out[:, pb:] = scale.contiguous().view(torch.uint8)
    return out


def dequantize_reference(packed: torch.Tensor, s: int, bits: int, block: int,
                         dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """:func:`dequantize`, eager: the definition the fused kernel is checked against."""
    n = packed.shape[0]
    nb = num_blocks(s, block)
    pb = payload_size(s, bits)
    scale = torch.empty(n, nb, dtype=torch.float32, device=packed.device)
    scale.view(torch.uint8).copy_(packed[:, pb:])                    # an aligned copy
    payload = packed[:, :pb]
    if bits == 8:
        q = payload.contiguous().view(torch.int8).float()
    else:
        q = torch.empty(n, s, dtype=torch.float32, device=packed.device)
        q[:, 0::2] = payload & 0xF
        q[:, 1::2] = payload >> 4
        q.sub_(8)
    if nb * block != s:
        q = F.pad(q, (0, nb * block - s))
    out = q.view(n, nb, block).mul_(scale.unsqueeze(2)).view(n, nb * block)[:, :s]
    return out.to(dtype)


def error_bound(x: torch.Tensor, bits: int, block: int) -> torch.Tensor:
    """Per element of ``x`` (``n x s``): the largest error :func:`quantize` then
    :func:`dequantize` may introduce, ``absmax(block) / (2 * qmax)`` plus the fp32 rounding of
    the division and the product."""
    n, s = x.shape
    nb = num_blocks(s, block)
    xf = x.float()
    if nb * block != s:
        xf = F.pad(xf, (0, nb * block - s))
    amax = xf.view(n, nb, block).abs().amax(dim=2, keepdim=True)
    bound = amax * (1 / (2 * qmax(bits)) + 2.0 ** -21)
    return bound.expand(n, nb, block).reshape(n, nb * block)[:, :s]
