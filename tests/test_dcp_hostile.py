"""``shardckpt import dcp`` / ``export dcp`` and the chunk-tiling check against a hostile DCP
checkpoint: the author of the input is untrusted, the operator's paths are. Reading never leaves
the input's root, never writes more than the input holds, takes work O(n log n) in the number of
chunks, and every bad input is one error naming the file, with nothing committed."""

from __future__ import annotations

import io
import itertools
import os
import shutil
from pathlib import Path
from typing import Any

import pytest

from shardckpt.errors import IntegrityError, ShardckptError
from shardckpt.format import chunk_tiling, chunked
from shardckpt.format.chunk_tiling import tiling_problems
from shardckpt.format.chunked import ChunkRecord, ChunkedTensor
from shardckpt.format.manifest import MANIFEST_NAME
from shardckpt.format.parse_context import MAX_LISTED

from testing.cli import cli, ok, one_line_error
from testing.tilings import split_tiling

torch = pytest.importorskip("torch")
pytest.importorskip("torch.distributed.checkpoint")

from shardckpt.interop.dcp.export import export_dcp  # noqa: E402
from shardckpt.interop.dcp.import_ import import_dcp  # noqa: E402
from testing.dcp_hostile import (  # noqa: E402
    blob_checkpoint, grid, one_payload_checkpoint, payload, tiled_checkpoint,
)

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

SECRET = b"aws_secret_access_key = wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY\n"


def nothing_written(dst: Path) -> None:
    assert not (dst / MANIFEST_NAME).exists()
    assert not dst.exists() or not [p for p in dst.rglob("*") if p.is_file()]


def refused(src: Path, tmp_path: Path, *needles: str) -> str:
    dst = tmp_path / "dst"
    with pytest.raises(ShardckptError) as e:
        import_dcp(str(src), str(dst))
    for n in needles:
        assert n in str(e.value), (n, str(e.value))
    assert len(str(e.value)) < 2000
    nothing_written(dst)
    return str(e.value)


# ------------------------------------------------------------------------------ symbolic links


@pytest.fixture
def credentials(tmp_path: Path) -> Path:
    f = tmp_path / "home" / ".aws" / "credentials"
    f.parent.mkdir(parents=True)
    f.write_bytes(SECRET)
    return f


def test_payload_linked_outside_the_source_is_refused(tmp_path: Path, credentials: Path) -> None:
    src = blob_checkpoint(tmp_path / "src", {"stolen": SECRET})
    (src / "__0_0.distcp").unlink()
    (src / "__0_0.distcp").symlink_to(credentials)
    msg = refused(src, tmp_path, "__0_0.distcp", str(credentials), "symbolic link")
    assert SECRET.decode() not in msg
    r = cli("import", "dcp", str(src), str(tmp_path / "cli"))
    one_line_error(r, "__0_0.distcp", str(credentials))
    nothing_written(tmp_path / "cli")


def test_metadata_linked_outside_the_source_is_refused(tmp_path: Path) -> None:
    elsewhere = blob_checkpoint(tmp_path / "elsewhere", {"v": b"12345"})
    src = tmp_path / "src"
    src.mkdir()
    shutil.copy(elsewhere / "__0_0.distcp", src / "__0_0.distcp")
    (src / ".metadata").symlink_to(elsewhere / ".metadata")
    refused(src, tmp_path, str(src / ".metadata"), str(elsewhere / ".metadata"))


def test_links_that_stay_inside_the_source_are_followed(tmp_path: Path) -> None:
    """Like a Hugging Face cache: files that are links into a ``blobs`` folder of the root, and
    a root that is itself a link (the operator's path, trusted)."""
    src = blob_checkpoint(tmp_path / "real", {"a": b"first", "b": b"second"})
    (src / "blobs").mkdir()
    os.replace(src / "__0_0.distcp", src / "blobs" / "0123abcd")
    (src / "__0_0.distcp").symlink_to("blobs/0123abcd")
    (tmp_path / "link").symlink_to(src)
    m = import_dcp(str(tmp_path / "link"), str(tmp_path / "ck"))
    assert m.chunked is not None and set(m.chunked.blobs) == {"a", "b"}


def test_export_refuses_a_chunks_file_linked_outside(source: Path, tmp_path: Path) -> None:
    import_dcp(str(source), str(tmp_path / "ck"))
    chunks = next((tmp_path / "ck").rglob("chunks-*.safetensors"))
    moved = tmp_path / "outside.safetensors"
    os.replace(chunks, moved)
    chunks.symlink_to(moved)
    with pytest.raises(IntegrityError, match="symbolic link") as e:
        export_dcp(str(tmp_path / "ck"), str(tmp_path / "out"))
    assert chunks.name in str(e.value) and str(moved) in str(e.value)
    assert not (tmp_path / "out" / ".metadata").exists()
    assert not list((tmp_path / "out").glob("*.distcp")) if (tmp_path / "out").exists() else True


