"""The ZeRO++ options of :class:`~shardckpt.runtime.engine.ZeroEngine`, validated
(:mod:`shardckpt.runtime.zeropp` has what they mean)."""

from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Iterable

import torch

from shardckpt.errors import ConfigError
from shardckpt.runtime.collectives import FP32
from shardckpt.runtime.mesh import ProcessMesh
from shardckpt.runtime.zeropp import quant

__all__ = ["ZeroPP", "check_zeropp"]


@dataclass(frozen=True, slots=True)
class ZeroPP:
    """Which ZeRO++ options are on (see :mod:`shardckpt.runtime.zeropp`); all off by default.

    ``block_size``: elements per quantization block (one fp32 scale each), for qwZ and qgZ.
    ``grad_bits``: qgZ's integer width, 4 (the paper's) or 8.
    """

    qwz: bool = False
    hpz: bool = False
    qgz: bool = False
    block_size: int = 256
    grad_bits: int = 4

    def __post_init__(self) -> None:
        bad = [f"{name}={getattr(self, name)!r}" for name in ("qwz", "hpz", "qgz")
               if not isinstance(getattr(self, name), bool)]
        if bad:
            raise ConfigError(f"ZeroPP: {', '.join(bad)}; the options are True or False")
        b = self.block_size
        if not isinstance(b, int) or isinstance(b, bool) or b < 1:
            raise ConfigError(f"ZeroPP.block_size is {b!r}; it must be a whole number >= 1 "
                              "(elements per quantization block; 256 is the default)")
        if not isinstance(self.grad_bits, int) or self.grad_bits not in quant.BITS:
            raise ConfigError(f"ZeroPP.grad_bits is {self.grad_bits!r}; qgZ quantizes gradients "
                              f"to {' or '.join(map(str, quant.BITS))} bits")

    @property
    def enabled(self) -> bool:
        return self.qwz or self.hpz or self.qgz

    def describe(self) -> str:
        on = [n for n in ("qwz", "hpz", "qgz") if getattr(self, n)]
        return (f"ZeRO++ {'+'.join(on)} (block {self.block_size}, grads int{self.grad_bits})"
                if on else "ZeRO++ off")


def check_zeropp(cfg: ZeroPP, pm: ProcessMesh, stage: int,
                 sum_dtypes: Iterable[tuple[str, torch.dtype]]) -> None:
    """Refuse, in one :class:`ConfigError`, what these options cannot do on this engine.

    ``sum_dtypes``: (flat group, dtype its gradient is summed in) of every trained group.
    """
    if not isinstance(cfg, ZeroPP):
        raise ConfigError(f"zeropp is {cfg!r}; pass ZeroPP(qwz=..., hpz=..., qgz=...) or None")
    if not cfg.enabled:
        return
    problems = []
    if pm.mesh.replicate_degree > 1:
        problems.append(f"the mesh {pm.mesh.describe()} replicates shards (HSDP); ZeRO++ runs "
                        "on a plain ZeRO mesh (replicate=1)")
    if cfg.hpz and stage != 3:
        problems.append(f"hpz needs stage 3 (parameters sharded); the engine is stage {stage}")
    if (cfg.hpz or cfg.qgz) and pm.world_size % pm.node_size:
        problems.append(f"hpz/qgz need the world size ({pm.world_size}) to be a multiple of "
                        f"the node size (ranks_per_node={pm.node_size})")
    if cfg.qgz:
        wrong = [f"{name} ({str(dt).removeprefix('torch.')})" for name, dt in sum_dtypes
                 if dt != FP32]
        if wrong:
            problems.append(f"qgz dequantizes and reduces gradients in fp32, but these flat "
                            f"groups ask to reduce in another dtype: {', '.join(wrong[:3])}"
                            f"{'...' if len(wrong) > 3 else ''}; use "
                            "MixedPrecisionPolicy(reduce_dtype=torch.float32)")
    if problems:
        raise ConfigError(f"{cfg.describe()}: " + "; ".join(problems))
