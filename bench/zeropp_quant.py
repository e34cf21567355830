"""ZeRO++ blockwise quantization: the fused kernels against the eager reference, same process,
same tensors (``shardckpt/runtime/zeropp/quant.py``, ``fused.py``).

Per case (qwZ: bf16 weights to int8; qgZ: fp32 gradients to int4 and to int8), quantize and
dequantize each run ``--reps`` times after a warm-up (the fused kernels compile there, once), the
two implementations taking turns rep by rep; the figure is the median, in GB/s of the input tensor
(the dequantized output, of the same size, for dequantize), and the ratio fused over eager. Both
outputs are compared: bit-equal on CPU, within ``quant.error_bound`` elsewhere.
``bench/gpu_check.py`` section e runs the same measurement on the device.

    python bench/zeropp_quant.py [--device cpu|cuda] [--rows 8] [--cols 4194304] [--reps 7]

Prints a line per case and then one JSON document.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

#: (label, input dtype name, bits)
CASES = [("qwZ weights, int8", "bfloat16", 8), ("qgZ gradients, int4", "float32", 4),
         ("qgZ gradients, int8", "float32", 8)]
KERNELS = ("eager", "fused")


def _timed(fn: Callable[[], Any], sync: Callable[[], None]) -> float:
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t0


def measure_case(x: Any, bits: int, block: int, reps: int, sync: Callable[[], None]
                 ) -> dict[str, Any]:
    """Both implementations on ``x``, interleaved rep by rep: median seconds and GB/s of input
    for quantize and dequantize, the ratios, and whether the outputs agree."""
    import torch

    from shardckpt.runtime.zeropp import quant

    n_in, cols = x.numel() * x.element_size(), x.shape[1]
    packed = {k: quant.quantize(x, bits, block, kernel=k) for k in KERNELS}  # warm-up, compile
    back = {k: quant.dequantize(packed["eager"], cols, bits, block, x.dtype, kernel=k)
            for k in KERNELS}
    times: dict[str, list[float]] = {f"{op}_{k}": [] for op in ("quantize", "dequantize")
                                     for k in KERNELS}
    for _ in range(reps):
        for k in KERNELS:
            times[f"quantize_{k}"].append(_timed(
                lambda k=k: quant.quantize(x, bits, block, kernel=k), sync))
            times[f"dequantize_{k}"].append(_timed(
                lambda k=k: quant.dequantize(packed["eager"], cols, bits, block, x.dtype, kernel=k),
                sync))
    row: dict[str, Any] = {"input_bytes": n_in, "packed_bytes": packed["eager"].numel()}
    for key, ts in times.items():
        med = statistics.median(ts)
        row[f"{key}_s"] = med
        row[f"{key}_gbs"] = round(n_in / med / 1e9, 3)
    for op in ("quantize", "dequantize"):
        row[f"{op}_fused_over_eager"] = round(row[f"{op}_fused_gbs"] / row[f"{op}_eager_gbs"], 3)
    if x.device.type == "cpu":
        row["bit_equal"] = bool(torch.equal(packed["fused"], packed["eager"])
                                and torch.equal(back["fused"], back["eager"]))
    head = x[:1, : min(cols, 1 << 20)]
    bound = quant.error_bound(head, bits, block)
    for k in KERNELS:
        got = quant.dequantize(quant.quantize(head, bits, block, kernel=k), head.shape[1], bits,
                               block, kernel=k)
        row[f"within_error_bound_{k}"] = bool(((got - head.float()).abs() <= bound).all())
    return row


def run(device: Any, rows: int, cols: int, block: int, reps: int,
        sync: Callable[[], None] = lambda: None, log: Callable[[str], None] = print
        ) -> list[dict[str, Any]]:
    """Every case of :data:`CASES` on an ``rows x cols`` tensor of normal values."""
    import torch

    gen = torch.Generator(device=device).manual_seed(0)
    out = []
    for label, dtype, bits in CASES:
        x = torch.randn(rows, cols, device=device, generator=gen).to(getattr(torch, dtype))
        row = {"case": label, "dtype": dtype, "bits": bits,
               **measure_case(x, bits, block, reps, sync)}
        del x
        out.append(row)
        log(f"{label}: quantize {row['quantize_eager_gbs']} -> {row['quantize_fused_gbs']} GB/s "
            f"(x{row['quantize_fused_over_eager']}), dequantize {row['dequantize_eager_gbs']} -> "
            f"{row['dequantize_fused_gbs']} GB/s (x{row['dequantize_fused_over_eager']})")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--cols", type=int, default=1 << 22)
    ap.add_argument("--block", type=int, default=256)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (CPU)")
    args = ap.parse_args(argv)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if root not in sys.path:
        sys.path.insert(0, root)
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    cases = run(device, args.rows, args.cols, args.block, args.reps, sync,
                log=lambda m: print(m, file=sys.stderr))
    print(json.dumps({"device": str(device), "torch": torch.__version__,
                      "threads": torch.get_num_threads(), "shape": [args.rows, args.cols],
                      "block": args.block, "reps": args.reps, "cases": cases}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
