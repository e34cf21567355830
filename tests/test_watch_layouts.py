"""`shardckpt watch` as a new user meets it: every run layout shardckpt writes (step-*, the
Trainer's checkpoint-N, Lightning's *.ckpt), an empty or mistyped prefix, a checkpoint removed
under the watcher, retain with derived outputs, --redrive, the reshard ``from`` guard, and a
failed torchrun job's log. One process; no torchrun."""

from __future__ import annotations

import io
import json
import logging
import shutil
from pathlib import Path

import pytest

from testing.ckpts import TINY_PARAMS
from testing.cli import cli, ok
from shardckpt.errors import ConfigError
from shardckpt.tools.synth import synthesize
from shardckpt.watch import service as watch_service
from shardckpt.watch.config import load_pipeline, parse_pipeline
from shardckpt.watch.records import checkpoint_dir, checkpoint_step
from shardckpt.watch.service import Watcher

HEAD = """\
name = "t"
watch = "run"
state = "out"
retries = 0
backoff_s = 0.0
"""
VERIFY = HEAD + '[[steps]]\nkind = "verify"\n'


def pipeline(tmp: Path, text: str = VERIFY) -> Path:
    path = tmp / "p.toml"
    path.write_text(text)
    return path


def make(run: Path, names: list[str], ranks: int = 2) -> None:
    for i, name in enumerate(names):
        synthesize(str(run / name), TINY_PARAMS, ranks, step=100 * (i + 1), seed=i)


def done(tmp: Path, name: str) -> list[str]:
    d = tmp / "out" / checkpoint_dir("t", name)
    return sorted(p.name for p in d.glob("*.d*") if p.is_file())


# --------------------------------------------------------------------------- every layout


@pytest.mark.parametrize("names", [
    ["checkpoint-100", "checkpoint-200"],                                  # HF Trainer
    ["epoch=0-step=100.ckpt", "epoch=1-step=200.ckpt"],                    # Lightning
    ["step-00000100", "step-00000200"],
])
def test_once_finds_the_checkpoints_of_every_layout(tmp_path: Path, names: list[str]) -> None:
    make(tmp_path / "run", names)
    (tmp_path / "run" / "latest").write_text(names[-1])
    r = ok(cli("watch", str(pipeline(tmp_path)), "--once"))
    assert r.stdout.startswith("2 step(s) done"), r.stdout
    for name in names:
        assert done(tmp_path, name) == ["1-verify.done"]


def test_the_naming_rule_is_the_integrations_own() -> None:
    """One rule: the watch service's names are those the Trainer's run manager lists."""
    from shardckpt.checkpoint.run_names import TRAINER_DIR
    from shardckpt.integrations.transformers import CHECKPOINT_DIR, TrainerRun

    assert CHECKPOINT_DIR is TRAINER_DIR and TrainerRun.DIR_PATTERN is TRAINER_DIR
    assert [checkpoint_step(n) for n in ("checkpoint-7", "epoch=1-step=40-v1.ckpt", "step=3.ckpt",
                                         "last.ckpt", "checkpoint-", "step-1", "x.ckpt\n")] == \
        [7, 40, 3, None, None, None, None]


# --------------------------------------------------------------------------- nothing to watch


@pytest.mark.parametrize("setup, needle", [
    ("missing", "does not exist or is empty"),
    ("foreign", "none of the names"),
    ("last-only", "give ModelCheckpoint a filename with {step}"),
])
def test_an_empty_prefix_warns_and_once_fails(tmp_path: Path, setup: str, needle: str,
                                               caplog: pytest.LogCaptureFixture) -> None:
    run = tmp_path / "run"
    if setup == "foreign":
        make(run, ["ckpt-100"])  # a checkpoint, but under no name shardckpt writes
    elif setup == "last-only":
        make(run, ["last.ckpt"])
    r = cli("watch", str(pipeline(tmp_path)), "--once")
    assert r.exit_code == 1 and "--allow-empty" in r.stderr, (r.output, r.exception)
    assert r.stdout.startswith("0 step(s) done")
    r = ok(cli("watch", str(pipeline(tmp_path)), "--once", "--allow-empty"))
    caplog.set_level(logging.WARNING)
    caplog.clear()
    Watcher(load_pipeline(str(pipeline(tmp_path)))).run(once=True)
    warned = [rec.getMessage() for rec in caplog.records if rec.levelno == logging.WARNING]
    assert len(warned) == 1 and needle in warned[0] and str(run) in warned[0], warned


