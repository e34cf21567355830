"""``transformers.Trainer`` runs with shardckpt checkpoints, for ``integration/test_trainer.py``:
:func:`job` under ``testing.ranks.run_ranks``, or ``python -m testing.trainer_job SPEC.json``
(under ``torchrun`` for several ranks, or alone for one).

A tiny ``LlamaForCausalLM`` built from a config (no download), a fixed token data set, save every
``save_steps``. Each rank records its loss at every step (exact floats); rank 0 writes the final
weights. ``kill_at`` = [rank, step] makes that rank SIGKILL itself right after the save of
``step`` has returned on it (the job dies with a committed checkpoint behind it). ``bare``: the
run records nothing after ``train()`` (the process exits right after it) but, from its last
atexit hook, whether a process group was still alive (``exit-rank-N.json``).
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch

VOCAB, SEQ, SAMPLES = 1024, 16, 96


def llama_config() -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                       tie_word_embeddings=False)


def dataset() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1234)
    out = []
    for _ in range(SAMPLES):
        ids = torch.randint(0, VOCAB, (SEQ,), generator=g)
        out.append({"input_ids": ids, "labels": ids.clone()})
    return out


def plant(copy: str, to: str, app: dict[str, Any], trainer_state: dict[str, Any]) -> None:
    """What a hostile author does: the committed checkpoint ``copy`` copied to ``to`` with
    entries of its ``extras.app.trainer`` and of the trainer state in it replaced (manifest
    checksum and all)."""
    import shutil

    from shardckpt.format.integrity import seal

    shutil.copytree(copy, to)
    doc = json.loads((Path(to) / "manifest.json").read_text())
    record = doc["extras"]["app"]["trainer"]
    record.update(app)
    record["trainer_state"] = json.dumps({**json.loads(record["trainer_state"]), **trainer_state})
    (Path(to) / "manifest.json").write_bytes(seal(doc))


def train(spec: dict[str, Any], out: Path) -> None:
    """One Trainer run (``spec``); its records go to ``out``. ``spec["plant"]``: the arguments of
    :func:`plant`, done first; ``spec["expect_error"]``: a shardckpt error of the run is
    recorded (``error``), not raised."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from transformers import LlamaForCausalLM, TrainerCallback, TrainingArguments
    from shardckpt.errors import ShardckptError
    from shardckpt.integrations.transformers import ShardckptTrainer
    from testing.logs import warnings_of

    out.mkdir(parents=True, exist_ok=True)
    if spec.get("bare"):  # registered first, so run last of the atexit hooks: what teardown meets
        atexit.register(_record_group_at_exit, out / f"exit-rank-{os.environ.get('RANK', '0')}.json")
    if spec.get("plant"):
        plant(**spec["plant"])
    args = TrainingArguments(
        output_dir=spec["output_dir"], max_steps=spec["steps"], save_strategy="steps",
        save_steps=spec["save_steps"], save_total_limit=spec.get("save_total_limit"),
        per_device_train_batch_size=spec["batch"], learning_rate=1e-3, warmup_steps=2,
        lr_scheduler_type="linear", logging_steps=1, report_to=[], seed=7, use_cpu=True,
        disable_tqdm=True, dataloader_num_workers=0, ddp_find_unused_parameters=False)
    torch.manual_seed(7)
    model = LlamaForCausalLM(llama_config())
    if spec.get("fsdp"):
        # FSDP2 as transformers applies it at load time (Accelerate's FSDP plugin needs a GPU)
        from transformers.distributed import DistributedConfig

        init = Path(spec["output_dir"]) / "init"
        if int(os.environ.get("RANK", "0")) == 0:
            model.save_pretrained(init)
        torch.distributed.barrier()
        model = LlamaForCausalLM.from_pretrained(
            init, distributed_config=DistributedConfig(fsdp_size=torch.distributed.get_world_size()))
    losses: list[float] = []
    rank = int(os.environ.get("RANK", "0"))

    class Recording(ShardckptTrainer):  # type: ignore[misc, valid-type]
        def compute_loss(self, model: Any, inputs: Any, *a: Any, **kw: Any) -> Any:
            loss = super().compute_loss(model, inputs, *a, **kw)
            value = loss[0] if isinstance(loss, tuple) else loss
            losses.append(float(value.detach()))
            return loss

    class KillAfterSave(TrainerCallback):
        def on_save(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            if spec.get("kill_at") == [rank, state.global_step]:
                (out / f"killed-rank-{rank}").write_text(str(state.global_step))
                os.kill(os.getpid(), signal.SIGKILL)

    trainer = Recording(model=model, args=args, train_dataset=dataset(), callbacks=[KillAfterSave()],
                        shardckpt_url=spec.get("run_url"), storage_options=spec.get("storage_options"),
                        consolidate_every=spec.get("consolidate_every"))
    with warnings_of("shardckpt") as warned:
        try:
            trainer.train(resume_from_checkpoint=spec.get("resume"))
        except ShardckptError as e:
            if not spec.get("expect_error"):
                raise
            (out / f"rank-{rank}.json").write_text(json.dumps({"error": str(e)}))
            return
    if spec.get("bare"):  # the script ends with train(), as most do: the process exits next
        return
    (out / f"rank-{rank}.json").write_text(json.dumps({
        "losses": losses, "global_step": trainer.state.global_step, "warnings": warned,
        "world_size": trainer.args.world_size, "lr": trainer.lr_scheduler.get_last_lr()}))
    full = get_model_state_dict(trainer.model, options=StateDictOptions(full_state_dict=True))
    if rank == 0:
        from safetensors.torch import save_file

        save_file({k: v.detach().contiguous().clone() for k, v in full.items()}, str(out / "final.safetensors"))


def _record_group_at_exit(path: Path) -> None:
    """Whether a process group is still alive when the interpreter's teardown begins."""
    path.write_text(json.dumps({"group_alive": torch.distributed.is_initialized()}))


def load_pretrained(folder: str, out: Path) -> None:
    """``LlamaForCausalLM.from_pretrained(folder)``'s weights, as safetensors at ``out``."""
    from safetensors.torch import save_file
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(folder)
    save_file({k: v.detach().contiguous().clone() for k, v in model.state_dict().items()}, str(out))


def main(spec: dict[str, Any]) -> None:
    """``spec["runs"]``: Trainer runs one after the other in this process (records under
    ``spec["results"]/<i>``); ``spec["pretrained"]``: [folder, file] for :func:`load_pretrained`."""
    os.environ["HF_HUB_OFFLINE"] = "1"  # nothing is downloaded: the model comes from a config
    torch.set_num_threads(1)
    results = Path(spec["results"])
    for i, run in enumerate(spec.get("runs", [])):
        began = time.monotonic()
        train(run, results / str(i))
        print(f"run {i}: {time.monotonic() - began:.1f} s", file=sys.stderr, flush=True)
    if spec.get("pretrained"):
        load_pretrained(spec["pretrained"][0], results / spec["pretrained"][1])


def job(rank: int, world_size: int, spec: dict[str, Any]) -> int:
    """:func:`main` as a ``testing.ranks.run_ranks`` target."""
    main(spec)
    return rank


if __name__ == "__main__":
    main(json.loads(Path(sys.argv[1]).read_text()))
