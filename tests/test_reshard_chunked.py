"""``shardckpt reshard`` of checkpoints saved through DCP (chunked tensors): the chunks FSDP2 saves
at M ranks (HSDP too), or ``--format flat``. Equal content bit for bit both ways; the boxes are
``torch.chunk``'s and the files DCP's own planner's (checked against torch's functions); reads
never larger than ``--buffer``; the flat output is ``import dcp --ranks``'s; ``dcp.load`` reads
the result; a local reshard loads neither torch nor numpy."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from shardckpt.checkpoint.reader import CheckpointReader
from shardckpt.checkpoint.verify import verify
from shardckpt.interop.dcp.storage import ShardckptReader, ShardckptWriter
from shardckpt.storage.reads import RangeReader
from shardckpt.tools.diff import diff
from shardckpt.tools.reshard import MIN_BUFFER, reshard
from testing.cli import cli
from testing.dcp_states import assert_same, dcp_save

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _state() -> dict[str, Any]:
    """A model and AdamW as ``get_state_dict`` gives them: uneven rows (7, 64 over 3 ranks), a
    tensor over 64 KiB, a tied weight, a buffer, an int buffer, two param groups."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Embedding(7, 5), torch.nn.LayerNorm(5), torch.nn.Linear(5, 300),
                            torch.nn.Linear(300, 64), torch.nn.Linear(64, 5), torch.nn.Linear(5, 7))
    m[5].weight = m[0].weight
    m.register_buffer("pos", torch.arange(4.0))
    m.register_buffer("count", torch.tensor([3, 1, 2], dtype=torch.int64))
    decay = [m[0].weight, m[3].weight]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": [p for p in m.parameters() if all(p is not d for d in decay)],
                              "weight_decay": 0.0}], lr=1e-2)
    for _ in range(2):
        m(torch.tensor([[1, 2, 3]])).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
    msd, osd = get_state_dict(m, opt)
    return {"model": msd, "optim": osd}


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """The state saved through ``ShardckptWriter`` (``ck``) and by stock DCP (``dcp``)."""
    root = tmp_path_factory.mktemp("rc")
    sd = _state()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(sd, storage_writer=ShardckptWriter(str(root / "ck"), extras={"step": 2}))
    dcp_save(sd, root / "dcp")
    return root, sd


def _boxes(path: Path) -> dict[str, list[tuple[tuple[int, ...], tuple[int, ...], str]]]:
    m = CheckpointReader(str(path)).manifest
    assert m.chunked is not None
    return {k: [(c.offsets, c.sizes, c.file.rsplit("/", 1)[1]) for c in t.chunks]
            for k, t in m.chunked.tensors.items()}


def _expected_rows(rows: int, shards: int) -> list[tuple[int, int]]:
    """(first row, rows) of each shard box, from ``torch.chunk`` on an arange of the rows; the
    ranks ``torch.chunk`` leaves out hold one empty box at ``rows`` (DTensor's offset for them)."""
    parts = [(int(c[0]), len(c)) for c in torch.chunk(torch.arange(rows), shards) if len(c)]
    return parts + ([(rows, 0)] if len(parts) < shards else [])


