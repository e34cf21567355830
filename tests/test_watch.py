"""`shardckpt watch` in one process: the TOML pipeline, --once, each step's output and record,
dead-letters, adoption of an unrecorded output, idle cost, claims, status."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from typer.testing import CliRunner

from testing.ckpts import TINY_PARAMS, make_run_dir
from shardckpt.checkpoint.reader import read_manifest
from shardckpt.checkpoint.verify import verify
from shardckpt.tools.consolidate import consolidate
from shardckpt.errors import ConfigError
from shardckpt.tools.reshard import reshard
from shardckpt.storage.backends import Backend
from shardckpt.storage import Storage
from shardckpt.tools.synth import synthesize
from shardckpt.watch.service import Watcher
from shardckpt.watch.config import load_pipeline, parse_pipeline
from shardckpt.watch.records import StepClaim, checkpoint_dir
from shardckpt.watch.status import pipeline_status

PIPELINE = """\
name = "t"
watch = "run"
state = "out"
retries = 1
backoff_s = 0.0
[[steps]]
kind = "verify"
[[steps]]
kind = "reshard"
dst = "out/ws3/{name}"
to = 3
[[steps]]
kind = "consolidate"
dst = "out/hf/{name}"
dtype = "bf16"
[[steps]]
kind = "copy"
dst = "out/copy/step-{step:06d}"
"""
KEYS = ["1-verify", "2-reshard", "3-consolidate", "4-copy"]


def make_run(tmp: Path, steps: tuple[int, ...] = (100, 200), extra: str = "") -> Path:
    make_run_dir(tmp / "run", steps)
    path = tmp / "p.toml"
    path.write_text(PIPELINE + extra)
    return path


def records(tmp: Path, ckpt: str) -> dict[str, dict]:
    d = tmp / "out" / checkpoint_dir("t", ckpt)
    return {p.name: json.loads(p.read_text()) for p in sorted(d.glob("*.done")) + sorted(d.glob("*.dead"))}


def damage(ckpt: Path) -> None:
    shard = next(ckpt.glob("*/shard-00000-of-*.safetensors"))
    data = bytearray(shard.read_bytes())
    data[-5] ^= 0xFF
    shard.write_bytes(bytes(data))


def test_once_runs_every_step_once_and_outputs_equal_a_run_by_hand(tmp_path: Path) -> None:
    p = load_pipeline(str(make_run(tmp_path)))
    report = Watcher(p).run(once=True)
    assert (report.done, report.dead) == (8, 0)
    for s in (100, 200):
        name = f"step-{s:08d}"
        recs = records(tmp_path, name)
        assert sorted(recs) == [f"{k}.done" for k in KEYS]
        src = str(tmp_path / "run" / name)
        ws3 = tmp_path / "out" / "ws3" / name
        assert verify(str(ws3)) and read_manifest(Storage(str(ws3))).mesh.world_size == 3
        assert recs["2-reshard.done"]["identity"] == read_manifest(Storage(str(ws3))).save_id
        copy = tmp_path / "out" / "copy" / f"step-{s:06d}"
        assert verify(str(copy))
        assert (copy / "manifest.json").read_bytes() == (Path(src) / "manifest.json").read_bytes()
        by_hand = tmp_path / "hand" / name
        consolidate(src, str(by_hand), dtype="bf16")
        hf = tmp_path / "out" / "hf" / name
        assert (hf / "model-00001-of-00001.safetensors").read_bytes() == \
            (by_hand / "model-00001-of-00001.safetensors").read_bytes()
        reshard(src, str(tmp_path / "hand3" / name), 3)  # lossless: consolidates to the same bytes
        consolidate(str(ws3), str(tmp_path / "hand3hf" / name), dtype="bf16")
        assert (tmp_path / "hand3hf" / name / "model-00001-of-00001.safetensors").read_bytes() == \
            (by_hand / "model-00001-of-00001.safetensors").read_bytes()
    again = Watcher(p).run(once=True)
    assert (again.done, again.dead) == (0, 0)


def test_damaged_checkpoint_is_dead_lettered_and_the_next_is_processed(tmp_path: Path) -> None:
    p = load_pipeline(str(make_run(tmp_path)))
    damage(tmp_path / "run" / "step-00000100")
    report = Watcher(p).run(once=True)
    assert (report.done, report.dead) == (4, 1)
    dead = records(tmp_path, "step-00000100")
    assert list(dead) == ["1-verify.dead"]
    reason = dead["1-verify.dead"]["reason"]
    assert "\n" not in reason and "CRC32C" in reason and dead["1-verify.dead"]["tries"] == 2
    assert not (tmp_path / "out" / "ws3" / "step-00000100").exists()
    assert sorted(records(tmp_path, "step-00000200")) == [f"{k}.done" for k in KEYS]
    doc = pipeline_status(p)
    states = {c["checkpoint"]: [s["state"] for s in c["steps"]] for c in doc["checkpoints"]}
    assert states == {"step-00000100": ["dead", "blocked", "blocked", "blocked"],
                      "step-00000200": ["done"] * 4}


def test_concurrency_processes_several_checkpoints_at_once(tmp_path: Path) -> None:
    path = make_run(tmp_path, (100, 200, 300))
    path.write_text(PIPELINE.replace("backoff_s = 0.0", "backoff_s = 0.0\nconcurrency = 3"))
    report = Watcher(load_pipeline(str(path))).run(once=True)
    assert (report.done, report.dead, report.held) == (12, 0, 0)
    for s in (100, 200, 300):
        assert sorted(records(tmp_path, f"step-{s:08d}")) == [f"{k}.done" for k in KEYS]


def test_long_running_watcher_survives_a_storage_failure(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    import threading

    from shardckpt.watch import records as watch_records
    from shardckpt.errors import StorageError

    path = make_run(tmp_path, (100,))
    path.write_text("interval_s = 0.01\n" + PIPELINE)
    failures = []
    real = watch_records.write_done

    def flaky(*args, **kwargs):  # type: ignore[no-untyped-def]
        if not failures:
            failures.append(args[3])
            raise StorageError("s3://b/x: unreachable")
        return real(*args, **kwargs)
    monkeypatch.setattr(watch_records, "write_done", flaky)
    w = Watcher(load_pipeline(str(path)))
    t = threading.Thread(target=w.run)
    t.start()
    try:
        for _ in range(20000):  # a bound on a hang, not a timing assertion
            if len(records(tmp_path, "step-00000100")) == 4:
                break
            w.stop_event.wait(0.005)
    finally:
        w.stop()
        t.join(60)
    assert failures == ["1-verify"] and w.counters.errors == {"pass": 1}
    assert sorted(records(tmp_path, "step-00000100")) == [f"{k}.done" for k in KEYS]


def test_uncommitted_checkpoint_waits(tmp_path: Path) -> None:
    p = load_pipeline(str(make_run(tmp_path, (100,))))
    (tmp_path / "run" / "step-00000200" / "x").mkdir(parents=True)
    report = Watcher(p).run(once=True)
    assert (report.done, report.uncommitted) == (4, 1)
    assert not (tmp_path / "out" / checkpoint_dir("t", "step-00000200")).exists()


def test_committed_output_without_record_is_adopted_not_rewritten(tmp_path: Path) -> None:
    p = load_pipeline(str(make_run(tmp_path, (100,))))
    name = "step-00000100"
    src = str(tmp_path / "run" / name)
    r = reshard(src, str(tmp_path / "out" / "ws3" / name), 3)  # as if killed before the record
    consolidate(src, str(tmp_path / "out" / "hf" / name), dtype="fp32")  # wrong dtype: redone
    Watcher(p).run(once=True)
    recs = records(tmp_path, name)
    assert recs["2-reshard.done"]["adopted"] is True
    assert recs["2-reshard.done"]["identity"] == r.manifest.save_id
    assert read_manifest(Storage(str(tmp_path / "out" / "ws3" / name))).save_id == r.manifest.save_id
    assert "adopted" not in recs["3-consolidate.done"]
    prov = json.loads((tmp_path / "out" / "hf" / name / "shardckpt_consolidated.json").read_text())
    assert prov["dtype"] == "bfloat16"


def test_damaged_output_is_not_adopted(tmp_path: Path) -> None:
    p = load_pipeline(str(make_run(tmp_path, (100,))))
    name = "step-00000100"
    dst = tmp_path / "out" / "ws3" / name
    first = reshard(str(tmp_path / "run" / name), str(dst), 3)
    damage(dst)
    Watcher(p).run(once=True)
    rec = records(tmp_path, name)["2-reshard.done"]
    assert "adopted" not in rec and rec["identity"] != first.manifest.save_id
    assert verify(str(dst)) and read_manifest(Storage(str(dst))).save_id == rec["identity"]


def test_idle_pass_costs_one_list(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    w = Watcher(load_pipeline(str(make_run(tmp_path, (100,)))))
    w.run(once=True)
    calls: list[tuple[str, str]] = []
    real = Backend.call  # every storage operation of every backend goes through it

    def counted(self, what, url, fn, deadline=None):  # type: ignore[no-untyped-def]
        calls.append((what, url))
        return real(self, what, url, fn, deadline)
    monkeypatch.setattr(Backend, "call", counted)
    for _ in range(3):
        w.process_pass()
    assert calls == [("list", str(tmp_path / "run"))] * 3


def test_claims_exclude_each_other(tmp_path: Path) -> None:
    st = Storage(str(tmp_path))
    a = StepClaim(st, "t", "step-00000001", "2-reshard", ttl_s=60)
    b = StepClaim(st, "t", "step-00000001", "2-reshard", ttl_s=60)
    assert a.try_claim() and a.attempt == 1
    assert not b.try_claim()  # a's claim and lease are live
    a.release()
    assert b.try_claim() and b.attempt == 2  # released: the next attempt has the next number
    b.lease.release()  # as if b were killed: its lease gone, its claim left live ...
    b.lease = None
    claim_dir = tmp_path / checkpoint_dir("t", "step-00000001") / "2-reshard"
    c = StepClaim(st, "t", "step-00000001", "2-reshard", ttl_s=60)
    assert not c.try_claim()
    doc = json.loads((claim_dir / ".lease-claim-0002").read_text())
    doc["pid"] = 2 ** 22 + 12345  # ... by a process of this host that is gone
    (claim_dir / ".lease-claim-0002").write_text(json.dumps(doc))
    assert c.try_claim() and c.attempt == 3
    c.release()
    (tmp_path / checkpoint_dir("t", "step-00000001") / "2-reshard.done").write_text("{}")
    assert not StepClaim(st, "t", "step-00000001", "2-reshard", ttl_s=60).try_claim()  # done
    assert sorted(p.name for p in claim_dir.iterdir()) == [f".lease-claim-000{i}" for i in (1, 2, 3)]


@pytest.mark.parametrize("text, needle", [
    ('name = "t"\nwatch = "r"\n', "no [[steps]]"),
    ('name = "t"\nwatch = "r"\n[[steps]]\nkind = "shuffle"\n', "kind 'shuffle'"),
    ('name = "t"\nwatch = "r"\n[[steps]]\nkind = "reshard"\ndst = "o/x"\nto = 2\n', "{step} or {name}"),
    ('name = "t"\nwatch = "r"\n[[steps]]\nkind = "reshard"\ndst = "o/{name}"\nto = 3\nreplicate = 2\n',
     "not divisible"),
    ('name = "t"\nwatch = "r"\ninterval = 3\n[[steps]]\nkind = "verify"\n', "unknown key(s) interval"),
    ('name = "t"\nwatch = "r"\nretries = -1\n[[steps]]\nkind = "verify"\n', "retries = -1"),
    ('name = "t"\nwatch = "r"\n[[steps]]\nkind = "copy"\ndst = "o/{nam}"\n', "{step} or {name}"),
    ('name = "a/b"\nwatch = "r"\n[[steps]]\nkind = "verify"\n', "name 'a/b'"),
    ('name = "t\nwatch', "not valid TOML"),
])
def test_bad_pipeline_is_one_clear_error(tmp_path: Path, text: str, needle: str) -> None:
    from shardckpt.cli.main import app

    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as e:
        load_pipeline(str(path))
    assert str(path) in str(e.value) and needle in str(e.value)
    r = CliRunner().invoke(app, ["watch", str(path), "--once"])
    lines = r.stderr.strip().splitlines()
    assert r.exit_code == 2 and len(lines) == 1 and needle in lines[0], r.stderr


def test_relative_locations_follow_the_pipeline_file(tmp_path: Path) -> None:
    p = parse_pipeline({"name": "t", "watch": "run", "steps": [{"kind": "copy", "dst": "s3://b/{name}"}]},
                       "x.toml", str(tmp_path))
    assert p.watch == p.state == str(tmp_path / "run")
    assert p.steps[0].dst_for(7, "step-00000007") == "s3://b/step-00000007"


def test_cli_once_status_and_json(tmp_path: Path) -> None:
    from shardckpt.cli.main import app

    path = make_run(tmp_path, (100,))
    damage(tmp_path / "run" / "step-00000100")
    synthesize(str(tmp_path / "run" / "step-00000200"), TINY_PARAMS, 2, step=200)
    r = CliRunner().invoke(app, ["watch", str(path), "--once", "-q"])
    assert r.exit_code == 1 and "4 step(s) done, 1 dead-lettered" in r.stdout, r.output
    r = CliRunner().invoke(app, ["watch", str(path), "--status"])
    assert r.exit_code == 0
    assert "1-verify         dead" in r.stdout and "CRC32C" in r.stdout and "2-reshard        done" in r.stdout
    r = CliRunner().invoke(app, ["watch", str(path), "--status", "--json"])
    doc = json.loads(r.stdout)
    assert doc["totals"]["done"] == 4 and doc["totals"]["dead"] == 1 and doc["totals"]["blocked"] == 3
    r = CliRunner().invoke(app, ["watch", str(path), "--json"])
    assert r.exit_code == 2 and r.stderr.strip() == "error: --json goes with --status"


def test_retain_keeps_the_newest_and_spares_unsettled(tmp_path: Path) -> None:
    path = make_run(tmp_path, (100, 200, 300), extra='[[steps]]\nkind = "retain"\nkeep = 1\n')
    Watcher(load_pipeline(str(path))).run(once=True)
    assert sorted(os.listdir(tmp_path / "run")) == ["step-00000300"]
    for s in (100, 200, 300):
        assert "5-retain.done" in records(tmp_path, f"step-{s:08d}")


def test_watcher_does_not_import_torch(tmp_path: Path) -> None:
    path = make_run(tmp_path, (100,))
    code = textwrap.dedent(f"""
        import sys
        from shardckpt.cli.main import app
        try:
            app(["watch", {str(path)!r}, "--once", "-q"])
        except SystemExit as e:
            assert not e.code, e.code
        assert "torch" not in sys.modules, "torch was imported"
        print("ok")
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr
    assert sorted(records(tmp_path, "step-00000100")) == [f"{k}.done" for k in KEYS]


def test_retain_thins_past_the_optimizer_window(tmp_path: Path) -> None:
    from shardckpt.checkpoint.reader import read_manifest
    from shardckpt.checkpoint.thin import optimizer_kinds
    from shardckpt.checkpoint.verify import verify
    from shardckpt.storage import Storage

    path = make_run(tmp_path, (100, 200, 300),
                    extra='[[steps]]\nkind = "retain"\nkeep = 2\nkeep_optimizer_last = 1\n')
    Watcher(load_pipeline(str(path))).run(once=True)
    assert sorted(os.listdir(tmp_path / "run")) == ["step-00000200", "step-00000300"]
    done = records(tmp_path, "step-00000300")["5-retain.done"]
    assert done["removed"] == ["step-00000100"] and done["thinned"] == ["step-00000200"]
    kinds = {s: optimizer_kinds(read_manifest(Storage(str(tmp_path / "run" / s))))
             for s in ("step-00000200", "step-00000300")}
    assert kinds == {"step-00000200": [], "step-00000300": ["exp_avg", "exp_avg_sq"]}
    assert not verify(Storage(str(tmp_path / "run" / "step-00000200"))).problems
