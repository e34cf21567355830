"""Lightning's FSDP2 strategy saving through shardckpt: a run killed after a save resumes with
``trainer.fit(ckpt_path=...)`` to the same losses as a run never interrupted (bit for bit on the
same 2 ranks; on 1 rank within the tolerance measured below), ``ModelCheckpoint``'s retention
deletes through shardckpt and never the newest good checkpoint, and Lightning's own state is JSON.

Three process launches in all (``testing/lightning_job.py``): the uninterrupted run and the run
killed by SIGKILL one step after its epoch-1 save, in one 2-rank job; then the resumes on 2 and
on 1 rank, side by side (each from its own copy of the checkpoints).
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from typing import Any
from collections.abc import Iterator

import pytest

if importlib.util.find_spec("lightning") is None:  # found, not imported: only the ranks import it
    pytest.skip("lightning is not installed (the dev extra installs it)", allow_module_level=True)

from shardckpt.checkpoint.reader import read_manifest  # noqa: E402
from shardckpt.checkpoint.verify import verify  # noqa: E402
from shardckpt.errors import ConfigError, ManifestError  # noqa: E402
from shardckpt.format.records import run_extras  # noqa: E402
from shardckpt.integrations.lightning_paths import newest_good, remove_checkpoint  # noqa: E402
from shardckpt.integrations.lightning_state import join_state, split_state  # noqa: E402
from shardckpt.storage import Storage  # noqa: E402
from testing import lightning_job as job  # noqa: E402
from testing.ranks import run_distributed, run_ranks  # noqa: E402

pytestmark = [pytest.mark.slow]

#: 1 rank instead of 2: the same global batches, gradients reduced in another order. Measured
#: (``python -m testing.lightning_job``): the largest relative difference of a loss after the
#: resume was 9.1e-8, about one float32 ulp.
ONE_RANK_RTOL = 1e-6


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, moto_server: Any) -> Iterator[dict[str, Any]]:
    work = tmp_path_factory.mktemp("lightning")
    bucket = moto_server.create_bucket()
    s3 = (f"s3://{bucket}/run", moto_server.storage_options(None))
    killed = run_ranks(job.reference_then_kill, 2, args=(str(work),), timeout_s=300)
    after_kill = sorted(p.name for p in (work / "ckpts").iterdir())
    shutil.copytree(work / "ckpts", work / "ckpts-1rank")
    shutil.copytree(work / "ckpts", work / "ckpts-kept")
    hostile = _plant_hostile_paths(work, bucket, s3[1])
    with ThreadPoolExecutor(2) as pool:
        two = pool.submit(run_distributed, job.resume, 2,
                          args=(str(work), str(work / "ckpts"), s3), timeout_s=300)
        one = pool.submit(run_distributed, job.resume, 1,
                          args=(str(work), str(work / "ckpts-1rank")), timeout_s=300)
        resumed = {2: two.result(), 1: one.result()}
    yield {"work": work, "s3": s3, "killed": killed, "after_kill": after_kill, "resumed": resumed,
           "hostile": hostile,
           "reference": json.loads((work / "reference.json").read_text()),
           "before_kill": json.loads((work / "killed.json").read_text())}
    moto_server.delete_bucket(bucket)


def _plant_hostile_paths(work: Any, bucket: str, options: dict[str, Any]) -> dict[str, Any]:
    """The checkpoints both resumes start from, rewritten by a hostile author: their
    ``ModelCheckpoint`` states name, as paths to delete at the next save, a sentinel directory
    outside the run (absolute; the 1-rank resume), two through ``<dirpath>/..`` (the 1-rank
    resume: ``kth_best_model_path`` and ``last_model_path``) and an ``s3://`` one (the 2-rank
    resume, whose strategy holds the bucket's storage options: ``best_model_path``)."""
    one = os.path.realpath(work / "ckpts-1rank")
    sentinels = {name: work / name for name in ("sentinel-abs", "sentinel-kth", "sentinel-last")}
    for d in sentinels.values():
        d.mkdir()
        (d / "keep").write_text("not the run's")
    s3_sentinel = f"s3://{bucket}/sentinel"
    Storage(s3_sentinel, options).put("keep", b"not the run's")
    paths = {"abs": str(sentinels["sentinel-abs"]), "kth": f"{one}/../sentinel-kth",
             "last": f"{one}/../sentinel-last", "s3": s3_sentinel}
    job.plant_paths(work / "ckpts-1rank" / "last.ckpt", {
        job.TOPK_KEY: {"dirpath": one, "best_k_models": {f"{one}/epoch=1-step=8.ckpt": 8.0, paths["kth"]: 4.0},
                       "kth_best_model_path": paths["kth"], "kth_value": 4.0,
                       "last_model_path": paths["last"]},
        job.TOP1_KEY: {"dirpath": f"{one}-top1", "best_model_path": paths["abs"]}})
    job.plant_paths(work / "ckpts" / "last.ckpt", {job.TOP1_KEY: {"best_model_path": s3_sentinel}})
    return {"paths": paths, "dirs": list(sentinels.values()), "s3": s3_sentinel}


