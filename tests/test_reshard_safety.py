"""reshard's destination: never the source by another name, a damaged checkpoint can be replaced,
no debris after failures or reruns, one winner when two runs race, and work bounded by the data."""

from __future__ import annotations

import os
import shutil
import threading
import time

import pytest
from typer.testing import CliRunner

from shardckpt.checkpoint.reader import CheckpointReader

from shardckpt.checkpoint.verify import verify

from shardckpt.checkpoint.writer import CheckpointWriter, new_save_id
from shardckpt.cli.common import parse_bytes
from shardckpt.cli.main import app
from shardckpt.tools.clean import SAVE_ID
from shardckpt.errors import CommitConflictError, ConfigError, IntegrityError
from shardckpt.storage.lease import LEASE_PREFIX
from shardckpt.format.manifest import MANIFEST_NAME
from shardckpt.tools.reshard import MIN_BUFFER, reshard
from shardckpt.storage.local import LocalBackend
from shardckpt.tools.synth import synthesize

PARAMS = 20_000


@pytest.fixture
def src(tmp_path):
    d = tmp_path / "src"
    synthesize(str(d), PARAMS, ranks=2, units=1)
    return d


def snapshot(d) -> dict[str, int]:
    return {os.path.relpath(os.path.join(r, f), d): os.path.getsize(os.path.join(r, f))
            for r, _, fs in os.walk(d) for f in fs}


def checks_out(d) -> None:
    result = verify(str(d))
    assert result.ok, result.problems


# ----------------------------------------------------------------- the source by another name


@pytest.mark.parametrize("how", ["dot", "symlink", "dotdot"])
def test_destination_that_is_the_source_is_refused(tmp_path, src, how):
    if how == "dot":
        dst = f"{src}/."
    elif how == "symlink":
        os.symlink(src, tmp_path / "link")
        dst = str(tmp_path / "link")
    else:
        dst = f"{tmp_path}/elsewhere/../src"
    before = snapshot(src)
    with pytest.raises(ConfigError, match="is the source"):
        reshard(str(src), dst, to=3, overwrite=True)
    assert snapshot(src) == before
    checks_out(src)


def test_destination_inside_the_source_is_refused(src):
    before = snapshot(src)
    with pytest.raises(ConfigError, match="inside the source"):
        reshard(str(src), f"{src}/sub", to=3)
    assert snapshot(src) == before


def test_source_inside_an_overwritten_destination_is_refused(tmp_path, src):
    outer = tmp_path / "outer"
    reshard(str(src), str(outer), to=3)
    inner = outer / "inner"
    shutil.copytree(src, inner)
    with pytest.raises(ConfigError, match="inside the destination"):
        reshard(str(inner), str(outer), to=1, overwrite=True)
    checks_out(inner)


def test_cli_refuses_the_source_by_another_name(src):
    res = CliRunner().invoke(app, ["reshard", str(src), f"{src}/.", "--to", "3", "--overwrite"])
    assert res.exit_code == 2 and "is the source" in res.output
    checks_out(src)


# ----------------------------------------------------------------- a damaged checkpoint is replaced


def test_overwrite_replaces_a_checkpoint_whose_manifest_is_corrupt(tmp_path, src):
    dst = tmp_path / "dst"
    reshard(str(src), str(dst), to=3)
    (dst / MANIFEST_NAME).write_bytes(b'{"format": "shardckpt", "vers')
    with pytest.raises(ConfigError, match="--overwrite"):
        reshard(str(src), str(dst), to=1)
    r = reshard(str(src), str(dst), to=1, overwrite=True)
    assert CheckpointReader(str(dst)).manifest.save_id == r.manifest.save_id
    assert sorted(os.listdir(dst)) == sorted([MANIFEST_NAME, r.manifest.save_id])
    checks_out(dst)


# ----------------------------------------------------------------- debris