# ------------------------------------------------------------------- payloads that amplify


def test_stride0_payload_declared_huge_is_refused_before_writing(tmp_path: Path) -> None:
    """A 1.5 KB payload (one element, expanded) that the metadata says is 2**20 floats."""
    n = 1 << 20
    data = payload(torch.zeros(1).expand(n))
    assert len(data) < 4096
    src = one_payload_checkpoint(tmp_path / "src", "w", torch.float32, (n,), data)
    refused(src, tmp_path, "__0_0.distcp", "'w'")
    r = cli("import", "dcp", str(src), str(tmp_path / "cli"))
    one_line_error(r, "__0_0.distcp")
    nothing_written(tmp_path / "cli")


@pytest.mark.parametrize("view", ["stride 0", "overlapping", "offset stride 0"])
def test_views_that_repeat_storage_elements_are_refused(tmp_path: Path, view: str) -> None:
    """Small enough to fit its payload's length: refused for the view itself, in the
    ``torch.load`` path (the allow-listing reader hands a strided payload over to it)."""
    base = torch.arange(8, dtype=torch.float32)
    t = {"stride 0": base[:1].expand(16), "overlapping": base.as_strided((4, 4), (1, 1)),
         "offset stride 0": base.as_strided((4, 4), (1, 0), 2)}[view]
    src = one_payload_checkpoint(tmp_path / "src", "w", torch.float32, tuple(t.shape), payload(t))
    refused(src, tmp_path, "__0_0.distcp", "'w'", "storage")


def test_compressed_payload_is_refused_before_it_is_inflated(tmp_path: Path) -> None:
    import zipfile

    plain = payload(torch.zeros(1 << 18))
    zin, out = zipfile.ZipFile(io.BytesIO(plain)), io.BytesIO()
    with zipfile.ZipFile(out, "w") as zo:
        for name in zin.namelist():
            zo.writestr(name, zin.read(name), compress_type=zipfile.ZIP_DEFLATED)
    # a tensor of one element viewing a storage that inflates 100-fold
    src = one_payload_checkpoint(tmp_path / "src", "w", torch.float32, (1 << 18,), out.getvalue())
    refused(src, tmp_path, "__0_0.distcp", "'w'")


def test_a_plain_strided_payload_still_imports(tmp_path: Path) -> None:
    """A transposed (non-contiguous but non-overlapping) payload is decoded by torch.load."""
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4).t()
    src = one_payload_checkpoint(tmp_path / "src", "w", torch.float32, (4, 3), payload(t))
    m = import_dcp(str(src), str(tmp_path / "ck"))
    assert m.chunked is not None and m.chunked.tensors["w"].shape == (4, 3)


# ------------------------------------------------------------ numbers out of every range


@pytest.mark.parametrize("field", ["offset", "length", "chunk offset", "chunk size", "shape"])
def test_huge_integers_in_metadata_are_one_error(source: Path, tmp_path: Path, field: str) -> None:
    from testing.dcp_hostile import write_metadata
    from testing.dcp_states import metadata

    src = Path(shutil.copytree(source, tmp_path / "src"))
    md = metadata(src)
    huge = 10 ** 5000
    key = next(k for k in md.storage_data if k.fqn == "extra.scale")
    info = md.storage_data[key]
    tmd = md.state_dict_metadata["extra.scale"]
    if field == "offset":
        info.offset = huge
    elif field == "length":
        info.length = huge
    elif field == "chunk offset":
        tmd.chunks[0].offsets = torch.Size([huge, 0])
    elif field == "chunk size":
        tmd.chunks[0].sizes = torch.Size([huge, 3])
    else:
        tmd.size = torch.Size([huge, 3])
        tmd.chunks[0].sizes = torch.Size([huge, 3])
    write_metadata(src, md)
    msg = refused(src, tmp_path, ".metadata", "'extra.scale'")
    assert "0" * 100 not in msg
    one_line_error(cli("import", "dcp", str(src), str(tmp_path / "cli")), ".metadata")


# ----------------------------------------------- hyper-parameters that cannot be recorded


def _adamw_checkpoint(path: Path, lr: Any) -> Path:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from testing.dcp_states import dcp_save

    torch.manual_seed(0)
    m = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    m(torch.ones(1, 3)).sum().backward()
    opt.step()
    msd, osd = get_state_dict(m, opt)
    osd["param_groups"][0]["lr"] = lr
    dcp_save({"model": msd, "optim": osd}, path)
    return path


