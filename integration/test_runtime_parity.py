"""ZeRO-3 runtime on real gloo process groups: bit-exact parity, frozen/mixed dtypes, meta init.

One spawned job per world size runs every case on one process group and reports per-case
problems (empty list = pass) back through :mod:`distutil`; the tests below read those reports.

The references use plain PyTorch only (no shardckpt runtime code): each rank's micro-batch is run
in turn, gradients are summed in rank order and divided by the world size, and
``torch.optim.AdamW`` / ``SGD`` with ``foreach=False`` take the step, one thread per process.
"""

from __future__ import annotations

from typing import Callable, Iterable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

try:  # integration/ as a package, or (no __init__.py) as a rootdir on sys.path
    from .distutil import case_suite, check_case
except ImportError:
    from distutil import case_suite, check_case


class ToyBlock(nn.Module):
    def __init__(self, d: int, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 2 * d, dtype=dtype)
        self.fc2 = nn.Linear(2 * d, d, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x).to(self.fc1.weight.dtype)
        return x + self.fc2(F.gelu(self.fc1(h))).to(x.dtype)


class Toy(nn.Module):
    """Embedding, blocks, head with bias; optional bf16 block and frozen ``blocks.0.fc1``.

    Has one persistent buffer (``scale``) so buffer handling is exercised.
    """

    def __init__(self, d: int = 16, n: int = 2, vocab: int = 48, bf16_block: int | None = None,
                 freeze: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(
            ToyBlock(d, torch.bfloat16 if i == bf16_block else torch.float32) for i in range(n))
        self.head = nn.Linear(d, vocab)
        self.register_buffer("scale", torch.tensor([1.0]))
        if freeze:
            self.blocks[0].fc1.requires_grad_(False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids) * self.scale
        for b in self.blocks:
            h = b(h)
        return self.head(h)


def toy_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def toy_batch(step: int, rank: int, vocab: int = 48, mb: int = 2, seq: int = 12) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, vocab, (mb, seq), generator=g)


def two_groups(named: Iterable[tuple[str, nn.Parameter]], wd: float) -> list[dict]:
    """Decay for matrices, none for norms and biases (the reference's own grouping)."""
    named = [(n, p) for n, p in named if p.requires_grad]
    return [{"params": [p for n, p in named if p.ndim >= 2 and "norm" not in n], "weight_decay": wd},
            {"params": [p for n, p in named if p.ndim < 2 or "norm" in n], "weight_decay": 0.0}]


def reference_train(model: nn.Module, make_opt: Callable[[list[dict]], torch.optim.Optimizer],
                    batch: Callable[[int, int], torch.Tensor], loss_fn: Callable, world: int,
                    steps: int, wd: float, fp32_masters: bool = False,
                    scheduler: Callable | None = None,
                    clip: float | None = None) -> torch.optim.Optimizer:
    """Plain-PyTorch data parallelism on one process. With ``fp32_masters`` the optimizer runs on
    fp32 copies of the trained parameters, which are cast back into the (maybe bf16) model."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if fp32_masters:
        masters = {n: p.detach().float().clone().requires_grad_(True) for n, p in named}
        opt = make_opt(two_groups(masters.items(), wd))
    else:
        masters = dict(named)
        opt = make_opt(two_groups(named, wd))
    sched = scheduler(opt) if scheduler else None
    for step in range(steps):
        per_rank = []
        for r in range(world):
            model.zero_grad(set_to_none=True)
            loss_fn(model(batch(step, r)), batch(step, r)).backward()
            per_rank.append({n: p.grad.clone() for n, p in named})
        for n, _ in named:
            total = per_rank[0][n].to(torch.float32, copy=True)
            for r in range(1, world):
                total += per_rank[r][n]
            masters[n].grad = total / world
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(list(masters.values()), clip)
        opt.step()
        if sched:
            sched.step()
        if fp32_masters:
            with torch.no_grad():
                for n, p in named:
                    p.copy_(masters[n])
    opt.masters = masters  # type: ignore[attr-defined]
    return opt


def compare_shards(engine, tensors: dict[str, torch.Tensor], kind: str = "master") -> list[str]:
    """Names of flat groups whose local ``kind`` shard differs (``torch.equal``) from ``tensors``
    laid out by the engine's layout. Padding must be zero."""
    layout, rank = engine.layout, engine.process_mesh.shard_rank
    bad = []
    for name, kinds in engine.local_shards().items():
        if kind not in kinds:
            continue
        g = layout.group(name)
        flat = torch.zeros(g.padded_numel, dtype=kinds[kind].dtype)
        for spec in layout.group_params(g):
            flat[spec.offset:spec.offset + spec.numel] = tensors[spec.fqn].reshape(-1)
        lo, hi = layout.shard_range(g, rank)
        if not torch.equal(kinds[kind], flat[lo:hi]):
            diff = (kinds[kind].double() - flat[lo:hi].double()).abs().max().item()
            bad.append(f"{name}.{kind} (max diff {diff:g})")
    return bad


