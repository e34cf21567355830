"""What each runnable snippet of the docs (:mod:`testing.snippets`) is given and must do.

:data:`RANK_PHASE` runs on 2 gloo ranks in one launch, then :data:`SINGLE_PHASE` on 1 rank in the
same folder (the 2-rank checkpoints resumed on another world size): each snippet's code, read from
the markdown with its substitutions made, in a namespace of its own (or a copy of its
predecessor's, for ``after``), between a prelude that builds what its marker says it is given and
a check of what it must have done. Everything runs in the launch's folder, so relative paths in
the snippets (``runs/llama``) land there.
"""

from __future__ import annotations

import os
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from collections.abc import Callable

from testing.snippets import ROOT, snippet


# ------------------------------------------------------------------ what each snippet is given


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


def _tiny_hf_llama(tie: bool = True) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64,
                                        num_hidden_layers=2, num_attention_heads=4,
                                        num_key_value_heads=2, max_position_embeddings=32,
                                        tie_word_embeddings=tie))


def _given_hf_folder(ns: dict[str, Any], run: int) -> None:
    import torch

    if _rank() == 0:
        torch.manual_seed(0)
        _tiny_hf_llama().save_pretrained("Llama-3.2-1B")
    _barrier()


def _given_key(ns: dict[str, Any], run: int) -> None:
    from cryptography.hazmat.primitives import serialization as s
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    if _rank() == 0:
        key = Ed25519PrivateKey.generate()
        Path("ckpt_ed25519").write_bytes(key.private_bytes(
            s.Encoding.PEM, s.PrivateFormat.OpenSSH, s.NoEncryption()))
        Path("ckpt_ed25519.pub").write_bytes(key.public_key().public_bytes(
            s.Encoding.OpenSSH, s.PublicFormat.OpenSSH))
    _barrier()


def _given_fsdp2(ns: dict[str, Any], run: int) -> None:
    import torch
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    for m in model:
        if isinstance(m, torch.nn.Linear):
            fully_shard(m)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(4, 8)).pow(2).sum().backward()
    optimizer.step()
    ns.update(model=model, optimizer=optimizer)


def _given_trainer(ns: dict[str, Any], run: int) -> None:
    import torch
    from transformers import TrainingArguments

    os.environ["HF_HUB_OFFLINE"] = "1"
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    ids = [torch.randint(0, 256, (16,), generator=g) for _ in range(32)]
    ns.update(model=_tiny_hf_llama(tie=False), ds=[{"input_ids": t, "labels": t} for t in ids],
              args=TrainingArguments(output_dir="runs/trainer-out", max_steps=2 * (run + 1),
                                     save_steps=2, per_device_train_batch_size=2, use_cpu=True,
                                     report_to=[], disable_tqdm=True, dataloader_num_workers=0))


