"""torchtitan's checkpoint manager over shardckpt, on real ranks: the job of
``integration/test_torchtitan.py``.

torchtitan's ``Trainer`` does not start on a CPU-only torch (``torchtitan.tools.utils`` falls
back to ``device_type = "cuda"`` and ``Trainer.__init__`` calls ``torch.cuda.set_device``, which
raises ``AttributeError: module 'torch._C' has no attribute '_cuda_setDevice'``; importing
``torchtitan.trainer`` also needs ``triton``). So this job drives the manager as
``Trainer.train`` does (``load``, then per step ``train_step`` and ``save(step, last_step=...)``,
``close`` at the end), with torchtitan's own components: ``OptimizersContainer`` (AdamW),
``LRSchedulersContainer`` (warmup), ``ParallelAwareDataloader`` (torchdata's stateful loader),
a ``train_state`` like the trainer's, and an FSDP2 model.

One job trains ``total`` steps on every rank with checkpoints off (the reference), then, for each
folder it is given (local, ``s3://``): a run that saves every ``interval`` steps and stops after
step ``crash_at`` (the steps since its last save are lost), and a run from another seed,
``async_mode="async"``, that resumes from the folder and finishes. Before the resume, rank 0
leaves a directory that never committed (``step-00000099``, no manifest) in the folder. Each
rank reports its losses (exact hex) and final state (digests of the bytes), and rank 0 what the
folder holds at the end.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.data import IterableDataset

VOCAB, DIM, HIDDEN, SEQ = 29, 12, 20, 6
STRAY = "step-00000099"


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.up = nn.Linear(DIM, HIDDEN)
        self.down = nn.Linear(HIDDEN, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


class TinyLM(nn.Module):
    """Embedding, two residual blocks, a norm and an output projection (odd sizes: uneven shards)."""

    def __init__(self) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList([Block(), Block()])
        self.norm = nn.LayerNorm(DIM)
        self.output = nn.Linear(DIM, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


class Tokens(IterableDataset):
    """Each rank's own token sequences, the same on every run (input, labels as torchtitan's)."""

    def __init__(self, rank: int, n: int = 64) -> None:
        self.rank, self.n = rank, n

    def __iter__(self) -> Any:
        for i in range(self.n):
            g = torch.Generator().manual_seed(10_000 * self.rank + i)
            seq = torch.randint(0, VOCAB, (SEQ + 1,), generator=g)
            yield {"input": seq[:-1]}, seq[1:]


class TrainState:
    """The trainer's ``train_state`` (its ``step``)."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.step = sd["step"]


@dataclass
class Parts:
    model: nn.Module
    optimizers: Any
    lr_schedulers: Any
    dataloader: Any
    train_state: TrainState
    checkpointer: Any


def build(rank: int, world: int, seed: int, total: int, checkpoint: dict[str, Any] | None) -> Parts:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torchtitan.components.dataloader import ParallelAwareDataloader
    from torchtitan.components.optimizer import LRSchedulersContainer, OptimizersContainer
    from torchtitan.components.optimizer.optimizer import ParamGroupConfig

    from shardckpt.integrations.torchtitan import ShardckptCheckpointManager

    torch.manual_seed(seed)
    model = TinyLM()
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizers = OptimizersContainer.Config(
        param_groups=[ParamGroupConfig(pattern=r".*", optimizer_name="AdamW", optimizer_kwargs={
            "lr": 2e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1})],
        implementation="for-loop").build(model_parts=[model])
    lr_schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(
        optimizers=optimizers, training_steps=total)
    dataloader = ParallelAwareDataloader(Tokens(rank), dp_rank=rank, dp_world_size=world,
                                         batch_size=2)
    train_state = TrainState()
    config = ShardckptCheckpointManager.Config(**(checkpoint or {"enable": False}))
    checkpointer = config.build(dataloader=dataloader, model_parts=[model], optimizers=optimizers,
                                lr_schedulers=lr_schedulers, states={"train_state": train_state},
                                sd_adapter=None, base_folder="")
    return Parts(model, optimizers, lr_schedulers, dataloader, train_state, checkpointer)


