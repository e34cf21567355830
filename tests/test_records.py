"""The typed records of ``extras``, ``per_rank_state`` and the optimizer's param groups
(``shardckpt/format/records.py``): each gives back the very object it read, for every golden
checkpoint and a Checkpointer-written one, and a malformed value is one ManifestError naming the
key and the file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

import pytest

from shardckpt.errors import ManifestError
from shardckpt.format.parse_context import ParseContext, Problem
from shardckpt.format.records import (
    ParamGroupRecord, PerRankState, RunExtras, param_groups, per_rank_state, run_extras,
)
from shardckpt.interop.dcp.config import DcpOrigin
from shardckpt.interop.deepspeed.config import DeepSpeedOrigin

GOLDEN = Path(__file__).parent / "golden"
MANIFESTS = sorted(GOLDEN.glob("*/manifest.json"))


def records_of(doc: dict[str, Any]) -> Iterator[tuple[Any, Any, str]]:
    """(record class, object, where) for every record of a manifest's JSON."""
    yield RunExtras, doc.get("extras", {}), "extras"
    yield PerRankState, doc.get("per_rank_state", {}), "per_rank_state"
    for i, pg in enumerate((doc.get("optimizer") or {}).get("param_groups", [])):
        yield ParamGroupRecord, pg, f"optimizer.param_groups[{i}]"


def assert_round_trip(doc: dict[str, Any], source: str) -> None:
    for cls, obj, where in records_of(doc):
        back = cls.from_doc(obj, where, source).to_doc()
        assert back == obj, (source, where)
        # the same keys in the same order, and so the same bytes when written again
        assert json.dumps(back) == json.dumps(obj), (source, where)


def test_golden_manifests_are_there() -> None:
    assert len(MANIFESTS) >= 4


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.parent.name)
def test_golden_records_round_trip(path: Path) -> None:
    assert_round_trip(json.loads(path.read_text()), str(path))


def test_golden_records_read_what_the_writer_wrote() -> None:
    from shardckpt.format.manifest_parse import parse

    m = parse((GOLDEN / "v1_1" / "manifest.json").read_bytes())
    extras = run_extras(m)
    assert (extras.step, extras.samples_seen) == (42, 672)
    assert dict(extras.other) == {"user": {"synthetic": True, "seed": 1234}}
    assert per_rank_state(m) == PerRankState(world_size=2)
    groups = param_groups(m.optimizer)
    assert [g.step for g in groups] == [42, 42]
    assert [g.hparams["weight_decay"] for g in groups] == [0.1, 0.0]


def test_checkpointer_written_records_round_trip(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    from shardckpt.runtime import ShardedAdamW, ZeroEngine, decay_param_groups
    from shardckpt.runtime.mesh import ProcessMesh
    from shardckpt.training.checkpointer import Checkpointer, JsonState

    torch.manual_seed(0)
    engine = ZeroEngine(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2)),
                        process_mesh=ProcessMesh.single())
    opt = ShardedAdamW(engine, decay_param_groups(engine, 0.1), lr=1e-2)
    engine(torch.ones(3, 4)).sum().backward()
    opt.step()
    app = JsonState({"epoch": 3, "name": "run"})
    ckpt = Checkpointer(str(tmp_path / "run"), engine, app_state={"data": app}, seed=7,
                        hf_config={"model_type": "llama", "hidden_size": 8})
    ckpt.save(5, extras={"note": "mine", "samples_seen": 40})
    ckpt.close()
    path = tmp_path / "run" / "step-00000005" / "manifest.json"
    doc = json.loads(path.read_text())
    assert list(doc["extras"]) == ["hf_config", "note", "samples_seen", "step", "seed", "app"]
    assert_round_trip(doc, str(path))
    extras = RunExtras.from_doc(doc["extras"], "extras", str(path))
    assert (extras.step, extras.seed, extras.samples_seen) == (5, 7, 40)
    assert extras.app == {"data": {"epoch": 3, "name": "run"}}
    assert dict(extras.other) == {"note": "mine"}
    rank = PerRankState.from_doc(doc["per_rank_state"], "per_rank_state", str(path))
    assert rank.files and rank.restorable_on(1) and not rank.restorable_on(2)