@pytest.mark.parametrize("m,replicate", [(1, 1), (3, 1), (4, 2)], ids=["1", "3", "hsdp2x2"])
def test_reshard_and_back_bit_for_bit_in_fsdp2_boxes(saved: tuple[Path, dict], tmp_path: Path,
                                                    m: int, replicate: int) -> None:
    root, _ = saved
    out, back = tmp_path / "out", tmp_path / "back"
    r = cli("reshard", str(root / "ck"), str(out), "--to", str(m), "--replicate", str(replicate),
            "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.output)
    assert doc["format"] == "chunked" and doc["to"] == m and doc["from"] == 1
    assert diff(str(root / "ck"), str(out)).equal and verify(str(out))
    src = CheckpointReader(str(root / "ck")).manifest.chunked
    shards = m // replicate
    for fqn, boxes in _boxes(out).items():
        t = src.tensors[fqn]
        if t.shape and t.dtype.startswith(("float", "bfloat")):
            want = sorted(((a, *(0,) * (len(t.shape) - 1)), (n, *t.shape[1:]))
                          for a, n in _expected_rows(t.shape[0], shards))
        else:  # a step count, an integer buffer: replicated, one box
            want = [((0,) * len(t.shape), tuple(t.shape))]
        assert sorted((o, s) for o, s, _ in boxes) == want, fqn
    m2 = CheckpointReader(str(out)).manifest
    assert m2.mesh.world_size == m and m2.chunked.blobs.keys() == src.blobs.keys()
    assert m2.chunked.planner_data == src.planner_data and m2.extras == {"step": 2}
    r = reshard(str(out), str(back), to=1)
    assert r.manifest.mesh.world_size == 1 and diff(str(root / "ck"), str(back)).equal


def _torch_plans(section: Any, R: int, S: int) -> tuple[list[Any], Any]:
    """What DCP's own planner makes of FSDP2's state at R x S: each rank's items (boxes from
    DTensor's ``_compute_local_shape_and_global_offset``), deduped by ``dedup_save_plans``."""
    from torch.distributed.checkpoint._dedup_save_plans import dedup_save_plans
    from torch.distributed.checkpoint.default_planner import create_default_global_save_plan
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata, MetadataIndex, TensorProperties)
    from torch.distributed.checkpoint.planner import (
        SavePlan, TensorWriteData, WriteItem, WriteItemType)
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    plans = []
    for rank in range(R * S):
        items = []
        for key in section.planner_data:
            if key in section.blobs:
                items.append(WriteItem(MetadataIndex(key), WriteItemType.BYTE_IO))
                continue
            t = section.tensors[key]
            shape = torch.Size(t.shape)
            if t.shape and t.dtype.startswith(("float", "bfloat")):
                sizes, offs = _compute_local_shape_and_global_offset(
                    shape, (R, S), [rank // S, rank % S], [Replicate(), Shard(0)])
                kind = WriteItemType.SHARD
            else:
                sizes, offs, kind = shape, (0,) * len(shape), WriteItemType.TENSOR
            items.append(WriteItem(MetadataIndex(key, torch.Size(offs)), kind, tensor_data=TensorWriteData(
                ChunkStorageMetadata(torch.Size(offs), torch.Size(sizes)),
                TensorProperties(dtype=getattr(torch, t.dtype)), shape)))
        plans.append(SavePlan(items))
    return create_default_global_save_plan(dedup_save_plans(plans))


@pytest.mark.parametrize("m,replicate", [(3, 1), (4, 2)], ids=["3", "hsdp2x2"])
def test_files_are_those_dcps_planner_gives(saved: tuple[Path, dict], tmp_path: Path, m: int,
                                            replicate: int) -> None:
    root, _ = saved
    reshard(str(root / "ck"), str(tmp_path / "out"), to=m, replicate=replicate)
    got = CheckpointReader(str(tmp_path / "out")).manifest
    plans, md = _torch_plans(CheckpointReader(str(root / "ck")).manifest.chunked, replicate,
                             m // replicate)
    for rank, plan in enumerate(plans):
        want = [(it.index.fqn, None if it.index.offset is None else tuple(it.index.offset))
                for it in plan.items]
        held = [(c.begin, k, c.offsets) for k, t in got.chunked.tensors.items() for c in t.chunks
                if c.file.endswith(f"chunks-{rank:05d}.safetensors")]
        held += [(b.begin, k, None) for k, b in got.chunked.blobs.items()
                 if b.file.endswith(f"chunks-{rank:05d}.safetensors")]
        assert [(k, o) for _, k, o in sorted(held, key=lambda x: x[0])] == want, rank
    order = list(md.state_dict_metadata)
    assert list(got.chunked.tensors) == [k for k in order if k in got.chunked.tensors]
    assert list(got.chunked.blobs) == [k for k in order if k in got.chunked.blobs]
    for k, t in got.chunked.tensors.items():
        assert [c.offsets for c in t.chunks] == \
            [tuple(c.offsets) for c in md.state_dict_metadata[k].chunks], k


class _Reads:
    """The bytes each checked read asks for, per call (a batch of ranges counts as one read)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.sizes: list[int] = []
        fetch, gather = RangeReader.fetch, CheckpointReader.read_ranges
        reads = self

        def counted_fetch(self: Any, requests: Any, *a: Any, **k: Any) -> Any:
            reads.sizes.append(sum(b - a for _, a, b in requests))
            return fetch(self, requests, *a, **k)

        def counted_gather(self: Any, requests: Any, *a: Any, **k: Any) -> Any:
            reads.sizes.append(sum(b - a for _, a, b in requests))
            return gather(self, requests, *a, **k)

        monkeypatch.setattr(RangeReader, "fetch", counted_fetch)
        monkeypatch.setattr(CheckpointReader, "read_ranges", counted_gather)


def test_buffer_smaller_than_a_tensor_bounds_every_read(saved: tuple[Path, dict], tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    root, _ = saved
    big = CheckpointReader(str(root / "ck")).manifest.chunked.tensors["model.3.weight"]
    assert big.nbytes > MIN_BUFFER
    reads = _Reads(monkeypatch)
    reshard(str(root / "ck"), str(tmp_path / "m3"), to=3, buffer_bytes=MIN_BUFFER)
    reshard(str(tmp_path / "m3"), str(tmp_path / "m2"), to=2, replicate=2, buffer_bytes=MIN_BUFFER)
    assert reads.sizes and max(reads.sizes) <= MIN_BUFFER
    monkeypatch.undo()
    assert diff(str(root / "ck"), str(tmp_path / "m2")).equal


def _column_split(path: Path) -> torch.Tensor:
    """A checkpoint whose 200 x 100 tensor (80 KB) is stored as two column boxes, one per rank
    (as a tensor-parallel ``Shard(1)`` is), written by hand."""
    from shardckpt.checkpoint.writer import CheckpointSpec, CheckpointWriter
    from shardckpt.format.chunked import ChunkRecord, ChunkedSection, ChunkedTensor, chunk_name
    from shardckpt.format.layout import Mesh
    from shardckpt.format.manifest import TensorSlot
    from shardckpt.storage import Storage

    full = torch.arange(20000, dtype=torch.float32).reshape(200, 100)
    parts = [(0, full[:, :60].contiguous()), (60, full[:, 60:].contiguous())]
    sid = "20260101T000000Z-00000000"
    chunks = tuple(ChunkRecord((0, c), tuple(p.shape), f"{sid}/chunks-{r:05d}.safetensors", 0,
                               p.numel() * 4) for r, (c, p) in enumerate(parts))
    section = ChunkedSection({"w": ChunkedTensor("w", "float32", (200, 100), chunks)}, {},
                             {"w": ("w",)})
    w = CheckpointWriter(Storage(str(path)), CheckpointSpec(Mesh.for_world(2), {}, chunked=section,
                                                            chunk_size=4096), sid)
    entries = [w.write_chunks(r, [TensorSlot(chunk_name("w", (0, c)), "float32", tuple(p.shape), 0,
                                             p.numel() * 4)], lambda s, p=p: [p.numpy()])
               for r, (c, p) in enumerate(parts)]
    w.commit(entries)
    return full


def test_boxes_split_along_other_dims_are_assembled_within_the_buffer(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    full = _column_split(tmp_path / "tp")
    reads = _Reads(monkeypatch)
    reshard(str(tmp_path / "tp"), str(tmp_path / "out"), to=3, buffer_bytes=MIN_BUFFER)
    assert reads.sizes and max(reads.sizes) <= MIN_BUFFER
    monkeypatch.undo()
    assert _boxes(tmp_path / "out")["w"] == [((0, 0), (67, 100), "chunks-00000.safetensors"),
                                             ((67, 0), (67, 100), "chunks-00001.safetensors"),
                                             ((134, 0), (66, 100), "chunks-00002.safetensors")]
    sd = {"w": torch.zeros(200, 100)}
    dcp.load(sd, storage_reader=ShardckptReader(str(tmp_path / "out")), no_dist=True)
    assert torch.equal(sd["w"], full) and diff(str(tmp_path / "tp"), str(tmp_path / "out")).equal


def test_dcp_load_reads_the_resharded_checkpoint(saved: tuple[Path, dict], tmp_path: Path) -> None:
    root, sd = saved
    reshard(str(root / "ck"), str(tmp_path / "out"), to=3)
    target = _state()
    for group in target["optim"]["state"].values():  # other values everywhere
        for k, v in group.items():
            group[k] = torch.zeros_like(v)
    for k, v in target["model"].items():
        target["model"][k] = torch.zeros_like(v)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(target, storage_reader=ShardckptReader(str(tmp_path / "out")), no_dist=True)
    assert_same(target, sd)


def test_format_flat_is_import_dcp_ranks(saved: tuple[Path, dict], tmp_path: Path) -> None:
    root, _ = saved
    assert cli("import", "dcp", str(root / "dcp"), str(tmp_path / "chunks")).exit_code == 0
    r = cli("import", "dcp", str(root / "dcp"), str(tmp_path / "imported"), "--ranks", "3")
    assert r.exit_code == 0, r.output
    r = cli("reshard", str(tmp_path / "chunks"), str(tmp_path / "flat"), "--to", "3",
            "--format", "flat", "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["format"] == "flat"
    assert diff(str(tmp_path / "imported"), str(tmp_path / "flat")).equal
    a = CheckpointReader(str(tmp_path / "imported")).manifest
    b = CheckpointReader(str(tmp_path / "flat")).manifest
    assert (a.mesh, a.components, a.optimizer, a.per_rank_state) == \
        (b.mesh, b.components, b.optimizer, b.per_rank_state)
    assert {k: v for k, v in a.extras.items() if k != "source"} == \
        {k: v for k, v in b.extras.items() if k != "source"}
    assert [(f.role, f.index, f.size) for f in a.files] == [(f.role, f.index, f.size) for f in b.files]
    for fa, fb in zip(a.files, b.files):  # the data sections, byte for byte
        da = (tmp_path / "imported" / fa.path).read_bytes()[fa.data_start:]
        assert da == (tmp_path / "flat" / fb.path).read_bytes()[fb.data_start:], fa.path


def test_every_kind_of_target_is_a_reshard_target_reading_through_a_range_source(
        saved: tuple[Path, dict], tmp_path: Path) -> None:
    """The seams of reshard are typed: the target of each kind of source and ``--format`` is a
    :class:`ReshardTarget`, and what the chunked reads go through (the reader, or the counting
    reader of ``--format flat``) is a :class:`RangeSource`."""
    from shardckpt.checkpoint.chunked_read import RangeSource
    from shardckpt.tools.reshard import open_source
    from shardckpt.tools.reshard_target import ReshardTarget
    from shardckpt.tools.reshard_to_flat import _Counted

    root, _ = saved
    assert cli("import", "dcp", str(root / "dcp"), str(tmp_path / "flat"), "--ranks", "2").exit_code == 0
    kinds = {}
    for src, fmt in ((root / "ck", None), (root / "ck", "flat"), (tmp_path / "flat", None)):
        source = open_source(str(src), 3, fmt=fmt)
        assert isinstance(source.target, ReshardTarget), type(source.target)
        assert isinstance(source.reader, RangeSource)
        kinds[type(source.target).__name__] = source
    assert sorted(kinds) == ["ChunkedTarget", "FlatFromChunks", "FlatTarget"]
    counted = _Counted(kinds["FlatFromChunks"].reader, None)
    assert isinstance(counted, RangeSource) and counted.url == str(root / "ck")


def test_overwrite_workers_guards_and_bad_format(saved: tuple[Path, dict], tmp_path: Path) -> None:
    root, _ = saved
    out = str(tmp_path / "out")
    assert cli("reshard", str(root / "ck"), out, "--to", "2").exit_code == 0
    r = cli("reshard", str(root / "ck"), out, "--to", "3")
    assert r.exit_code != 0 and "--overwrite" in r.output
    first = CheckpointReader(out).manifest.save_id
    r = cli("reshard", str(root / "ck"), out, "--to", "3", "--workers", "2", "--overwrite")
    assert r.exit_code == 0, r.output
    m = CheckpointReader(out).manifest
    assert m.mesh.world_size == 3 and not (tmp_path / "out" / first).exists()
    assert diff(str(root / "ck"), out).equal
    r = cli("reshard", str(root / "ck"), str(tmp_path / "x"), "--to", "2", "--from", "4")
    assert r.exit_code != 0 and "--from 4" in r.output
    r = cli("reshard", str(root / "ck"), str(tmp_path / "x"), "--to", "2", "--format", "zarr")
    assert r.exit_code != 0 and "--format zarr" in r.output and not (tmp_path / "x").exists()


def test_local_chunked_reshard_loads_no_torch_or_numpy(saved: tuple[Path, dict],
                                                       tmp_path: Path) -> None:
    from test_startup import CRC_PACKAGE, HELP_ONLY, NEVER, loaded_by

    root, _ = saved
    mods = loaded_by(tmp_path, "reshard", str(root / "ck"), str(tmp_path / "r"), "--to", "3")
    assert not mods & set(NEVER + HELP_ONLY + CRC_PACKAGE + ("numpy",)), mods
