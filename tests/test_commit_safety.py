"""The commit never names a file that is not there, syncs its directories first, and writer leases
keep `clean` away from saves in progress; writes refuse a destination without the space for them."""

from __future__ import annotations

import json
import os
import threading
import time
import uuid
from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

from shardckpt.checkpoint.verify import verify

from shardckpt.checkpoint.writer import CheckpointWriter, new_save_id
from shardckpt.cli.main import app
from shardckpt.tools.clean import clean
from shardckpt.errors import InsufficientSpaceError, IncompleteCheckpointError
from shardckpt.storage.lease import LEASE_PREFIX, Lease, live_until
from shardckpt.format.manifest import MANIFEST_NAME
from shardckpt.tools.reshard import reshard
from shardckpt.storage import Storage
from shardckpt.tools.synth import shard_producer, synth_spec, synthesize

PARAMS = 20_000


@pytest.fixture(params=["local", "memory"])
def storage(request, tmp_path):
    if request.param == "local":
        yield Storage(str(tmp_path / "ck"))
        return
    url = f"memory://commit-{uuid.uuid4().hex}"
    yield Storage(url)
    Storage(url).rm("", recursive=True)


def write_uncommitted(storage: Storage) -> tuple[CheckpointWriter, list]:
    spec = synth_spec(PARAMS, ranks=2, units=1)
    w = CheckpointWriter(storage, spec)
    layout = spec.components["model"].layout
    entries = [w.write_shard(s, shard_producer(layout, 0, s)) for s in range(2)]
    entries.append(w.write_buffers(lambda slot: iter([bytes(slot.end - slot.begin)])))
    return w, entries


# ------------------------------------------------------------------ every named file is there


def test_commit_with_a_missing_file_raises_and_commits_nothing(storage):
    w, entries = write_uncommitted(storage)
    storage.rm(entries[1].path)
    with pytest.raises(IncompleteCheckpointError, match=r"shard-00001-of-00002\.safetensors \(missing\)"):
        w.commit(entries)
    assert not storage.exists(MANIFEST_NAME)


def test_commit_with_a_truncated_file_raises_and_commits_nothing(storage):
    w, entries = write_uncommitted(storage)
    data = storage.read(entries[0].path)
    storage.put(entries[0].path, data[:-5])
    with pytest.raises(IncompleteCheckpointError, match=rf"shard-00000-of-00002\.safetensors "
                                                        rf"\({entries[0].size - 5} bytes, written as"):
        w.commit(entries)
    assert not storage.exists(MANIFEST_NAME)


def test_commit_lists_each_directory_once(storage):
    w, entries = write_uncommitted(storage)
    calls = []
    real = storage.list_sizes
    storage.list_sizes = lambda rel="": calls.append(rel) or real(rel)  # type: ignore[method-assign]
    w.commit(entries)
    assert calls == [w.save_id]


# ------------------------------------------------------------------ directories are durable first


def test_save_directory_and_its_parent_are_synced_before_the_manifest_exists(tmp_path, monkeypatch):
    from shardckpt.storage import local

    ck = tmp_path / "run" / "ck"
    seen = []
    real = local._fsync_dir

    def record(path):
        shards = [f for _, _, fs in os.walk(ck) for f in fs if f.startswith("shard-")]
        seen.append((os.path.realpath(path), (ck / MANIFEST_NAME).exists(), len(shards)))
        real(path)
    monkeypatch.setattr(local, "_fsync_dir", record)
    m = synthesize(str(ck), PARAMS, ranks=2, units=1)
    before = {p for p, committed, shards in seen if not committed and shards == 2}
    assert os.path.realpath(ck / m.save_id) in before
    assert os.path.realpath(ck) in before


# ------------------------------------------------------------------ leases


def test_lease_is_held_renewed_and_removed(tmp_path, monkeypatch):
    s = Storage(str(tmp_path / "ck"))
    writes = []
    renewed = threading.Event()
    real = Storage.put

    def put(self, rel, data):
        real(self, rel, data)
        if LEASE_PREFIX in rel:
            writes.append(json.loads(data)["expires"])
            if len(writes) == 2:
                renewed.set()
    monkeypatch.setattr(Storage, "put", put)
    sid = new_save_id()
    with Lease(s, sid, ttl_s=0.3) as lease:
        assert live_until(s, sid) is not None
        assert renewed.wait(60)
        assert writes[1] > writes[0]
    assert not s.exists(lease.rel)
    assert live_until(s, sid) is None


def write_lease(root, save_id: str, expires: float) -> None:
    os.makedirs(root / save_id, exist_ok=True)
    (root / save_id / f"{LEASE_PREFIX}0000abcd").write_text(json.dumps({"expires": expires}))


def test_clean_keeps_leased_saves_whatever_their_age_and_removes_expired_ones(tmp_path):
    run = tmp_path / "run"
    good = synthesize(str(run / "ck"), PARAMS, ranks=2, units=1)
    old_live, old_dead = "20200101T000000Z-0000aaaa", "20200101T000000Z-0000bbbb"
    new_dead = new_save_id()
    write_lease(run / "ck", old_live, time.time() + 3600)
    write_lease(run / "ck", old_dead, time.time() - 1)
    write_lease(run / "ck", new_dead, time.time() - 1)
    r = clean(str(run), min_age_s=0)
    assert r.kept_live == [f"ck/{old_live}"]
    assert sorted(r.debris) == sorted([f"ck/{old_dead}", f"ck/{new_dead}"])
    assert sorted(os.listdir(run / "ck")) == sorted([MANIFEST_NAME, good.save_id, old_live])
    res = CliRunner().invoke(app, ["clean", str(run), "--min-age", "0"])
    assert res.exit_code == 0 and f"kept ck/{old_live} (its writer holds a lease" in res.output


