"""The real ``transformers.Trainer`` on gloo with shardckpt checkpoints
(``shardckpt.integrations.transformers``): a tiny ``LlamaForCausalLM`` (~210K parameters, built
from a config), 2 ranks, CPU. The jobs are ``testing/trainer_job.py``, launched by
``testing.ranks.run_ranks``.

Three launches, shared by every test here (module-scoped):

1. 2 ranks: an FSDP2 run (the model sharded by ``from_pretrained(distributed_config=...)``;
   Accelerate's FSDP plugin needs a GPU) saving steps 2 and 4 to S3 (moto); an uninterrupted DDP
   run of 8 steps saving every 2 with ``save_total_limit=2`` and ``consolidate_every=2`` (the
   reference); the same DDP run
   again, whose rank 1 SIGKILLs itself right after the save of step 4 (the job dies);
2. 2 ranks: the FSDP2 run resumed from its S3 checkpoint-2; the killed run resumed with
   ``resume_from_checkpoint=True`` after an uncommitted ``checkpoint-99`` was planted beside it;
3. 1 rank, beside 2: the killed run's checkpoint-4 and the FSDP2 checkpoint-2 resumed on one
   rank (twice the per-device batch: the same global batch); then, from copies of that run's
   checkpoints rewritten by a hostile author, three resumes with a planted
   ``best_model_checkpoint`` and one with a planted ``rng_bytes``; and ``from_pretrained`` of
   ``shardckpt consolidate`` of the reference's checkpoint-8.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from testing.ranks import run_ranks
from testing.trainer_job import job

pytestmark = [pytest.mark.slow, pytest.mark.s3]

TIMEOUT_S = 300
#: Measured: 2 -> 1 ranks, per-step loss 1.1e-7 relative and weights 7.5e-9 absolute (the
#: gradient of one batch of 4 against the mean of two batches of 2, rounded in fp32).
ONE_RANK_LOSS_RTOL = 1e-6
ONE_RANK_WEIGHT_ATOL = 1e-6
DDP = {"steps": 8, "save_steps": 2, "save_total_limit": 2, "batch": 2}
FSDP = {"steps": 4, "save_steps": 2, "batch": 2, "fsdp": True}


def _launch(spec: dict[str, Any], world: int) -> list[Any]:
    # Trainer (Accelerate) sets the process group up from the rank environment, as under
    # torchrun; so no rank waits at exit for a peer that was killed
    return run_ranks(job, world, args=(spec,), timeout_s=TIMEOUT_S, init_process_group=False,
                     env={"HF_HUB_OFFLINE": "1"})


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, moto_server: Any) -> dict[str, Any]:
    from testing.cli import cli

    root = tmp_path_factory.mktemp("trainer")
    bucket = moto_server.create_bucket()
    opts = moto_server.storage_options()
    s3 = {"run_url": f"s3://{bucket}/fsdp", "storage_options": opts}
    fsdp_out = str(root / "fsdp")

    began = time.monotonic()
    first = _launch({"results": str(root / "r1"), "runs": [
        {**FSDP, **s3, "output_dir": fsdp_out},
        {**DDP, "output_dir": str(root / "ref"), "consolidate_every": 2},
        {**DDP, "output_dir": str(root / "killed"), "kill_at": [1, 4]}]}, 2)
    assert first[1].exitcode == -signal.SIGKILL and (root / "r1/2/killed-rank-1").exists(), first
    assert not first[0].ok  # its peer is gone: the job ends there

    first_s = time.monotonic() - began
    cons = cli("consolidate", str(root / "ref/checkpoint-8"), str(root / "cons"), "--dtype", "fp32")
    assert cons.exit_code == 0, cons.output
    shutil.copytree(root / "killed/checkpoint-4", root / "copy/checkpoint-4")
    (root / "killed/checkpoint-99").mkdir()
    (root / "killed/checkpoint-99/chunks-00000.safetensors").write_bytes(b"half a save")

    two = {"results": str(root / "r2"), "runs": [
        {**FSDP, **s3, "output_dir": fsdp_out, "resume": f"{s3['run_url']}/checkpoint-2"},
        {**DDP, "output_dir": str(root / "killed"), "resume": True}]}
    one = {"results": str(root / "r3"), "runs": [
        {**DDP, "batch": 4, "output_dir": str(root / "one"), "resume": str(root / "copy/checkpoint-4")},
        {**FSDP, "fsdp": False, "batch": 4, "storage_options": opts, "output_dir": str(root / "one-fsdp"),
         "resume": f"{s3['run_url']}/checkpoint-2"},
        *_hostile_runs(root, bucket, opts)],
        "pretrained": [str(root / "cons"), "pretrained.safetensors"]}
    began = time.monotonic()
    with ThreadPoolExecutor(2) as pool:  # independent jobs, side by side
        for results in pool.map(_launch, [two, one], [2, 1]):
            assert all(r.ok for r in results), [r.describe() for r in results if not r.ok]
    print(f"trainer jobs: {first_s:.1f} s, then {time.monotonic() - began:.1f} s side by side")
    return {"root": root, "bucket": bucket, "opts": opts}


#: Planted as best_model_checkpoint in the hostile resumes (by name; the paths are in the run).
HOSTILE_BEST = {"outside": "{root}/sentinel", "dotdot": "{root}/hostile-dotdot/../sentinel",
                "url": "s3://{bucket}/sentinel"}
#: What the hostile manifest says rank 0's RNG document holds: 3 GiB.
HOSTILE_RNG_BYTES = 3 << 30


def _hostile_runs(root: Path, bucket: str, opts: dict[str, Any]) -> list[dict[str, Any]]:
    """Resumes on 1 rank (after the ``one`` run has written ``one/checkpoint-6`` and ``-8``)
    from checkpoints a hostile author rewrote: ``best_model_checkpoint`` naming a directory
    outside the run (absolute, through ``..``, an ``s3://`` URL) with ``save_total_limit=1``,
    which makes Trainer delete every other ``checkpoint-*`` at the end of ``train()``; and
    ``rng_bytes`` claiming 3 GiB."""
    from shardckpt.storage import Storage

    (root / "sentinel").mkdir()
    (root / "sentinel" / "keep").write_text("not the run's")
    Storage(f"s3://{bucket}/sentinel", opts).put("keep", b"not the run's")
    runs: list[dict[str, Any]] = [
        {**DDP, "batch": 4, "save_total_limit": 1, "output_dir": str(root / f"hostile-{name}"),
         "resume": True, "plant": {"copy": str(root / "one/checkpoint-6"),
                                   "to": str(root / f"hostile-{name}/checkpoint-6"), "app": {},
                                   "trainer_state": {"best_model_checkpoint":
                                                         best.format(root=root, bucket=bucket)}}}
        for name, best in HOSTILE_BEST.items()]
    runs.append({**DDP, "batch": 4, "output_dir": str(root / "hostile-rng"), "resume": True,
                 "expect_error": True,
                 "plant": {"copy": str(root / "one/checkpoint-8"), "to": str(root / "hostile-rng/checkpoint-8"),
                           "app": {"rng_bytes": [HOSTILE_RNG_BYTES]}, "trainer_state": {}}})
    return runs


def _losses(root: Path, run: str) -> list[list[float]]:
    return [json.loads(p.read_text())["losses"] for p in sorted((root / run).glob("rank-*.json"))]


def _weights(path: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    return load_file(str(path))


def _bit_equal(a: dict[str, Any], b: dict[str, Any]) -> bool:
    import torch

    return sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_killed_job_resumes_bit_for_bit(runs: dict[str, Any]) -> None:
    root = runs["root"]
    ref, resumed = _losses(root, "r1/1"), _losses(root, "r2/1")
    assert len(ref) == 2 and [len(x) for x in ref] == [8, 8]
    assert resumed == [x[4:] for x in ref]  # steps 5-8 on each rank, exact floats
    assert _bit_equal(_weights(root / "r1/1/final.safetensors"), _weights(root / "r2/1/final.safetensors"))
    lr = [json.loads((root / f"{r}/rank-0.json").read_text())["lr"] for r in ("r1/1", "r2/1")]
    assert lr[0] == lr[1]


def test_retention_counts_only_committed_checkpoints(runs: dict[str, Any]) -> None:
    from shardckpt.checkpoint.verify import verify

    root = runs["root"]
    assert sorted(os.listdir(root / "ref")) == ["checkpoint-6", "checkpoint-8", "hf"]
    # resume skipped the newer uncommitted folder; retention neither counted nor deleted it
    assert sorted(os.listdir(root / "killed")) == ["checkpoint-6", "checkpoint-8", "checkpoint-99"]
    assert not (root / "killed/checkpoint-99/manifest.json").exists()
    for name in ("checkpoint-6", "checkpoint-8"):
        assert list(verify(str(root / "killed" / name)).problems) == []


def test_trainer_state_is_inside_the_checkpoint(runs: dict[str, Any]) -> None:
    root = runs["root"]
    ckpt = root / "ref/checkpoint-8"
    m = json.loads((ckpt / "manifest.json").read_text())
    app = m["extras"]["app"]["trainer"]
    assert json.loads(app["trainer_state"])["global_step"] == 8 == m["extras"]["step"]
    assert app["world_size"] == 2 and app["lr_scheduler"]["last_epoch"] == 8
    files = [str(p.relative_to(ckpt)) for p in ckpt.rglob("*") if p.is_file()]
    assert all(f == "manifest.json" or f.endswith(".safetensors") for f in files), files
    assert m["extras"]["hf_config"]["model_type"] == "llama"


def test_resume_two_ranks_on_one(runs: dict[str, Any]) -> None:
    import torch

    root = runs["root"]
    ref = _losses(root, "r1/1")
    mean = [(a + b) / 2 for a, b in zip(*ref, strict=True)][4:]
    (one,) = _losses(root, "r3/0")
    assert one == pytest.approx(mean, rel=ONE_RANK_LOSS_RTOL, abs=0)
    a, b = _weights(root / "r1/1/final.safetensors"), _weights(root / "r3/0/final.safetensors")
    assert sorted(a) == sorted(b)
    worst = max(float((a[k] - b[k]).abs().max()) for k in a)
    assert worst <= ONE_RANK_WEIGHT_ATOL
    moved = max(float((a[k] - _weights(root / "r1/0/final.safetensors")[k]).abs().max()) for k in a)
    assert moved > 100 * ONE_RANK_WEIGHT_ATOL  # the two runs trained different models
    assert torch.isfinite(torch.tensor(one)).all()


def test_fsdp2_sharded_on_s3_resumes(runs: dict[str, Any]) -> None:
    import fsspec

    root, opts = runs["root"], runs["opts"]
    fs = fsspec.filesystem("s3", **opts)
    m = json.loads(fs.cat_file(f"{runs['bucket']}/fsdp/checkpoint-2/manifest.json"))
    embed = next(t for t in m["chunked"]["tensors"] if t["fqn"] == "model.model.embed_tokens.weight")
    # FSDP2's DTensor shards: half the rows from each rank, each in that rank's file
    assert [(c["offsets"], c["sizes"]) for c in embed["chunks"]] == [([0, 0], [512, 64]), ([512, 0], [512, 64])]
    assert len({c["file"] for c in embed["chunks"]}) == 2
    first, resumed = _losses(root, "r1/0"), _losses(root, "r2/0")
    assert [len(x) for x in first] == [4, 4]
    assert resumed == [x[2:] for x in first]
    assert _bit_equal(_weights(root / "r1/0/final.safetensors"), _weights(root / "r2/0/final.safetensors"))
    (one,) = _losses(root, "r3/1")
    mean = [(a + b) / 2 for a, b in zip(*first, strict=True)][2:]
    assert one == pytest.approx(mean, rel=ONE_RANK_LOSS_RTOL, abs=0)


def test_a_path_read_from_a_checkpoint_never_decides_a_delete(runs: dict[str, Any]) -> None:
    """After a resume whose stored best_model_checkpoint names a directory outside the run
    (absolute, or through ``..``), with ``save_total_limit=1``: the run's newest checkpoint
    survives Trainer's end of training, retention kept it alone, the directory is untouched, and
    a warning named the path."""
    from shardckpt.checkpoint.verify import verify

    from shardckpt.storage import Storage

    root, bucket = runs["root"], runs["bucket"]
    for i, (name, best) in enumerate(HOSTILE_BEST.items(), start=2):
        run = root / f"hostile-{name}"
        assert sorted(os.listdir(run)) == ["checkpoint-8"], name
        assert list(verify(str(run / "checkpoint-8")).problems) == []
        record = json.loads((root / f"r3/{i}/rank-0.json").read_text())
        assert record["global_step"] == 8
        assert any(best.format(root=root, bucket=bucket) in w and "dropped" in w
                   for w in record["warnings"]), record
        stored = json.loads(json.loads((run / "checkpoint-8/manifest.json").read_text())
                            ["extras"]["app"]["trainer"]["trainer_state"])
        assert stored["best_model_checkpoint"] is None
    assert (root / "sentinel" / "keep").read_text() == "not the run's"
    assert Storage(f"s3://{bucket}/sentinel", runs["opts"]).read("keep") == b"not the run's"


def test_rng_is_sized_by_what_is_stored(runs: dict[str, Any]) -> None:
    """A manifest whose rng_bytes claims 3 GiB for rank 0: one clear error naming the manifest,
    the entry and both lengths, before anything is allocated."""
    record = json.loads((runs["root"] / "r3/5/rank-0.json").read_text())
    error = record["error"]
    assert "hostile-rng/checkpoint-8/manifest.json" in error
    assert f"rng_bytes[0] is {HOSTILE_RNG_BYTES}" in error and "rng.rank-00000" in error


def test_consolidated_checkpoint_loads_with_from_pretrained(runs: dict[str, Any]) -> None:
    root = runs["root"]
    assert _bit_equal(_weights(root / "r3/pretrained.safetensors"), _weights(root / "r1/1/final.safetensors"))


def test_consolidate_every_writes_folders_from_pretrained_opens(runs: dict[str, Any]) -> None:
    """``consolidate_every=2``: the 2nd and 4th saves (steps 4 and 8) are also Hugging Face
    folders, kept when retention deletes their checkpoints; ``from_pretrained`` opens step 8 to
    the run's final weights, its config naming the class the run trained."""
    from transformers import AutoModelForCausalLM

    root = runs["root"]
    assert sorted(os.listdir(root / "ref/hf")) == ["checkpoint-4", "checkpoint-8"]
    config = json.loads((root / "ref/hf/checkpoint-8/config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["dtype"] == "float32"
    model = AutoModelForCausalLM.from_pretrained(str(root / "ref/hf/checkpoint-8"))
    assert _bit_equal({k: v.detach() for k, v in model.state_dict().items()},
                      _weights(root / "r1/1/final.safetensors"))
