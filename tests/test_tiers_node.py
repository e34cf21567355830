"""The node-local tier's pure parts and its node directories (no processes): topology, the fetch
plan of a resume, commit and pruning rules, the quota."""

from __future__ import annotations

import os

import pytest

from shardckpt.checkpoint.tiers import (
    LocalTier, Nodes, commit_node, committed_steps, durable_references, ensure_room, fetch_plan,
    files_needed, holdings, is_full, node_storage,
)
from shardckpt.checkpoint.node_files import prune
from shardckpt.errors import ConfigError, IncompleteCheckpointError, InsufficientSpaceError


def test_config_is_checked_field_by_field():
    for kwargs, field in (({"every": 0}, "every"), ({"keep": 0}, "keep"), ({"peers": -1}, "peers"),
                          ({"ranks_per_node": 0}, "ranks_per_node"), ({"quota_bytes": -1}, "quota_bytes"),
                          ({"preallocate": 1}, "preallocate")):
        with pytest.raises(ConfigError, match=f"LocalTier.{field}"):
            LocalTier(path="/dev/shm/run", **{"every": 2, **kwargs})
    with pytest.raises(ConfigError, match="LocalTier.path"):
        LocalTier(path="s3://bucket/run", every=2)
    with pytest.raises(ConfigError, match="does not divide"):
        LocalTier(path="/x", every=1, ranks_per_node=3).topology(4)
    assert LocalTier(path="/x", every=1).topology(8, {"LOCAL_WORLD_SIZE": "4"}) == Nodes(8, 4)
    assert LocalTier(path="/x", every=1).topology(8, {}) == Nodes(8, 8)
    assert LocalTier(path="/r/{node}/t", every=1).node_url(3) == "/r/3/t"