def test_both_ranks_were_killed_after_the_epoch_1_save(runs: dict[str, Any]) -> None:
    assert [r.exitcode for r in runs["killed"]] == [-9, -9], [r.describe() for r in runs["killed"]]
    assert runs["after_kill"] == ["epoch=0-step=4.ckpt", "epoch=1-step=8.ckpt", "last.ckpt"]
    # the killed run had taken a step past its last save (lost, and taken again on resume)
    assert max(int(s) for s in runs["before_kill"]) == 9
    for step, loss in runs["before_kill"].items():
        assert loss == runs["reference"][step]


def test_resume_on_2_ranks_equals_the_uninterrupted_run_bit_for_bit(runs: dict[str, Any]) -> None:
    for r in runs["resumed"][2]:
        assert (r["start_step"], r["start_epoch"], r["end_step"]) == (8, 2, 12)
        assert r["lr"] == 0.05 * 0.5 ** 2  # the scheduler's state came back (stepped at 3 and 6)
        assert r["losses"] == {s: runs["reference"][s] for s in ("9", "10", "11", "12")}


def test_resume_on_1_rank_within_tolerance(runs: dict[str, Any]) -> None:
    (r,) = runs["resumed"][1]
    assert (r["start_step"], r["start_epoch"], r["end_step"], r["lr"]) == (8, 2, 12, 0.0125)
    assert sorted(r["losses"], key=int) == ["9", "10", "11", "12"]
    for step, loss in r["losses"].items():
        assert math.isclose(loss, runs["reference"][step], rel_tol=ONE_RANK_RTOL, abs_tol=0), step


def test_each_save_is_a_committed_checkpoint_with_lightning_state_as_json(runs: dict[str, Any]) -> None:
    ck = runs["work"] / "ckpts-kept" / "epoch=1-step=8.ckpt"
    assert not verify(str(ck)).problems
    m = read_manifest(Storage(str(ck)))
    extras = run_extras(m)
    assert extras.step == 8
    state = extras.app["lightning"]["state"]
    assert state["global_step"] == 8 and state["epoch"] == 1
    assert state["hyper_parameters"] == {"lr": 0.05, "betas": {"$tuple": [0.9, 0.95]}, "note": None}
    assert state["loops"]["fit_loop"]["epoch_loop.state_dict"]["_batches_that_stepped"] == 8
    assert state["lr_schedulers"][0]["last_epoch"] == 8
    assert state["optimizer_states"][0]["param_groups"][0]["lr"] == 0.0125
    assert m.chunked is not None and dict(m.chunked.blobs) == {}  # no value DCP would pickle
    names = set(m.chunked.tensors)
    assert {"state_dict.net.0.weight", "optimizer_states.0.state.net.0.weight.exp_avg_sq"} <= names
    # FSDP2 shards: each of the two ranks wrote half of the first layer's rows
    assert len(m.chunked.tensors["state_dict.net.0.weight"].chunks) == 2
    assert extras.hf_config == job.HF_CONFIG and extras.hf_prefix is None  # hf_config= of the strategy


