"""Write the DeepSpeed ZeRO checkpoints under ``tests/fixtures/deepspeed/`` with DeepSpeed itself.

For every (stage, precision, ranks) in the matrix: ``ranks`` processes (gloo on 127.0.0.1, the
CPU accelerator) train the package's small Llama (tied embedding, one frozen parameter, one
persistent buffer) for ``STEPS`` steps with DeepSpeed ZeRO wrapping a client
``torch.optim.AdamW(foreach=False)``, then ``engine.save_checkpoint``. Beside each checkpoint the
generator stores what the tests compare with, as safetensors (never pickle):

* ``reference_fp32.safetensors``: DeepSpeed's own ``get_fp32_state_dict_from_zero_checkpoint``;
* ``reference_optim.safetensors``: the Adam moments DeepSpeed holds, gathered by
  ``deepspeed.utils.safe_get_full_optimizer_state`` (``<fqn>.exp_avg``, ``<fqn>.exp_avg_sq``);
* ``reference.json``: step, hyper-parameters, the training batches, and the losses of DeepSpeed
  continuing ``RESUME_STEPS`` more steps from its own checkpoint.

Run once, with DeepSpeed installed (``pip install -e '.[deepspeed]'``)::

    DS_ACCELERATOR=cpu python scripts/make_deepspeed_fixtures.py [--only zero2-fp32-2]

The DeepSpeed and torch versions are recorded in ``tests/fixtures/deepspeed/README.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
OUT = ROOT / "tests" / "fixtures" / "deepspeed"
STEPS = 3
RESUME_STEPS = 3
MICRO_BATCH = 2
SEQ = 8
LR = 1e-2
WEIGHT_DECAY = 0.1
FROZEN = "model.layers.1.post_attention_layernorm.weight"
BUFFER = "model.pos_scale"
MATRIX = [(stage, prec, ranks)
          for ranks in (2, 3) for stage in (1, 2, 3) for prec in ("fp32", "bf16")]


def config_dict() -> dict:
    """The model's shape (a ``LlamaConfig``'s fields): about 4.4k parameters, tied head."""
    return dict(vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16)


def build_model():  # noqa: ANN201 - torch types stay out of the module's import
    """The fixture model: the small Llama with one frozen weight and one persistent buffer."""
    import torch

    from shardckpt.runtime.models.llama import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**config_dict()))
    model.get_parameter(FROZEN).requires_grad_(False)
    model.model.register_buffer("pos_scale", torch.linspace(0.5, 1.5, 5), persistent=True)
    return model


def batches(world: int, steps: int) -> list[list[list[list[int]]]]:
    """Token ids per step: ``world * MICRO_BATCH`` sequences, rank r takes rows [r*MB, (r+1)*MB)."""
    import torch

    g = torch.Generator().manual_seed(1234)
    vocab = config_dict()["vocab_size"]
    return [torch.randint(0, vocab, (world * MICRO_BATCH, SEQ), generator=g).tolist()
            for _ in range(steps)]


def param_groups(model):  # noqa: ANN001, ANN201
    decay = [p for n, p in model.named_parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.requires_grad and p.dim() < 2]
    return [{"params": decay, "weight_decay": WEIGHT_DECAY},
            {"params": no_decay, "weight_decay": 0.0}]


def ds_config(stage: int, prec: str, world: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "gradient_accumulation_steps": 1,
        "train_batch_size": MICRO_BATCH * world,
        "gradient_clipping": 0.0,
        "zero_allow_untested_optimizer": True,
        "zero_optimization": {"stage": stage},
        "bf16": {"enabled": prec == "bf16"},
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }


def _train(engine, data, rank: int, steps) -> list[float]:  # noqa: ANN001
    import torch
    import torch.distributed as dist

    from shardckpt.runtime.models.llama import causal_lm_loss

    losses = []
    for step in steps:
        rows = torch.tensor(data[step][rank * MICRO_BATCH:(rank + 1) * MICRO_BATCH])
        loss = causal_lm_loss(engine(rows), rows)
        engine.backward(loss)
        engine.step()
        mean = loss.detach().float().clone()
        dist.all_reduce(mean)
        losses.append(float(mean) / dist.get_world_size())
    return losses


def _engine(stage: int, prec: str, world: int):  # noqa: ANN202
    import deepspeed
    import torch

    model = build_model()
    opt = torch.optim.AdamW(param_groups(model), lr=LR, betas=(0.9, 0.95), eps=1e-8,
                            foreach=False)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt,
                                      config=ds_config(stage, prec, world))
    return engine


def _gathered_moments(engine) -> dict:  # noqa: ANN001
    """Every trained parameter's full exp_avg / exp_avg_sq (collective: all ranks call it)."""
    from deepspeed.utils import safe_get_full_optimizer_state

    opt = engine.optimizer
    if hasattr(opt, "_hp_optimizer_states_linked"):
        # DeepSpeed links the optimizer state views after the first param group's first step,
        # before the later groups have state: link again now that every group has it.
        opt._hp_optimizer_states_linked = False
        opt._lazy_init_hp_params_optimizer_state()
    out = {}
    for name, p in engine.module.named_parameters():
        if not p.requires_grad:
            continue
        for kind in ("exp_avg", "exp_avg_sq"):
            t = safe_get_full_optimizer_state(p, kind)
            out[f"{name}.{kind}"] = t.detach().float().cpu().clone().contiguous()
    return out