def test_writer_built_records_write_what_the_writers_wrote() -> None:
    assert PerRankState(world_size=4).to_doc() == {"world_size": 4, "dropped_from_world_size": None}
    assert list(PerRankState(4, 8, "dropped", True).to_doc()) == [
        "world_size", "dropped_from_world_size", "note", "files"]
    assert ParamGroupRecord(("a", "b")).to_doc() == {"params": ["a", "b"], "hparams": {}, "step": 0}
    assert RunExtras(step=0, source="s3://b/m").to_doc() == {"step": 0, "source": "s3://b/m"}
    assert RunExtras(source="x", other=DcpOrigin(None, ("b", "a")).entry()).to_doc() == {
        "source": "x", "dcp": {"version": None, "files": ["b", "a"]}}
    ds = DeepSpeedOrigin("0.14", 3, 8, "global_step5", "bf16")
    assert RunExtras(other=ds.entry()).to_doc()["deepspeed"] == {
        "version": "0.14", "stage": 3, "world_size": 8, "tag": "global_step5", "precision": "bf16"}
    assert list(RunExtras(step=1, other={"dcp": None}, source="s", keys=("source", "dcp", "step")).to_doc()) \
        == ["source", "dcp", "step"]


def test_unknown_keys_pass_through_untouched() -> None:
    doc = {"z": [1, {"a": None}], "step": 3, "user": {"anything": ["goes", 1.5]}, "a": True}
    r = RunExtras.from_doc(doc, "extras")
    assert r.step == 3 and dict(r.other) == {"z": [1, {"a": None}], "user": doc["user"], "a": True}
    assert json.dumps(r.to_doc()) == json.dumps(doc)
    pg = {"step": 2, "params": ["w"], "lr_sched": "cosine"}
    assert json.dumps(ParamGroupRecord.from_doc(pg, "pg").to_doc()) == json.dumps(pg)


def test_null_reads_as_absent_and_is_kept() -> None:
    doc = {"world_size": 2, "dropped_from_world_size": None}
    r = PerRankState.from_doc(doc, "per_rank_state")
    assert r.dropped_from_world_size is None and r.to_doc() == doc
    assert PerRankState.from_doc({}, "per_rank_state").to_doc() == {}
    assert RunExtras.from_doc({"dcp": None}, "extras").to_doc() == {"dcp": None}


MALFORMED = [
    (RunExtras, {"step": "42"}, "extras.step", "expected an integer"),
    (RunExtras, {"step": 1.0}, "extras.step", "expected an integer"),
    (RunExtras, {"step": float("nan")}, "extras.step", "expected an integer"),
    (RunExtras, {"step": True}, "extras.step", "expected an integer"),
    (RunExtras, {"step": -1}, "extras.step", "outside"),
    (RunExtras, {"samples_seen": [1]}, "extras.samples_seen", "expected an integer"),
    (RunExtras, {"seed": "7"}, "extras.seed", "expected an integer"),
    (RunExtras, {"app": []}, "extras.app", "expected an object"),
    (RunExtras, {"app": {"sched": {"lr": float("nan")}}}, "extras.app.sched.lr", "not a finite"),
    (RunExtras, {"hf_config": "llama"}, "extras.hf_config", "expected an object"),
    (RunExtras, {"hf_config": {"x": float("inf")}}, "extras.hf_config.x", "not a finite"),
    (RunExtras, {"source": 3}, "extras.source", "expected a string"),
    (DcpOrigin, {"files": ["a", 2]}, "extras.dcp.files[1]", "expected a string"),
    (DeepSpeedOrigin, {"stage": "3"}, "extras.deepspeed.stage", "expected an integer"),
    (RunExtras, {"user": {"v": float("-inf")}}, "extras.user.v", "not a finite"),
    (RunExtras, {"user": object()}, "extras.user", "is not JSON"),
    (RunExtras, [], "extras", "expected an object"),
    (PerRankState, {"world_size": "2"}, "per_rank_state.world_size", "expected an integer"),
    (PerRankState, {"dropped_from_world_size": 2.5}, "per_rank_state.dropped_from_world_size",
     "expected an integer"),
    (PerRankState, {"files": 1}, "per_rank_state.files", "expected true or false"),
    (ParamGroupRecord, {"hparams": {}, "step": 0}, "optimizer.param_groups[0]",
     "missing field 'params'"),
    (ParamGroupRecord, {"params": "w"}, "optimizer.param_groups[0].params", "expected a list"),
    (ParamGroupRecord, {"params": [1]}, "optimizer.param_groups[0].params[0]", "expected a string"),
    (ParamGroupRecord, {"params": [], "step": None}, "optimizer.param_groups[0].step",
     "expected an integer"),
    (ParamGroupRecord, {"params": [], "hparams": {"lr": float("nan")}},
     "optimizer.param_groups[0].hparams.lr", "not a finite"),
]