# ------------------------------------------------------------------ removed under the watcher


def test_a_checkpoint_removed_before_it_is_processed_is_skipped_by_name(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    run = tmp_path / "run"
    make(run, ["checkpoint-100", "checkpoint-200", "checkpoint-300"])
    w = Watcher(load_pipeline(str(pipeline(tmp_path))))
    listed = w.pending

    def pending_then_remove() -> list[tuple[int, str]]:
        out = listed()
        shutil.rmtree(run / "checkpoint-100")  # after the listing (the Trainer's own retention)
        return out

    read = watch_service._read

    def remove_then_read(src, *args):  # after the commit check, before the step runs
        if src.url.endswith("checkpoint-200"):
            shutil.rmtree(run / "checkpoint-200", ignore_errors=True)
        return read(src, *args)

    monkeypatch.setattr(w, "pending", pending_then_remove)
    monkeypatch.setattr(watch_service, "_read", remove_then_read)
    caplog.set_level(logging.WARNING)
    report = w.run(once=True)
    assert (report.done, report.dead, report.skipped, report.uncommitted) == (1, 0, 2, 0)
    skipped = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert len(skipped) == 2 and "checkpoint-100" in skipped[0] and "checkpoint-200" in skipped[1]
    assert done(tmp_path, "checkpoint-200") == [] and done(tmp_path, "checkpoint-300") == ["1-verify.done"]


# ------------------------------------------------------------------------ retain, derived


def test_retain_prunes_the_outputs_earlier_steps_derived(tmp_path: Path) -> None:
    text = HEAD + """\
[[steps]]
kind = "reshard"
dst = "out/ws1/{name}"
to = 1
[[steps]]
kind = "consolidate"
dst = "out/hf/{step}"
[[steps]]
kind = "copy"
dst = "elsewhere/{name}"
[[steps]]
kind = "retain"
keep = 1
"""
    names = ["checkpoint-100", "checkpoint-200", "checkpoint-300"]
    make(tmp_path / "run", names)
    (tmp_path / "out" / "ws1").mkdir(parents=True)
    (tmp_path / "out" / "ws1" / "notes.txt").write_text("mine")  # not an output: stays
    r = ok(cli("watch", str(pipeline(tmp_path, text)), "--once"))
    assert r.stdout.startswith("12 step(s) done"), r.stdout
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["checkpoint-300"]
    assert sorted(p.name for p in (tmp_path / "out" / "ws1").iterdir()) == ["checkpoint-300", "notes.txt"]
    assert sorted(p.name for p in (tmp_path / "out" / "hf").iterdir()) == ["300"]
    assert sorted(p.name for p in (tmp_path / "elsewhere").iterdir()) == ["checkpoint-300"]
    rec = json.loads((tmp_path / "out" / checkpoint_dir("t", "checkpoint-200") / "4-retain.done").read_text())
    assert rec["removed"] == ["checkpoint-100"]
    assert rec["derived"] == [str(tmp_path / "out" / "ws1" / "checkpoint-100"),
                              str(tmp_path / "out" / "hf" / "100"),
                              str(tmp_path / "elsewhere" / "checkpoint-100")]


# ---------------------------------------------------------------------- redrive, from guard


def test_redrive_reruns_a_dead_lettered_step(tmp_path: Path) -> None:
    text = HEAD + '[[steps]]\nkind = "reshard"\ndst = "out/ws1/{name}"\nto = 1\nfrom = 3\n'
    make(tmp_path / "run", ["step-00000100"], ranks=2)
    path = pipeline(tmp_path, text)
    r = cli("watch", str(path), "--once")
    assert r.exit_code == 1 and "1 dead-lettered" in r.stdout
    base = tmp_path / "out" / checkpoint_dir("t", "step-00000100")
    reason = json.loads((base / "1-reshard.dead").read_text())["reason"]
    assert "--from 3 does not match" in reason and not (tmp_path / "out" / "ws1").exists()
    # nothing to redrive: a name that is no checkpoint, a step that is not dead
    r = cli("watch", str(path), "--redrive", "step-00000200")
    assert r.exit_code == 1 and "no committed checkpoint there" in r.stderr
    r = cli("watch", str(path), "--redrive", "step-00000100", "--step", "verify")
    assert r.exit_code == 1 and "names none of this pipeline's steps (1-reshard)" in r.stderr
    path.write_text(text.replace("from = 3", "from = 2"))  # the cause fixed
    r = ok(cli("watch", str(path), "--redrive", "step-00000100", "--step", "reshard"))
    assert r.stdout == "step-00000100: 1 step(s) done, 0 dead-lettered again\n"
    assert sorted(p.name for p in base.glob("1-reshard.*")) == ["1-reshard.dead.1", "1-reshard.done"]
    assert (tmp_path / "out" / "ws1" / "step-00000100" / "manifest.json").exists()
    r = cli("watch", str(path), "--redrive", "step-00000100")
    assert r.exit_code == 1 and "has no dead-lettered step" in r.stderr and "1-reshard done" in r.stderr


def test_reshard_from_is_checked_in_the_pipeline(tmp_path: Path) -> None:
    doc = {"name": "t", "watch": "run", "steps": [{"kind": "reshard", "dst": "o/{name}", "to": 2,
                                                   "from": 0}]}
    with pytest.raises(ConfigError, match=r"steps\[1\] \(reshard\): from = 0"):
        parse_pipeline(doc)
    doc["steps"][0]["from"] = 4
    assert parse_pipeline(doc).steps[0].from_ == 4
    doc["steps"] = [{"kind": "consolidate", "dst": "o/{name}", "from": 4}]
    with pytest.raises(ConfigError, match="unknown key"):
        parse_pipeline(doc)


def test_job_argv_passes_the_from_guard_and_keep_buffers(tmp_path: Path) -> None:
    from shardckpt.watch.job import job_argv
    from shardckpt.watch.steps import StepContext
    from shardckpt.storage import Storage

    spec = parse_pipeline({"name": "t", "watch": "run", "steps": [
        {"kind": "reshard", "dst": "/o/{name}", "to": 2, "from": 4, "processes": 2}]}).steps[0]
    ctx = StepContext(spec, Storage(str(tmp_path)), None, "step-00000001", 1,  # type: ignore[arg-type]
                      Storage(str(tmp_path)), {}, lambda n: True)
    argv = job_argv(ctx)
    assert argv[argv.index("--from") + 1] == "4"
    spec = parse_pipeline({"name": "t", "watch": "run", "steps": [
        {"kind": "consolidate", "dst": "/o/{name}", "keep_buffers": True, "processes": 2}]}).steps[0]
    ctx.spec = spec
    assert "--keep-buffers" in job_argv(ctx)
    with pytest.raises(ConfigError, match="keep_buffers = 1: expected true or false"):
        parse_pipeline({"name": "t", "watch": "run", "steps": [
            {"kind": "consolidate", "dst": "/o/{name}", "keep_buffers": 1}]})


# ------------------------------------------------------------------------ a failed torchrun job


TORCHRUN_FAILURE = """\
progress: reshard 3 of 4 files
[rank1]: Traceback (most recent call last):
[rank1]:   File "x.py", line 1, in <module>
[rank1]: OSError: disk full
error: reshard: /out/step-00000100: disk full
E1204 12:00:00.123000 4567 torch/distributed/elastic/multiprocessing/api.py:882] failed (exitcode: 1)
Traceback (most recent call last):
  File "torch/distributed/run.py", line 9, in main
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
shardckpt FAILED
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  rank      : 1 (local_rank: 1)
  exitcode  : 1 (pid: 7)
============================================================
"""


def test_a_failed_job_logs_its_reason_first_and_the_traceback_at_debug(
        caplog: pytest.LogCaptureFixture) -> None:
    from shardckpt.watch.job import _failure, _log_lines

    caplog.set_level(logging.DEBUG, logger="shardckpt.watch.job")
    errors: list[str] = []
    _log_lines(io.BytesIO(TORCHRUN_FAILURE.encode()), "step-00000100 1-reshard", errors)
    shown = [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO]
    assert shown == ["step-00000100 1-reshard: progress: reshard 3 of 4 files"]
    hidden = [r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG]
    assert len(hidden) == len(TORCHRUN_FAILURE.splitlines()) - 1
    assert any("Traceback" in m for m in hidden) and any("Root Cause" in m for m in hidden)
    assert _failure(1, errors, 2).startswith("reshard: /out/step-00000100: disk full (torchrun")