def test_consolidate_needs_no_prefix_and_writes_the_strategys_config(runs: dict[str, Any]) -> None:
    """The model's tensors lie under ``state_dict.net.``: consolidate finds them by itself and
    writes the ``hf_config=`` the strategy was given."""
    from testing.cli import cli, ok

    ck, out = runs["work"] / "ckpts-kept" / "epoch=1-step=8.ckpt", runs["work"] / "consolidated"
    ok(cli("consolidate", str(ck), str(out), "--dtype", "fp32"))
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert sorted(index["weight_map"]) == [f"{i}.{k}" for i in (0, 2, 4) for k in ("bias", "weight")]
    assert json.loads((out / "config.json").read_text())["model_type"] == "tiny-mlp"


def test_retention_deletes_through_shardckpt(runs: dict[str, Any]) -> None:
    ckpts = runs["work"] / "ckpts"
    assert sorted(p.name for p in ckpts.iterdir()) == ["epoch=1-step=8.ckpt", "epoch=2-step=12.ckpt",
                                                       "last.ckpt"]
    # last.ckpt was saved over at steps 4, 8 and 12: one save's files left, the one its manifest names
    last = ckpts / "last.ckpt"
    m = read_manifest(Storage(str(last)))
    assert sorted(p.name for p in last.iterdir()) == sorted(["manifest.json", m.save_id])
    assert run_extras(m).step == 12 and not verify(str(last)).problems


def test_the_newest_good_checkpoint_is_never_deleted(runs: dict[str, Any]) -> None:
    kept = runs["work"] / "ckpts-kept"
    # last.ckpt and epoch=1-step=8.ckpt hold step 8 (several are newest only where commit times tie)
    assert "last.ckpt" in newest_good(Storage(str(kept)))
    # a checkpoint with a file missing is not good: epoch=1-step=8 is then the only newest good one
    m = read_manifest(Storage(str(kept / "last.ckpt")))
    (kept / "last.ckpt" / m.files[0].path).unlink()
    assert newest_good(Storage(str(kept))) == ["epoch=1-step=8.ckpt"]
    assert remove_checkpoint(str(kept / "epoch=1-step=8.ckpt")) is False
    assert (kept / "epoch=1-step=8.ckpt" / "manifest.json").exists()
    assert remove_checkpoint(str(kept / "epoch=0-step=4.ckpt")) is True
    assert remove_checkpoint(str(kept / "last.ckpt")) is True
    assert sorted(p.name for p in kept.iterdir()) == ["epoch=1-step=8.ckpt"]


def test_state_that_is_not_json_is_refused_on_every_rank(runs: dict[str, Any]) -> None:
    for world in (2, 1):
        for r in runs["resumed"][world]:
            assert "hyper_parameters.loss_fn" in r["save_refused"]
            assert "torch.nn.modules.loss.MSELoss" in r["save_refused"]
    assert not (runs["work"] / "refused.ckpt" / "manifest.json").exists()


def test_paths_read_from_a_checkpoint_are_never_deleted(runs: dict[str, Any]) -> None:
    """Each hostile path survived the save that followed the resume (Lightning would have had
    the strategy delete those under ``..`` and the URL), and each was dropped with a warning;
    the resumes trained on, and the 1-rank run kept its own checkpoints."""
    hostile = runs["hostile"]
    for d in hostile["dirs"]:
        assert (d / "keep").read_text() == "not the run's", d
    url, options = runs["s3"]
    assert Storage(hostile["s3"], options).read("keep") == b"not the run's"
    (one,) = runs["resumed"][1]
    for what in ("abs", "kth", "last"):
        assert any(hostile["paths"][what] in w and "dropped" in w for w in one["warnings"]), what
    two = runs["resumed"][2][0]
    assert any(hostile["s3"] in w and "dropped" in w for w in two["warnings"]), two["warnings"]
    # nothing of the run went either (without the planted last_model_path, Lightning names its
    # next last save last-v1.ckpt and leaves last.ckpt)
    ckpts = {p.name for p in (runs["work"] / "ckpts-1rank").iterdir()}
    assert {"epoch=0-step=4.ckpt", "epoch=1-step=8.ckpt", "epoch=2-step=12.ckpt", "last.ckpt"} <= ckpts
    assert sorted(p.name for p in (runs["work"] / "ckpts-1rank-top1").iterdir()) == ["epoch=2-step=12.ckpt"]