def case(rank: int, world: int, stage: int, prec: str, out: str) -> dict:
    """One DeepSpeed job: train, save, gather the references, resume and train on."""
    import deepspeed
    import torch
    from safetensors.torch import save_file

    deepspeed.init_distributed(dist_backend="gloo")
    data = batches(world, STEPS + RESUME_STEPS)
    engine = _engine(stage, prec, world)
    losses = _train(engine, data, rank, range(STEPS))
    engine.save_checkpoint(out, tag=f"global_step{STEPS}")
    moments = _gathered_moments(engine)
    hparams = [{k: v for k, v in g.items() if k != "params"} for g in engine.optimizer.param_groups]
    torch.distributed.barrier()
    if rank == 0:
        save_file(moments, os.path.join(out, "reference_optim.safetensors"))
    del engine
    resumed = _engine(stage, prec, world)
    resumed.load_checkpoint(out)
    after = _train(resumed, data, rank, range(STEPS, STEPS + RESUME_STEPS))
    return {"losses": losses, "resumed_losses": after,
            "hparams": json.loads(json.dumps(hparams, default=str))}


def reference_weights(out: Path) -> None:
    """DeepSpeed's own consolidation of the checkpoint, stored as safetensors."""
    import torch
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from safetensors.torch import save_file

    sd = get_fp32_state_dict_from_zero_checkpoint(str(out))
    seen: dict[int, str] = {}
    flat = {}
    for k, v in sd.items():
        if id(v) in seen:  # shared parameters: stored once, recorded in reference.json
            continue
        seen[id(v)] = k
        flat[k] = v.detach().to(torch.float32 if v.is_floating_point() else v.dtype).contiguous()
    save_file(flat, str(out / "reference_fp32.safetensors"))


def generate(name: str, stage: int, prec: str, world: int) -> None:
    from testing.ranks import run_distributed

    out = OUT / name
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    env = {"DS_ACCELERATOR": "cpu"}
    values = run_distributed(case, world, args=(stage, prec, str(out)), timeout_s=900,
                             pg_timeout_s=300, env=env)
    for script in ("zero_to_fp32.py", "zero_to_torch.py"):  # DeepSpeed copies its scripts beside
        (out / script).unlink(missing_ok=True)
    reference_weights(out)
    doc = {"stage": stage, "precision": prec, "world_size": world, "steps": STEPS,
           "micro_batch": MICRO_BATCH, "lr": LR, "weight_decay": WEIGHT_DECAY,
           "model": config_dict(), "frozen": [FROZEN], "buffers": [BUFFER],
           "batches": batches(world, STEPS + RESUME_STEPS), "losses": values[0]["losses"],
           "resumed_losses": values[0]["resumed_losses"], "hparams": values[0]["hparams"]}
    (out / "reference.json").write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {out}")


def main() -> None:
    import deepspeed
    import torch

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", action="append", help="fixture name(s), e.g. zero2-fp32-2")
    args = ap.parse_args()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    for stage, prec, world in MATRIX:
        name = f"zero{stage}-{prec}-{world}"
        if not args.only or name in args.only:
            generate(name, stage, prec, world)
    (OUT / "VERSIONS.json").write_text(json.dumps(
        {"deepspeed": deepspeed.__version__, "torch": torch.__version__}, indent=1) + "\n")


if __name__ == "__main__":
    main()
