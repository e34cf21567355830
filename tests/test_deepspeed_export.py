"""``shardckpt export deepspeed``: a checkpoint of flat groups (a ``ZeroEngine`` save, or an imported
DeepSpeed checkpoint) becomes the folder DeepSpeed's ``engine.load_checkpoint`` reads, for ZeRO
stage 1, 2 or 3 at N ranks: laid out as DeepSpeed itself writes it (the committed fixtures of
``tests/fixtures/deepspeed``), imported back equal bit for bit, and, where DeepSpeed is installed,
resumed by DeepSpeed with the losses of DeepSpeed resuming from its own checkpoint."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from shardckpt.cli.main import app
from shardckpt.errors import ConfigError
from shardckpt.interop.deepspeed.export import export_deepspeed
from shardckpt.interop.deepspeed.files import DeepSpeedObject, load_pt
from shardckpt.interop.deepspeed.import_ import import_deepspeed
from shardckpt.storage import Storage
from shardckpt.tools.diff import diff

torch = pytest.importorskip("torch")

FIXTURES = Path(__file__).parent / "fixtures" / "deepspeed"
TAG = "global_step3"


def _round_trip(src: str, tmp: Path, stage: int, ranks: int, bf16: bool = False) -> None:
    out = tmp / f"ds-{stage}-{ranks}"
    s = export_deepspeed(src, str(out), ranks, stage=stage, bf16=bf16)
    assert (out / "latest").read_text() == s["tag"]
    back = str(tmp / f"back-{stage}-{ranks}")
    import_deepspeed(str(out), back, 3)
    d = diff(src, back)
    assert d.equal and d.identical == d.compared > 0


@pytest.mark.parametrize("name,stage,ranks", [("zero2-fp32-3", 1, 2), ("zero1-bf16-2", 2, 3),
                                              ("zero3-fp32-2", 3, 3), ("zero3-bf16-3", 3, 1)])
def test_imported_deepspeed_round_trip(tmp_path: Path, name: str, stage: int, ranks: int) -> None:
    src = str(tmp_path / "ours")
    import_deepspeed(str(FIXTURES / name), src, 2)
    _round_trip(src, tmp_path, stage, ranks, bf16="bf16" in name)


def test_zero_engine_checkpoint_round_trip(tmp_path: Path) -> None:
    from shardckpt.runtime import ShardedAdamW, ZeroEngine, decay_param_groups
    from shardckpt.runtime.mesh import ProcessMesh
    from shardckpt.runtime.models.llama import (
        LLAMA_POLICY, LlamaConfig, LlamaForCausalLM, causal_lm_loss,
    )
    from shardckpt.training.checkpointer import Checkpointer

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1)
    engine = ZeroEngine(LlamaForCausalLM(cfg), policy=LLAMA_POLICY,
                        process_mesh=ProcessMesh.single())
    opt = ShardedAdamW(engine, decay_param_groups(engine, 0.1), lr=1e-2)
    for step in range(2):
        tokens = torch.randint(0, cfg.vocab_size, (2, 8),
                               generator=torch.Generator().manual_seed(step))
        causal_lm_loss(engine(tokens), tokens).backward()
        opt.step()
        opt.zero_grad()
    ckpt = Checkpointer(str(tmp_path / "run"), engine)
    ckpt.save(2)
    ckpt.close()
    src = ckpt.manager.url_for(2)
    for stage in (1, 2, 3):
        _round_trip(src, tmp_path, stage, 3)


# ------------------------------------------------------------- laid out as DeepSpeed lays it out


def structure(v: Any) -> Any:
    """Keys, tensor shapes and dtypes, DeepSpeed objects' classes and fields; other values by
    type only (hyper-parameter values and the config differ by design)."""
    if isinstance(v, torch.Tensor):
        return ("tensor", tuple(v.shape), str(v.dtype))
    if isinstance(v, DeepSpeedObject):
        return (type(v).__name__, structure(v.state))
    if isinstance(v, dict):
        return {k: ("config" if k == "ds_config" else structure(x)) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [structure(x) for x in v]
    return "value" if v is None or isinstance(v, (bool, int, float, str)) else type(v).__name__


@pytest.mark.parametrize("name", sorted(p.name for p in FIXTURES.iterdir() if p.is_dir()))
def test_structure_equals_deepspeed_fixture(tmp_path: Path, name: str) -> None:
    stage, prec, world = int(name[4]), name.split("-")[1], int(name.split("-")[2])
    src = str(tmp_path / "ours")
    import_deepspeed(str(FIXTURES / name), src, 1)
    out = tmp_path / "ds"
    export_deepspeed(src, str(out), world, stage=stage, tag=TAG, bf16=prec == "bf16")
    theirs, ours = FIXTURES / name / TAG, out / TAG
    assert sorted(p.name for p in ours.iterdir()) == sorted(p.name for p in theirs.iterdir())
    for f in sorted(theirs.iterdir()):
        a = load_pt(Storage(str(theirs)), f.name)
        b = load_pt(Storage(str(ours)), f.name)
        assert structure(b) == structure(a), f.name
        if "optim_states" in f.name:
            osd_a, osd_b = a["optimizer_state_dict"], b["optimizer_state_dict"]
            for k in ("zero_stage", "partition_count", "group_paddings"):
                assert osd_b.get(k) == osd_a.get(k), (f.name, k)
            if "param_slice_mappings" in osd_a:
                assert ([{n: x.state for n, x in g.items()} for g in osd_b["param_slice_mappings"]]
                        == [{n: x.state for n, x in g.items()} for g in osd_a["param_slice_mappings"]])
        else:
            assert set(b["module"]) == set(a["module"])
            for k in ("global_steps", "dp_world_size", "buffer_names", "frozen_param_shapes"):
                assert b[k] == a[k], (f.name, k)


# ------------------------------------------------------------------------------- CLI and errors


def test_cli_json_and_one_line_errors(tmp_path: Path) -> None:
    src = str(tmp_path / "ours")
    import_deepspeed(str(FIXTURES / "zero2-fp32-2"), src, 2)
    runner = CliRunner()
    dst = str(tmp_path / "ds")
    r = runner.invoke(app, ["export", "deepspeed", src, dst, "--ranks", "2", "--stage", "3",
                            "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["tag"] == TAG and doc["stage"] == 3 and "latest" in doc["files"]
    r = runner.invoke(app, ["export", "deepspeed", src, dst, "--ranks", "2"])
    assert r.exit_code == 2 and "holds files" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    with pytest.raises(ConfigError, match="stage"):
        export_deepspeed(src, str(tmp_path / "x"), 2, stage=0)


def test_failure_leaves_nothing_and_latest_alone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import shardckpt.interop.deepspeed.export_plan as ex

    src = str(tmp_path / "ours")
    import_deepspeed(str(FIXTURES / "zero2-fp32-2"), src, 2)
    dst = tmp_path / "ds"
    dst.mkdir()
    (dst / "latest").write_text("older")
    calls = []

    def failing(*a: Any) -> Any:
        calls.append(1)
        if len(calls) == 2:
            raise OSError("disk full")
        return real(*a)

    real = ex._optim_12
    monkeypatch.setattr(ex, "_optim_12", failing)
    with pytest.raises(OSError, match="disk full"):
        export_deepspeed(src, str(dst), 2, stage=2)
    assert (dst / "latest").read_text() == "older"
    assert not any((dst / TAG).iterdir())


# ----------------------------------------------------------------------------- real DeepSpeed


def _resume(rank: int, world: int, stage: int, prec: str, ckpt: str, ref: str) -> list[float]:
    """One rank of DeepSpeed loading ``ckpt`` and training on as the fixture script does."""
    root = Path(__file__).resolve().parent.parent
    sys.path.insert(0, str(root / "scripts"))
    import deepspeed
    import make_deepspeed_fixtures as fx

    deepspeed.init_distributed(dist_backend="gloo")
    doc = json.loads(Path(ref).read_text())
    engine = fx._engine(stage, prec, world)
    engine.load_checkpoint(ckpt)
    return fx._train(engine, doc["batches"], rank, range(fx.STEPS, fx.STEPS + fx.RESUME_STEPS))


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                    reason="DeepSpeed is not installed (pip install -e '.[deepspeed]')")
@pytest.mark.parametrize("name", ["zero1-bf16-2", "zero2-fp32-2", "zero3-fp32-2"])
def test_deepspeed_resumes_from_the_export(tmp_path: Path, name: str) -> None:
    from testing.ranks import run_distributed

    stage, prec = int(name[4]), name.split("-")[1]
    src = str(tmp_path / "ours")
    import_deepspeed(str(FIXTURES / name), src, 3)  # another world, so the layout is rebuilt
    out = str(tmp_path / "ds")
    export_deepspeed(src, out, 2, stage=stage, bf16=prec == "bf16")
    ref = FIXTURES / name / "reference.json"
    losses = run_distributed(_resume, 2, args=(stage, prec, out, str(ref)),
                             env={"DS_ACCELERATOR": "cpu"})
    assert losses[0] == json.loads(ref.read_text())["resumed_losses"]