def optimizer_tensors(opt: torch.optim.Optimizer, names: dict[int, str], key: str) -> dict[str, torch.Tensor]:
    return {names[id(p)]: s[key] for p, s in opt.state.items() if key in s}


# ------------------------------------------------------------------------------- the cases

STEPS = 10
LLAMA = dict(vocab_size=512, hidden_size=32, intermediate_size=88, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2)


def _warmup(step: int) -> float:
    return min(1.0, (step + 1) / 4)


def _llama_adamw(pm, deterministic: bool = True, exact: bool = True) -> list[str]:
    from torch.optim.lr_scheduler import LambdaLR

    from shardckpt.runtime import ShardedAdamW, ZeroEngine, decay_param_groups
    from shardckpt.runtime.data import SyntheticCorpus, TokenBatches
    from shardckpt.runtime.llama import LLAMA_POLICY, LlamaConfig, LlamaForCausalLM, causal_lm_loss

    cfg, W = LlamaConfig(**LLAMA), pm.world_size
    data = TokenBatches(SyntheticCorpus(cfg.vocab_size, seed=1), seq_len=16, micro_batch=2,
                        rank=pm.rank, world_size=W)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    engine = ZeroEngine(model, policy=LLAMA_POLICY, process_mesh=pm, deterministic=deterministic)
    opt = ShardedAdamW(engine, decay_param_groups(engine, 0.1), lr=3e-3, betas=(0.9, 0.95))
    sched = LambdaLR(opt, _warmup)
    for step in range(STEPS):
        tokens = data.batch(step)
        causal_lm_loss(engine(tokens), tokens).backward()
        opt.step()
        sched.step()
        opt.zero_grad()

    torch.manual_seed(0)
    ref = LlamaForCausalLM(cfg)
    ropt = reference_train(
        ref, lambda groups: torch.optim.AdamW(groups, lr=3e-3, betas=(0.9, 0.95), foreach=False),
        data.batch, causal_lm_loss, W, STEPS, 0.1, scheduler=lambda o: LambdaLR(o, _warmup))
    ref_params = dict(ref.named_parameters())
    if not exact:
        full = engine.gather_full_params()
        return [f"{n} differs by {(full[n] - p).abs().max().item():g}"
                for n, p in ref_params.items() if not torch.allclose(full[n], p, rtol=1e-4, atol=1e-5)]
    names = {id(p): n for n, p in ref_params.items()}
    problems = compare_shards(engine, ref_params)
    for kind in ("exp_avg", "exp_avg_sq"):
        problems += compare_shards(engine, optimizer_tensors(ropt, names, kind), kind)
    meta = opt.optimizer_metadata()
    if [g["step"] for g in meta["param_groups"]] != [STEPS, STEPS]:
        problems.append(f"steps {[g['step'] for g in meta['param_groups']]}, expected {STEPS}")
    if [g["lr"] for g in opt.param_groups] != [g["lr"] for g in ropt.param_groups]:
        problems.append("learning rates differ from the reference scheduler's")
    return problems