@pytest.mark.parametrize("lr", ["nan", "inf", "tensor", "bytes", "huge int", "string"])
def test_unrecordable_learning_rate_is_one_error(tmp_path: Path, lr: str) -> None:
    value = {"nan": float("nan"), "inf": float("-inf"), "tensor": torch.tensor([0.1, 0.2]),
             "bytes": b"\x00lr", "huge int": 10 ** 5000, "string": "0.1"}[lr]
    src = _adamw_checkpoint(tmp_path / "src", value)
    r = cli("import", "dcp", str(src), str(tmp_path / "flat"), "--ranks", "2")
    line = one_line_error(r, str(src), "lr")
    assert "0" * 100 not in line
    nothing_written(tmp_path / "flat")


def test_a_plain_learning_rate_still_imports(tmp_path: Path) -> None:
    src = _adamw_checkpoint(tmp_path / "src", 3e-4)
    ok(cli("import", "dcp", str(src), str(tmp_path / "flat"), "--ranks", "2"))


# ------------------------------------------------------------------------- the tiling check


def _tensor(shape: tuple[int, ...], boxes: Any) -> ChunkedTensor:
    return ChunkedTensor("t", "float32", shape, tuple(
        ChunkRecord(tuple(o), tuple(s), "f", 0, 0) for o, s in boxes))


def _staircase(n: int) -> tuple[tuple[int, int], list[Any]]:
    """n strips that span all of dim 0 beside n rows that split dim 0: a sweep along either dim
    meets every strip at once (what made the old check quadratic)."""
    boxes = [((0, j), (n, 1)) for j in range(n)] + [((i, n), (1, n)) for i in range(n)]
    return (n, 2 * n), boxes


def _grid3(k: int) -> tuple[tuple[int, ...], list[Any]]:
    return (k, k, k), [((a, b, c), (1, 1, 1)) for a in range(k) for b in range(k) for c in range(k)]