def test_peers_are_the_same_local_rank_on_the_next_nodes():
    n = Nodes(8, 2)  # 4 nodes
    assert [n.node_of(r) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert n.peers_of(1, 1) == [3]
    assert n.peers_of(7, 2) == [1, 3]
    assert n.peers_of(0, 9) == [2, 4, 6]  # at most the other nodes
    assert Nodes(4, 4).peers_of(2, 1) == []  # one node: nobody to copy to
    for r in range(8):
        assert all(n.node_of(p) != n.node_of(r) for p in n.peers_of(r, 3))


def test_fetch_plan_fetches_each_missing_file_once_per_node_from_a_holder():
    n = Nodes(4, 2)
    needs = {0: ["s0", "b"], 1: ["s1", "b"], 2: ["s2", "b"], 3: ["s3", "b"]}
    held = {0: {"s0", "s1", "s2", "s3", "b"}, 1: set()}  # node 1 lost its directory
    plan, lost = fetch_plan(n, needs, held)
    assert lost == []
    assert sorted((t.path, n.node_of(t.src), t.dst) for t in plan) == \
        [("b", 0, 2), ("s2", 0, 2), ("s3", 0, 3)]  # the buffers once for node 1, by its rank 2
    assert plan == sorted(plan, key=lambda t: (t.src, t.dst, t.path))
    assert {(t.src, t.dst) for t in plan} == {(0, 2), (1, 3)}  # pairs side by side
    # nothing to fetch where every node holds what its ranks need
    assert fetch_plan(n, needs, {0: {"s0", "s1", "b"}, 1: {"s2", "s3", "b"}}) == ([], [])
    # a file no node holds whole makes the step unassemblable
    plan, lost = fetch_plan(n, needs, {0: {"s0", "s1", "b"}, 1: {"s2", "b"}})
    assert lost == ["s3"]


def _manifest(tmp_path):
    """A real committed checkpoint (one rank, tiny) and its manifest."""
    from shardckpt.checkpoint.reader import read_manifest
    from shardckpt.format.layout import Mesh
    from shardckpt.checkpoint.writer import CheckpointSpec, CheckpointWriter
    from shardckpt.storage import Storage

    spec = CheckpointSpec(Mesh.for_world(1), {})
    src = Storage(str(tmp_path / "src"))
    w = CheckpointWriter(src, spec)
    files = [w.write_shard(0, lambda slot: iter([])), w.write_rank_state(0, [], lambda slot: iter([]))]
    m = w.commit(files)
    assert read_manifest(src).save_id == m.save_id
    return m, src


def test_node_commit_needs_the_files_the_node_holds_and_is_create_only(tmp_path):
    m, src = _manifest(tmp_path)
    tier = LocalTier(path=str(tmp_path / "node{node}"), every=1)
    node = node_storage(tier, 0)
    here = node.child("step-00000004")
    with pytest.raises(IncompleteCheckpointError, match="not committed on this node"):
        commit_node(here, m, m.files)
    assert not here.exists("manifest.json")
    os.makedirs(here.full(m.save_id))
    for f in m.files:
        with open(here.full(f.path), "wb") as out, open(src.full(f.path), "rb") as inp:
            out.write(inp.read())
    commit_node(here, m, m.files)
    commit_node(here, m, m.files)  # the same bytes again: a retried commit
    held = holdings(node)
    assert held["4"]["manifest"] == m.save_id and set(held["4"]["files"]) == {f.path for f in m.files}
    assert held["4"]["committed"]
    assert committed_steps([held, {}]) == [(4, m.save_id)]
    assert committed_steps([held, {"4": {"manifest": "other", "files": {}}}]) == []


@pytest.mark.parametrize("saved,loaded", [(4, 4), (4, 2), (2, 4), (3, 2)])
def test_files_needed_names_each_ranks_reads_for_the_whole_job(saved, loaded):
    """What every rank of a job of ``loaded`` ranks reads of a checkpoint of ``saved`` (one
    call, the same on every rank): the source shards its reshard plan names, the buffers, and
    its own rank file only on the same world size; never another rank's."""
    from shardckpt.format.reshard_plan import plan_reshard
    from shardckpt.tools.synth import synth_spec
    from testing.ckpts import TINY_PARAMS, manifest_from_spec

    m = manifest_from_spec(synth_spec(TINY_PARAMS, saved), rank_files=saved)
    layout = synth_spec(TINY_PARAMS, loaded).components["model"].layout
    plan = plan_reshard(m.components["model"].layout, layout, strict=False)
    shards = {f.index: f.path for f in m.files if f.role == "shard"}
    got = files_needed(m, layout, loaded)
    assert sorted(got) == list(range(loaded))
    for r, paths in got.items():
        want = {shards[i] for i in plan.src_shards_for(layout.mesh.shard_rank(r))}
        want |= {f.path for f in m.files if f.role == "buffers"}
        if saved == loaded:
            want.add(f"{m.save_id}/rank-{r:05d}.safetensors")
        assert paths == sorted(want), (r, paths)
    assert set().union(*got.values()) >= set(shards.values())  # every source shard is read


def test_prune_keeps_the_newest_and_never_a_newer_uncommitted_step(tmp_path):
    tier = LocalTier(path=str(tmp_path / "n{node}"), every=1)
    node = node_storage(tier, 0)
    for step, committed in ((2, True), (3, False), (4, True), (6, True), (8, False)):
        d = tmp_path / "n0" / f"step-{step:08d}"
        d.mkdir(parents=True)
        (d / "x").write_bytes(b"1")
        if committed:
            (d / "manifest.json").write_bytes(b"{}")
    removed = prune(node, keep=2)
    assert sorted(removed) == ["step-00000002", "step-00000003"]
    assert sorted(os.listdir(tmp_path / "n0")) == ["step-00000004", "step-00000006", "step-00000008"]


def test_prune_keeps_a_step_whose_frozen_files_a_kept_step_references(tmp_path):
    tier = LocalTier(path=str(tmp_path / "n{node}"), every=1)
    node = node_storage(tier, 0)
    ref = b'{"files": [{"path": "../step-00000002/20260101T000000Z-0000abcd/frozen-00000-of-00001.safetensors"}]}'
    for step in (2, 3, 4, 5):
        d = tmp_path / "n0" / f"step-{step:08d}"
        d.mkdir(parents=True)
        (d / "manifest.json").write_bytes(ref if step == 5 else b"{}")
    assert prune(node, keep=2) == ["step-00000003"]
    assert sorted(os.listdir(tmp_path / "n0")) == ["step-00000002", "step-00000004", "step-00000005"]


def test_a_referenced_file_is_held_where_the_referenced_step_holds_it():
    from shardckpt.checkpoint.node_files import held_whole
    from shardckpt.format.manifest import FileEntry

    ref = "../step-00000002/20260101T000000Z-0000abcd/frozen-00000-of-00001.safetensors"

    class M:
        files = (FileEntry("s/shard-00000-of-00001.safetensors", "shard", 10, 1, 0, (), 0),
                 FileEntry(ref, "frozen", 20, 1, 0, (), 0))
    held = {"4": {"files": {"s/shard-00000-of-00001.safetensors": 10}},
            "2": {"files": {"20260101T000000Z-0000abcd/frozen-00000-of-00001.safetensors": 20}}}
    assert held_whole(held, 4, M) == {"s/shard-00000-of-00001.safetensors", ref}
    held["2"]["files"]["20260101T000000Z-0000abcd/frozen-00000-of-00001.safetensors"] = 19
    assert held_whole(held, 4, M) == {"s/shard-00000-of-00001.safetensors"}


def test_quota_and_enospc_are_a_full_tier(tmp_path):
    tier = LocalTier(path=str(tmp_path / "n{node}"), every=1, quota_bytes=100)
    node = node_storage(tier, 0)
    (tmp_path / "n0").mkdir(exist_ok=True)  # node_storage creates it, 0700
    (tmp_path / "n0" / "f").write_bytes(b"x" * 60)
    ensure_room(tier, node, 40, "save")
    with pytest.raises(InsufficientSpaceError, match="quota of 100 bytes") as e:
        ensure_room(tier, node, 41, "save")
    assert is_full(e.value)
    import errno

    from shardckpt.errors import StorageError

    err = StorageError("disk")
    err.__cause__ = OSError(errno.ENOSPC, "No space left on device")
    assert is_full(err) and not is_full(StorageError("other"))


def test_direct_read_fills_each_target_and_checks_every_chunk_it_touches(tmp_path):
    import random

    from shardckpt.errors import IntegrityError
    from shardckpt.format.integrity import crc32c
    from shardckpt.format.manifest import FileEntry
    from shardckpt.storage.local import read_local_into as read_into

    cs, size = 64, 64 * 9 + 17  # a short last chunk
    data = bytes(random.Random(0).randrange(256) for _ in range(size))
    path = tmp_path / "f"
    path.write_bytes(data)
    chunks = tuple(crc32c(data[i:i + cs]) for i in range(0, size, cs))
    entry = FileEntry("f", "shard", size, 0, crc32c(data), chunks, 0)
    # inside one chunk, across boundaries, touching, a gap of whole chunks, to the end
    ranges = [(3, 10), (60, 130), (130, 140), (400, 420), (500, size)]
    targets = [bytearray(b - a) for a, b in ranges]
    read_into(str(path), "f", entry, cs,
              [(a, b, memoryview(t)) for (a, b), t in zip(ranges, targets, strict=True)])
    assert [bytes(t) for t in targets] == [data[a:b] for a, b in ranges]
    overlap = [bytearray(20), bytearray(20)]  # the same bytes wanted twice
    read_into(str(path), "f", entry, cs, [(100, 120, memoryview(overlap[0])),
                                          (110, 130, memoryview(overlap[1]))])
    assert bytes(overlap[0]) == data[100:120] and bytes(overlap[1]) == data[110:130]
    # a flipped bit outside the wanted bytes, in a chunk a range touches, is still caught
    bad = bytearray(data)
    bad[135] ^= 1
    path.write_bytes(bytes(bad))
    with pytest.raises(IntegrityError, match=r"bytes \[128, 192\) fail their CRC32C"):
        read_into(str(path), "f", entry, cs, [(129, 131, memoryview(bytearray(2)))])
    read_into(str(path), "f", entry, cs, [(3, 10, memoryview(bytearray(7)))])  # chunk 0 is whole
    path.write_bytes(data[:-1])
    with pytest.raises(IntegrityError, match="the manifest records"):
        read_into(str(path), "f", entry, cs, [(3, 10, memoryview(bytearray(7)))])


def test_a_local_manifest_is_parsed_once_per_bytes_and_a_bad_one_every_time(tmp_path):
    """The local tier's manifests are validated once per distinct bytes (a resume reads each
    several times), until :func:`forget`; a manifest that fails is refused on every read."""
    from shardckpt.checkpoint import manifest_memo
    from shardckpt.errors import ManifestError
    from shardckpt.format.manifest import to_json

    m, _ = _manifest(tmp_path)
    data = to_json(m)
    manifest_memo.forget()
    first = manifest_memo.parsed(data, "a/manifest.json")
    assert first == m and manifest_memo.parsed(bytes(data), "b/manifest.json") is first
    manifest_memo.forget()
    assert manifest_memo.parsed(data, "a/manifest.json") is not first
    for _ in range(2):
        with pytest.raises(ManifestError, match="c/manifest.json"):
            manifest_memo.parsed(data[:-2], "c/manifest.json")


def test_durable_references_name_the_latest_durable_frozen_files_that_are_still_there(tmp_path):
    """What a durable copy references instead of copying: the frozen files of the run's latest
    committed checkpoint with the same entries, only while they are there with their size."""
    import torch
    from torch import nn

    from shardckpt.checkpoint.run_dir import CheckpointManager
    from shardckpt.runtime import ZeroEngine
    from shardckpt.storage import Storage
    from shardckpt.training.save_load import save

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 2))
    model[0].requires_grad_(False)
    engine = ZeroEngine(model)
    run = tmp_path / "run"
    first = save(engine, str(run / "step-00000002"))
    CheckpointManager(str(run)).mark_committed(2)
    local = save(engine, str(tmp_path / "node0" / "step-00000004"))  # a node's copy: own files
    dst = Storage(str(run / "step-00000004"))
    old = first.frozen_file(0)
    new = local.frozen_file(0)
    assert durable_references(dst, local) == {new.path: f"../step-00000002/{old.path}"}
    # an entry that is a reference already stays as it is
    assert durable_references(dst, _with_path(local, new.path, f"../step-00000002/{old.path}")) == {}
    # no latest checkpoint, or its frozen bytes differ, or its file is gone: copied whole
    assert durable_references(Storage(str(tmp_path / "elsewhere" / "step-00000004")), local) == {}
    with torch.no_grad():
        model[0].weight.add_(1.0)
    changed = save(ZeroEngine(model), str(tmp_path / "node1" / "step-00000004"))
    assert durable_references(dst, changed) == {}
    os.remove(run / "step-00000002" / old.path)
    assert durable_references(dst, local) == {}


