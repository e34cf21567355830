"""`shardckpt demo`'s directory policy (:func:`shardckpt.demo.demo_workdir`), on its own: a temp
directory the demo made is removed at the end, a --workdir the user named is kept, --keep and
--no-keep override either, and the policy holds when the demo fails. The demo itself runs in
integration/test_demo.py."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

from shardckpt.demo import demo_workdir
from shardckpt.errors import ConfigError


def fill(path: str) -> None:
    os.makedirs(os.path.join(path, "run-2", "step-00000002"))
    Path(path, "run-2", "step-00000002", "manifest.json").write_text("{}")
    Path(path, "hf.json").write_text("{}")


@pytest.fixture(autouse=True)
def own_tmpdir(tmp_path: Path, monkeypatch):
    """Temporary directories the policy makes go below this test's own."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))


def test_the_temp_dir_it_made_is_removed(tmp_path: Path) -> None:
    said: list[str] = []
    with demo_workdir(None, say=said.append) as wd:
        assert Path(wd.path).parent == tmp_path and os.path.isdir(wd.path)
        fill(wd.path)
    assert not os.path.exists(wd.path) and not wd.kept
    assert wd.note == f"removed {wd.path} (--keep keeps them)"
    assert said == []  # a summary carries the note when the demo succeeds


def test_keep_keeps_the_temp_dir_and_says_how_to_remove_it() -> None:
    with demo_workdir(None, keep=True) as wd:
        fill(wd.path)
    assert os.path.isfile(os.path.join(wd.path, "hf.json")) and wd.kept
    assert wd.note == f"files kept in {wd.path} (remove them with: rm -rf {wd.path})"


def test_a_named_workdir_is_kept_and_no_keep_removes_only_what_the_demo_made(tmp_path: Path) -> None:
    new = tmp_path / "new"
    with demo_workdir(str(new)) as wd:
        assert wd.created
        fill(wd.path)
    assert wd.kept and (new / "hf.json").exists()

    fresh = tmp_path / "fresh"
    with demo_workdir(str(fresh), keep=False) as wd:
        fill(wd.path)
    assert not fresh.exists() and wd.note == f"removed {fresh} (--keep keeps them)"

    empty = tmp_path / "empty"
    empty.mkdir()
    with demo_workdir(str(empty), keep=False) as wd:
        assert not wd.created
        fill(wd.path)
    assert empty.is_dir() and os.listdir(empty) == []  # the user's directory stays, emptied
    assert wd.note == f"removed the files in {empty} (--keep keeps them)"


def test_the_policy_holds_when_the_demo_fails_and_says_so() -> None:
    said: list[str] = []
    with pytest.raises(RuntimeError, match="phase failed"):
        with demo_workdir(None, say=said.append) as wd:
            fill(wd.path)
            raise RuntimeError("phase failed")
    assert not os.path.exists(wd.path)
    assert said == [f"removed {wd.path} (--keep keeps them)"]


def test_a_workdir_that_is_not_empty_or_not_a_directory_is_refused(tmp_path: Path) -> None:
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("occupied")
    with pytest.raises(ConfigError, match="not empty"):
        with demo_workdir(str(tmp_path / "full"), keep=False):
            pass
    assert (tmp_path / "full" / "x").read_text() == "occupied"
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match="not a directory"):
        with demo_workdir(str(tmp_path / "file")):
            pass