def test_failed_reshard_removes_its_own_save_directory(tmp_path):
    src = tmp_path / "src"
    m = synthesize(str(src), 300_000, ranks=4, units=2)
    last = m.shard_file(3)
    with open(src / last.path, "r+b") as f:
        f.seek(last.size - 100)
        b = f.read(1)
        f.seek(last.size - 100)
        f.write(bytes([b[0] ^ 0x40]))
    dst = tmp_path / "dst"
    with pytest.raises(IntegrityError, match="CRC32C"):
        reshard(str(src), str(dst), to=2)
    assert not dst.exists() or os.listdir(dst) == []


def test_failure_that_cannot_clean_up_says_what_clean_removes(tmp_path, src, monkeypatch):
    def fail(self, files, replacing=None):
        raise CommitConflictError("boom")
    monkeypatch.setattr(CheckpointWriter, "commit", fail)
    monkeypatch.setattr(CheckpointWriter, "discard", lambda self: False)
    dst = tmp_path / "dst"
    with pytest.raises(CommitConflictError, match=r"boom; `shardckpt clean .*dst` removes the "
                                                  r"unfinished \d{8}T\d{6}Z-[0-9a-f]{8}/"):
        reshard(str(src), str(dst), to=3)


def test_overwrite_removes_earlier_attempts_but_not_live_ones(tmp_path, src):
    dst = tmp_path / "dst"
    first = reshard(str(src), str(dst), to=3).manifest.save_id
    killed_old, killed_new, live = "20200101T000000Z-0badc0de", new_save_id(), new_save_id()
    for n in (killed_old, killed_new, live):
        shutil.copytree(dst / first, dst / n)
    (dst / live / f"{LEASE_PREFIX}0000abcd").write_text(f'{{"expires": {time.time() + 3600}}}')
    r = reshard(str(src), str(dst), to=1, overwrite=True)
    assert sorted(os.listdir(dst)) == sorted([MANIFEST_NAME, r.manifest.save_id, live])
    checks_out(dst)


def test_overwrite_of_a_never_committed_destination_removes_its_debris(tmp_path, src):
    dst = tmp_path / "dst"
    first = reshard(str(src), str(dst), to=3).manifest.save_id
    os.remove(dst / MANIFEST_NAME)  # as if killed before the commit
    r = reshard(str(src), str(dst), to=3, overwrite=True)
    assert sorted(os.listdir(dst)) == sorted([MANIFEST_NAME, r.manifest.save_id])
    assert first != r.manifest.save_id
    checks_out(dst)


# ----------------------------------------------------------------- two runs race