def case_adamw_llama(pm) -> list[str]:
    return _llama_adamw(pm)


def case_adamw_hsdp(pm) -> list[str]:
    """HSDP 2 x 2: deterministic mode equals the 4-rank reference bit for bit; the default
    (reduce-scatter in the shard group, all-reduce across replicas) up to rounding."""
    from shardckpt.format.layout import Mesh
    from shardckpt.runtime.mesh import ProcessMesh

    hsdp = ProcessMesh.from_process_group(Mesh.hsdp(2, pm.world_size // 2))
    return (_llama_adamw(hsdp)
            + [f"default mode: {p}" for p in _llama_adamw(hsdp, deterministic=False, exact=False)])


def case_nondeterministic(pm) -> list[str]:
    """The default reduce-scatter path: equal to the reference up to rounding."""
    return _llama_adamw(pm, deterministic=False, exact=False)


def case_sgd_toy(pm) -> list[str]:
    from shardckpt.runtime import ShardedSGD, ZeroEngine, decay_param_groups

    W = pm.world_size
    torch.manual_seed(1)
    engine = ZeroEngine(Toy(), policy=ToyBlock, process_mesh=pm, deterministic=True)
    opt = ShardedSGD(engine, decay_param_groups(engine, 0.01), lr=0.05, momentum=0.9,
                     dampening=0.1)
    for step in range(STEPS):
        ids = toy_batch(step, pm.rank)
        toy_loss(engine(ids), ids).backward()
        opt.step()
        opt.zero_grad()
    torch.manual_seed(1)
    ref = Toy()
    ropt = reference_train(
        ref, lambda g: torch.optim.SGD(g, lr=0.05, momentum=0.9, dampening=0.1, foreach=False),
        toy_batch, toy_loss, W, STEPS, 0.01)
    names = {id(p): n for n, p in ref.named_parameters()}
    return (compare_shards(engine, dict(ref.named_parameters()))
            + compare_shards(engine, optimizer_tensors(ropt, names, "momentum_buffer"),
                             "momentum_buffer"))


def case_frozen_mixed(pm) -> list[str]:
    """bf16 block (fp32 masters), frozen ``blocks.0.fc1``: bit-exact, frozen unchanged, no state."""
    from shardckpt.runtime import ShardedAdamW, ZeroEngine, decay_param_groups

    W = pm.world_size
    torch.manual_seed(2)
    engine = ZeroEngine(Toy(bf16_block=1, freeze=True), policy=ToyBlock, process_mesh=pm,
                        deterministic=True)
    opt = ShardedAdamW(engine, decay_param_groups(engine, 0.1), lr=1e-2)
    for step in range(STEPS):
        ids = toy_batch(step, pm.rank)
        toy_loss(engine(ids), ids).backward()
        opt.step()
        opt.zero_grad()
    torch.manual_seed(2)
    ref = Toy(bf16_block=1, freeze=True)
    frozen = {n: p.detach().clone() for n, p in ref.named_parameters() if not p.requires_grad}
    ropt = reference_train(ref, lambda g: torch.optim.AdamW(g, lr=1e-2, foreach=False),
                           toy_batch, toy_loss, W, STEPS, 0.1, fp32_masters=True)
    problems = compare_shards(engine, {**ropt.masters, **frozen})
    dtypes = {(g.dtype, g.requires_grad) for g in engine.layout.groups}
    if not {("bfloat16", True), ("float32", False), ("float32", True)} <= dtypes:
        problems.append(f"unexpected flat groups {sorted(dtypes)}")
    for g in engine.layout.groups:
        kinds = set(engine.local_shards()[g.name])
        expected = {"master", "exp_avg", "exp_avg_sq"} if g.requires_grad else {"master"}
        if kinds != expected:
            problems.append(f"{g.name} has state kinds {sorted(kinds)}, expected {sorted(expected)}")
        if engine.local_shards()[g.name]["master"].dtype != torch.float32:
            problems.append(f"{g.name} master is not fp32")
    return problems


def case_clip_toy(pm) -> list[str]:
    """Gradient clipping by the global norm: equal to the reference up to rounding."""
    from shardckpt.runtime import ShardedAdamW, ZeroEngine, decay_param_groups

    torch.manual_seed(3)
    engine = ZeroEngine(Toy(), policy=ToyBlock, process_mesh=pm, deterministic=True)
    opt = ShardedAdamW(engine, decay_param_groups(engine, 0.1), lr=1e-2)
    norms = []
    for step in range(3):
        ids = toy_batch(step, pm.rank)
        toy_loss(engine(ids), ids).backward()
        norms.append(engine.clip_grad_norm_(0.5))
        opt.step()
        opt.zero_grad()
    torch.manual_seed(3)
    ref = Toy()
    reference_train(ref, lambda g: torch.optim.AdamW(g, lr=1e-2, foreach=False), toy_batch,
                    toy_loss, pm.world_size, 3, 0.1, clip=0.5)
    full = engine.gather_full_params()
    problems = [f"{n} differs by {(full[n] - p).abs().max().item():g}"
                for n, p in ref.named_parameters() if not torch.allclose(full[n], p, atol=1e-6)]
    if min(norms) <= 0.5:
        problems.append(f"clipping never engaged: norms {norms}")
    return problems


def case_meta_init(pm) -> list[str]:
    """A meta-device model initialized unit by unit equals the eager one with the same seed."""
    from shardckpt.runtime import ZeroEngine
    from shardckpt.runtime.llama import LLAMA_POLICY, LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**LLAMA)
    torch.manual_seed(5)
    eager = LlamaForCausalLM(cfg)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    engine = ZeroEngine(model, policy=LLAMA_POLICY, process_mesh=pm, init_seed=5)
    full = engine.gather_full_params()
    problems = [n for n, p in eager.named_parameters() if not torch.equal(full[n], p)]
    tokens = torch.arange(12).reshape(2, 6)
    with torch.no_grad():
        if not torch.equal(engine(tokens), eager(tokens)):
            problems.append("logits differ from the eager model's")
    return problems


CASES: dict[str, Callable] = {
    "adamw_llama": case_adamw_llama,
    "sgd_toy": case_sgd_toy,
    "frozen_mixed": case_frozen_mixed,
    "meta_init": case_meta_init,
    "nondeterministic": case_nondeterministic,
    "clip_toy": case_clip_toy,
    "adamw_hsdp": case_adamw_hsdp,
}


def cases_for(world: int) -> list[str]:
    names = ["adamw_llama", "sgd_toy", "frozen_mixed", "meta_init"]
    if world > 1:
        names += ["nondeterministic", "clip_toy"]
    if world == 4:
        names.append("adamw_hsdp")
    return names


reports = case_suite(__name__, CASES, cases_for, [1, 2, 3, 4], timeout_s=170, pg_timeout_s=60,
                     case_pg_timeout_s=60)


# ------------------------------------------------------------------------------- the tests

pytestmark = pytest.mark.slow


_check = check_case


def test_adamw_bit_exact_with_two_param_groups_and_scheduler(reports):
    _check(reports, "adamw_llama")


def test_sgd_momentum_bit_exact(reports):
    _check(reports, "sgd_toy")


def test_frozen_and_mixed_dtype(reports):
    _check(reports, "frozen_mixed")


def test_meta_init_equals_eager(reports):
    _check(reports, "meta_init")


def test_nondeterministic_reduce_scatter_close(reports):
    _check(reports, "nondeterministic")


def test_gradient_clipping_by_global_norm(reports):
    _check(reports, "clip_toy")


def test_hsdp_2x2_equals_reference(reports):
    _check(reports, "adamw_hsdp")
