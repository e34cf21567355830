"""Checked reads: every reader compares each file's header with the manifest, verify's result is
false when anything fails, only regular files are opened, and the manifest is read once."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner, Result

from testing.ckpts import make_ckpt
from testing.cli import cli_process
from shardckpt.checkpoint.reader import CheckpointReader, read_manifest
from shardckpt.checkpoint.verify import verify
from shardckpt.cli.main import app
from shardckpt.tools.consolidate import consolidate
from shardckpt.tools.diff import diff
from shardckpt.errors import IntegrityError
from shardckpt.format.manifest import Manifest
from shardckpt.format.integrity import seal
from shardckpt.tools.reshard import reshard
from shardckpt.storage import Storage
from shardckpt.storage import backends as storage_backends

runner = CliRunner()


@pytest.fixture
def ckpt(tmp_path: Path) -> tuple[Path, Manifest]:
    path, m = make_ckpt(tmp_path)
    return Path(path), m


def edit_manifest(root: Path, edit: Any) -> None:
    """Edit the manifest consistently: its checksum recomputed, so only the files can tell."""
    doc = json.loads((root / "manifest.json").read_bytes())
    edit(doc)
    (root / "manifest.json").write_bytes(seal(doc))


def rename_kind(doc: dict[str, Any]) -> None:
    for g in doc["components"]["model"]["groups"]:
        for st in g["states"]:
            if st["kind"] == "exp_avg":
                st["kind"] = "dxp_avg"


def older_major(doc: dict[str, Any]) -> None:
    doc["version"] = "0.1"  # 0.x slot order: group by group


def one_error(r: Result, *needles: str) -> str:
    assert r.exit_code not in (0, None), r.output
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    for n in needles:
        assert n in lines[0], f"{n!r} not in {lines[0]!r}"
    return lines[0]


# ------------------------------------------------------------------------------ verify result


def test_verify_result_is_false_on_a_corrupted_checkpoint(ckpt: tuple[Path, Manifest]) -> None:
    root, m = ckpt
    good = verify(str(root))
    assert good and good.ok and good.manifest == m and good.problems == ()
    assert [r.path for r in good.reports] == [f.path for f in m.files]
    shard = root / m.shard_file(1).path
    data = bytearray(shard.read_bytes())
    data[-3] ^= 1
    shard.write_bytes(bytes(data))
    (root / m.shard_file(0).path).unlink()
    bad = verify(str(root))
    assert not bad and not bad.ok and bad.manifest == m
    assert len(bad.problems) == 2  # every problem, each naming its file
    assert any(m.shard_file(0).path in p and "missing" in p for p in bad.problems)
    assert any(m.shard_file(1).path in p and "CRC32C" in p for p in bad.problems)
    (root / "manifest.json").unlink()
    gone = verify(str(root))
    assert not gone and gone.manifest is None and "never committed" in gone.problems[0]


# ------------------------------------------------------------- header against the manifest


@pytest.mark.parametrize("edit", [rename_kind, older_major], ids=["kind renamed", "version 0.x"])
def test_every_reader_compares_headers_with_the_manifest(tmp_path: Path, ckpt: tuple[Path, Manifest],
                                                         edit: Any) -> None:
    root, m = ckpt
    original = tmp_path / "original"
    make_ckpt(tmp_path, "original")
    edit_manifest(root, edit)
    shard0 = m.shard_file(0).path
    reader = CheckpointReader(str(root))  # the manifest alone is valid
    with pytest.raises(IntegrityError, match=shard0):
        reader.read_state(0, m.components["model"].layout.groups[0].name, "master", 0, 1)
    with pytest.raises(IntegrityError, match=f"{shard0}.*header tensors differ from the manifest"):
        consolidate(str(root), str(tmp_path / "hf"), dtype="fp32", optimizer=True)
    with pytest.raises(IntegrityError, match=shard0):
        reshard(str(root), str(tmp_path / "r4"), 4)
    assert not (tmp_path / "r4" / "manifest.json").exists()
    with pytest.raises(IntegrityError, match=shard0):
        diff(str(original), str(root))
    result = verify(str(root))
    assert not result and any(shard0 in p and "differ from the manifest" in p for p in result.problems)
    # and through the command line: one line naming the file, a failing exit
    one_error(runner.invoke(app, ["consolidate", str(root), str(tmp_path / "hf2")]), shard0)
    one_error(runner.invoke(app, ["reshard", str(root), str(tmp_path / "r2"), "--to", "2"]), shard0)
    one_error(runner.invoke(app, ["diff", str(original), str(root)]), shard0)


def test_buffers_file_header_compared_too(tmp_path: Path, ckpt: tuple[Path, Manifest]) -> None:
    root, m = ckpt
    buffers = m.buffers_file()
    assert buffers is not None

    def rename_buffer(doc: dict[str, Any]) -> None:
        doc["components"]["model"]["buffers"][0]["fqn"] += "_renamed"

    edit_manifest(root, rename_buffer)
    with pytest.raises(IntegrityError, match=f"{buffers.path}.*_renamed"):
        consolidate(str(root), str(tmp_path / "hf"), dtype="fp32", keep_buffers=True)
    with pytest.raises(IntegrityError, match=buffers.path):
        reshard(str(root), str(tmp_path / "r4"), 4)


def test_header_mismatch_names_every_tensor(ckpt: tuple[Path, Manifest]) -> None:
    root, m = ckpt
    edit_manifest(root, rename_kind)
    reader = CheckpointReader(str(root))
    with pytest.raises(IntegrityError) as ei:
        reader.check_file(m.shard_file(1))
    msg = str(ei.value)
    groups = [g.name for g in m.components["model"].layout.groups if g.requires_grad]
    for g in groups:
        assert f"{g}.dxp_avg" in msg and f"{g}.exp_avg" in msg


def test_header_read_once_per_file(ckpt: tuple[Path, Manifest], monkeypatch: pytest.MonkeyPatch) -> None:
    root, m = ckpt
    reader = CheckpointReader(str(root))
    reads: list[tuple[str, int | None, int | None]] = []
    real = reader.storage.read
    monkeypatch.setattr(reader.storage, "read",
                        lambda rel, a=None, b=None: reads.append((rel, a, b)) or real(rel, a, b))
    g = m.components["model"].layout.groups[0].name
    for shard in (0, 1, 0, 1):
        reader.state_range(shard, g, "master", 0, 1)
    # one small read per file: its header, not a whole checksum chunk
    assert reads == [(m.shard_file(0).path, 0, m.shard_file(0).data_start),
                     (m.shard_file(1).path, 0, m.shard_file(1).data_start)]
    assert m.shard_file(0).data_start < m.chunk_size


def test_damaged_header_reported_as_damage(ckpt: tuple[Path, Manifest]) -> None:
    root, m = ckpt
    e = m.shard_file(0)
    path = root / e.path
    data = bytearray(path.read_bytes())
    at = data.index(b"exp_avg", 8)
    data[at] = ord("d")  # the file's own header damaged: its chunk checksum catches it
    path.write_bytes(bytes(data))
    reader = CheckpointReader(str(root))
    with pytest.raises(IntegrityError, match=f"{e.path}: chunk 0: bytes \\[0, .*CRC32C"):
        reader.check_file(e)


# ------------------------------------------------------------------- only regular files


def assert_refused(r: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert r.returncode != 0, r.stdout + r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    for n in needles:
        assert n in r.stderr, f"{n!r} not in {r.stderr!r}"


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs named pipes")
def test_fifo_manifest_refused(ckpt: tuple[Path, Manifest], tmp_path: Path) -> None:
    root, _ = ckpt
    (root / "manifest.json").unlink()
    os.mkfifo(root / "manifest.json")
    for args in (["verify", str(root)], ["inspect", str(root)],
                 ["consolidate", str(root), str(tmp_path / "hf")],
                 ["reshard", str(root), str(tmp_path / "r"), "--to", "1"]):
        assert_refused(cli_process(*args), "manifest.json", "not a regular file", "named pipe")


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs named pipes")
def test_fifo_shard_refused(ckpt: tuple[Path, Manifest], tmp_path: Path) -> None:
    root, m = ckpt
    shard = root / m.shard_file(1).path
    shard.unlink()
    os.mkfifo(shard)
    for args in (["verify", str(root)], ["consolidate", str(root), str(tmp_path / "hf")],
                 ["reshard", str(root), str(tmp_path / "r"), "--to", "1"]):
        assert_refused(cli_process(*args), m.shard_file(1).path, "not a regular file")


@pytest.mark.skipif(not os.path.exists("/dev/zero"), reason="needs /dev/zero")
def test_manifest_linked_to_a_device_refused(ckpt: tuple[Path, Manifest]) -> None:
    root, _ = ckpt
    (root / "manifest.json").unlink()
    os.symlink("/dev/zero", root / "manifest.json")
    for args in (["verify", str(root)], ["inspect", str(root)]):
        assert_refused(cli_process(*args), "manifest.json", "not a regular file", "device")


def test_regular_file_through_a_symlink_still_reads(ckpt: tuple[Path, Manifest], tmp_path: Path) -> None:
    root, m = ckpt
    moved = tmp_path / "elsewhere.json"
    (root / "manifest.json").rename(moved)
    os.symlink(moved, root / "manifest.json")
    assert read_manifest(Storage(str(root))) == m


# ----------------------------------------------------------- one read of the manifest


def count_manifest_calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every retried storage operation (one retry loop, one deadline) on a manifest."""
    calls: list[str] = []
    real = storage_backends.retry_call

    def counted(policy: Any, what: str, url: str, fn: Any, deadline: Any = None, **kw: Any) -> Any:
        if url.endswith("manifest.json"):
            calls.append(what)
        return real(policy, what, url, fn, deadline, **kw)

    monkeypatch.setattr(storage_backends, "retry_call", counted)
    return calls