def _given_lightning(ns: dict[str, Any], run: int) -> None:
    import torch
    import lightning.pytorch as L
    from torch.utils.data import DataLoader

    seen: dict[str, int] = {}

    class TinyLM(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = _tiny_hf_llama()

        def configure_model(self) -> None:
            from torch.distributed.fsdp import fully_shard

            mesh = self.device_mesh["data_parallel"]
            for layer in self.model.model.layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(self.model, mesh=mesh)

        def on_train_start(self) -> None:
            seen["start"] = self.trainer.global_step

        def training_step(self, batch: Any, i: int) -> Any:
            return self.model(input_ids=batch, labels=batch).loss

        def train_dataloader(self) -> Any:
            g = torch.Generator().manual_seed(1)
            return DataLoader(torch.randint(0, 256, (32, 16), generator=g), batch_size=2)

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    torch.manual_seed(0)
    ns.update(model=TinyLM(), STEPS=2 * (run + 1), seen=seen)


def _given_titan(ns: dict[str, Any], run: int) -> None:
    from types import SimpleNamespace

    from torchtitan.components.checkpoint import CheckpointManager

    ns["config"] = SimpleNamespace(checkpoint=CheckpointManager.Config())


def _given_dcp_source(ns: dict[str, Any], run: int) -> None:
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.Linear(64, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    msd, osd = get_state_dict(model, opt)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({**msd, "optimizer": osd}, checkpoint_id="data/dcp_ckpt")


# ------------------------------------------------------------------------ what each must do


def _committed(url: str) -> bool:
    return (Path(url) / "manifest.json").is_file()


def _check_tour(ns: dict[str, Any], run: int) -> None:
    assert ns["start"] == 0, f"a fresh run resumed from step {ns['start']}"
    assert all(_committed(f"runs/llama/step-0000000{s}") for s in (2, 4)), os.listdir("runs/llama")


def _check_tour_resumed(ns: dict[str, Any], run: int) -> None:
    assert ns["pm"].world_size == 1 and ns["start"] == 4, (ns["pm"].world_size, ns["start"])


def _check_keep(ns: dict[str, Any], run: int) -> None:
    ckpt = ns["ckpt"]
    ckpt.save(6)
    ckpt.close()
    assert _committed("runs/thinned/step-00000006")


def _check_signed(ns: dict[str, Any], run: int) -> None:
    from shardckpt import CheckpointReader
    from shardckpt.errors import ShardckptError

    ns["ckpt"].save(7)
    ns["ckpt"].close()
    if _rank() == 0:  # a trusted read takes what the key signed, and refuses what it did not
        assert CheckpointReader("runs/signed/step-00000007", trust="ckpt_ed25519.pub").manifest.extras["step"] == 7
        try:
            assert CheckpointReader("runs/llama/step-00000004", trust="ckpt_ed25519.pub").manifest
        except ShardckptError:
            return
        raise AssertionError("an unsigned checkpoint was read as trusted")


def _check_tiers(ns: dict[str, Any], run: int) -> None:
    assert ns["start"] == 0, f"a fresh run resumed from step {ns['start']}"
    node = f"runs/node-{_rank()}"
    assert all(_committed(f"{node}/step-0000000{s}") for s in (2, 3)), os.listdir(node)
    assert _committed("runs/tiered/step-00000002") and not Path("runs/tiered/step-00000003").exists()


def _check_hf_start(ns: dict[str, Any], run: int) -> None:
    import torch
    from safetensors.torch import load_file

    full = ns["engine"].full_state_dict()   # a collective: every rank
    ref = load_file("Llama-3.2-1B/model.safetensors")
    bad = [k for k, v in ref.items() if not torch.equal(full[k].float(), v.float())]
    assert not bad, f"not the source weights: {bad}"


def _check_fsdp2(ns: dict[str, Any], run: int) -> None:
    from shardckpt import verify

    assert verify("runs/fsdp2/step-00000100"), "the DCP checkpoint does not verify"


def _check_dcp_ckpt(ns: dict[str, Any], run: int) -> None:
    assert ns["start"] == 2 * run, f"run {run} started at {ns['start']}"
    assert _committed(f"runs/dcp/step-0000000{2 * run + 2}")


def _check_trainer(ns: dict[str, Any], run: int) -> None:
    assert ns["resume"] is bool(run), f"run {run}: resume {ns['resume']}"
    assert ns["trainer"].state.global_step == ns["args"].max_steps
    assert type(ns["model"]).__name__ == "LlamaForCausalLM"


def _check_lightning(ns: dict[str, Any], run: int) -> None:
    assert ns["seen"]["start"] == 2 * run, f"run {run} started at step {ns['seen']['start']}"
    assert ns["trainer"].global_step == ns["STEPS"]
    assert type(ns["hf_model"]).__name__ == "LlamaForCausalLM"


def _check_hf_out(ns: dict[str, Any], run: int) -> None:
    assert type(ns["model"]).__name__ == "LlamaForCausalLM"
    assert "model.embed_tokens.weight" in ns["sd"]


def _check_offline(ns: dict[str, Any], run: int) -> None:
    assert ns["result"] and ns["reader"].manifest.mesh is not None


def _check_importer(ns: dict[str, Any], run: int) -> None:
    assert _committed("data/from_dcp")


def _check_titan(ns: dict[str, Any], run: int) -> None:
    from shardckpt.integrations.torchtitan import ShardckptCheckpointManager

    cfg = ns["config"].checkpoint
    assert isinstance(cfg, ShardckptCheckpointManager.Config) and cfg.folder == "s3://bucket/run"


# ------------------------------------------------------------------------------- the phases

Step = Callable[[dict[str, Any], int], None]


@dataclass(frozen=True)
class Run:
    """Run snippet ``name`` (``runs`` times, each in a fresh namespace or a copy of ``after``'s)."""

    name: str
    check: Step
    given: Step | None = None
    after: str | None = None
    runs: int = 1


RANK_PHASE = [Run("tour-loop", _check_tour), Run("keep-weights", _check_keep, after="tour-loop"),
              Run("signing", _check_signed, _given_key, after="tour-loop"),
              Run("tiers", _check_tiers, after="tour-loop"),
              Run("hf-start", _check_hf_start, _given_hf_folder),
              Run("fsdp2-dcp", _check_fsdp2, _given_fsdp2),
              Run("dcp-checkpointer", _check_dcp_ckpt, after="fsdp2-dcp", runs=2),
              Run("trainer", _check_trainer, _given_trainer, runs=2),
              Run("lightning", _check_lightning, _given_lightning, runs=2)]
SINGLE_PHASE = [Run("tour-loop", _check_tour_resumed), Run("hf-out", _check_hf_out),
                Run("offline-api", _check_offline), Run("importer-api", _check_importer, _given_dcp_source),
                Run("torchtitan-config", _check_titan, _given_titan)]
PHASES = {"ranks": RANK_PHASE, "single": SINGLE_PHASE}


#: The outcome of a snippet left out (its framework is not installed): the test skips it.
SKIPPED = "skipped: "


def run_phase(phase: list[Run], root: Path = ROOT, skip: dict[str, str] | None = None) -> dict[str, str]:
    """Each run's outcome by snippet name: '' when it ran and passed its check, else the error,
    or :data:`SKIPPED` and the reason for a name in ``skip``. After a failure the rest are not run
    (a collective left half-done would hang them)."""
    spaces: dict[str, dict[str, Any]] = {}
    out: dict[str, str] = {}
    for r in phase:
        if any(v and not v.startswith(SKIPPED) for v in out.values()):
            out[r.name] = "not run: an earlier snippet failed"
            continue
        if r.name in (skip or {}):
            out[r.name] = SKIPPED + (skip or {})[r.name]
            continue
        try:
            block = snippet(r.name, root)
            code = compile(block.runnable(), f"{block.path}:{block.line}", "exec")
            for i in range(r.runs):
                ns = dict(spaces[r.after]) if r.after else {"__name__": "__snippet__"}
                if r.given is not None:
                    r.given(ns, i)
                exec(code, ns)
                r.check(ns, i)
                spaces[r.name] = ns
            out[r.name] = ""
        except BaseException as e:  # noqa: BLE001 - reported by name, the launch goes on
            out[r.name] = f"{type(e).__name__}: {e}\n" + "".join(traceback.format_exc()[-3000:])
    return out


def job(rank: int, world: int, workdir: str, phase: str, skip: dict[str, str]) -> dict[str, str]:
    """:func:`run_phase` of ``PHASES[phase]`` in ``workdir``, as a ``testing.ranks`` target."""
    os.chdir(workdir)
    return run_phase(PHASES[phase], skip=skip)