#: 25k chunks each: a check that compares pairs does 3e8 steps here, the bounds below allow 1.6e6
#: (the claim is the work per chunk, which does not depend on how many there are)
MANY = 25_000
LARGE = {
    "grid 2-D": lambda: ((159, 159), grid(159, 159)),
    "rows": lambda: ((MANY, 8), [((i, 0), (1, 8)) for i in range(MANY)]),
    "staircase": lambda: _staircase(MANY // 2),
    "grid 3-D": lambda: _grid3(30),
}


@pytest.mark.parametrize("layout", list(LARGE))
def test_tiling_check_of_many_chunks_is_linear_work(layout: str) -> None:
    shape, boxes = LARGE[layout]()
    n = len(boxes)
    assert n >= MANY
    work = chunk_tiling.TilingWork()
    assert tiling_problems(_tensor(shape, boxes), work) == []
    assert work.total <= 20 * n, (work, n)


@pytest.mark.parametrize("layout", list(LARGE))
def test_one_bad_chunk_among_many_is_named_in_bounded_work(layout: str) -> None:
    shape, boxes = LARGE[layout]()
    n = len(boxes)
    (o, s), rest = boxes[n // 2], boxes[:n // 2] + boxes[n // 2 + 1:]
    # the middle chunk moved by one along a dim: an overlap and a gap
    d = next(d for d in range(len(shape)) if o[d] + s[d] < shape[d])
    moved = (tuple(x + (i == d) for i, x in enumerate(o)), s)
    work = chunk_tiling.TilingWork()
    problems = tiling_problems(_tensor(shape, rest + [moved]), work)
    assert problems and all(p.startswith("chunks offsets") and p.endswith("overlap")
                            for p in problems), problems[:2]
    assert work.total <= 64 * n, (work, n)
    # a chunk left out: a gap, found in linear work too
    work = chunk_tiling.TilingWork()
    problems = tiling_problems(_tensor(shape, rest), work)
    assert problems == [f"its chunks hold {_numel(shape) - _numel(s)} of its {_numel(shape)} "
                        "elements; a chunked tensor must be stored whole"]
    assert work.total <= 64 * n, (work, n)


def _numel(shape: Any) -> int:
    out = 1
    for d in shape:
        out *= d
    return out


def test_import_of_many_chunks_counts_no_pairs(tmp_path: Path) -> None:
    """The import runs the same check: 4096 chunks of a 64 x 64 tensor, each tested in a constant
    number of steps (the old check compared every chunk of a row band with the rest of it)."""
    src = tiled_checkpoint(tmp_path / "src", (64, 64), grid(64, 64))
    seen: list[Any] = []
    real = chunked.tiling_problems

    def counted(t: Any, work: Any = None) -> list[str]:
        seen.append(chunk_tiling.TilingWork())
        return real(t, seen[-1])

    import shardckpt.interop.dcp.source as dcp_import
    mp = pytest.MonkeyPatch()
    mp.setattr(dcp_import, "tiling_problems", counted)
    mp.setattr(chunked, "tiling_problems", counted)
    try:
        m = import_dcp(str(src), str(tmp_path / "ck"))
    finally:
        mp.undo()
    assert m.chunked is not None and len(m.chunked.tensors["t"].chunks) == 64 * 64
    assert seen and all(w.total <= 20 * 64 * 64 for w in seen)


# -------------------------------------------- the same answers as comparing every pair


def brute_force(t: ChunkedTensor) -> tuple[str, set[tuple[int, int]]]:
    """(kind, overlapping pairs by index) of the old definition: outside, overlap, gap or ok."""
    chunks = t.chunks
    if any(o + s > d for c in chunks for o, s, d in zip(c.offsets, c.sizes, t.shape)):
        return "outside", set()
    pairs = set()
    for i, j in itertools.combinations(range(len(chunks)), 2):
        a, b = chunks[i], chunks[j]
        if a.numel and b.numel and all(x < y + m and y < x + k for x, k, y, m in
                                       zip(a.offsets, a.sizes, b.offsets, b.sizes)):
            pairs.add((i, j))
    if pairs:
        return "overlap", pairs
    return ("ok" if sum(c.numel for c in chunks) == t.numel else "gap"), set()


def _pairs(t: ChunkedTensor, problems: list[str]) -> set[tuple[int, int]]:
    from shardckpt.format.chunk_tiling import _box

    index = {_box(c): i for i, c in reversed(list(enumerate(t.chunks)))}
    out = set()
    for p in problems:
        a, b = p.removeprefix("chunks ").removesuffix(" overlap").split(" and ")
        ia, ib = index[a], index[b]
        out.add((min(ia, ib), max(ia, ib)))
    return out


def _check_like_brute_force(t: ChunkedTensor) -> None:
    kind, pairs = brute_force(t)
    problems = tiling_problems(t)
    if kind == "ok":
        assert problems == []
    elif kind == "outside":
        assert problems and all("lies outside the shape" in p for p in problems)
    elif kind == "gap":
        assert len(problems) == 1 and problems[0].startswith("its chunks hold "), problems
    else:
        assert problems and all(p.endswith(" overlap") for p in problems), problems
        found = {(min(a, b), max(a, b)) for a, b in _pairs(t, problems)}
        # distinct chunks with equal boxes are one box to the message: compare boxes
        boxes = lambda ps: {frozenset((t.chunks[a], t.chunks[b])) for a, b in ps}  # noqa: E731
        if len(pairs) <= MAX_LISTED:
            assert boxes(found) == boxes(pairs)
        else:
            assert len(problems) == MAX_LISTED + 1 and boxes(found) <= boxes(pairs)


hypothesis = pytest.importorskip("hypothesis")
st = hypothesis.strategies


@hypothesis.settings(max_examples=300, deadline=None, derandomize=True)
@hypothesis.given(shape=st.lists(st.integers(1, 5), min_size=0, max_size=4),
                  cuts=st.lists(st.integers(0, 50), max_size=12),
                  perturb=st.lists(st.tuples(st.integers(0, 99), st.integers(0, 3),
                                             st.integers(-2, 2), st.booleans()), max_size=3),
                  drop=st.lists(st.integers(0, 99), max_size=2),
                  empties=st.integers(0, 2))
def test_tiling_check_agrees_with_comparing_every_pair(shape: list[int], cuts: list[int],
                                                       perturb: list[Any], drop: list[int],
                                                       empties: int) -> None:
    shape_ = tuple(shape)
    boxes = [list(map(list, b)) for b in split_tiling((0,) * len(shape_), shape_, cuts)]
    for i, d, delta, size in perturb:
        if shape_:
            box = boxes[i % len(boxes)]
            box[1 if size else 0][d % len(shape_)] = max(0, box[1 if size else 0][d % len(shape_)]
                                                         + delta)
    for i in drop:
        if len(boxes) > 1:
            boxes.pop(i % len(boxes))
    boxes += [[[0] * len(shape_), [0] * len(shape_)]] * (empties if shape_ else 0)
    _check_like_brute_force(_tensor(shape_, [(tuple(o), tuple(s)) for o, s in boxes]))


def test_tiling_check_on_the_cases_of_the_old_tests() -> None:
    for shape, boxes in [
        ((4,), [((0,), (2,)), ((2,), (2,)), ((1,), (2,))]),
        ((6, 5), [((0, 0), (3, 5)), ((2, 0), (3, 5))]),
        ((7, 5), [((0, 0), (3, 5)), ((3, 0), (3, 5))]),
        ((), [((), ()), ((), ())]),
        ((2, 2), [((0, 0), (2, 2))] * 14),
    ]:
        _check_like_brute_force(_tensor(shape, boxes))