def test_remove_checkpoint_deletes_only_what_the_listing_finds(tmp_path: Any, caplog: Any) -> None:
    """The strategy's delete, in process: only a committed checkpoint directly below one of the
    run's directories; a ``..`` path, a path outside, a directory without a manifest and a URL
    elsewhere are kept, with a warning."""
    from testing.ckpts import make_ckpt

    run, outside = tmp_path / "run", tmp_path / "outside"
    for name in ("a.ckpt", "b.ckpt"):
        make_ckpt(run, name)
    make_ckpt(outside, "c.ckpt")
    (run / "loose").mkdir()
    (run / "loose" / "x").write_text("no manifest")
    within = [str(run)]
    for path in (f"{run}/../outside/c.ckpt", str(outside / "c.ckpt"), f"{run}/loose", f"{run}/..",
                 "memory://elsewhere/a.ckpt", f"{run}/a.ckpt/..", f"{run}//a.ckpt"):
        caplog.clear()
        assert remove_checkpoint(path, within=within) is False, path
        assert "not a committed checkpoint listed" in caplog.text, path
    assert (outside / "c.ckpt" / "manifest.json").exists() and (run / "loose" / "x").exists()
    assert remove_checkpoint(f"{run}/a.ckpt", within=within) is True
    assert sorted(p.name for p in run.iterdir()) == ["b.ckpt", "loose"]


@pytest.mark.s3
def test_save_to_s3_and_resume_from_it(runs: dict[str, Any]) -> None:
    url, options = runs["s3"]
    for r in runs["resumed"][2]:
        assert r["s3_restored"] and r["s3_step"] == 12
    assert not verify(f"{url}/b.ckpt", options).problems
    assert run_extras(read_manifest(Storage(f"{url}/b.ckpt", options))).step == 12
    # a and b hold step 12: one may go, the other is then the newest good one and stays
    assert remove_checkpoint(f"{url}/a.ckpt", options) is True
    assert remove_checkpoint(f"{url}/b.ckpt", options) is False
    names = sorted(p.rsplit("/", 1)[-1] for p in Storage(url, options).ls(""))
    assert names == ["b.ckpt"]


# ------------------------------------------------------------------- the JSON side, in process


def test_split_and_join_give_back_every_kind_of_value() -> None:
    import torch

    t = torch.arange(3.0)
    state = {"a": (1, 2.5, "x"), "b": {0: "int key", (1, 2): None}, "c": [math.inf, -math.inf, True],
             "$only": {"$tuple": 1}, "t": {"w": t}, "none": None, "nan": math.nan}
    doc, tensors = split_state(state)
    assert tensors == {"t.w": t}
    json.dumps(doc, allow_nan=False)  # strict JSON
    back = join_state(json.loads(json.dumps(doc)), tensors, "here")
    assert math.isnan(back["nan"])
    assert back["a"] == (1, 2.5, "x") and back["b"] == {0: "int key", (1, 2): None}
    assert back["c"] == [math.inf, -math.inf, True] and back["$only"] == {"$tuple": 1}
    assert back["t"]["w"] is t and back["none"] is None


def test_split_refuses_what_json_cannot_hold() -> None:
    import torch

    with pytest.raises(ConfigError, match=r"hyper_parameters\.act: a value of type torch\.nn"):
        split_state({"hyper_parameters": {"act": torch.nn.ReLU()}})
    with pytest.raises(ConfigError, match="two tensors are named 'a.b'"):
        split_state({"a.b": torch.zeros(1), "a": {"b": torch.zeros(1)}})


def test_join_refuses_a_document_out_of_layout() -> None:
    with pytest.raises(ManifestError, match=r"ck: extras\.app\.lightning\.state\.x: unknown tag"):
        join_state({"x": {"$code": "os.system"}}, {}, "ck")
    with pytest.raises(ManifestError, match="names tensor 'w', which was not loaded"):
        join_state({"y": [{"$tensor": "w"}]}, {}, "ck")
    with pytest.raises(ManifestError, match=r"\$float must be one of"):
        join_state({"$float": "1e999"}, {}, "ck")