def test_lease_of_a_writer_gone_from_this_host_has_ended(tmp_path):
    import subprocess
    import sys

    from shardckpt.storage.lease import whoami

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    s = Storage(str(tmp_path))
    sid = new_save_id()
    for pid, live in ((int(gone.stdout), False), (os.getpid(), True)):
        s.put(f"{sid}/{LEASE_PREFIX}0000abcd", json.dumps(
            {"expires": time.time() + 3600, **whoami(), "pid": pid}).encode())
        assert (live_until(s, sid) is not None) == live
    s.put(f"{sid}/{LEASE_PREFIX}0000abcd", json.dumps(
        {"expires": time.time() + 3600, **whoami(), "host": "elsewhere", "pid": int(gone.stdout)}).encode())
    assert live_until(s, sid) is not None  # another host's writer: only its expiry counts


def test_clean_during_a_paused_reshard_deletes_nothing_of_it(tmp_path, monkeypatch):
    src, dst = str(tmp_path / "src"), tmp_path / "dst"
    synthesize(src, PARAMS, ranks=2, units=1)
    paused, resume = threading.Event(), threading.Event()
    real = CheckpointWriter.write_shard

    def write_shard(self, shard, produce):
        if shard != 0:  # the files written beside it (several at once) wait before writing
            assert resume.wait(120)
            return real(self, shard, produce)
        entry = real(self, shard, produce)
        paused.set()
        assert resume.wait(120)
        return entry
    monkeypatch.setattr(CheckpointWriter, "write_shard", write_shard)
    out: dict = {}

    def run():
        try:
            out["result"] = reshard(src, str(dst), to=3)
        except BaseException as e:  # noqa: BLE001 - reported below
            out["error"] = e
    t = threading.Thread(target=run)
    t.start()
    try:
        assert paused.wait(120)
        (save_id,) = os.listdir(dst)
        before = sorted(os.listdir(dst / save_id))
        res = CliRunner().invoke(app, ["clean", str(dst), "--min-age", "0", "--json"])
        assert res.exit_code == 0, res.output
        doc = json.loads(res.output)
        assert doc["debris"] == [] and doc["kept_live"] == [save_id]
        assert sorted(os.listdir(dst / save_id)) == before
    finally:
        resume.set()
        t.join(120)
    assert "error" not in out, out.get("error")
    assert out["result"].manifest.save_id == save_id
    result = verify(str(dst))
    assert result, result.problems
    assert not [n for n in os.listdir(dst / save_id) if n.startswith(LEASE_PREFIX)]


def test_reshard_whose_files_vanish_before_the_commit_commits_nothing(tmp_path, monkeypatch):
    """Without its lease (as for a writer that holds none), a file removed under a running
    reshard makes the commit fail, naming the file, instead of committing a manifest naming it."""
    from contextlib import nullcontext

    src, dst = str(tmp_path / "src"), tmp_path / "dst"
    synthesize(src, PARAMS, ranks=2, units=1)
    monkeypatch.setattr(CheckpointWriter, "lease", lambda self, *a, **k: nullcontext())
    real = CheckpointWriter.write_shard

    def write_shard(self, shard, produce):
        entry = real(self, shard, produce)
        if shard == 2:
            os.remove(dst / self.save_id / "shard-00000-of-00003.safetensors")
        return entry
    monkeypatch.setattr(CheckpointWriter, "write_shard", write_shard)
    res = CliRunner().invoke(app, ["reshard", src, str(dst), "--to", "3"])
    assert res.exit_code == 1, res.output
    assert "not committed" in res.output and "shard-00000-of-00003.safetensors (missing)" in res.output
    assert not (dst / MANIFEST_NAME).exists()
    assert os.listdir(dst) == []  # the failed attempt removed its own directory


# ------------------------------------------------------------------ free space


def tiny_disk(monkeypatch, free_bytes: int) -> list[str]:
    probed: list[str] = []

    def statvfs(path):
        probed.append(str(path))
        return SimpleNamespace(f_bavail=free_bytes // 4096, f_frsize=4096)
    monkeypatch.setattr(os, "statvfs", statvfs)
    return probed


def test_synth_refuses_a_destination_without_room(tmp_path, monkeypatch):
    dst = tmp_path / "a" / "b"
    probed = tiny_disk(monkeypatch, 1 << 20)
    with pytest.raises(InsufficientSpaceError) as ei:
        synthesize(str(dst), 2_000_000, ranks=2, units=1)
    msg = str(ei.value)
    assert "synth" in msg and str(dst) in msg and "needs" in msg and "1048576 bytes" in msg
    assert probed == [str(tmp_path)]  # the nearest existing directory
    assert not dst.exists()


def test_reshard_refuses_a_destination_without_room(tmp_path, monkeypatch):
    src, dst = str(tmp_path / "src"), tmp_path / "dst"
    synthesize(src, 2_000_000, ranks=2, units=1)
    tiny_disk(monkeypatch, 1 << 20)
    res = CliRunner().invoke(app, ["reshard", src, str(dst), "--to", "3"])
    assert res.exit_code == 1 and "needs" in res.output and "free" in res.output, res.output
    assert not dst.exists()


def test_free_space_is_not_checked_on_object_stores(monkeypatch):
    tiny_disk(monkeypatch, 0)
    Storage(f"memory://free-{uuid.uuid4().hex}").ensure_free_space("", 1 << 50, "synth")
