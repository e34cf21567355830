"""clean: removes save directories no manifest names, never a committed checkpoint."""

from __future__ import annotations

import os
import shutil

from typer.testing import CliRunner

from shardckpt.checkpoint.verify import verify
from shardckpt.cli.main import app
from shardckpt.tools.clean import clean
from shardckpt.format.manifest import MANIFEST_NAME
from shardckpt.tools.synth import synthesize


def make_run(tmp_path):
    run = tmp_path / "run"
    good = synthesize(str(run / "step-00000001"), 20_000, ranks=2, units=1)
    # an uncommitted save: files but no manifest
    bad = synthesize(str(run / "step-00000002"), 20_000, ranks=2, units=1)
    os.remove(run / "step-00000002" / MANIFEST_NAME)
    # a failed second attempt inside the committed checkpoint
    stale = "20200101T000000Z-0badc0de"
    shutil.copytree(run / "step-00000001" / good.save_id, run / "step-00000001" / stale)
    return run, good, bad, stale


def test_clean_removes_debris_only(tmp_path):
    run, good, bad, stale = make_run(tmp_path)
    dry = clean(str(run), dry_run=True, min_age_s=0)
    assert sorted(dry.debris) == sorted([f"step-00000001/{stale}", f"step-00000002/{bad.save_id}"])
    assert os.path.exists(run / "step-00000001" / stale)  # dry run removed nothing
    r = clean(str(run), min_age_s=0)
    assert r.committed == ["step-00000001"]
    assert not os.path.exists(run / "step-00000001" / stale)
    assert not os.path.exists(run / "step-00000002" / bad.save_id)
    result = verify(str(run / "step-00000001"))
    assert result, result.problems


def test_min_age_protects_saves_in_progress(tmp_path):
    run, good, bad, stale = make_run(tmp_path)
    r = clean(str(run), min_age_s=3600)
    assert r.debris == [f"step-00000001/{stale}"]  # from 2020
    assert r.kept_young == [f"step-00000002/{bad.save_id}"]  # started seconds ago
    assert os.path.exists(run / "step-00000002" / bad.save_id)


def test_clean_cli_json(tmp_path):
    run, *_ = make_run(tmp_path)
    res = CliRunner().invoke(app, ["clean", str(run), "--min-age", "0", "--json"])
    assert res.exit_code == 0, res.output
    assert '"debris"' in res.output
