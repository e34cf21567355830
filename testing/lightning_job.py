"""A tiny Lightning run on FSDP2 (``ModelParallelStrategy``, gloo, CPU) saving through shardckpt.

One function per process launch (:func:`testing.ranks.run_ranks` runs it on every rank):

* :func:`reference_then_kill`: an uninterrupted fit without checkpoints (its global loss per
  step written to ``reference.json``), then the same fit from the same initial weights with a
  ``ModelCheckpoint`` saving through shardckpt every epoch, which every rank ends with SIGKILL
  one step after the save of epoch ``KILL_EPOCH - 1`` (the losses it saw in ``killed.json``);
* :func:`resume`: ``trainer.fit(ckpt_path=<dir>/last.ckpt)`` on any world size with the same
  global batch, to the end; its losses per step, and what it restored, come back; then a save
  that must be refused, and optionally two saves to S3 and a fit restoring from one.

The data are one fixed tensor, not shuffled: global batch ``k`` holds the same samples on every
world size (``DistributedSampler`` deals them out rank by rank).
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

from testing.logs import warnings_of

GLOBAL_BATCH = 8
SAMPLES = 32                      # 4 steps per epoch
EPOCHS = 3
KILL_EPOCH = 2                    # killed after the first step of this epoch (saved: the one before)
#: What the strategy records for ``consolidate`` (the model is no Hugging Face one: no prefix).
HF_CONFIG = {"model_type": "tiny-mlp", "architectures": ["TinyMLP"]}


def _run(rank: int, world: int, workdir: str, *, ckpt_dir: str | None, kill: bool,
         resume_from: str | None, s3: tuple[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    import lightning.pytorch as L
    from lightning.pytorch.callbacks import ModelCheckpoint
    from torch.utils.data import DataLoader, TensorDataset

    from shardckpt.integrations.lightning import ShardckptModelParallelStrategy

    class Tiny(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.save_hyperparameters({"lr": 0.05, "betas": (0.9, 0.95), "note": None})
            self.net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(),
                                           torch.nn.Linear(32, 32), torch.nn.Tanh(),
                                           torch.nn.Linear(32, 1))

        def configure_model(self) -> None:
            from torch.distributed.fsdp import FSDPModule, fully_shard

            if isinstance(self.net, FSDPModule):  # a second fit on the same module
                return
            mesh = self.device_mesh["data_parallel"]
            for m in self.net:
                if isinstance(m, torch.nn.Linear):
                    fully_shard(m, mesh=mesh)
            fully_shard(self.net, mesh=mesh)

        def training_step(self, batch: Any, i: int) -> Any:
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self) -> Any:
            opt = torch.optim.AdamW(self.parameters(), lr=0.05, betas=(0.9, 0.95), foreach=False)
            sched = torch.optim.lr_scheduler.StepLR(opt, 3, 0.5)  # stepped every step: 0.0125 at step 8
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    losses: dict[int, float] = {}
    seen: dict[str, Any] = {}

    class Record(L.Callback):
        def on_train_start(self, trainer: Any, module: Any) -> None:
            seen["start_step"] = trainer.global_step
            seen["start_epoch"] = trainer.current_epoch
            seen["lr"] = trainer.optimizers[0].param_groups[0]["lr"]

        def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, i: int) -> None:
            loss = outputs["loss"].detach().clone()
            dist.all_reduce(loss)  # the global batch's loss: the mean over ranks of equal shares
            losses[trainer.global_step] = (loss / world).item()
            if kill and trainer.current_epoch == KILL_EPOCH and i == 0:
                if rank == 0:
                    (Path(workdir) / "killed.json").write_text(json.dumps(losses))
                dist.barrier()
                os.kill(os.getpid(), signal.SIGKILL)

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(SAMPLES, 8, generator=g), torch.randn(SAMPLES, 1, generator=g))
    callbacks: list[Any] = [Record()]
    if ckpt_dir is not None:
        callbacks.append(ModelCheckpoint(dirpath=ckpt_dir, monitor="step", mode="max", save_top_k=2,
                                         save_last=True))
    if ckpt_dir is not None and resume_from is not None:  # keeps only its newest: best_model_path
        callbacks.append(ModelCheckpoint(dirpath=f"{ckpt_dir}-top1", save_top_k=1))
    trainer = L.Trainer(accelerator="cpu", devices=world, max_epochs=EPOCHS, logger=False,
                        strategy=ShardckptModelParallelStrategy(
                            data_parallel_size=world, tensor_parallel_size=1,
                            storage_options=s3[1] if s3 else None, hf_config=HF_CONFIG),
                        enable_checkpointing=ckpt_dir is not None, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=callbacks, num_sanity_val_steps=0)
    torch.manual_seed(0)
    module, loader = Tiny(), DataLoader(data, batch_size=GLOBAL_BATCH // world, shuffle=False)
    with warnings_of("shardckpt") as warned:
        trainer.fit(module, loader, ckpt_path=resume_from)
    out = {"losses": losses, **seen, "end_step": trainer.global_step, "warnings": warned}
    if ckpt_dir is not None:
        out["save_refused"] = _save_refused(trainer, workdir)
    if s3 is not None:
        out.update(_through_s3(trainer, module, loader, s3[0]))
    return out


#: ``ModelCheckpoint.state_key`` of the two callbacks of a resumed run.
TOPK_KEY = ("ModelCheckpoint{'monitor': 'step', 'mode': 'max', 'every_n_train_steps': 0, "
            "'every_n_epochs': 1, 'train_time_interval': None}")
TOP1_KEY = TOPK_KEY.replace("'monitor': 'step', 'mode': 'max'", "'monitor': None, 'mode': 'min'")


def plant_paths(ckpt: Path, states: dict[str, dict[str, Any]]) -> None:
    """What a hostile author does: rewrite the ``ModelCheckpoint`` states of the committed
    checkpoint ``ckpt`` (each key of ``states`` updated, or added, with its entries), manifest
    checksum and all."""
    from shardckpt.format.integrity import seal

    doc = json.loads((ckpt / "manifest.json").read_text())
    stored = doc["extras"]["app"]["lightning"]["state"]["callbacks"]
    assert TOPK_KEY in stored, sorted(stored)
    for key, entries in states.items():
        stored[key] = {**stored.get(key, stored[TOPK_KEY]), **entries}
    (ckpt / "manifest.json").write_bytes(seal(doc))


def _local_weights(module: Any) -> Any:
    import torch

    return torch.cat([(p.to_local() if hasattr(p, "to_local") else p).detach().reshape(-1)
                      for p in module.parameters()])


def _through_s3(trainer: Any, module: Any, loader: Any, url: str) -> dict[str, Any]:
    """Save twice to ``url`` (an S3 prefix), spoil the weights, and fit again from the second
    save (the run is at its last epoch: the fit restores and stops)."""
    import torch

    before = _local_weights(module).clone()
    trainer.save_checkpoint(f"{url}/a.ckpt")
    trainer.save_checkpoint(f"{url}/b.ckpt")
    with torch.no_grad():
        for p in module.parameters():
            p.add_(1.0)
    spoiled = not torch.equal(before, _local_weights(module))
    trainer.fit(module, loader, ckpt_path=f"{url}/b.ckpt")
    return {"s3_restored": spoiled and torch.equal(before, _local_weights(module)),
            "s3_step": trainer.global_step}


def _save_refused(trainer: Any, workdir: str) -> str:
    """A save whose hyper-parameters hold a module: the error every rank raised ('' if none)."""
    import torch

    from shardckpt.errors import ConfigError

    trainer.lightning_module.hparams["loss_fn"] = torch.nn.MSELoss()
    try:
        trainer.save_checkpoint(str(Path(workdir) / "refused.ckpt"))
    except ConfigError as e:
        return str(e)
    finally:
        del trainer.lightning_module.hparams["loss_fn"]
    return ""


def reference_then_kill(rank: int, world: int, workdir: str) -> None:
    ref = _run(rank, world, workdir, ckpt_dir=None, kill=False, resume_from=None)
    if rank == 0:
        (Path(workdir) / "reference.json").write_text(json.dumps(ref["losses"]))
    _run(rank, world, workdir, ckpt_dir=str(Path(workdir) / "ckpts"), kill=True, resume_from=None)
    raise AssertionError("the run was to be killed")


def resume(rank: int, world: int, workdir: str, ckpt_dir: str,
           s3: tuple[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    """Resume from ``<ckpt_dir>/last.ckpt``; with ``s3`` (a prefix and its storage options), then
    save there twice and load the second save back (:func:`_through_s3`)."""
    return _run(rank, world, workdir, ckpt_dir=ckpt_dir, kill=False,
                resume_from=str(Path(ckpt_dir) / "last.ckpt"), s3=s3)


def main() -> None:
    """``python -m testing.lightning_job``: the killed run resumed on 1 rank against the
    uninterrupted 2-rank run, loss by loss (the figure behind the test's 1-rank tolerance)."""
    import tempfile

    from testing import lightning_job as this  # by module name: spawn imports it
    from testing.ranks import run_distributed, run_ranks

    with tempfile.TemporaryDirectory(prefix="lightning-") as work:
        run_ranks(this.reference_then_kill, 2, args=(work,), timeout_s=300)
        ref = json.loads((Path(work) / "reference.json").read_text())
        (one,) = run_distributed(this.resume, 1, args=(work, f"{work}/ckpts"), timeout_s=300)
    worst = 0.0
    for step, loss in sorted(one["losses"].items(), key=lambda kv: int(kv[0])):
        rel = abs(loss - ref[step]) / abs(ref[step])
        worst = max(worst, rel)
        print(f"step {step}: 1 rank {loss!r}, 2 ranks uninterrupted {ref[step]!r}, relative {rel:.2g}")
    print(f"largest relative difference: {worst:.2g}")


if __name__ == "__main__":
    main()
