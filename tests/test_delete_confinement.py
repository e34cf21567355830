"""Destructive commands (clean, retention, reshard --overwrite) never delete outside their prefix.

Whoever writes inside a run or checkpoint directory can plant symbolic links and manifests; the
directory the operator names is trusted. Nothing outside it is removed, a link below it is never
followed (nor removed: it is reported, or the command refuses before writing), and a checkpoint
that verifies never loses its data to clean.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from pathlib import Path

import pytest

from shardckpt.checkpoint.reader import read_manifest
from shardckpt.checkpoint.run_dir import STEP_DIR, CheckpointManager
from shardckpt.checkpoint.verify import verify
from shardckpt.errors import ConfigError, ManifestError, StorageError
from shardckpt.format.manifest import MANIFEST_NAME, SAFE_NAME, to_json
from shardckpt.storage import Storage
from shardckpt.tools.clean import SAVE_ID, TMP_MANIFEST, clean
from shardckpt.tools.reshard import reshard
from shardckpt.watch.config import StepSpec, parse_pipeline
from shardckpt.watch.steps import StepContext, run_retain
from testing.ckpts import make_ckpt, make_run_dir
from testing.cli import cli, ok, one_line_error

OLD_ID = "20200101T000000Z-deadbeef"


def tree(d: Path) -> dict[str, bytes]:
    """Every file below ``d`` (links not followed) and its bytes."""
    out = {}
    for r, _, fs in os.walk(d):
        for f in fs:
            p = os.path.join(r, f)
            out[os.path.relpath(p, d)] = b"<link>" if os.path.islink(p) else Path(p).read_bytes()
    return out


def checks_out(d: Path | str) -> None:
    result = verify(str(d))
    assert result.ok, result.problems


def relink(d: Path, outside: Path) -> None:
    """Move directory ``d`` to ``outside`` and leave a symbolic link to it in its place."""
    outside.parent.mkdir(parents=True, exist_ok=True)
    shutil.move(str(d), str(outside))
    os.symlink(outside, d)


# ------------------------------------------------------------------------------------ clean


def test_clean_does_not_follow_a_linked_directory(tmp_path: Path) -> None:
    """The reported reproduction: a link in the run to a directory holding a save-id-named
    directory; clean with its default --min-age used to empty it."""
    run, elsewhere = tmp_path / "run", tmp_path / "elsewhere"
    run.mkdir()
    (elsewhere / OLD_ID).mkdir(parents=True)
    (elsewhere / OLD_ID / "w").write_text("d")
    os.symlink("../elsewhere", run / "link")
    r = ok(cli("clean", str(run)))
    assert tree(elsewhere) == {f"{OLD_ID}/w": b"d"}
    assert os.path.islink(run / "link")
    assert "kept link" in r.stdout and str(elsewhere) in r.stdout


def test_clean_leaves_a_linked_save_directory_and_reports_it(tmp_path: Path) -> None:
    """A save-id-named entry that is a link is neither followed nor removed: the operator is
    told, and decides."""
    run, target = tmp_path / "run", tmp_path / "theirs"
    run.mkdir()
    target.mkdir()
    (target / "w").write_text("d")
    os.symlink(target, run / OLD_ID)
    r = clean(str(run), min_age_s=0)
    assert r.debris == [] and r.links == [(OLD_ID, str(target))]
    assert os.path.islink(run / OLD_ID) and tree(target) == {"w": b"d"}


def test_clean_keeps_data_of_a_manifest_whose_save_id_ends_in_a_newline(tmp_path: Path) -> None:
    """A manifest naming its own directory plus a newline used to pass the name check (``$``
    matches before a final newline): verify accepted it, and clean removed its data as debris."""
    path, m = make_ckpt(tmp_path)
    files = tree(Path(path) / m.save_id)
    Path(path, MANIFEST_NAME).write_bytes(to_json(dataclasses.replace(m, save_id=m.save_id + "\n")))
    clean(path, min_age_s=0)
    assert tree(Path(path) / m.save_id) == files
    with pytest.raises(ManifestError):  # refused now: it names no directory that exists
        read_manifest(Storage(path))


def test_clean_keeps_the_directory_the_files_live_in(tmp_path: Path) -> None:
    """A manifest whose save_id is another well-formed id than the directory its files lie in
    verifies; clean must judge what is live by the files, not by the save_id field."""
    path, m = make_ckpt(tmp_path)
    Path(path, MANIFEST_NAME).write_bytes(to_json(dataclasses.replace(m, save_id=OLD_ID)))
    checks_out(path)
    r = clean(path, min_age_s=0)
    assert r.debris == [] and r.committed == ["."]
    checks_out(path)


# ------------------------------------------------------------------------------- retention


def _retain(run: Path, step: int, keep: int = 1) -> dict:
    ckpt = Storage(str(run / f"step-{step:08d}"))
    ctx = StepContext(StepSpec(1, "retain", keep=keep), ckpt, read_manifest(ckpt),
                      f"step-{step:08d}", step, Storage(str(run)), {}, lambda name: True)
    return run_retain(ctx)


def test_watch_retain_does_not_follow_a_linked_step_directory(tmp_path: Path) -> None:
    run = make_run_dir(tmp_path / "run", (100, 200, 300))
    outside = tmp_path / "archive" / "step-00000100"
    relink(run / "step-00000100", outside)
    before = tree(outside)
    facts = _retain(run, 300)
    assert tree(outside) == before  # the manifest outside is still there
    checks_out(outside)
    assert os.path.islink(run / "step-00000100")
    assert facts["removed"] == ["step-00000200"]
    assert facts["links"] == [{"path": str(run / "step-00000100"), "target": str(outside)}]


def test_manager_retention_does_not_follow_a_linked_step_directory(tmp_path: Path) -> None:
    run = make_run_dir(tmp_path / "run", (100, 200, 300))
    outside = tmp_path / "archive" / "step-00000100"
    relink(run / "step-00000100", outside)
    before = tree(outside)
    removed = CheckpointManager(str(run), keep_last=1).apply_retention()
    assert tree(outside) == before
    assert os.path.islink(run / "step-00000100")
    assert removed == [f"{run}/step-00000200"]


# ------------------------------------------------------------------------ reshard --overwrite


def _dst_with_linked_save(tmp_path: Path) -> tuple[str, Path, Path, dict[str, bytes]]:
    src, _ = make_ckpt(tmp_path, "src")
    dst = tmp_path / "dst"
    old = reshard(src, str(dst), 1).manifest
    outside = tmp_path / "theirs" / old.save_id
    relink(dst / old.save_id, outside)
    return src, dst, outside, tree(outside)


def test_reshard_overwrite_refuses_a_linked_save_directory(tmp_path: Path) -> None:
    """DST's old save directory is a link: --overwrite used to delete the files it points to.
    It now refuses before writing anything, naming the link and its target."""
    src, dst, outside, before = _dst_with_linked_save(tmp_path)
    manifest = (dst / MANIFEST_NAME).read_bytes()
    r = cli("reshard", src, str(dst), "--to", "2", "--overwrite")
    one_line_error(r, str(dst / outside.name), str(outside), "symbolic link")
    assert tree(outside) == before
    assert (dst / MANIFEST_NAME).read_bytes() == manifest  # the previous checkpoint stands
    assert sorted(os.listdir(dst)) == sorted([MANIFEST_NAME, outside.name])
    checks_out(dst)


def test_reshard_overwrite_refuses_a_stray_linked_save_directory(tmp_path: Path) -> None:
    """A save-id-named link in DST that the old manifest does not use: --overwrite would remove
    it as a stale save; it refuses instead of touching a link."""
    src, _ = make_ckpt(tmp_path, "src")
    dst = tmp_path / "dst"
    reshard(src, str(dst), 1)
    target = tmp_path / "theirs"
    target.mkdir()
    (target / "w").write_text("d")
    os.symlink(target, dst / OLD_ID)
    with pytest.raises(StorageError) as e:
        reshard(src, str(dst), 2, overwrite=True)
    assert type(e.value).__name__ == "LinkRefusedError"
    assert e.value.link == str(dst / OLD_ID) and e.value.target == str(target)
    assert os.path.islink(dst / OLD_ID) and tree(target) == {"w": b"d"}
    checks_out(dst)


# ------------------------------------------------------------------------------ the primitive


def test_remove_inside_never_follows_or_removes_a_link(tmp_path: Path) -> None:
    root, outside = tmp_path / "root", tmp_path / "outside"
    (outside / "d").mkdir(parents=True)
    (outside / "d" / "f").write_text("x")
    (root / "tree" / "sub").mkdir(parents=True)
    (root / "tree" / "sub" / "f").write_text("y")
    os.symlink(outside, root / "tree" / "sub" / "out")   # inside a tree being removed
    os.symlink(outside, root / "link")
    storage = Storage(str(root))
    for rel in ("link/d/f", "link/d", "link"):
        with pytest.raises(StorageError) as e:
            storage.remove_inside(rel, recursive=True)
        assert type(e.value).__name__ == "LinkRefusedError"
        assert e.value.link == f"{root}/link" and e.value.target == str(outside)
        assert str(outside) in str(e.value) and "\n" not in str(e.value)
    assert storage.first_link("link/d/f") == (f"{root}/link", str(outside))
    assert storage.first_link("tree/sub/f") is None
    assert storage.remove_inside("tree", recursive=True)      # its link is unlinked, not followed
    assert not storage.remove_inside("tree", recursive=True)  # gone already
    assert sorted(os.listdir(root)) == ["link"]
    assert tree(outside) == {"d/f": b"x"}


# --------------------------------------------------------------------------------- names


@pytest.mark.parametrize("pattern, name", [
    (SAVE_ID, OLD_ID), (TMP_MANIFEST, "manifest.json.tmp-0a1b"), (SAFE_NAME, "shard"),
    (STEP_DIR, "step-00000100"),
])
def test_names_are_checked_to_their_end(pattern, name: str) -> None:
    assert pattern.match(name)
    assert not pattern.match(name + "\n")


def test_pipeline_name_is_checked_to_its_end(tmp_path: Path) -> None:
    doc = {"name": "t", "watch": str(tmp_path), "steps": [{"kind": "verify"}]}
    assert parse_pipeline(doc).name == "t"
    with pytest.raises(ConfigError, match="name"):
        parse_pipeline({**doc, "name": "t\n"})
