"""Format 1.2, chunked tensors and blobs: the golden checkpoint written by DCP through
``ShardckptWriter`` (``tests/golden/v1_2_chunked``, never regenerated), the codec, older readers'
refusal, and hostile manifests (each refused with one error naming the file and what is wrong).
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any

import crc32c as crc32c_pkg
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from shardckpt.format import manifest as manifest_mod
from shardckpt.checkpoint.reader import CheckpointReader
from shardckpt.checkpoint.verify import verify
from shardckpt.format.chunk_tiling import tiling_problems
from shardckpt.format.chunked import ChunkRecord, ChunkedTensor, box_byte_span
from shardckpt.interop.dcp.storage import ShardckptReader, ShardckptWriter
from shardckpt.errors import ManifestError
from shardckpt.format.manifest import to_json
from shardckpt.format.manifest_parse import parse
from shardckpt.format.integrity import seal

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

HERE = Path(__file__).resolve().parent / "golden"
GOLDEN = HERE / "v1_2_chunked"
SAVE_ID = "20261201T155708Z-0929691d"
MANIFEST = (3230, 0xCB7BB721)  # size, CRC32C
FILES = [(f"{SAVE_ID}/chunks-00000.safetensors", 400, 0xFBD1A1FF),
         (f"{SAVE_ID}/chunks-00001.safetensors", 3126, 0x3FD42F79)]

sys.path.insert(0, str(HERE))
from make_golden_chunked import golden_state  # noqa: E402


def _plain_target() -> dict[str, Any]:
    zeros = {k: torch.zeros_like(v) for k, v in golden_state()["t"].items()}
    return {"t": zeros, "meta": {"lr": 0.0, "name": ""}}


def test_golden_files_unchanged_and_verify() -> None:
    files = sorted(p.relative_to(GOLDEN).as_posix() for p in GOLDEN.rglob("*") if p.is_file())
    assert files == sorted(["manifest.json"] + [f for f, _, _ in FILES])
    raw = (GOLDEN / "manifest.json").read_bytes()
    assert (len(raw), crc32c_pkg.crc32c(raw)) == MANIFEST
    for rel, size, crc in FILES:
        data = (GOLDEN / rel).read_bytes()
        assert (len(data), crc32c_pkg.crc32c(data)) == (size, crc), rel
    result = verify(str(GOLDEN))
    assert result and result.manifest is not None and result.manifest.version == (1, 2)


def test_golden_loads_bit_for_bit_with_dcp() -> None:
    sd = _plain_target()
    dcp.load(sd, storage_reader=ShardckptReader(str(GOLDEN)))
    want = golden_state()
    for k, v in want["t"].items():
        assert sd["t"][k].dtype == v.dtype and torch.equal(sd["t"][k], v), k
    assert sd["meta"] == want["meta"]


def test_golden_chunks_as_recorded() -> None:
    m = CheckpointReader(str(GOLDEN)).manifest
    assert m.chunked is not None and m.extras == {"step": 3}
    t = m.chunked.tensors
    assert [(c.offsets, c.sizes) for c in t["t.v"].chunks] == [((0, 0), (4, 3)), ((0, 3), (4, 3))]
    assert [(c.offsets, c.sizes) for c in t["t.s"].chunks] == [((), ())]
    assert sorted(m.chunked.blobs) == ["meta.lr", "meta.name"]
    assert parse(to_json(m)) == m


def test_older_readers_refuse_the_new_kind(monkeypatch: pytest.MonkeyPatch) -> None:
    raw = (GOLDEN / "manifest.json").read_bytes()
    # A 1.1 reader knows three file roles; it stops at the first chunks file, with one error.
    monkeypatch.setattr(manifest_mod, "ROLES", ("shard", "buffers", "rank"))
    with pytest.raises(ManifestError, match=r"files\[0\]\.role: 'chunks' is not one of"):
        parse(raw)


def _doc() -> dict[str, Any]:
    return json.loads((GOLDEN / "manifest.json").read_bytes())


def _refused(doc: dict[str, Any], match: str) -> None:
    with pytest.raises(ManifestError, match=match):
        parse(seal(doc))


def test_unknown_required_feature_refused() -> None:
    doc = _doc()
    doc["requires"] = ["chunked_tensors", "sparse_tensors"]
    _refused(doc, "needs 'sparse_tensors'.*upgrade shardckpt")


def test_chunked_section_needs_version_1_2() -> None:
    doc = _doc()
    doc["version"] = "1.1"
    _refused(doc, "chunked: a chunked section needs format 1.2")


def test_chunk_past_file_end_refused() -> None:
    doc = _doc()
    c = doc["chunked"]["tensors"][0]["chunks"][0]
    c["begin"], c["end"] = 10_000, 10_060
    _refused(doc, r"tensors\[0\]\.chunks\[0\]: bytes \[10000, 10060\) .*chunks-00000.*past its end")


def test_overlapping_chunks_refused() -> None:
    doc = _doc()
    c = doc["chunked"]["tensors"][0]["chunks"][1]  # t.w rows [3, 6) -> [2, 5): overlaps [0, 3)
    c["offsets"] = [2, 0]
    _refused(doc, r"'t\.w': chunks offsets \[0, 0\] sizes \[3, 5\] and offsets \[2, 0\] .*overlap")


def test_chunks_that_do_not_tile_refused() -> None:
    doc = _doc()
    doc["chunked"]["tensors"][0]["shape"] = [7, 5]
    _refused(doc, r"'t\.w': its chunks hold 30 of its 35 elements")
    doc = _doc()
    doc["chunked"]["tensors"][0]["chunks"][1]["offsets"] = [4, 0]
    _refused(doc, r"'t\.w': chunk offsets \[4, 0\] sizes \[3, 5\] lies outside the shape \[6, 5\]")


def test_chunk_of_wrong_byte_length_and_byte_overlap_refused() -> None:
    doc = _doc()
    doc["chunked"]["tensors"][0]["chunks"][0]["end"] = 64
    _refused(doc, r"hold 64 bytes, but a \[3, 5\] box of float32 needs 60")
    doc = _doc()
    doc["chunked"]["blobs"][0]["begin"] = 90  # inside t.s's bytes in chunks-00001
    _refused(doc, "byte ranges overlap in a file")


def test_chunk_naming_an_unlisted_file_refused() -> None:
    doc = _doc()
    doc["chunked"]["tensors"][0]["chunks"][0]["file"] = f"{SAVE_ID}/other.safetensors"
    _refused(doc, "is not a 'chunks' file of this manifest")


def _copy(tmp_path: Path) -> Path:
    dst = tmp_path / "ck"
    shutil.copytree(GOLDEN, dst)
    return dst


def test_missing_file_one_clear_error(tmp_path: Path) -> None:
    ck = _copy(tmp_path)
    (ck / FILES[1][0]).unlink()
    with pytest.raises(CheckpointException, match=r"chunks-00001\.safetensors"):
        dcp.load(_plain_target(), storage_reader=ShardckptReader(str(ck)))
    problems = verify(str(ck)).problems
    assert len(problems) == 1 and "chunks-00001.safetensors: missing" in problems[0]


def test_damaged_byte_caught_by_ranged_read(tmp_path: Path) -> None:
    ck = _copy(tmp_path)
    path = ck / FILES[0][0]
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF  # inside t.i's chunk
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointException, match=r"chunks-00000\.safetensors.*CRC32C|CRC32C.*chunks-00000"):
        dcp.load(_plain_target(), storage_reader=ShardckptReader(str(ck)))


def test_header_disagreeing_with_manifest_refused(tmp_path: Path) -> None:
    ck = _copy(tmp_path)
    doc = _doc()
    t = doc["chunked"]["tensors"]
    t[0]["chunks"][0]["offsets"], t[0]["chunks"][1]["offsets"] = [3, 0], [0, 0]
    (ck / "manifest.json").write_bytes(seal(doc))
    with pytest.raises(CheckpointException, match="header tensors differ from the manifest"):
        dcp.load(_plain_target(), storage_reader=ShardckptReader(str(ck)))


def test_save_refuses_to_overwrite_a_committed_checkpoint(tmp_path: Path) -> None:
    ck = _copy(tmp_path)
    before = (ck / "manifest.json").read_bytes()
    with pytest.raises(CheckpointException, match="already exists"):
        dcp.save(golden_state(), storage_writer=ShardckptWriter(str(ck)))
    assert (ck / "manifest.json").read_bytes() == before
    assert sorted(p.name for p in ck.iterdir()) == sorted(["manifest.json", SAVE_ID])


def test_box_byte_span_reads_only_the_requested_rows() -> None:
    c = ChunkRecord((0, 0), (4, 6), "f", 0, 96)
    assert box_byte_span(c, 4, (1, 0), (2, 6)) == (24, 72)       # whole rows: exactly them
    assert box_byte_span(c, 4, (1, 2), (2, 3)) == (32, 68)       # a column band: its span
    assert box_byte_span(c, 4, (0, 0), (0, 6)) == (0, 0)
    scalar = ChunkRecord((), (), "f", 0, 8)
    assert box_byte_span(scalar, 8, (), ()) == (0, 8)


def test_tiling_problems_names_each_offender() -> None:
    t = ChunkedTensor("x", "float32", (4,), (ChunkRecord((0,), (2,), "f", 0, 8),
                                            ChunkRecord((2,), (2,), "f", 8, 16)))
    assert tiling_problems(t) == []
    empty = ChunkRecord((4,), (0,), "f", 16, 16)
    assert tiling_problems(ChunkedTensor("x", "float32", (4,), t.chunks + (empty,))) == []
    bad = ChunkedTensor("x", "float32", (4,), t.chunks + (ChunkRecord((1,), (2,), "f", 16, 24),))
    assert len(tiling_problems(bad)) == 2


def test_exception_mid_save_commits_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from torch.distributed.checkpoint import DefaultSavePlanner

    real, calls = DefaultSavePlanner.resolve_data, []

    def failing(self: Any, item: Any) -> Any:
        calls.append(item)
        if len(calls) == 3:  # two tensors of this rank's file are written, not the rest
            raise RuntimeError("device lost")
        return real(self, item)

    monkeypatch.setattr(DefaultSavePlanner, "resolve_data", failing)
    with pytest.raises(CheckpointException, match="device lost"):
        dcp.save(golden_state(), storage_writer=ShardckptWriter(str(tmp_path / "ck")))
    assert not (tmp_path / "ck" / "manifest.json").exists()
    assert not list((tmp_path / "ck").rglob("*.safetensors"))  # the partial file was removed
    assert not list((tmp_path / "ck").rglob("*lease*"))       # and the lease released


def test_one_writer_and_reader_follow_checkpoint_id(tmp_path: Path) -> None:
    """As torchtitan passes them: one instance each, ``checkpoint_id`` per step."""
    writer, reader = ShardckptWriter(str(tmp_path / "unused")), ShardckptReader(str(GOLDEN))
    for step in (1, 2):
        dcp.save(golden_state(), checkpoint_id=str(tmp_path / f"step-{step}"), storage_writer=writer)
        sd = _plain_target()
        dcp.load(sd, checkpoint_id=str(tmp_path / f"step-{step}"), storage_reader=reader)
        assert torch.equal(sd["t"]["w"], golden_state()["t"]["w"])
        assert verify(str(tmp_path / f"step-{step}"))
    assert not (tmp_path / "unused").exists()


@pytest.mark.parametrize("offload", [None, "nvme"])
def test_runtime_load_of_chunked_tensors_goes_through_load_chunked(tmp_path: Path,
                                                                  offload: str | None) -> None:
    """``Checkpointer.load`` (``save_load.load``) of what a module and its optimizer saved through
    DCP loads into ``ZeroEngine`` with no special call: weights (a frozen layer too), moments,
    step, into the engine's tensors or its offload files; a checkpoint without optimizer state
    is one clear error."""
    import warnings

    from torch import nn
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from shardckpt.errors import CollectiveError
    from shardckpt.runtime import ShardedAdamW, ZeroEngine
    from shardckpt.training.checkpointer import Checkpointer
    from shardckpt.training.save_load import load, save
    from testing.ckpts import flat_state

    def net(seed: int) -> nn.Module:
        torch.manual_seed(seed)
        m = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 3))
        m[0].requires_grad_(False)
        return m

    m = net(0)
    opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=0.1)
    m(torch.ones(2, 4)).pow(2).sum().backward()
    opt.step()
    msd, osd = get_state_dict(m, opt)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": msd, "optim": osd}, storage_writer=ShardckptWriter(str(tmp_path / "ck")))
    where = {"offload_optimizer": offload, "offload_dir": str(tmp_path / "off")} if offload else {}
    engine = ZeroEngine(net(1), policy=(nn.Linear,), **where)
    ShardedAdamW(engine, [p for _, p in engine.named_parameters() if p.requires_grad], lr=1.0)
    Checkpointer(str(tmp_path / "run"), engine).load(str(tmp_path / "ck"))
    full = engine.full_state_dict()
    assert all(torch.equal(full[k], v) for k, v in m.state_dict().items())
    save(engine, str(tmp_path / "again"))
    for i, p in enumerate(m[1].parameters()):
        fqn = ("1.weight", "1.bias")[i]
        for kind in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(flat_state(str(tmp_path / "again"), fqn, kind).reshape(p.shape),
                               opt.state[p][kind])
    assert engine.optimizer.optimizer_metadata()["param_groups"][0]["step"] == 1
    with pytest.raises(CollectiveError, match="no optimizer state"):
        load(engine, str(GOLDEN))
    engine.close()