@pytest.mark.parametrize("cls,doc,key,what", MALFORMED, ids=[f"{k}:{w}" for _, _, k, w in MALFORMED])
def test_malformed_value_is_one_error_naming_key_and_file(cls: Any, doc: Any, key: str,
                                                         what: str) -> None:
    where = "optimizer.param_groups[0]" if cls is ParamGroupRecord else \
        "per_rank_state" if cls is PerRankState else f"extras.{cls.KEY}" if hasattr(cls, "KEY") else "extras"
    with pytest.raises(ManifestError) as e:
        cls.from_doc(doc, where, "s3://b/run/step-7/manifest.json")
    msg = str(e.value)
    assert msg.startswith("s3://b/run/step-7/manifest.json: "), msg
    assert f"{key}: " in msg and what in msg, msg


def test_every_fault_of_a_record_in_one_error() -> None:
    with pytest.raises(ManifestError) as e:
        RunExtras.from_doc({"step": "x", "seed": [], "app": 1}, "extras", "m.json")
    msg = str(e.value)
    assert msg.startswith("m.json: 3 problems")
    assert all(k in msg for k in ("extras.step", "extras.seed", "extras.app"))


def test_inside_a_parse_a_record_is_one_problem_of_the_document() -> None:
    ctx = ParseContext("run/manifest.json")
    with pytest.raises(Problem) as e:
        ParamGroupRecord.from_doc({"params": [], "step": -2}, "optimizer.param_groups[3]", ctx=ctx)
    assert e.value.problem.startswith("optimizer.param_groups[3].step: ")
    assert str(e.value).startswith("run/manifest.json: ")


def test_every_record_field_is_a_key() -> None:
    from dataclasses import fields

    for cls in (DcpOrigin, DeepSpeedOrigin, RunExtras, PerRankState, ParamGroupRecord):
        assert [f.name for f in fields(cls)] == list(cls.KEYS) + ["other", "keys"], cls


def test_a_manifest_decodes_its_extras_once_and_a_fault_names_the_file() -> None:
    import dataclasses

    from shardckpt.format.manifest_parse import parse

    m = parse((GOLDEN / "v1_1" / "manifest.json").read_bytes())
    assert m.run_extras is m.run_extras and run_extras(m, "elsewhere") is m.run_extras
    assert m.run_extras.step == 42
    assert dataclasses.replace(m, extras={**m.extras, "step": 7}).run_extras.step == 7
    bad = dataclasses.replace(m, extras={**m.extras, "step": "42"})
    with pytest.raises(ManifestError, match=r"^s3://b/run/step-7: extras\.step: expected an integer"):
        run_extras(bad, "s3://b/run/step-7")