def train(p: Parts, total: int, stop_after: int) -> tuple[int, list[str]]:
    """``Trainer.train``'s order: load, then step / save until ``stop_after``; the step it
    resumed from and the losses (as hex)."""
    p.checkpointer.load(step=-1)
    loaded = p.train_state.step
    losses = []
    batches = iter(p.dataloader)
    while p.train_state.step < stop_after:
        p.train_state.step += 1
        inputs, labels = next(batches)
        logits = p.model(inputs["input"])
        loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))
        loss.backward()
        p.optimizers.step()
        p.lr_schedulers.step()
        p.optimizers.zero_grad()
        losses.append(float(loss.detach()).hex())
        p.checkpointer.save(p.train_state.step, last_step=(p.train_state.step == total))
    p.checkpointer.maybe_wait_for_saving()
    p.checkpointer.close()
    return loaded, losses


def digests(p: Parts) -> dict[str, str]:
    """Every tensor of the model and optimizer (whole, gathered: collective) and the scalars, as
    digests of their bytes."""
    from torch.distributed.tensor import DTensor

    def digest(v: Any) -> str:
        if isinstance(v, DTensor):
            v = v.full_tensor()
        if isinstance(v, torch.Tensor):
            return hashlib.sha256(v.detach().contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()
        return repr(v)

    out = {f"model.{k}": digest(v) for k, v in sorted(p.model.state_dict().items())}
    out.update({f"optim.{k}": digest(v) for k, v in sorted(p.optimizers.state_dict().items())})
    out["lr_scheduler"] = repr(p.lr_schedulers.state_dict())
    out["step"] = str(p.train_state.step)
    return out


def titan_job(rank: int, world: int, folders: list[tuple[str, dict[str, Any]]], total: int,
              interval: int, crash_at: int, keep: int) -> dict[str, Any]:
    """The reference, then for each (folder, storage options) the interrupted and the resumed
    run (module docstring)."""
    ref = build(rank, world, 0, total, None)
    _, ref_losses = train(ref, total, total)
    out: dict[str, Any] = {"ref_losses": ref_losses, "ref_state": digests(ref), "runs": []}
    for folder, storage_options in folders:
        out["runs"].append(checkpointed_runs(rank, world, folder, storage_options, total,
                                             interval, crash_at, keep))
    return out


def checkpointed_runs(rank: int, world: int, folder: str, storage_options: dict[str, Any],
                      total: int, interval: int, crash_at: int, keep: int) -> dict[str, Any]:
    checkpoint = {"enable": True, "folder": folder, "interval": interval, "keep_latest_k": keep,
                  "last_save_model_only": False, "storage_options": storage_options}
    first = build(rank, world, 0, total, checkpoint)
    _, first_losses = train(first, total, crash_at)

    if rank == 0:  # a save that never committed, with the highest step number in the folder
        from shardckpt.storage import Storage

        Storage(folder, storage_options).put(f"{STRAY}/attempt/chunks-00000.safetensors", b"torn")
    torch.distributed.barrier()

    resumed = build(rank, world, 1, total, {**checkpoint, "async_mode": "async"})
    fresh = digests(resumed)
    resumed_from, rest = train(resumed, total, total)
    out: dict[str, Any] = {"first_losses": first_losses, "resumed_losses": rest,
                           "resumed_from": resumed_from, "resumed_state": digests(resumed),
                           "fresh_state": fresh}
    if rank == 0:
        from shardckpt.checkpoint.run_dir import CheckpointManager as RunDir

        run = RunDir(folder, storage_options=storage_options)
        out["committed"] = [f.name for f in run.committed()]
        out["step_dirs"] = [n for _, n in run.step_dirs()]
        out["latest"] = run.read_latest()
    return out