def _with_path(m, path: str, to: str):
    from dataclasses import replace

    return replace(m, files=tuple(replace(f, path=to) if f.path == path else f for f in m.files))


def test_spans_cover_every_byte_of_the_chunks_in_order_with_no_span_over_the_cap():
    from shardckpt.storage.checked import spans

    cs, size = 64, 64 * 9 + 17
    targets = [bytearray(7), bytearray(70), bytearray(size - 500)]
    pieces = [(3, 10, memoryview(targets[0])), (60, 130, memoryview(targets[1])),
              (500, size, memoryview(targets[2]))]
    scratch = memoryview(bytearray(cs))
    for cap in (None, 5, 64):
        out = spans(size, cs, 0, 10, pieces, scratch, cap=cap)
        offsets = [off for off, _ in out]
        assert offsets[0] == 0 and sum(len(v) for _, v in out) == size
        assert all(a + len(v) == b for (a, v), (b, _) in zip(out, out[1:]))  # contiguous, in order
        assert all(len(v) <= (cap or size) for _, v in out)
        for _, v in out:  # a gap never crosses a chunk boundary; a target's span is its own bytes
            assert v.obj is scratch.obj or any(v.obj is t for t in targets)
    # a run of chunks in the middle: from chunk 1 to the end of chunk 2 only
    mid = spans(size, cs, 1, 3, [(100, 140, memoryview(bytearray(40)))], scratch)
    assert [(off, len(v)) for off, v in mid] == [(64, 36), (100, 40), (140, 52)]