def test_verify_reads_the_manifest_in_one_operation(ckpt: tuple[Path, Manifest],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    root, _ = ckpt
    calls = count_manifest_calls(monkeypatch)
    assert verify(str(root))
    assert calls == ["read"]
    calls.clear()
    r = runner.invoke(app, ["verify", str(root)])
    assert r.exit_code == 0, r.output
    # (the command first asks whether the location is a checkpoint or a run directory)
    assert [c for c in calls if c != "exists"] == ["read"]


def test_unreachable_manifest_costs_one_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every request fails as a dropped connection does: verify gives up after one retry loop on
    the manifest, not one per step of reading it."""
    from fsspec.implementations.memory import MemoryFileSystem

    def unreachable(*a: Any, **k: Any) -> Any:
        raise ConnectionResetError("connection reset by peer")

    for name in ("cat_file", "info", "exists", "open"):
        monkeypatch.setattr(MemoryFileSystem, name, unreachable)
    calls = count_manifest_calls(monkeypatch)
    result = verify("memory://unreachable/ck", {"shardckpt_deadline_s": 0.01})
    assert not result and len(result.problems) == 1 and "manifest.json" in result.problems[0]
    assert calls == ["read"]


@pytest.mark.parametrize("tool", ["consolidate", "reshard"])
def test_from_an_object_store_every_header_is_checked_once_before_any_state_is_read(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tool: str) -> None:
    """Checked one by one as consolidate and reshard planned their batches, a 64-rank
    checkpoint's headers were 64 GETs in a row; now they are read at once, up front, each once."""
    import threading
    import uuid

    from shardckpt.checkpoint import reader as reader_module
    from shardckpt.storage.reads import RangeReader
    from shardckpt.tools.synth import synthesize
    from testing.ckpts import TINY_PARAMS

    url = f"memory://headers-{uuid.uuid4().hex[:8]}/ckpt"
    m = synthesize(url, TINY_PARAMS, 4, seed=1, chunk_size=4096)
    events: list[str] = []
    real_check, real_read = reader_module.check_header, RangeReader.read

    planner, checkers = threading.get_ident(), set()

    def check(url: str, entry: Any, *args: Any, **kwargs: Any) -> Any:
        if entry.role == "shard":
            events.append(f"header {entry.path}")
            checkers.add(threading.get_ident())
        return real_check(url, entry, *args, **kwargs)

    def read(self: Any, entry: Any, *args: Any, **kwargs: Any) -> Any:
        events.append("state")
        return real_read(self, entry, *args, **kwargs)

    monkeypatch.setattr(reader_module, "check_header", check)
    monkeypatch.setattr(RangeReader, "read", read)
    # batches of a few KB: the first touches the first shard file alone
    if tool == "consolidate":
        consolidate(url, str(tmp_path / "hf"), dtype="fp32", buffer_bytes=8192)
    else:
        reshard(url, f"{url}-to-2", 2, buffer_bytes=65536)
    shards = sorted(f"header {e.path}" for e in m.files if e.role == "shard")
    first = events.index("state")
    assert sorted(events[:first]) == shards, events  # every shard file's header before any state
    assert sorted(e for e in events if e.startswith("header")) == shards  # and each once
    assert planner not in checkers  # on the read threads, at once, not in the planning thread