def race(src, dst) -> dict[str, object]:
    """Run two `reshard --overwrite` into ``dst`` on threads "A" (to 1) and "B" (to 3)."""
    out: dict[str, object] = {}

    def run(name, to):
        try:
            out[name] = reshard(str(src), str(dst), to=to, overwrite=True)
        except BaseException as e:  # noqa: BLE001 - the test inspects it
            out[name] = e
    threads = [threading.Thread(target=run, args=("A", 1), name="A"),
               threading.Thread(target=run, args=("B", 3), name="B")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return out


def test_race_the_second_commit_sees_the_first_and_replaces_nothing(tmp_path, src, monkeypatch):
    dst = tmp_path / "dst"
    reshard(str(src), str(dst), to=2)
    both, a_done = threading.Barrier(2, timeout=60), threading.Event()
    real = CheckpointWriter.commit

    def commit(self, files, replacing=None):
        both.wait()  # both have written every shard
        if threading.current_thread().name == "A":
            try:
                return real(self, files, replacing)
            finally:
                a_done.set()
        assert a_done.wait(60)
        return real(self, files, replacing)
    monkeypatch.setattr(CheckpointWriter, "commit", commit)
    out = race(src, dst)
    a, b = out["A"], out["B"]
    assert not isinstance(a, BaseException), a
    assert isinstance(b, CommitConflictError) and "nothing was replaced" in str(b)
    assert f"save {a.manifest.save_id}" in str(b)
    assert CheckpointReader(str(dst)).manifest.save_id == a.manifest.save_id
    assert sorted(os.listdir(dst)) == sorted([MANIFEST_NAME, a.manifest.save_id])
    checks_out(dst)


def test_race_both_replace_and_the_one_replaced_fails(tmp_path, src, monkeypatch):
    dst = tmp_path / "dst"
    reshard(str(src), str(dst), to=2)
    both = threading.Barrier(2, timeout=60)
    a_put, b_put = threading.Event(), threading.Event()
    real = LocalBackend.put  # what the local replace_if calls once it has checked

    def put(self, path, url, data):
        if not path.endswith(f"/{MANIFEST_NAME}"):
            return real(self, path, url, data)
        both.wait()  # both checked that the manifest is the one they began with
        if threading.current_thread().name == "A":
            real(self, path, url, data)
            a_put.set()
            assert b_put.wait(60)  # A reads back after B replaced it
        else:
            assert a_put.wait(60)
            real(self, path, url, data)
            b_put.set()
    monkeypatch.setattr(LocalBackend, "put", put)
    out = race(src, dst)
    a, b = out["A"], out["B"]
    assert not isinstance(b, BaseException), b
    assert isinstance(a, CommitConflictError), a
    assert f"replaced by save {b.manifest.save_id}" in str(a)
    assert CheckpointReader(str(dst)).manifest.save_id == b.manifest.save_id
    assert sorted(os.listdir(dst)) == sorted([MANIFEST_NAME, b.manifest.save_id])
    checks_out(dst)


def test_cli_says_which_save_committed(tmp_path, src):
    res = CliRunner().invoke(app, ["reshard", str(src), str(tmp_path / "d"), "--to", "3"])
    assert res.exit_code == 0, res.output
    sid = CheckpointReader(str(tmp_path / "d")).manifest.save_id
    assert f"committed save {sid}" in res.output


# ----------------------------------------------------------------- work bounded by the data


def test_shard_degree_beyond_the_data_is_refused_with_the_figure(tmp_path, src):
    m = CheckpointReader(str(src)).manifest
    largest = max(g.numel for c in m.components.values() for g in c.layout.groups)
    limit = -(-largest // 16)
    with pytest.raises(ConfigError, match=rf"{largest} elements.*choose --to <= {limit}\b"):
        reshard(str(src), str(tmp_path / "x"), to=limit + 1)
    with pytest.raises(ConfigError, match=rf"choose --to <= {2 * limit}\b"):
        reshard(str(src), str(tmp_path / "x"), to=2 * limit + 2, replicate=2)
    assert not (tmp_path / "x").exists()


def test_buffer_below_the_minimum_is_refused(tmp_path, src):
    with pytest.raises(ConfigError, match=rf"--buffer {MIN_BUFFER - 1} bytes.*minimum"):
        reshard(str(src), str(tmp_path / "x"), to=3, buffer_bytes=MIN_BUFFER - 1)
    runner = CliRunner()
    for text in ("1", "64B", "64KB"):  # 64B is 64 bytes, not 64e9
        res = runner.invoke(app, ["reshard", str(src), str(tmp_path / "x"), "--to", "3", "--buffer", text])
        assert res.exit_code == 2 and "minimum" in res.output, (text, res.output)
    assert not (tmp_path / "x").exists()
    res = runner.invoke(app, ["reshard", str(src), str(tmp_path / "y"), "--to", "3", "--buffer", "64KiB"])
    assert res.exit_code == 0, res.output


def test_parse_bytes():
    assert [parse_bytes(t, "--buffer") for t in ("64", "64B", "64b", "2KB", "2KiB", "1.5MB", "1MiB",
                                                 "2GB", "1GiB")] == [
        64, 64, 64, 2000, 2048, 1_500_000, 1 << 20, 2 * 10**9, 1 << 30]
    res = CliRunner().invoke(app, ["reshard", "a", "b", "--to", "1", "--buffer", "64 parsecs"])
    assert res.exit_code == 2 and "64 parsecs" in res.output


def test_save_ids_are_what_clean_recognises():
    assert SAVE_ID.match(new_save_id())
