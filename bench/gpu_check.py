"""One GPU check of the runtime and the Checkpointer: parity, speed against FSDP2, save and load
against the device's and the disk's limits, offload, ZeRO++ quantization, multi-rank NCCL.

    python bench/gpu_check.py [--only a,c] [--budget-s 420] [--out FILE] [--small]
                              [--peak-tflops T] [--workdir DIR] [--device cuda|cpu]
    python bench/gpu_check.py --dry-run        # lists the checks as JSON; needs no GPU, no torch

Sections (each one guarded: an exception is recorded in the JSON with its type, message and a
short traceback, and the next section runs; by default each section runs in a child process of
its own, so that a crash, a hang or a poisoned CUDA context costs only that section):

* a: deterministic parity of ``ZeroEngine`` (``deterministic=True``) on the device against plain
  PyTorch on the same device, in a world-1 process group (NCCL on CUDA, gloo on CPU): stages 1-3,
  bf16 compute with fp32 reduction, gradient accumulation (``no_sync`` and per-micro-batch);
  fp32 masters, AdamW moments and every micro-batch's loss compared bit for bit (``torch.equal``),
  with the largest absolute difference where they differ;
* b: a bf16 training step of the built-in Llama at about 1.03 B parameters, ZeRO-3 against
  FSDP2's ``fully_shard`` on the same device, weights and batches, steps interleaved A B B A ...;
  tokens/s and MFU (peak dense bf16 TFLOP/s from a table keyed by the device name, or
  ``--peak-tflops``);
* b2: the same step with each decoder layer compiled on both sides (``compile_units`` against
  FSDP2 + ``torch.compile`` per layer, torchtitan's setup; ``bench/_gpu_compile.py``), keys as b;
* c: ``Checkpointer``: how long an async ``save()`` blocks, the device-to-host staging rate
  against a plain copy of the same bytes into pinned memory, the step that overlaps the write,
  sync save and load GB/s against a plain write + fsync and read of the same byte count;
* d: ``offload_optimizer="cpu"`` against the resident optimizer: step time and device memory;
* e: qwZ / qgZ blockwise quantization and dequantization throughput (``runtime/zeropp/quant.py``);
* f: multi-rank NCCL (ZeRO-3 steps, a save and a load on every device) when
  ``torch.cuda.device_count() > 1``; otherwise a record saying why it did not run.

Sections run in the order a, b2, d, e, b, c, f (:data:`RUN_ORDER`). ``--budget-s`` (default 420)
skips a section, with the reason, when the time left is below its estimate; ``--small`` shrinks every size for a quick smoke run; ``--device cpu`` runs the same code
on CPU with gloo (for testing the script itself; the figures mean nothing there). Without CUDA and
without ``--device cpu`` the script exits with status 2 and one line. The JSON goes to stdout (and
to ``--out``, rewritten after each section); progress lines go to stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import types
from typing import Any
from collections.abc import Callable, Iterator

SCHEMA = "shardckpt-gpu-check/1"
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

#: Dense bf16 peak TFLOP/s by device name (the longest key found in the name wins). SXM parts;
#: the PCIe and NVL boards run lower clocks.
PEAK_BF16_TFLOPS = {
    "H100 PCIe": 756.0,
    "H100 NVL": 835.0,
    "H200 NVL": 835.0,
    "H100": 989.0,
    "H800": 989.0,
    "H200": 989.0,
    "GH200": 989.0,
    "A100": 312.0,
    "A800": 312.0,
}

#: Model shapes (the built-in Llama; tied embedding).
LLAMA_1B = dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                num_attention_heads=32, num_key_value_heads=4)          # 1.03 B parameters
LLAMA_300M = dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=24,
                  num_attention_heads=16, num_key_value_heads=4)         # 0.30 B parameters
LLAMA_PARITY = dict(vocab_size=4096, hidden_size=256, intermediate_size=704, num_hidden_layers=4,
                    num_attention_heads=8, num_key_value_heads=4)
LLAMA_TINY = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=1)
LLAMA_SMALL = dict(vocab_size=1024, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2)

#: Sizes per section: the full run and ``--small``.
SIZES: dict[str, dict[str, dict[str, Any]]] = {
    "a": {"full": dict(model=LLAMA_PARITY, seq=128, micro_batch=4, micro=4, steps=3),
          "small": dict(model=LLAMA_TINY, seq=8, micro_batch=2, micro=2, steps=2)},
    "b": {"full": dict(model=LLAMA_1B, seq=2048, batch=4, warmup=2, steps=6),
          "small": dict(model=LLAMA_SMALL, seq=64, batch=2, warmup=1, steps=2)},
    "b2": {"full": dict(model=LLAMA_1B, seq=2048, batch=4, warmup=2, steps=6),
           "small": dict(model=LLAMA_TINY, seq=16, batch=2, warmup=1, steps=2)},
    "c": {"full": dict(model=LLAMA_300M, seq=1024, batch=2),
          "small": dict(model=LLAMA_SMALL, seq=32, batch=2)},
    "d": {"full": dict(model=LLAMA_300M, seq=1024, batch=4, warmup=1, steps=4),
          "small": dict(model=LLAMA_SMALL, seq=32, batch=2, warmup=1, steps=2)},
    "e": {"full": dict(rows=8, cols=32 << 20, block=256, reps=5, model=LLAMA_300M, seq=1024,
                       batch=4, warmup=1, steps=3),
          "small": dict(rows=8, cols=1 << 16, block=256, reps=2, model=LLAMA_TINY, seq=8,
                        batch=2, warmup=1, steps=2)},
    "f": {"full": dict(model=LLAMA_300M, seq=1024, batch=4, warmup=2, steps=5, max_ranks=8),
          "small": dict(model=LLAMA_TINY, seq=16, batch=2, warmup=1, steps=2, max_ranks=2)},
}

#: Rough seconds per section on one H200 (full) and for a ``--small`` CPU run, process start-up
#: included; a section starts only if the budget left covers its estimate.
ESTIMATE_S = {"a": (40, 30), "b": (150, 40), "b2": (100, 120), "c": (110, 40), "d": (70, 40),
              "e": (60, 90), "f": (120, 60)}

#: The order a run takes them in: parity first, then the runtime's newer sections (compile,
#: offload, ZeRO++ kernels), then the eager step and the checkpointer (measured on an H200 before;
#: ``--only c`` measures the checkpointer alone), then multi-rank. A run cut short by
#: ``--budget-s`` skips from the end: the estimates total more than the default budget.
RUN_ORDER = ("a", "b2", "d", "e", "b", "c", "f")

SECTIONS = {
    "a": ("parity", "ZeroEngine (deterministic) against plain PyTorch on the same device, world-1 "
          "process group: stages 1-3, bf16 compute + fp32 reduce, gradient accumulation "
          "(no_sync and per micro-batch); fp32 masters, AdamW moments and losses bit for bit"),
    "b": ("train_step_vs_fsdp2", "bf16 train step of the built-in Llama, ZeRO-3 vs FSDP2 "
          "fully_shard, same device, weights and batches, interleaved: step time, tokens/s, MFU"),
    "b2": ("train_step_vs_fsdp2_compile", "section b with each decoder layer torch.compile'd "
           "on both sides (ZeroEngine compile_units vs FSDP2 + torch.compile per layer)"),
    "c": ("checkpointer", "Checkpointer async save: time save() blocks, staging GB/s vs a pinned "
          "copy of the same bytes, step time during the write; sync save and load GB/s vs plain "
          "write+fsync and read of the same byte count"),
    "d": ("offload_cpu", "offload_optimizer='cpu' vs resident optimizer: step time and "
          "torch.cuda.max_memory_allocated"),
    "e": ("zeropp_quant", "qwZ (int8 bf16 weights) and qgZ (int4/int8 fp32 gradients) blockwise "
          "quantize and dequantize, fused kernels vs the eager reference in the same run: GB/s "
          "of input, ratio to the memory bandwidth, share of a ZeRO++ step spent quantizing"),
    "f": ("multi_rank_nccl", "ZeRO-3 bf16 steps, a sync and an async save and a load on every "
          "CUDA device over NCCL; recorded as not run when torch.cuda.device_count() < 2"),
}


# =============================================================================== helpers


def log(msg: str) -> None:
    print(f"[gpu_check {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def error_record(exc: BaseException) -> dict[str, Any]:
    tb = traceback.format_exception(type(exc), exc, exc.__traceback__)
    return {"type": type(exc).__name__, "message": str(exc)[:2000],
            "traceback": "".join(tb)[-3000:]}


class Ctx:
    """What the sections share: the options, the device, the world-1 process mesh."""

    def __init__(self, args: argparse.Namespace) -> None:
        import torch

        self.args = args
        self.small = args.small
        self.device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
        self.cuda = self.device.type == "cuda"
        self._pm: Any = None
        self.flush: Callable[[], None] = lambda: None
        if not self.cuda:
            torch.set_num_threads(1)  # a CPU smoke run: steadier on a shared machine

    def size(self, section: str) -> dict[str, Any]:
        return SIZES[section]["small" if self.small else "full"]

    def pm(self) -> Any:
        """The world-1 process mesh (NCCL on CUDA, gloo on CPU), initialized once."""
        if self._pm is None:
            import torch.distributed as dist

            from shardckpt.runtime.mesh import init_distributed
            from shardckpt.training.launch import free_port, rank_env

            if not dist.is_initialized():
                os.environ.update(rank_env(0, 1, free_port()))
            self._pm = init_distributed(backend="nccl" if self.cuda else "gloo")
        return self._pm

    def sync(self) -> None:
        if self.cuda:
            import torch

            torch.cuda.synchronize(self.device)

    def free(self) -> None:
        import gc

        gc.collect()
        if self.cuda:
            import torch

            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()

    def workdir(self, name: str) -> str:
        base = self.args.workdir or default_workdir()
        os.makedirs(base, exist_ok=True)
        return tempfile.mkdtemp(prefix=f"gpu-check-{name}-", dir=base)


@contextlib.contextmanager
def guarded(rec: dict[str, Any], key: str, ctx: Ctx | None = None) -> Iterator[None]:
    """Run a part of a section; an exception is recorded under ``rec["errors"][key]`` and the
    section goes on with its next part."""
    try:
        yield
    except Exception as exc:  # noqa: BLE001 - recorded, the next part runs
        rec.setdefault("errors", {})[key] = error_record(exc)
        log(f"  {key}: {type(exc).__name__}: {str(exc)[:300]}")
    finally:
        if ctx is not None:
            ctx.flush()


def median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def gb(nbytes: float) -> float:
    return round(nbytes / 1e9, 4)


def rate(nbytes: float, seconds: float | None) -> float | None:
    return round(nbytes / seconds / 1e9, 3) if seconds else None


def fmt_params(n: int) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return str(n)


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 4) if a is not None and b else None


def fs_type(path: str) -> str | None:
    """The file system type of the mount holding ``path`` (from /proc/mounts)."""
    try:
        path = os.path.realpath(path)
        best, kind = "", None
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) < 3:
                    continue
                under = path == parts[1] or path.startswith(parts[1].rstrip("/") + "/")
                if under and len(parts[1]) >= len(best):
                    best, kind = parts[1], parts[2]
        return kind
    except OSError:
        return None


def default_workdir() -> str:
    """The system temporary directory unless it is in memory (tmpfs): then the current one."""
    tmp = tempfile.gettempdir()
    if fs_type(tmp) in ("tmpfs", "ramfs"):
        return os.path.join(os.getcwd(), ".gpu-check-tmp")
    return tmp


def llama_config(shape: dict[str, Any], seq: int) -> Any:
    from shardckpt.runtime.models.llama import LlamaConfig

    return LlamaConfig(**shape, max_position_embeddings=max(256, seq))


def llama_params(shape: dict[str, Any]) -> int:
    """Parameters of a Llama shape (tied embedding), without importing torch."""
    from shardckpt.runtime.models.llama_config import LlamaConfig

    return LlamaConfig(**shape).num_params()


def token_batches(cfg: Any, seq: int, batch: int, n: int, device: Any, rank: int = 0,
                  world: int = 1) -> list[Any]:
    from shardckpt.runtime.data import SyntheticCorpus, TokenBatches

    data = TokenBatches(SyntheticCorpus(cfg.vocab_size, seed=1), seq_len=seq, micro_batch=batch,
                        rank=rank, world_size=world)
    return [data.batch(k).to(device) for k in range(n)]


def zero_engine(ctx: Ctx, cfg: Any, pm: Any = None, **kwargs: Any) -> tuple[Any, Any]:
    """The Llama on the meta device sharded by a bf16 ZeRO engine (seed 0), and its AdamW."""
    import torch

    from shardckpt.runtime import MixedPrecisionPolicy, ShardedAdamW, ZeroEngine, decay_param_groups
    from shardckpt.runtime.models.llama import LLAMA_POLICY, LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    engine = ZeroEngine(model, policy=LLAMA_POLICY, process_mesh=pm or ctx.pm(), init_seed=0,
                        mixed_precision=MixedPrecisionPolicy(torch.bfloat16, torch.float32),
                        **kwargs)
    opt = ShardedAdamW(engine, decay_param_groups(engine, 0.1), lr=3e-4, betas=(0.9, 0.95))
    return engine, opt


def train_step(ctx: Ctx, forward: Any, opt: Any, tokens: Any) -> tuple[float, float]:
    """One step, timed between device synchronizations: (seconds, loss)."""
    from shardckpt.runtime.models.llama import causal_lm_loss

    ctx.sync()
    t0 = time.perf_counter()
    loss = causal_lm_loss(forward(tokens), tokens)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    ctx.sync()
    return time.perf_counter() - t0, float(loss.detach())


def shard_bytes(engine: Any) -> int:
    return sum(t.numel() * t.element_size() for kinds in engine.local_shards().values()
               for t in kinds.values())


def mem(ctx: Ctx) -> dict[str, float | None]:
    if not ctx.cuda:
        return {"allocated_gb": None, "max_allocated_gb": None}
    import torch

    return {"allocated_gb": gb(torch.cuda.memory_allocated(ctx.device)),
            "max_allocated_gb": gb(torch.cuda.max_memory_allocated(ctx.device))}


def rss_bytes() -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


# ======================================================================== a: parity


def _parity_reference(cfg: Any, device: Any, batches: list[list[Any]], micro: int,
                      accumulate: str) -> dict[str, Any]:
    """Plain PyTorch on ``device``: fp32 masters, a bf16 compute copy, gradients cast to fp32 and
    summed (no_sync: the micro-batches first, then the mean over the one rank; per-micro: the
    means add up), ``torch.optim.AdamW(foreach=False)``. Mirrors ``testing.reference``."""
    import copy

    import torch

    from shardckpt.runtime.models.llama import LlamaForCausalLM, causal_lm_loss

    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(device)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    compute = copy.deepcopy(model)
    for p in compute.parameters():
        p.data = p.data.to(torch.bfloat16)
    cparams = dict(compute.named_parameters())
    groups = [{"params": [p for n, p in named if p.ndim >= 2 and "norm" not in n],
               "weight_decay": PARITY_WD},
              {"params": [p for n, p in named if p.ndim < 2 or "norm" in n], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=PARITY_LR, betas=PARITY_BETAS, foreach=False)
    fp32 = torch.float32

    def mean(g: Any) -> Any:  # the mean over one rank, as the reference of any world size does
        return (g.to(fp32, copy=True) / 1).float()

    losses = []
    for step_batches in batches:
        local = []
        for m in range(micro):
            compute.zero_grad(set_to_none=True)
            tokens = step_batches[m]
            loss = causal_lm_loss(compute(tokens), tokens) / micro
            loss.backward()
            losses.append(loss.detach().float().cpu())
            local.append({n: cparams[n].grad.to(fp32, copy=True) for n, _ in named})
        for n, p in named:
            if accumulate == "no_sync":
                acc = local[0][n]
                for m in range(1, micro):
                    acc += local[m][n]
                p.grad = mean(acc)
            else:
                p.grad = mean(local[0][n])
                for m in range(1, micro):
                    p.grad += mean(local[m][n])
        opt.step()
        with torch.no_grad():
            for n, p in named:
                cparams[n].copy_(p)
    names = {id(p): n for n, p in named}
    out = {"master": {n: p.detach() for n, p in named}, "losses": losses}
    for kind in ("exp_avg", "exp_avg_sq"):
        out[kind] = {names[id(p)]: s[kind] for p, s in opt.state.items()}
    return out


PARITY_LR, PARITY_BETAS, PARITY_WD = 1e-2, (0.9, 0.95), 0.1


def _parity_engine(cfg: Any, pm: Any, stage: int, batches: list[list[Any]], micro: int,
                   accumulate: str) -> tuple[Any, list[Any]]:
    import torch

    from shardckpt.runtime import MixedPrecisionPolicy, ShardedAdamW, ZeroEngine, decay_param_groups
    from shardckpt.runtime.models.llama import LLAMA_POLICY, LlamaForCausalLM, causal_lm_loss

    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    engine = ZeroEngine(model, policy=LLAMA_POLICY, process_mesh=pm, deterministic=True,
                        stage=stage,
                        mixed_precision=MixedPrecisionPolicy(torch.bfloat16, torch.float32))
    opt = ShardedAdamW(engine, decay_param_groups(engine, PARITY_WD), lr=PARITY_LR,
                       betas=PARITY_BETAS)
    losses = []
    for step_batches in batches:
        for m in range(micro):
            engine.set_requires_gradient_sync(accumulate == "per_micro" or m == micro - 1)
            tokens = step_batches[m]
            loss = causal_lm_loss(engine(tokens), tokens) / micro
            loss.backward()
            losses.append(loss.detach().float().cpu())
        opt.step()
        opt.zero_grad()
    return engine, losses


def _compare(engine: Any, ref: dict[str, Any], losses: list[Any]) -> dict[str, Any]:
    """Bit comparison of every flat group's master and moments (its whole range: world 1) and of
    the losses; the largest absolute difference of each kind."""
    import torch

    layout, rank = engine.layout, engine.process_mesh.shard_rank
    out: dict[str, Any] = {}
    differing: list[str] = []
    for kind in ("master", "exp_avg", "exp_avg_sq"):
        equal, worst = True, 0.0
        for name, kinds in engine.local_shards().items():
            if kind not in kinds:
                continue
            g = layout.group(name)
            shard = kinds[kind]
            flat = torch.zeros(g.padded_numel, dtype=shard.dtype, device=shard.device)
            for spec in layout.group_params(g):
                flat[spec.offset:spec.offset + spec.numel] = ref[kind][spec.fqn].reshape(-1)
            lo, hi = layout.shard_range(g, rank)
            if not torch.equal(shard, flat[lo:hi]):
                equal = False
                diff = float((shard.double() - flat[lo:hi].double()).abs().max())
                worst = max(worst, diff)
                differing.append(f"{name}.{kind} (max abs diff {diff:g})")
        out[f"{kind}_equal"] = equal
        out[f"{kind}_max_abs_diff"] = worst
    mine = torch.stack(losses).double()
    theirs = torch.stack(ref["losses"]).double()
    out["losses_equal"] = bool(torch.equal(torch.stack(losses), torch.stack(ref["losses"])))
    out["losses_max_abs_diff"] = float((mine - theirs).abs().max())
    out["losses"] = [float(x) for x in mine[:8]]
    out["differing"] = differing[:10]
    out["equal"] = all(out[f"{k}_equal"] for k in ("master", "exp_avg", "exp_avg_sq")) and \
        out["losses_equal"]
    return out


def section_a(ctx: Ctx, rec: dict[str, Any]) -> None:
    import warnings

    import torch

    sz = ctx.size("a")
    cfg = llama_config(sz["model"], sz["seq"])
    saved = (torch.are_deterministic_algorithms_enabled(),
             torch.is_deterministic_algorithms_warn_only_enabled(),
             torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    if ctx.cuda:
        # bit-exact kernels on both sides (cuBLAS workspace set before CUDA starts, in main())
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    attention: Any = contextlib.nullcontext()
    if ctx.cuda:  # the math attention kernels: flash and memory-efficient backward use atomics
        try:
            from torch.nn.attention import SDPBackend, sdpa_kernel

            attention = sdpa_kernel([SDPBackend.MATH])
        except ImportError:  # torch < 2.3
            attention = torch.backends.cuda.sdp_kernel(
                enable_flash=False, enable_mem_efficient=False, enable_math=True)
    try:
        with attention, warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _section_a(ctx, rec, cfg, sz)
        seen = sorted({str(w.message)[:300] for w in caught})
        rec["warnings"] = seen[:8]
    finally:
        torch.use_deterministic_algorithms(saved[0], warn_only=saved[1])
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved[2:]


def _section_a(ctx: Ctx, rec: dict[str, Any], cfg: Any, sz: dict[str, Any]) -> None:
    import torch

    from shardckpt.runtime.mesh import ProcessMesh

    rec["settings"] = {
        "model": sz["model"], "params": llama_params(sz["model"]), "seq": sz["seq"],
        "micro_batch": sz["micro_batch"], "steps": sz["steps"],
        "mixed_precision": "bf16 compute, fp32 reduce, fp32 masters", "deterministic": True,
        "use_deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "cublas_workspace_config": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
        "reference": "plain PyTorch on the same device, torch.optim.AdamW(foreach=False)",
        "attention": "math SDPA kernels (deterministic)" if ctx.cuda else "default"}
    pm = ctx.pm()
    rec["settings"]["process_group"] = f"{pm.backend}, world {pm.world_size}"

    def batches(micro: int) -> list[list[Any]]:
        g = torch.Generator().manual_seed(7)
        return [[torch.randint(0, cfg.vocab_size, (sz["micro_batch"], sz["seq"]), generator=g)
                 .to(ctx.device) for _ in range(micro)] for _ in range(sz["steps"])]

    M = sz["micro"]
    cases = [(f"stage {s}", s, 1, "per_micro", pm) for s in (1, 2, 3)]
    cases += [(f"stage {s}, {M} micro-batches, no_sync", s, M, "no_sync", pm) for s in (1, 2, 3)]
    cases += [(f"stage {s}, {M} micro-batches, reduce each", s, M, "per_micro", pm) for s in (1, 2)]
    cases += [("stage 3, no process group (ProcessMesh.single)", 3, 1, "per_micro",
               ProcessMesh.single(ctx.device))]
    refs: dict[tuple[int, str], dict[str, Any]] = {}
    data: dict[int, list[list[Any]]] = {}
    rec["cases"] = []
    for label, stage, micro, acc, mesh in cases:
        row: dict[str, Any] = {"case": label, "stage": stage, "micro_batches": micro,
                               "accumulation": acc if micro > 1 else None}
        with guarded(row, "run", ctx):
            if micro not in data:
                data[micro] = batches(micro)
            key = (micro, acc if micro > 1 else "per_micro")
            if key not in refs:
                refs[key] = _parity_reference(cfg, ctx.device, data[micro], micro, key[1])
            t0 = time.perf_counter()
            engine, losses = _parity_engine(cfg, mesh, stage, data[micro], micro, key[1])
            row["engine_s"] = round(time.perf_counter() - t0, 3)
            row.update(_compare(engine, refs[key], losses))
            engine.close()
        rec["cases"].append(row)
        verdict = "equal" if row.get("equal") else "DIFFERS" if "equal" in row else "error"
        log(f"  a: {label}: {verdict}")
    with guarded(rec, "reference_repeatable", ctx):
        # the reference run twice: are the device's kernels themselves repeatable?
        again = _parity_reference(cfg, ctx.device, data[1], 1, "per_micro")
        first = refs[(1, "per_micro")]
        rec["reference_repeatable"] = all(
            torch.equal(first["master"][n], t) for n, t in again["master"].items()) and \
            torch.equal(torch.stack(first["losses"]), torch.stack(again["losses"]))
    rec["all_equal"] = all(c.get("equal") is True for c in rec["cases"])
    rec["summary"] = (f"{sum(c.get('equal') is True for c in rec['cases'])} of {len(cases)} "
                      "cases bit-equal to plain PyTorch")


# ============================================================ b: train step vs FSDP2


def peak_tflops(ctx: Ctx) -> tuple[float | None, str]:
    if ctx.args.peak_tflops:
        return float(ctx.args.peak_tflops), "--peak-tflops"
    if not ctx.cuda:
        return None, "no peak for a CPU (pass --peak-tflops)"
    import torch

    name = torch.cuda.get_device_name(ctx.device)
    for key in sorted(PEAK_BF16_TFLOPS, key=len, reverse=True):
        if key in name:
            return PEAK_BF16_TFLOPS[key], f"table: {key!r} in {name!r}"
    return None, f"{name!r} is not in the table (pass --peak-tflops)"


def fsdp2_model(ctx: Ctx, cfg: Any, full: dict[str, Any]) -> tuple[Any, Any, dict[str, Any]]:
    """The same Llama under FSDP2 (each decoder layer, then the root), bf16 compute and fp32
    reduce, given the engine's weights; torch's AdamW (its default implementation)."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    try:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    except ImportError:  # torch < 2.6
        from torch.distributed._composable.fsdp import MixedPrecisionPolicy, fully_shard

    from shardckpt.runtime.models.llama import LlamaDecoderLayer, LlamaForCausalLM

    torch.manual_seed(0)
    with torch.device(ctx.device):
        model = LlamaForCausalLM(cfg)
    mesh = init_device_mesh(ctx.device.type, (1,))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for m in model.modules():
        if isinstance(m, LlamaDecoderLayer):
            fully_shard(m, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    info: dict[str, Any] = {"missing_weights": []}
    with torch.no_grad():
        for name, p in model.named_parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            src = full.get(name)
            if src is None or src.numel() != local.numel():
                info["missing_weights"].append(name)
                continue
            local.copy_(src.reshape(local.shape))
    info["same_weights_as_shardckpt"] = not info["missing_weights"]
    named = list(model.named_parameters())
    nodecay = [p for n, p in named if p.ndim < 2 or "norm" in n]
    decay = [p for n, p in named if not (p.ndim < 2 or "norm" in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": nodecay, "weight_decay": 0.0}], lr=3e-4, betas=(0.9, 0.95))
    return model, opt, info


def section_b2(ctx: Ctx, rec: dict[str, Any]) -> None:
    if HERE not in sys.path:  # loaded from a file by the tests
        sys.path.insert(0, HERE)
    import _gpu_compile  # bench/_gpu_compile.py

    _gpu_compile.section_b2(ctx, rec, types.SimpleNamespace(**globals()))


def section_b(ctx: Ctx, rec: dict[str, Any]) -> None:
    import torch

    sz = ctx.size("b")
    cfg = llama_config(sz["model"], sz["seq"])
    tokens_per_step = sz["batch"] * sz["seq"]
    engine, opt = zero_engine(ctx, cfg)
    psi = sum(spec.numel for spec in engine.layout.params)
    L, h, s = cfg.num_hidden_layers, cfg.hidden_size, sz["seq"]
    flops_per_token = 6 * psi + 12 * L * h * s
    peak, peak_source = peak_tflops(ctx)
    rec["settings"] = {
        "model": sz["model"], "params": psi, "seq": s, "batch": sz["batch"],
        "tokens_per_step": tokens_per_step, "warmup": sz["warmup"], "steps": sz["steps"],
        "precision": "bf16 compute, fp32 reduce, fp32 masters and AdamW state on both sides",
        "shardckpt": "ZeroEngine stage 3, prefetch on, units = decoder layers + root, ShardedAdamW",
        "fsdp2": "fully_shard per decoder layer + root, torch.optim.AdamW (default implementation)",
        "flops_per_token": flops_per_token,
        "flops_formula": "6 * params + 12 * layers * hidden * seq (PaLM appendix B; the tied "
                         "embedding counted once, as the head's matmul)",
        "peak_tflops": peak, "peak_source": peak_source,
        "schedule": "interleaved A B B A ... step by step, same batch for both sides at each step"}
    sides: dict[str, tuple[Any, Any]] = {"shardckpt": (engine, opt)}
    with guarded(rec, "fsdp2_build", ctx):
        full = engine.full_state_dict()
        model, fopt, info = fsdp2_model(ctx, cfg, full)
        del full
        rec["settings"]["fsdp2_weights"] = info
        sides["fsdp2"] = (model, fopt)
    ctx.free()
    batches = token_batches(cfg, sz["seq"], sz["batch"], sz["warmup"] + sz["steps"], ctx.device)
    times: dict[str, list[float]] = {k: [] for k in sides}
    losses: dict[str, list[float]] = {k: [] for k in sides}
    memory: dict[str, dict[str, Any]] = {}
    failed: set[str] = set()
    names = list(sides)
    for k, tokens in enumerate(batches):
        for side in (names if k % 2 == 0 else names[::-1]):
            if side in failed:
                continue
            with guarded(rec, f"{side}_step", ctx):
                try:
                    if ctx.cuda:
                        before = torch.cuda.memory_allocated(ctx.device)
                        torch.cuda.reset_peak_memory_stats(ctx.device)
                    dt, loss = train_step(ctx, sides[side][0], sides[side][1], tokens)
                except Exception:
                    failed.add(side)
                    raise
                if ctx.cuda:
                    memory[side] = {
                        "allocated_before_step_gb": gb(before),
                        "peak_during_step_gb": gb(torch.cuda.max_memory_allocated(ctx.device)),
                        "note": "both sides' states are resident; the peak minus the "
                                "allocation before the step is this side's working set"}
                losses[side].append(loss)
                if k >= sz["warmup"]:
                    times[side].append(dt)
        log(f"  b: step {k}: " + ", ".join(f"{s} {times[s][-1]:.3f} s" for s in names
                                          if times[s] and k >= sz["warmup"]))
    res = {}
    for side in names:
        med = median(times[side])
        row: dict[str, Any] = {"median_step_s": med, "steps_s": times[side],
                               "losses": losses[side], "memory": memory.get(side)}
        if med:
            row["tokens_per_s"] = round(tokens_per_step / med, 1)
            row["achieved_tflops"] = float(f"{flops_per_token * tokens_per_step / med / 1e12:.4g}")
            row["mfu"] = (round(row["achieved_tflops"] / peak, 4) if peak else None)
        res[side] = row
    rec["results"] = res
    if res.get("fsdp2", {}).get("median_step_s") and res["shardckpt"].get("median_step_s"):
        rec["ratio_step_time_shardckpt_over_fsdp2"] = ratio(res["shardckpt"]["median_step_s"],
                                                            res["fsdp2"]["median_step_s"])
        rec["paired_ratio"] = round(statistics.median(
            a / b for a, b in zip(times["shardckpt"], times["fsdp2"], strict=False)), 4)
        rec["last_loss_abs_diff"] = abs(losses["shardckpt"][-1] - losses["fsdp2"][-1])
    engine.close()


# ================================================================= c: Checkpointer


def _fadvise_dontneed(root: str) -> bool:
    """Ask the kernel to drop the clean page-cache pages of every file under ``root``."""
    if not hasattr(os, "posix_fadvise"):
        return False
    for d, _, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(d, name), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
    return True


def _dir_bytes(root: str) -> int:
    return sum(os.path.getsize(os.path.join(d, n)) for d, _, files in os.walk(root) for n in files)


def disk_limit(path: str, nbytes: int) -> dict[str, Any]:
    """Plain Python: write ``nbytes`` in 16 MiB blocks, fsync, then read them back (after
    POSIX_FADV_DONTNEED); the seconds and GB/s of each."""
    block = 16 << 20
    buf = os.urandom(block)
    t0 = time.perf_counter()
    with open(path, "wb", buffering=0) as f:
        left = nbytes
        while left > 0:
            n = f.write(buf[:min(block, left)])
            left -= n
        os.fsync(f.fileno())
    write_s = time.perf_counter() - t0
    advised = _advise_file(path)
    view = memoryview(bytearray(block))
    t0 = time.perf_counter()
    got = 0
    with open(path, "rb", buffering=0) as f:
        while True:
            n = f.readinto(view)
            if not n:
                break
            got += n
    read_s = time.perf_counter() - t0
    os.remove(path)
    return {"bytes": nbytes, "write_fsync_s": round(write_s, 4), "write_gbs": rate(nbytes, write_s),
            "read_s": round(read_s, 4), "read_gbs": rate(got, read_s), "fadvise_dontneed": advised}


def _advise_file(path: str) -> bool:
    if not hasattr(os, "posix_fadvise"):
        return False
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return True


def _staged_watch(ck: Any) -> Callable[[], float]:
    """Start a thread that notes when the save in flight has staged its shards; the returned
    function waits for it and gives that moment (``time.perf_counter()``)."""
    import threading

    when: list[float] = []

    def watch() -> None:
        ck.wait_staged()
        when.append(time.perf_counter())

    th = threading.Thread(target=watch, name="gpu-check-staged", daemon=True)
    th.start()

    def result() -> float:
        th.join()
        return when[0]
    return result


def pinned_copy_limit(ctx: Ctx, nbytes: int, reps: int = 3) -> dict[str, Any]:
    """A ``torch.cuda`` copy of ``nbytes`` from device memory into pinned host memory (one
    buffer, blocking ``copy_`` as the staging does): the device-to-host limit."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, device=ctx.device)
    src.fill_(1)
    t0 = time.perf_counter()
    dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=ctx.cuda)
    alloc_s = time.perf_counter() - t0
    dst.copy_(src)  # warm-up (touches every page)
    ctx.sync()
    times = []
    for _ in range(reps):
        ctx.sync()
        t0 = time.perf_counter()
        dst.copy_(src)
        ctx.sync()
        times.append(time.perf_counter() - t0)
    del src, dst
    ctx.free()
    med = median(times)
    return {"bytes": nbytes, "median_s": med, "gbs": rate(nbytes, med),
            "pinned": ctx.cuda, "allocate_pinned_s": round(alloc_s, 4),
            "note": None if ctx.cuda else "cpu device: a host memcpy, not a device copy"}


def section_c(ctx: Ctx, rec: dict[str, Any]) -> None:
    import torch

    from shardckpt.training.checkpointer import Checkpointer

    sz = ctx.size("c")
    cfg = llama_config(sz["model"], sz["seq"])
    engine, opt = zero_engine(ctx, cfg)
    batches = token_batches(cfg, sz["seq"], sz["batch"], 8, ctx.device)
    step_s = [train_step(ctx, engine, opt, batches[0])[0]]
    nbytes = shard_bytes(engine)
    root = ctx.workdir("c")
    rec["settings"] = {"model": sz["model"], "params": sum(s.numel for s in engine.layout.params),
                       "state_bytes": nbytes,
                       "state": "fp32 masters + AdamW moments (ZeRO-3, world 1)",
                       "workdir": root, "workdir_fs": fs_type(root),
                       "page_cache": "not dropped: that needs root (/proc/sys/vm/drop_caches), "
                                     "which this check does not use; before each read the files "
                                     "get POSIX_FADV_DONTNEED, which the kernel may or may not "
                                     "honour, so read rates may include page-cache hits"}
    try:
        with guarded(rec, "pinned_copy_limit", ctx):
            rec["pinned_copy_limit"] = pinned_copy_limit(ctx, nbytes)
        step_s.append(train_step(ctx, engine, opt, batches[1])[0])
        rec["step_s"] = median(step_s[1:])
        with guarded(rec, "async_save", ctx):
            ck = Checkpointer(os.path.join(root, "async"), engine, async_save=True, keep_last=2)
            saves = []
            try:
                for i, step in enumerate((1, 2, 3)):
                    ctx.sync()
                    t0 = time.perf_counter()
                    ck.save(step)
                    blocked = time.perf_counter() - t0
                    watch = _staged_watch(ck)
                    overlapped = None
                    if step == 3:  # a training step while the save is in flight
                        overlapped = train_step(ctx, engine, opt, batches[2 + i])[0]
                    staged = watch() - t0
                    ck.wait()
                    done = time.perf_counter() - t0
                    saves.append({"step": step, "save_blocked_s": round(blocked, 5),
                                  "staged_after_s": round(staged, 4),
                                  "staging_gbs": rate(nbytes, staged - blocked),
                                  "committed_after_s": round(done, 4),
                                  "train_step_during_save_s": overlapped,
                                  "note": ("first save: allocates the pinned staging buffers"
                                           if step == 1 else None)})
                    if step < 3:
                        step_s.append(train_step(ctx, engine, opt, batches[2 + i])[0])
            finally:
                ck.close()
            rec["async_saves"] = saves
            later = saves[1:]
            rec["async_save_blocked_s"] = median([s["save_blocked_s"] for s in later])
            rec["staging_gbs"] = median([s["staging_gbs"] for s in later if s["staging_gbs"]])
            rec["step_s"] = median(step_s[1:])
            lim = rec.get("pinned_copy_limit", {}).get("gbs")
            rec["staging_vs_pinned_copy"] = ratio(rec["staging_gbs"], lim)
            rec["train_step_during_save_vs_alone"] = ratio(saves[-1]["train_step_during_save_s"],
                                                           rec["step_s"])
            shutil.rmtree(os.path.join(root, "async"), ignore_errors=True)
        sync_dir = os.path.join(root, "sync")
        with guarded(rec, "sync_save", ctx):
            ck = Checkpointer(sync_dir, engine, async_save=False, keep_last=1)
            ctx.sync()
            t0 = time.perf_counter()
            ck.save(10)
            save_s = time.perf_counter() - t0
            url = ck.manager.url_for(10)
            written = _dir_bytes(sync_dir)
            rec["sync_save"] = {"s": round(save_s, 4), "bytes_written": written,
                                "gbs": rate(written, save_s)}
        with guarded(rec, "load", ctx):
            before = {(g, k): t.clone() for g, kinds in engine.local_shards().items()
                      for k, t in kinds.items()}
            advised = _fadvise_dontneed(sync_dir)
            ctx.sync()
            t0 = time.perf_counter()
            res = ck.load(url)
            ctx.sync()
            load_s = time.perf_counter() - t0
            same = all(torch.equal(before[g, k], t) for g, kinds in engine.local_shards().items()
                       for k, t in kinds.items())
            del before
            rec["load"] = {"s": round(load_s, 4), "bytes_read": res.bytes_read,
                           "gbs": rate(res.bytes_read, load_s), "state_bit_equal_after": same,
                           "fadvise_dontneed": advised}
        with guarded(rec, "disk_limit", ctx):
            n = rec.get("sync_save", {}).get("bytes_written") or nbytes
            rec["disk_limit"] = disk_limit(os.path.join(root, "raw.bin"), n)
            rec["disk_limit"]["what"] = ("plain Python: 16 MiB writes then one fsync; 16 MiB "
                                         "readinto after POSIX_FADV_DONTNEED; same byte count "
                                         "as the sync checkpoint")
            rec["sync_save_vs_disk_write"] = ratio(rec.get("sync_save", {}).get("gbs"),
                                                   rec["disk_limit"]["write_gbs"])
            rec["load_vs_disk_read"] = ratio(rec.get("load", {}).get("gbs"),
                                             rec["disk_limit"]["read_gbs"])
    finally:
        shutil.rmtree(root, ignore_errors=True)
        engine.close()


# ==================================================================== d: offload


#: Section d's runs: (row key, offload_optimizer; a dict is an OffloadConfig's fields). The
#: pipelined bit-exact step is the default; ``pipeline=False`` is the step as it was.
D_RUNS = (("resident", None), ("offload_cpu", {"mode": "cpu"}),
          ("offload_cpu_unpipelined", {"mode": "cpu", "pipeline": False}),
          ("offload_cpu_fused", {"mode": "cpu", "fused_adamw": True}))


def _d_run(ctx: Ctx, cfg: Any, batches: list[Any], sz: dict[str, Any], offload: Any
           ) -> dict[str, Any]:
    """One engine of section d trained on ``batches``: step times, device and host memory."""
    import torch

    from shardckpt.runtime.offload import OffloadConfig

    row: dict[str, Any] = {}
    ctx.free()
    if ctx.cuda:
        accel = getattr(torch, "accelerator", None)  # the pinned blocks of the last run go
        empty = getattr(accel, "empty_host_cache", None) or getattr(torch._C, "_host_emptyCache",
                                                                    None)
        if empty is not None:
            empty()
        torch.cuda.reset_peak_memory_stats(ctx.device)
        with contextlib.suppress(Exception):  # the host caching allocator's own count
            torch.cuda.reset_peak_host_memory_stats()
    base = torch.cuda.memory_allocated(ctx.device) if ctx.cuda else None
    rss0 = rss_bytes()
    mode = OffloadConfig(**offload) if offload is not None else None
    engine, opt = zero_engine(ctx, cfg, offload_optimizer=mode)
    try:
        row["allocated_after_build_gb"] = (
            gb(torch.cuda.memory_allocated(ctx.device) - base) if ctx.cuda else None)
        times = []
        for k, tokens in enumerate(batches):
            dt, loss = train_step(ctx, engine, opt, tokens)
            if k >= sz["warmup"]:
                times.append(dt)
        row["median_step_s"] = median(times)
        row["steps_s"] = times
        row["last_loss"] = loss
        row["max_memory_allocated_gb"] = (
            gb(torch.cuda.max_memory_allocated(ctx.device) - base) if ctx.cuda else None)
        rss1 = rss_bytes()
        row["host_rss_growth_gb"] = gb(rss1 - rss0) if rss0 and rss1 else None
        store = getattr(opt, "_offload", None)
        if store is not None:
            row["offloaded_state_gb"] = gb(store.state_bytes)
            row["pinned_gb"] = gb(store.pinned_bytes)
            row["host_rss_growth_over_offloaded_state"] = ratio(
                row["host_rss_growth_gb"], row["offloaded_state_gb"])
        if ctx.cuda:
            with contextlib.suppress(Exception):
                stats = torch.cuda.host_memory_stats()
                row["pinned_peak_allocator_gb"] = gb(stats["allocated_bytes.peak"])
    finally:
        engine.close()
        del engine, opt
    return row


def section_d(ctx: Ctx, rec: dict[str, Any]) -> None:
    sz = ctx.size("d")
    cfg = llama_config(sz["model"], sz["seq"])
    batches = token_batches(cfg, sz["seq"], sz["batch"], sz["warmup"] + sz["steps"], ctx.device)
    rec["settings"] = {"model": sz["model"], "params": llama_params(sz["model"]), "seq": sz["seq"],
                       "batch": sz["batch"], "warmup": sz["warmup"], "steps": sz["steps"],
                       "engine": "ZeRO-3 bf16, world 1, ShardedAdamW",
                       "runs": {key: off for key, off in D_RUNS},
                       "order": "resident, then each offload run, one after the other (each "
                                "alone on the device, so that its peak memory is its own; the "
                                "pinned host cache emptied between runs)"}
    res: dict[str, Any] = {}
    for side, offload in D_RUNS:
        row: dict[str, Any] = {}
        with guarded(row, "run", ctx):
            row.update(_d_run(ctx, cfg, batches, sz, offload))
        res[side] = row
        log(f"  d: {side}: {row.get('median_step_s')} s, "
            f"{row.get('max_memory_allocated_gb')} GB, host RSS +{row.get('host_rss_growth_gb')} GB")
    rec["results"] = res
    r, o = res.get("resident", {}), res.get("offload_cpu", {})
    old, fused = res.get("offload_cpu_unpipelined", {}), res.get("offload_cpu_fused", {})
    rec["step_time_offload_over_resident"] = ratio(o.get("median_step_s"), r.get("median_step_s"))
    rec["step_time_offload_unpipelined_over_resident"] = ratio(old.get("median_step_s"),
                                                              r.get("median_step_s"))
    rec["step_time_offload_fused_over_resident"] = ratio(fused.get("median_step_s"),
                                                        r.get("median_step_s"))
    rec["step_time_offload_over_unpipelined"] = ratio(o.get("median_step_s"),
                                                      old.get("median_step_s"))
    rec["host_rss_growth_over_offloaded_state"] = o.get("host_rss_growth_over_offloaded_state")
    rec["host_rss_growth_over_offloaded_state_unpipelined"] = old.get(
        "host_rss_growth_over_offloaded_state")
    rec["targets"] = {"step_time_offload_over_resident": 1.5,
                      "host_rss_growth_over_offloaded_state": 1.3}
    if ctx.cuda and r.get("max_memory_allocated_gb") is not None and \
            o.get("max_memory_allocated_gb") is not None:
        rec["device_memory_saved_gb"] = round(r["max_memory_allocated_gb"]
                                              - o["max_memory_allocated_gb"], 4)
        rec["device_memory_offload_over_resident"] = ratio(o["max_memory_allocated_gb"],
                                                           r["max_memory_allocated_gb"])
    if not ctx.cuda:
        rec["note"] = "cpu device: torch.cuda.max_memory_allocated not measured"


# ================================================================= e: quantization


def section_e(ctx: Ctx, rec: dict[str, Any]) -> None:
    """The fused kernels against the eager reference in the same run (``bench/zeropp_quant.py``),
    their rate against the device's memory bandwidth, and the share of a ZeRO++ step spent
    quantizing."""
    import zeropp_quant

    sz = ctx.size("e")
    rows, cols, block = sz["rows"], sz["cols"], sz["block"]
    rec["settings"] = {"shape": [rows, cols], "block": block, "reps": sz["reps"],
                       "rate": "GB/s of the input tensor (quantize) or of the dequantized output "
                               "(dequantize); median of reps after one warm-up (which compiles "
                               "the fused kernels); eager and fused take turns rep by rep"}
    with guarded(rec, "bandwidth", ctx):
        rec["memory_bandwidth"] = _e_bandwidth(ctx, rows * cols * 4)
    rec["cases"] = []
    with guarded(rec, "cases", ctx):
        rec["cases"] = zeropp_quant.run(ctx.device, rows, cols, block, sz["reps"], ctx.sync,
                                        log=lambda m: log(f"  e: {m}"))
    with guarded(rec, "error_bound", ctx):
        over = [c["case"] for c in rec["cases"] if not c.get("within_error_bound_fused")]
        assert not over, f"fused kernels past quant.error_bound: {', '.join(over)}"
    peak = (rec.get("memory_bandwidth") or {}).get("nominal_gbs")
    for row in rec["cases"]:
        for op in ("quantize", "dequantize"):
            row[f"{op}_fused_over_hbm"] = ratio(row.get(f"{op}_fused_gbs"), peak)
    fused = [r[f"{op}_fused_gbs"] for r in rec["cases"] for op in ("quantize", "dequantize")
             if f"{op}_fused_gbs" in r]
    rec["target"] = {"fused_gbs_of_input": 1500.0, "min_fused_gbs": min(fused, default=None),
                     "met": (min(fused) >= 1500.0) if fused and ctx.cuda else None}
    ctx.free()
    with guarded(rec, "step_share", ctx):
        rec["step_share"] = _e_step_share(ctx, sz)


#: Nominal memory bandwidth, GB/s, by device name (the vendors' figures).
HBM_GBS = {"H200": 4800.0, "H100 SXM": 3350.0, "H100 PCIe": 2000.0, "H100": 3350.0,
           "A100-SXM4-80GB": 2039.0, "A100": 1555.0}


def _e_bandwidth(ctx: Ctx, nbytes: int) -> dict[str, Any]:
    """The nominal figure for this device (None on CPU or an unknown device) and a measured
    device-to-device copy of ``nbytes`` (read + write counted)."""
    import torch

    name = torch.cuda.get_device_name(ctx.device) if ctx.cuda else "cpu"
    nominal = next((v for k, v in HBM_GBS.items() if k in name), None)
    src = torch.empty(nbytes, dtype=torch.uint8, device=ctx.device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(5):
        ctx.sync()
        t0 = time.perf_counter()
        dst.copy_(src)
        ctx.sync()
        times.append(time.perf_counter() - t0)
    return {"device": name, "nominal_gbs": nominal, "copy_gbs": rate(2 * nbytes, median(times))}


def _e_step_share(ctx: Ctx, sz: dict[str, Any]) -> dict[str, Any]:
    """A world-1 ZeRO-3 + qwZ + qgZ bf16 step of the section's Llama, per kernel: the median step
    time without instrumentation, then the time inside ``quant.quantize``/``dequantize`` per step
    (each call between device synchronizations) over the same number of steps."""
    from shardckpt.runtime import ZeroPP
    from shardckpt.runtime.zeropp import quant

    cfg = llama_config(sz["model"], sz["seq"])
    batches = token_batches(cfg, sz["seq"], sz["batch"], sz["warmup"] + sz["steps"], ctx.device)
    out: dict[str, Any] = {"model": sz["model"], "params": llama_params(sz["model"]),
                           "note": "world 1: qwZ quantizes every gather; qgZ with one rank "
                                   "moves and quantizes nothing"}
    real, env = (quant.quantize, quant.dequantize), os.environ.get(quant.KERNEL_ENV)
    spent = [0.0]

    def timed(fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            ctx.sync()
            t0 = time.perf_counter()
            res = fn(*args, **kwargs)
            ctx.sync()
            spent[0] += time.perf_counter() - t0
            return res
        return wrapper

    for kernel in ("eager", "fused"):
        os.environ[quant.KERNEL_ENV] = kernel
        engine, opt = zero_engine(ctx, cfg, zeropp=ZeroPP(qwz=True, qgz=True))
        try:
            plain, inside = [], []
            for tokens in batches:
                plain.append(train_step(ctx, engine, opt, tokens)[0])
            quant.quantize, quant.dequantize = timed(real[0]), timed(real[1])
            for tokens in batches:
                spent[0] = 0.0
                train_step(ctx, engine, opt, tokens)
                inside.append(spent[0])
        finally:
            quant.quantize, quant.dequantize = real
            os.environ.pop(quant.KERNEL_ENV, None)
            if env is not None:
                os.environ[quant.KERNEL_ENV] = env
            engine.close()
        step, q = median(plain[sz["warmup"]:]), median(inside[sz["warmup"]:])
        out[kernel] = {"median_step_s": step, "quantization_s_per_step": q,
                       "quantization_share": ratio(q, step)}
        log(f"  e: {kernel} step {step} s, quantization {q} s per step")
        ctx.free()
    return out


# ====================================================================== f: multi-rank


def _f_rank(rank: int, world: int, port: int, device_type: str, sz: dict[str, Any],
            out_dir: str) -> None:
    """One rank of section f (a spawned process): ZeRO-3 steps, a sync save, a load checked bit
    for bit, an async save; writes ``rank-<r>.json``."""
    result: dict[str, Any] = {"rank": rank}
    try:
        from shardckpt.training.launch import rank_env

        os.environ.update(rank_env(rank, world, port))
        import torch
        import torch.distributed as dist

        from shardckpt.runtime.mesh import init_distributed
        from shardckpt.training.checkpointer import Checkpointer

        args = argparse.Namespace(device=device_type, small=True, workdir=None, peak_tflops=None)
        ctx = Ctx(args)
        if ctx.cuda:
            ctx.device = torch.device("cuda", rank)
        pm = init_distributed(backend="nccl" if ctx.cuda else "gloo")
        ctx._pm = pm
        result["backend"] = pm.backend
        cfg = llama_config(sz["model"], sz["seq"])
        engine, opt = zero_engine(ctx, cfg, pm=pm)
        batches = token_batches(cfg, sz["seq"], sz["batch"], sz["warmup"] + sz["steps"],
                                ctx.device, rank, world)
        times, loss = [], None
        for k, tokens in enumerate(batches):
            dist.barrier()
            dt, loss = train_step(ctx, engine, opt, tokens)
            t = torch.tensor([dt], dtype=torch.float64, device=ctx.device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            if k >= sz["warmup"]:
                times.append(float(t))
        result.update(steps_s=times, last_loss=loss)
        run = os.path.join(out_dir, "run")
        ck = Checkpointer(run, engine, async_save=False, keep_last=1)
        dist.barrier()
        t0 = time.perf_counter()
        ck.save(1)
        result["sync_save_s"] = time.perf_counter() - t0
        before = {(g, k): t.clone() for g, kinds in engine.local_shards().items()
                  for k, t in kinds.items()}
        train_step(ctx, engine, opt, batches[0])  # the state moves on; the load brings it back
        dist.barrier()
        t0 = time.perf_counter()
        ck.load(ck.manager.url_for(1))
        result["load_s"] = time.perf_counter() - t0
        result["state_bit_equal_after_load"] = all(
            torch.equal(before[g, k], t) for g, kinds in engine.local_shards().items()
            for k, t in kinds.items())
        ck.close()
        ak = Checkpointer(os.path.join(out_dir, "async"), engine, async_save=True, keep_last=1)
        t0 = time.perf_counter()
        ak.save(2)
        result["async_save_blocked_s"] = time.perf_counter() - t0
        train_step(ctx, engine, opt, batches[1])
        ak.close()
        result["async_committed"] = os.path.exists(
            os.path.join(out_dir, "async", "step-00000002", "manifest.json"))
        engine.close()
        dist.barrier()
        dist.destroy_process_group()
        result["ok"] = True
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        result.update(ok=False, error=error_record(exc))
    with open(os.path.join(out_dir, f"rank-{rank}.json"), "w") as f:
        json.dump(result, f)
    os._exit(0)


def section_f(ctx: Ctx, rec: dict[str, Any]) -> None:
    import multiprocessing

    import torch

    from shardckpt.training.launch import free_port, join_all

    sz = ctx.size("f")
    if ctx.cuda:
        count = torch.cuda.device_count()
        if count < 2:
            rec.update(ran=False, reason=f"torch.cuda.device_count() is {count}: one device, "
                                         "so no multi-rank NCCL run (the world-1 NCCL group "
                                         "of sections a-d is the only NCCL exercised)")
            return
        world = min(count, sz["max_ranks"])
    else:
        world = ctx.args.ranks
    rec["settings"] = {"world": world, "backend": "nccl" if ctx.cuda else "gloo",
                       "model": sz["model"], "params": llama_params(sz["model"]),
                       "seq": sz["seq"], "batch_per_rank": sz["batch"], "steps": sz["steps"]}
    out_dir = ctx.workdir("f")
    try:
        mp = multiprocessing.get_context("spawn")
        port = free_port()
        procs = [mp.Process(target=_f_rank, args=(r, world, port, ctx.device.type, sz, out_dir))
                 for r in range(world)]
        for p in procs:
            p.start()
        stuck = join_all(procs, float(ctx.args.section_timeout_s or 600), failure_grace_s=60.0)
        ranks = []
        for r in range(world):
            path = os.path.join(out_dir, f"rank-{r}.json")
            if os.path.exists(path):
                with open(path) as f:
                    ranks.append(json.load(f))
            else:
                late = ", ended after the timeout" if r in stuck else ""
                ranks.append({"rank": r, "ok": False, "error": {
                    "type": "NoResult",
                    "message": f"rank {r} left no result (exit code {procs[r].exitcode}{late})"}})
        rec["ran"] = True
        rec["ranks_ok"] = all(x.get("ok") for x in ranks)
        first = ranks[0]
        steps = first.get("steps_s") or []
        med = median(steps)
        rec["median_step_s"] = med
        if med:
            rec["tokens_per_s"] = round(world * sz["batch"] * sz["seq"] / med, 1)
        rec["state_bit_equal_after_load"] = all(x.get("state_bit_equal_after_load") for x in ranks)
        rec["async_committed"] = bool(first.get("async_committed"))
        rec["ranks"] = [{k: v for k, v in x.items() if k != "steps_s"} for x in ranks]
        if not rec["ranks_ok"]:
            bad = next(x for x in ranks if not x.get("ok"))
            raise RuntimeError(f"rank {bad['rank']} failed: {bad['error']['type']}: "
                               f"{bad['error']['message']}")
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)


RUNNERS: dict[str, Callable[[Ctx, dict[str, Any]], None]] = {
    "a": section_a, "b": section_b, "b2": section_b2, "c": section_c, "d": section_d,
    "e": section_e, "f": section_f}


# ============================================================================ driver


def dry_run(args: argparse.Namespace) -> dict[str, Any]:
    size_of = {
        "a": lambda s: (f"Llama {fmt_params(llama_params(s['model']))} params, {s['steps']} steps, "
                        f"{s['micro_batch']}x{s['seq']} tokens per micro-batch, up to "
                        f"{s['micro']} micro-batches, 9 cases"),
        "b": lambda s: (f"Llama {fmt_params(llama_params(s['model']))} params, "
                        f"{s['batch']}x{s['seq']} tokens per step, {s['warmup']} + {s['steps']} "
                        "steps per side"),
        "b2": lambda s: (f"Llama {fmt_params(llama_params(s['model']))} params, compiled layers, "
                         f"{s['batch']}x{s['seq']} tokens per step, {s['warmup']} + "
                         f"{s['steps']} steps per side"),
        "c": lambda s: (f"Llama {fmt_params(llama_params(s['model']))} params, about "
                        f"{12 * llama_params(s['model']) / 1e9:.2f} GB of state per save "
                        "(fp32 masters + 2 AdamW moments), 3 async saves, 1 sync save, 1 load"),
        "d": lambda s: (f"Llama {fmt_params(llama_params(s['model']))} params, "
                        f"{s['batch']}x{s['seq']} tokens, {s['warmup']} + {s['steps']} "
                        "steps per side"),
        "e": lambda s: (f"{s['rows']} x {s['cols']:,} elements (bf16 weights, fp32 gradients), "
                        f"block {s['block']}, {s['reps']} reps"),
        "f": lambda s: (f"Llama {fmt_params(llama_params(s['model']))} params on up to "
                        f"{s['max_ranks']} ranks, {s['batch']}x{s['seq']} tokens per rank"),
    }
    which = "small" if args.small else "full"
    checks = []
    for sid, (name, what) in SECTIONS.items():
        checks.append({"section": sid, "name": name, "measures": what,
                       "size": size_of[sid](SIZES[sid][which]),
                       "estimate_s": ESTIMATE_S[sid][1 if args.small else 0],
                       "selected": sid in args.only})
    return {"schema": SCHEMA, "dry_run": True, "sizes": which, "budget_s": args.budget_s,
            "checks": checks, "torch_imported": "torch" in sys.modules}


def environment(args: argparse.Namespace) -> dict[str, Any]:
    import platform

    import torch

    env: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                           "cuda_build": torch.version.cuda, "host": platform.node(),
                           "cpu_count": os.cpu_count()}
    try:
        env["git_commit"] = subprocess.run(["git", "-C", ROOT, "rev-parse", "HEAD"],
                                           capture_output=True, text=True,
                                           timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        env["git_commit"] = None
    if args.device != "cuda":
        env["device_name"] = "cpu"
        return env
    try:
        props = torch.cuda.get_device_properties(0)
        env.update(device_name=torch.cuda.get_device_name(0),
                   device_count=torch.cuda.device_count(), device_memory_gb=gb(props.total_memory),
                   capability=f"{props.major}.{props.minor}")
        version = torch.cuda.nccl.version()
        env["nccl"] = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
    except Exception as exc:  # noqa: BLE001 - the sections say more
        env["error"] = error_record(exc)
    return env


def run_section_here(sid: str, args: argparse.Namespace, ctx: Ctx | None,
                     flush: Callable[[dict[str, Any]], None] = lambda rec: None) -> dict[str, Any]:
    """Run one section in this process; its record (partial if it raised, with ``error``)."""
    rec: dict[str, Any] = {"name": SECTIONS[sid][0]}
    t0 = time.perf_counter()
    try:
        ctx = ctx or Ctx(args)
        ctx.flush = lambda: flush(rec)
        RUNNERS[sid](ctx, rec)
        rec["status"] = "error" if rec.get("errors") else "ok"
    except Exception as exc:  # noqa: BLE001 - recorded; the next section runs
        rec["status"] = "error"
        rec["error"] = error_record(exc)
        log(f"{sid}: {type(exc).__name__}: {str(exc)[:300]}")
    finally:
        rec["seconds"] = round(time.perf_counter() - t0, 2)
        if ctx is not None:
            with contextlib.suppress(Exception):
                ctx.free()
    flush(rec)
    return rec


def forwarded(args: argparse.Namespace) -> list[str]:
    out = ["--device", args.device, "--ranks", str(args.ranks)]
    if args.small:
        out.append("--small")
    if args.peak_tflops:
        out += ["--peak-tflops", str(args.peak_tflops)]
    if args.workdir:
        out += ["--workdir", args.workdir]
    return out


def run_section_child(sid: str, args: argparse.Namespace, timeout_s: float) -> dict[str, Any]:
    """Run one section in a child process of its own (killed, with its process group, after
    ``timeout_s``); a child that dies leaves what it had written and its stderr's tail."""
    import signal

    fd, path = tempfile.mkstemp(prefix=f"gpu-check-{sid}-", suffix=".json")
    os.close(fd)
    env = dict(os.environ)
    if sid == "a" and args.device == "cuda":
        env.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS
    cmd = [sys.executable, os.path.abspath(__file__), "--child", sid, "--child-out", path,
           "--section-timeout-s", str(int(timeout_s)), *forwarded(args)]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    tail: list[str] = []
    try:
        import threading

        def pump() -> None:
            assert proc.stderr is not None
            for line in proc.stderr:
                sys.stderr.write(line)
                tail.append(line)
                del tail[:-40]

        th = threading.Thread(target=pump, daemon=True)
        th.start()
        try:
            proc.wait(timeout=timeout_s)
            timed_out = False
        except subprocess.TimeoutExpired:
            timed_out = True
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        th.join(timeout=5)
        rec: dict[str, Any] = {}
        with contextlib.suppress(OSError, ValueError):
            with open(path) as f:
                rec = json.load(f)
        if timed_out:
            rec.setdefault("name", SECTIONS[sid][0])
            rec["status"] = "error"
            rec["error"] = {"type": "Timeout", "message": f"the section ran past {timeout_s:.0f} s "
                            "and was killed (with its process group)",
                            "stderr_tail": "".join(tail)[-3000:]}
        elif proc.returncode != 0 or "status" not in rec:
            rec.setdefault("name", SECTIONS[sid][0])
            rec["status"] = "error"
            rec["error"] = {"type": "ChildFailed", "message": f"the section's process exited "
                            f"with code {proc.returncode} before finishing its record",
                            "stderr_tail": "".join(tail)[-3000:]}
        rec.setdefault("seconds", round(time.perf_counter() - t0, 2))
        rec["process_seconds"] = round(time.perf_counter() - t0, 2)
        return rec
    finally:
        with contextlib.suppress(OSError):
            os.remove(path)


def write_json(doc: dict[str, Any], path: str | None) -> None:
    if path:
        tmp = f"{path}.tmp"
        with open(tmp, "w") as f:
            json.dump(doc, f, indent=2, default=str)
        os.replace(tmp, path)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="list the checks as JSON and exit")
    ap.add_argument("--only", default=",".join(SECTIONS),
                    help="comma-separated sections to run, in the order a,b2,d,e,b,c,f "
                         "(default: all)")
    ap.add_argument("--budget-s", type=float, default=420.0,
                    help="skip a section when the time left is below its estimate (default 420)")
    ap.add_argument("--out", help="also write the JSON here (rewritten after each section)")
    ap.add_argument("--small", action="store_true", help="small sizes: a quick smoke run")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                    help="cpu: run the same code on CPU with gloo, to test this script")
    ap.add_argument("--peak-tflops", type=float, help="peak dense bf16 TFLOP/s for MFU")
    ap.add_argument("--workdir", help="where checkpoints and the disk test write (default: the "
                                      "temporary directory, or ./.gpu-check-tmp if it is tmpfs)")
    ap.add_argument("--ranks", type=int, default=2, help="section f on --device cpu: gloo ranks")
    ap.add_argument("--no-isolate", action="store_true",
                    help="run the sections in this process instead of one child process each")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--child-out", help=argparse.SUPPRESS)
    ap.add_argument("--section-timeout-s", type=float, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    only = [s.strip() for s in args.only.split(",") if s.strip()]
    bad = [s for s in only if s not in SECTIONS]
    if bad or not only:
        ap.error(f"--only {args.only!r}: sections are {', '.join(SECTIONS)}")
    args.only = [s for s in RUN_ORDER if s in only]
    return args


def main(argv: list[str] | None = None) -> int:
    if ROOT not in sys.path:  # shardckpt from this checkout, installed or not
        sys.path.insert(0, ROOT)
    args = parse_args(argv)
    if args.dry_run:
        print(json.dumps(dry_run(args), indent=2))
        return 0
    if args.child:  # one section, in a process of its own
        def flush(rec: dict[str, Any]) -> None:
            write_json(rec, args.child_out)

        run_section_here(args.child, args, None, flush)
        return 0
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print(f"gpu_check: no CUDA device (torch.cuda.is_available() is False; torch "
              f"{torch.__version__}, CUDA build {torch.version.cuda}); nothing was run "
              "(--dry-run lists the checks, --device cpu runs them on CPU)", file=sys.stderr)
        return 2
    start = time.perf_counter()
    doc: dict[str, Any] = {
        "schema": SCHEMA,
        "command": " ".join(["python", "bench/gpu_check.py", *(argv or sys.argv[1:])]),
        "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "device": args.device, "small": args.small, "budget_s": args.budget_s,
        "isolated": not args.no_isolate, "sections": {}}
    if args.no_isolate and args.device == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before cuBLAS starts
    doc["environment"] = environment(args)
    ctx = Ctx(args) if args.no_isolate else None
    try:
        for sid in args.only:
            elapsed = time.perf_counter() - start
            left = args.budget_s - elapsed
            need = ESTIMATE_S[sid][1 if args.small else 0]
            if sid == "f" and args.device == "cuda" and torch.cuda.device_count() < 2:
                need = 15  # records why it does not run
            if left < need:
                doc["sections"][sid] = {
                    "name": SECTIONS[sid][0], "status": "skipped",
                    "reason": f"time budget: {elapsed:.0f} s of --budget-s {args.budget_s:.0f} "
                              f"used, {max(left, 0):.0f} s left; this section needs about "
                              f"{need} s"}
                log(f"{sid}: skipped ({doc['sections'][sid]['reason']})")
                continue
            log(f"{sid}: {SECTIONS[sid][0]} ...")
            if ctx is not None:
                rec = run_section_here(sid, args, ctx)
            else:
                rec = run_section_child(sid, args, timeout_s=max(left, need) + 45)
            doc["sections"][sid] = rec
            log(f"{sid}: {rec.get('status')} in {rec.get('seconds')} s")
            doc["elapsed_s"] = round(time.perf_counter() - start, 2)
            write_json(doc, args.out)
    finally:
        if ctx is not None and ctx._pm is not None:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
    doc["elapsed_s"] = round(time.perf_counter() - start, 2)
    doc["statuses"] = {sid: rec.get("status") for sid, rec in doc["sections"].items()}
    write_json(doc, args.out)
    print(json.dumps(doc, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
