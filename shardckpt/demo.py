"""``shardckpt demo``: the whole service on local disk, with nothing to configure.

1. train the small Llama-shaped model with ZeRO-3 on N local gloo processes and save;
2. reshard the checkpoint N -> M offline;
3. resume on M processes (optimizer state, LR schedule, data position) and keep training; save;
4. consolidate to Hugging Face safetensors (fp32) with a ``config.json``;
5. load the consolidated weights into a plain ``nn.Module`` and check that its loss on a named
   batch equals the sharded model's bit for bit.

The global batch stays the same across the change of world size (micro-batch x ranks).

The files go to a new temporary directory, removed at the end, or to a directory the user names,
kept (:func:`demo_workdir`; ``--keep``/``--no-keep`` override either).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any
from collections.abc import Callable, Iterator

from shardckpt.errors import ConfigError, ShardckptError

log = logging.getLogger(__name__)

#: The demo model: the vocabulary is large enough that the root unit is the largest.
DEMO_MODEL: dict[str, Any] = dict(vocab_size=4096, hidden_size=128, intermediate_size=344, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2)
GLOBAL_BATCH = 8
SEQ_LEN = 64
EVAL_BATCH = 10_000  # "the named batch": global step 10000 of the synthetic corpus, rank 0


def _model_and_data(world: int, rank: int):
    import torch
    from torch.optim.lr_scheduler import LambdaLR

    from shardckpt.runtime import ShardedAdamW, ZeroEngine, decay_param_groups, init_distributed
    from shardckpt.runtime.data import SyntheticCorpus, TokenBatches
    from shardckpt.runtime.models.llama import LLAMA_POLICY, LlamaConfig, LlamaForCausalLM

    pm = init_distributed(timeout_s=120)
    cfg = LlamaConfig(**DEMO_MODEL)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    engine = ZeroEngine(model, policy=LLAMA_POLICY, process_mesh=pm, init_seed=0, deterministic=True)
    opt = ShardedAdamW(engine, decay_param_groups(engine, 0.1), lr=3e-3, betas=(0.9, 0.95))
    sched = LambdaLR(opt, _schedule)
    data = TokenBatches(SyntheticCorpus(cfg.vocab_size, seed=0), seq_len=SEQ_LEN,
                        micro_batch=GLOBAL_BATCH // world, rank=rank, world_size=world)
    return cfg, engine, opt, sched, data


def _schedule(step: int) -> float:
    return min(1.0, (step + 1) / 3)


def _train_job(run: str, steps: int) -> dict[str, Any]:
    """One rank of a training phase: resume (if anything is there), train, save."""
    import torch

    from shardckpt.training.checkpointer import Checkpointer
    from shardckpt.runtime.models.llama import causal_lm_loss

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    cfg, engine, opt, sched, data = _model_and_data(world, rank)
    ckpt = Checkpointer(run, engine, app_state={"scheduler": sched, "data": data}, keep_last=2)
    start = ckpt.resume()
    losses, t0 = [], time.perf_counter()
    for _ in range(start, start + steps):
        tokens = next(data)
        loss = causal_lm_loss(engine(tokens), tokens)
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    train_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    ckpt.save(start + steps)
    save_s = time.perf_counter() - t0
    probe = data.batch(EVAL_BATCH // GLOBAL_BATCH, 0)[:1]  # the same tokens on every rank
    with torch.no_grad():
        eval_loss = causal_lm_loss(engine(probe), probe)
    return {"start": start, "losses": losses, "train_s": train_s, "save_s": save_s,
            "lr": sched.get_last_lr()[0], "samples_seen": data.state_dict()["samples_seen"],
            "eval_loss_hex": eval_loss.to(torch.float32).numpy().tobytes().hex(),
            "eval_loss": float(eval_loss)}


def _plain_loss(hf_dir: str) -> tuple[float, str]:
    """The consolidated weights in a plain, unsharded module: loss on the named batch."""
    import torch
    from safetensors.torch import load_file

    from shardckpt.runtime.data import SyntheticCorpus, TokenBatches
    from shardckpt.runtime.models.llama import LlamaConfig, LlamaForCausalLM, causal_lm_loss

    torch.set_num_threads(1)
    with open(os.path.join(hf_dir, "model.safetensors.index.json")) as f:
        files = sorted(set(json.load(f)["weight_map"].values()))
    state: dict[str, Any] = {}
    for name in files:
        state.update(load_file(os.path.join(hf_dir, name)))
    cfg = LlamaConfig(**DEMO_MODEL)
    model = LlamaForCausalLM(cfg)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if m != "lm_head.weight"]  # tied: written once
    if missing or unexpected:
        raise ShardckptError(f"{hf_dir}: missing {missing}, unexpected {unexpected}")
    data = TokenBatches(SyntheticCorpus(cfg.vocab_size, seed=0), seq_len=SEQ_LEN,
                        micro_batch=GLOBAL_BATCH, rank=0, world_size=1)
    probe = data.batch(EVAL_BATCH // GLOBAL_BATCH, 0)[:1]
    with torch.no_grad():
        loss = causal_lm_loss(model(probe), probe)
    return float(loss), loss.to(torch.float32).numpy().tobytes().hex()


@dataclass
class DemoSummary:
    workdir: str
    ranks: int
    to: int
    steps: int
    phases: list[dict[str, Any]] = field(default_factory=list)
    sizes: dict[str, int] = field(default_factory=dict)
    times: dict[str, float] = field(default_factory=dict)
    paths: dict[str, str] = field(default_factory=dict)
    sharded_loss: float = 0.0
    plain_loss: float = 0.0
    bit_exact: bool = False
    kept: bool = True               # whether the files are still there (see demo_workdir)
    cleanup: str = ""               # one line: where the files are, or what was removed

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def _dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def require_torch() -> None:
    """Refuse, before any process starts, a demo on a machine without torch (one line saying how
    to install it, rather than an import error from every rank)."""
    try:
        import torch  # noqa: F401
    except ImportError as e:
        raise ShardckptError(
            f"shardckpt demo trains a model and needs torch, which does not import here ({e}); "
            "install it with `pip install torch` (or `pip install 'shardckpt[torch]'`)") from None


def run_demo(workdir: str | None = None, ranks: int = 4, to: int = 2, steps: int = 4,
             say: Callable[[str], None] = lambda s: None, keep: bool | None = None) -> DemoSummary:
    """Run the demo in ``workdir`` (default: a new temporary directory); ``say`` receives one
    line per phase, and a last one saying where the files are or that they were removed
    (``keep``: see :func:`demo_workdir`, whose policy holds whether the demo succeeds or fails).
    Raises if the final check fails."""
    for name, n in (("--ranks", ranks), ("--to", to)):
        if n < 1 or GLOBAL_BATCH % n:
            raise ConfigError(f"{name} {n}: must divide the demo's global batch of {GLOBAL_BATCH}")
    if steps < 1:
        raise ConfigError(f"--steps {steps}: must be >= 1")
    require_torch()
    with demo_workdir(workdir, keep, say) as wd:
        s = DemoSummary(wd.path, ranks, to, steps)
        _run_phases(s, say)
    s.kept, s.cleanup = wd.kept, wd.note
    return s


def _run_phases(s: DemoSummary, say: Callable[[str], None]) -> None:
    from shardckpt.tools.consolidate import consolidate
    from shardckpt.training.launch import launch
    from shardckpt.checkpoint.run_dir import step_dir
    from shardckpt.tools.reshard import reshard
    from shardckpt.runtime.models.llama_config import LlamaConfig

    workdir, ranks, to, steps = s.workdir, s.ranks, s.to, s.steps
    run_n, run_m = os.path.join(workdir, f"run-{ranks}"), os.path.join(workdir, f"run-{to}")
    hf = os.path.join(workdir, "hf")

    t = time.perf_counter()
    say(f"training on {ranks} gloo processes with ZeRO-3 for {steps} steps")
    out = launch(_train_job, ranks, (run_n, steps))[0]
    s.times["phase1_s"] = time.perf_counter() - t
    s.phases.append({"ranks": ranks, **{k: out[k] for k in ("start", "losses", "samples_seen", "lr")}})
    src = os.path.join(run_n, step_dir(steps))
    s.sizes["checkpoint_bytes"] = _dir_bytes(src)

    t = time.perf_counter()
    say(f"resharding {src} from {ranks} to {to} ranks")
    dst = os.path.join(run_m, step_dir(steps))
    reshard(src, dst, to=to, from_=ranks)
    s.times["reshard_s"] = time.perf_counter() - t

    t = time.perf_counter()
    say(f"resuming on {to} processes and training {steps} more steps")
    out = launch(_train_job, to, (run_m, steps))[0]
    s.times["phase2_s"] = time.perf_counter() - t
    s.phases.append({"ranks": to, **{k: out[k] for k in ("start", "losses", "samples_seen", "lr")}})
    final = os.path.join(run_m, step_dir(2 * steps))

    t = time.perf_counter()
    say(f"consolidating {final} to Hugging Face safetensors")
    consolidate(final, hf, dtype="float32")
    with open(os.path.join(hf, "config.json"), "w") as f:
        json.dump(LlamaConfig(**DEMO_MODEL).to_hf_config(), f, indent=2)
    s.times["consolidate_s"] = time.perf_counter() - t
    s.sizes["consolidated_bytes"] = _dir_bytes(hf)

    say("checking the plain module's loss on the named batch against the sharded model's")
    s.sharded_loss = out["eval_loss"]
    s.plain_loss, plain_hex = _plain_loss(hf)
    s.bit_exact = plain_hex == out["eval_loss_hex"]
    s.paths = {"first_run": run_n, "resharded_run": run_m, "consolidated": hf}
    if out["start"] != steps:
        raise ShardckptError(f"the resumed job started at step {out['start']}, expected {steps}")
    if not s.bit_exact:
        raise ShardckptError(f"the plain module's loss {s.plain_loss!r} differs from the sharded "
                             f"model's {s.sharded_loss!r}")


@dataclass
class Workdir:
    path: str       # absolute
    created: bool   # the demo made the directory (a temporary one, or a --workdir that was new)
    keep: bool      # leave the files at the end
    kept: bool = True
    note: str = ""  # set at the end: where the files are, or what was removed


@contextmanager
def demo_workdir(workdir: str | None, keep: bool | None = None,
                 say: Callable[[str], None] = lambda s: None) -> Iterator[Workdir]:
    """The demo's directory for the ``with`` block, and what happens to it after, whatever the
    block's outcome. Without ``workdir``, a new temporary directory, removed at the end unless
    ``keep``; with one, it must be empty or new, and is kept unless ``keep`` is False: then the
    directory is removed if the demo made it, else emptied (it was empty before). The line saying
    where the files are, or what was removed, is ``note``; when the block fails, ``say`` gets it
    too (the caller then has no summary to print it with)."""
    if workdir is None:
        path, created = tempfile.mkdtemp(prefix="shardckpt-demo-"), True
        keep = bool(keep)
    else:
        path = os.path.abspath(workdir)
        created = not os.path.exists(path)
        if not created and not os.path.isdir(path):
            raise ConfigError(f"{workdir} is not a directory; give --workdir an empty or new one")
        if not created and os.listdir(path):
            raise ConfigError(f"{workdir} is not empty; give --workdir an empty or new directory")
        os.makedirs(path, exist_ok=True)
        keep = True if keep is None else keep
    wd = Workdir(path, created, keep)
    done = False
    try:
        yield wd
        done = True
    finally:
        if wd.keep:
            wd.note = f"files kept in {path} (remove them with: rm -rf {path})"
        else:
            _remove_own(wd)
            wd.kept = False
            wd.note = (f"removed {path}" if created else f"removed the files in {path}") + \
                " (--keep keeps them)"
        if not done:
            say(wd.note)


def _remove_own(wd: Workdir) -> None:
    """Remove what the demo wrote: the whole directory if it made it, else what is inside it."""
    if wd.created:
        shutil.rmtree(wd.path, ignore_errors=True)
        return
    for name in os.listdir(wd.path):
        p = os.path.join(wd.path, name)
        if os.path.isdir(p) and not os.path.islink(p):
            shutil.rmtree(p, ignore_errors=True)
        else:
            os.unlink(p)
    log.debug("emptied %s", wd.path)
