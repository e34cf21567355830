"""The dtypes shardckpt stores: one table of names, sizes and codes, and the names users type.

Names follow torch's (``bfloat16``, ``float8_e4m3fn``); safetensors codes are its header's
(``BF16``); numpy codes are little-endian, for the dtypes numpy holds natively (bf16 and fp8 are
decoded by :mod:`shardckpt.checkpoint.pieces`). Pure; no numpy or torch import.
"""

from __future__ import annotations

from typing import NamedTuple

from shardckpt.errors import ConfigError


class DType(NamedTuple):
    itemsize: int
    safetensors: str
    numpy: str | None  # None: numpy has no such type (widened to float32 when decoded)
    floating: bool


#: dtype name -> its size and codes.
DTYPES: dict[str, DType] = {
    "float64": DType(8, "F64", "<f8", True),
    "float32": DType(4, "F32", "<f4", True),
    "bfloat16": DType(2, "BF16", None, True),
    "float16": DType(2, "F16", "<f2", True),
    "float8_e4m3fn": DType(1, "F8_E4M3", None, True),
    "float8_e5m2": DType(1, "F8_E5M2", None, True),
    "int64": DType(8, "I64", "<i8", False),
    "int32": DType(4, "I32", "<i4", False),
    "int16": DType(2, "I16", "<i2", False),
    "int8": DType(1, "I8", "i1", False),
    "uint8": DType(1, "U8", "u1", False),
    "bool": DType(1, "BOOL", "u1", False),
}
SAFETENSORS_TO_DTYPE = {d.safetensors: name for name, d in DTYPES.items()}
FLOATS = tuple(name for name, d in DTYPES.items() if d.floating)
NUMPY = {name: d.numpy for name, d in DTYPES.items() if d.numpy is not None}

#: The dtypes an output may be cast to, under every name a user may type (``--dtype bf16``).
OUTPUT_ALIASES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "half": "float16",
                  "float16": "float16", "fp32": "float32", "float": "float32", "float32": "float32"}

#: The dtype fp32 master weights and optimizer states are kept in.
MASTER_DTYPE = "float32"


def itemsize(dtype: str) -> int:
    try:
        return DTYPES[dtype].itemsize
    except KeyError:
        raise ConfigError(f"unknown dtype {dtype!r}; known: {', '.join(DTYPES)}") from None


def output_dtype(name: str) -> str:
    """The canonical name of an output dtype a user typed (``bf16`` -> ``bfloat16``)."""
    try:
        return OUTPUT_ALIASES[name.lower()]
    except KeyError:
        raise ConfigError(f"unknown dtype {name!r}; use bf16, fp16 or fp32") from None
