"""Consolidation into Hugging Face safetensors: same bytes for every world size and mesh, exact
values, bf16 bit-identical to torch's round-to-nearest-even, sharding by size, tied parameters,
buffers, optimizer states, bounded memory, and failures that leave no index."""

from __future__ import annotations

import json
import os
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open
from typer.testing import CliRunner

from shardckpt.tools import synth
from shardckpt.checkpoint.reader import CheckpointReader
from shardckpt.cli.main import app
from shardckpt.checkpoint.pieces import cast_bytes, decode, f32_to_bf16_bits
from shardckpt.tools.consolidate import MODEL_INDEX, OPTIMIZER_INDEX, PROVENANCE, consolidate
from shardckpt.errors import ConfigError, IncompleteCheckpointError, IntegrityError

torch = pytest.importorskip("torch")

PARAMS, SEED = 50_000, 7
MESHES = [(1, 1), (3, 1), (4, 1), (7, 1), (16, 1), (8, 2)]  # (world size, replicate)
TIED = "lm_head.weight"
BUFFER = "model.rotary_emb.inv_freq"


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[int, int], str]:
    root = tmp_path_factory.mktemp("src")
    out = {}
    for ranks, rep in MESHES:
        dst = str(root / f"n{ranks}r{rep}")
        synth.synthesize(dst, PARAMS, ranks, rep, units=2, seed=SEED)
        out[(ranks, rep)] = dst
    return out


def tensors(dst: str | Path, prefix: str = "model") -> dict[str, np.ndarray]:
    """Every tensor of a consolidated set, read with safetensors, as raw numpy arrays."""
    index = json.loads((Path(dst) / f"{prefix}.safetensors.index.json").read_text())
    out = {}
    for name in sorted(set(index["weight_map"].values())):
        with safe_open(str(Path(dst) / name), "pt") as f:
            assert f.metadata() == {"format": "pt"}
            for k in f.keys():
                t = f.get_tensor(k)
                out[k] = t.view(torch.int16).numpy() if t.dtype == torch.bfloat16 else t.numpy()
    assert set(out) == set(index["weight_map"])
    return out


def expected_params(ckpt: str) -> dict[str, tuple[tuple[int, ...], np.ndarray]]:
    layout = CheckpointReader(ckpt).manifest.components["model"].layout
    return {p.fqn: (p.shape, synth.values(SEED, p.fqn, "master", 0, p.numel).reshape(p.shape))
            for p in layout.params}


def inv_freq(n: int) -> np.ndarray:
    return (1.0 / (10000.0 ** (np.arange(n, dtype=np.float32) / max(1, n)))).astype(np.float32)


# ------------------------------------------------------------------------------- equal for all N


def test_same_bytes_for_every_world_size_and_mesh(ckpts: dict, tmp_path: Path) -> None:
    blobs = {}
    for mesh, src in ckpts.items():
        r = consolidate(src, str(tmp_path / f"out{mesh[0]}x{mesh[1]}"), max_shard_size=40_000)
        assert len(r.files) > 1
        d = tmp_path / f"out{mesh[0]}x{mesh[1]}"
        blobs[mesh] = {n: (d / n).read_bytes() for n, _ in r.files} | {MODEL_INDEX: (d / MODEL_INDEX).read_bytes()}
    first = blobs[MESHES[0]]
    for mesh, files in blobs.items():
        assert files == first, mesh


def test_fp32_equals_synth_values_exactly(ckpts: dict, tmp_path: Path) -> None:
    src = ckpts[(7, 1)]
    consolidate(src, str(tmp_path / "o"), dtype="fp32", keep_buffers=True)
    got = tensors(tmp_path / "o")
    want = expected_params(src)
    assert "model.frozen_scale" in got  # frozen params are included
    for fqn, (shape, v) in want.items():
        assert got[fqn].dtype == np.float32 and got[fqn].shape == shape
        np.testing.assert_array_equal(got[fqn], v)
    assert set(got) == set(want) | {BUFFER}
    np.testing.assert_array_equal(got[BUFFER], inv_freq(got[BUFFER].shape[0]))


def test_bf16_output_is_torch_rne_bit_for_bit(ckpts: dict, tmp_path: Path) -> None:
    src = ckpts[(4, 1)]
    r = consolidate(src, str(tmp_path / "o"), keep_buffers=True)  # bf16 is the default
    assert r.dtype == "bfloat16"
    got = tensors(tmp_path / "o")
    for fqn, (_, v) in expected_params(src).items():
        ref = torch.from_numpy(v).to(torch.bfloat16).view(torch.int16).numpy()
        np.testing.assert_array_equal(got[fqn], ref, err_msg=fqn)
    ref = torch.from_numpy(inv_freq(got[BUFFER].shape[0])).to(torch.bfloat16).view(torch.int16).numpy()
    np.testing.assert_array_equal(got[BUFFER], ref)  # float buffers are cast like parameters


def _edge_floats() -> np.ndarray:
    rng = np.random.default_rng(0)
    bits = rng.integers(0, 1 << 32, 200_000, dtype=np.uint64).astype(np.uint32)
    special = np.array([0, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00000, 0x7F800001,
                        0xFFFFFFFF, 0x7F7FFFFF, 0xFF7FFFFF, 0x00000001, 0x807FFFFF, 0x3F808000,
                        0x3F818000, 0x3F80FFFF, 0x3F817FFF, 0x7F7F8000, 0x477FE000], np.uint32)
    ties = (rng.integers(0, 1 << 16, 1000).astype(np.uint32) << 16) | 0x8000  # exact ties
    return np.concatenate([special, bits, ties]).view(np.float32)


def test_bf16_rounding_matches_torch_including_edge_cases() -> None:
    x = _edge_floats()
    ours = f32_to_bf16_bits(x)
    ref = torch.from_numpy(x.copy()).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    nan = np.isnan(x)
    np.testing.assert_array_equal(ours[~nan], ref[~nan])
    assert np.isnan(decode(ref[nan].tobytes(), "bfloat16")).all()
    assert (ours[nan] == 0xFFFF).all()  # the NaN torch's CPU cast gives
    if (ref[nan] == 0xFFFF).all():
        np.testing.assert_array_equal(ours, ref)


def test_fp16_and_fp8_casts_match_torch() -> None:
    x = _edge_floats()
    ours = np.asarray(cast_bytes(x.tobytes(), "float32", "float16")).view(np.uint16)
    ref = torch.from_numpy(x.copy()).to(torch.float16).view(torch.int16).numpy().view(np.uint16)
    nan = np.isnan(x)
    np.testing.assert_array_equal(ours[~nan], ref[~nan])
    # float64 goes through float32 (double rounding), as torch does; numpy alone would differ
    rng = np.random.default_rng(1)
    x64 = rng.standard_normal(100_000)
    h = x64.astype(np.float16).astype(np.float64)
    x64 = np.concatenate([x64, h + np.ldexp(np.abs(h), -11) * (1 - 1e-12)])  # just below ties
    for name, tdt in (("float16", torch.float16), ("bfloat16", torch.bfloat16)):
        ours = np.asarray(cast_bytes(x64.tobytes(), "float64", name)).view(np.uint16)
        ref = torch.from_numpy(x64).to(tdt).view(torch.int16).numpy().view(np.uint16)
        np.testing.assert_array_equal(ours, ref)
    codes = np.arange(256, dtype=np.uint8)
    for name in ("float8_e4m3fn", "float8_e5m2"):
        want = torch.from_numpy(codes.copy()).view(getattr(torch, name)).to(torch.float32).numpy()
        np.testing.assert_array_equal(decode(codes.tobytes(), name), want)


def write_mixed(dst: str, ranks: int) -> None:
    """A checkpoint with a frozen bf16 parameter, and int64 and float16 buffers."""
    from shardckpt.checkpoint.reader import as_storage
    from shardckpt.checkpoint.writer import CheckpointSpec, CheckpointWriter
    from shardckpt.format.layout import Mesh, ParamInfo, build_layout
    from shardckpt.format.manifest import BufferSpec, Component, default_states

    infos = [ParamInfo("a.weight", (40, 24), "float32", True, "a"),
             ParamInfo("a.frozen", (7, 9), "bfloat16", False, "a"), ParamInfo("b.bias", (24,), "float32")]
    buffers = (BufferSpec("pos_ids", (16,), "int64"), BufferSpec("scale", (3,), "float16"))
    mesh = Mesh.for_world(ranks)
    layout = build_layout(infos, mesh)
    states = {g.name: default_states(g, ("exp_avg",)) for g in layout.groups}
    writer = CheckpointWriter(as_storage(dst), CheckpointSpec(mesh, {"model": Component(
        "model", layout, states, {}, buffers)}))

    def producer(shard: int):  # noqa: ANN202
        def produce(slot):  # noqa: ANN001, ANN202
            g = layout.group(slot.name.rsplit(".", 1)[0])
            lo, hi = layout.shard_range(g, shard)
            flat = np.zeros(hi - lo, np.float32)
            for p in layout.group_params(g):
                a, b = max(lo, p.offset), min(hi, p.offset + p.numel)
                if a < b:
                    flat[a - lo:b - lo] = synth.values(SEED, p.fqn, slot.name.rsplit(".", 1)[1],
                                                       a - p.offset, b - p.offset)
            yield f32_to_bf16_bits(flat) if slot.dtype == "bfloat16" else flat
        return produce

    entries = [writer.write_shard(s, producer(s)) for s in range(ranks)]
    bufs = {"pos_ids": np.arange(16, dtype=np.int64), "scale": np.array([0.5, 1.0, 65504], np.float16)}
    entries.append(writer.write_buffers(lambda slot: iter([bufs[slot.name]])))
    writer.commit(entries)


def test_frozen_bf16_and_non_float_buffers(tmp_path: Path) -> None:
    write_mixed(str(tmp_path / "m2"), 2)
    write_mixed(str(tmp_path / "m5"), 5)
    consolidate(str(tmp_path / "m5"), str(tmp_path / "f32"), dtype="fp32", keep_buffers=True)
    consolidate(str(tmp_path / "m2"), str(tmp_path / "b16"), keep_buffers=True)
    f32, b16 = tensors(tmp_path / "f32"), tensors(tmp_path / "b16")
    frozen = f32_to_bf16_bits(synth.values(SEED, "a.frozen", "master", 0, 63)).view(np.int16).reshape(7, 9)
    np.testing.assert_array_equal(b16["a.frozen"], frozen)  # bf16 stays bf16, bit for bit
    np.testing.assert_array_equal(f32["a.frozen"], decode(frozen.tobytes(), "bfloat16").reshape(7, 9))
    assert f32["pos_ids"].dtype == b16["pos_ids"].dtype == np.int64  # integers keep their dtype
    np.testing.assert_array_equal(b16["pos_ids"], np.arange(16))
    np.testing.assert_array_equal(f32["scale"], np.array([0.5, 1.0, 65504], np.float32))
    from shardckpt.tools.diff import diff

    assert diff(str(tmp_path / "m2"), str(tmp_path / "m5")).equal


# ----------------------------------------------------------------------------- layout of output


def test_split_by_max_shard_size(ckpts: dict, tmp_path: Path) -> None:
    limit = 20_000
    r = consolidate(ckpts[(3, 1)], str(tmp_path / "o"), max_shard_size=limit)
    index = json.loads((tmp_path / "o" / MODEL_INDEX).read_text())
    k = len(r.files)
    assert k >= 3 and [n for n, _ in r.files] == [f"model-{i:05d}-of-{k:05d}.safetensors" for i in range(1, k + 1)]
    got = tensors(tmp_path / "o")
    assert set(index["weight_map"]) == set(expected_params(ckpts[(3, 1)]))  # buffers left out
    assert r.left_out_buffers == (BUFFER,)
    assert index["metadata"]["total_size"] == sum(a.nbytes for a in got.values()) == r.total_size
    for name, size in r.files:
        assert (tmp_path / "o" / name).stat().st_size == size
        with safe_open(str(tmp_path / "o" / name), "np") as f:
            if len(list(f.keys())) > 1:
                assert size <= limit, name  # only a lone oversized tensor may pass the limit
    assert any(size > limit for _, size in r.files)  # the embedding (vocab x d bf16) alone


def test_tied_param_written_once_and_recorded(ckpts: dict, tmp_path: Path) -> None:
    r = consolidate(ckpts[(1, 1)], str(tmp_path / "o"))
    index = json.loads((tmp_path / "o" / MODEL_INDEX).read_text())
    assert TIED not in index["weight_map"] and "model.embed_tokens.weight" in index["weight_map"]
    prov = json.loads((tmp_path / "o" / PROVENANCE).read_text())
    assert prov["omitted_aliases"] == {TIED: "model.embed_tokens.weight"} == dict(r.omitted_aliases)
    m = CheckpointReader(ckpts[(1, 1)]).manifest
    assert prov["save_id"] == m.save_id and prov["step"] == 100 and prov["dtype"] == "bfloat16"


def test_optimizer_set(ckpts: dict, tmp_path: Path) -> None:
    src = ckpts[(7, 1)]
    r = consolidate(src, str(tmp_path / "o"), optimizer=True, max_shard_size=100_000)
    assert r.optimizer_files
    opt = tensors(tmp_path / "o", "optimizer")
    layout = CheckpointReader(src).manifest.components["model"].layout
    trained = [p for p in layout.params if layout.group(p.group).requires_grad]
    assert set(opt) == {f"{p.fqn}.{k}" for p in trained for k in synth.ADAMW_KINDS}
    assert "model.layers.0.mlp.up_proj.weight.exp_avg" in opt
    for p in trained:
        for k in synth.ADAMW_KINDS:
            a = opt[f"{p.fqn}.{k}"]
            assert a.dtype == np.float32 and a.shape == p.shape
            np.testing.assert_array_equal(a, synth.values(SEED, p.fqn, k, 0, p.numel).reshape(p.shape))
    meta = json.loads((tmp_path / "o" / OPTIMIZER_INDEX).read_text())["metadata"]
    assert meta["optimizer"] == "adamw" and meta["total_size"] == sum(a.nbytes for a in opt.values())
    assert [pg["step"] for pg in meta["param_groups"]] == [100, 100]
    assert [pg["hparams"]["weight_decay"] for pg in meta["param_groups"]] == [0.1, 0.0]


def test_bounded_memory_gives_identical_output(tmp_path: Path) -> None:
    src = str(tmp_path / "big")
    synth.synthesize(src, 2_000_000, 3, seed=SEED, chunk_size=4096)
    consolidate(src, str(tmp_path / "a"), dtype="fp32")
    tracemalloc.start()
    try:
        r = consolidate(src, str(tmp_path / "b"), dtype="fp32", buffer_bytes=64 << 10)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    largest = max(os.path.getsize(tmp_path / "a" / n) for n, _ in r.files)
    assert largest > 7_000_000 and peak < 1_500_000  # the embedding alone is 4.3 MB in fp32
    for n, _ in r.files:
        assert (tmp_path / "a" / n).read_bytes() == (tmp_path / "b" / n).read_bytes()


def test_memory_destination(ckpts: dict, tmp_path: Path) -> None:
    import fsspec

    consolidate(ckpts[(3, 1)], str(tmp_path / "local"), max_shard_size=40_000)
    r = consolidate(ckpts[(3, 1)], "memory://consolidate-test/out", max_shard_size=40_000)
    fs = fsspec.filesystem("memory")
    for n, _ in r.files:
        assert fs.cat_file(f"/consolidate-test/out/{n}") == (tmp_path / "local" / n).read_bytes()
    assert fs.exists("/consolidate-test/out/" + MODEL_INDEX)
    fs.rm("/consolidate-test", recursive=True)


# ------------------------------------------------------------------------------------- failures


def test_corrupted_shard_midway_leaves_no_index(tmp_path: Path) -> None:
    src = str(tmp_path / "src")
    synth.synthesize(src, PARAMS, 4, seed=SEED, chunk_size=4096)
    reader = CheckpointReader(src)
    root = reader.manifest.components["model"].layout.param("model.embed_tokens.weight").group
    entry, a, _ = reader.state_range(3, root, "master", 0, 1)
    path = Path(src) / entry.path
    data = bytearray(path.read_bytes())
    data[a + 100] ^= 0xFF  # late in the read order: earlier output files complete first
    path.write_bytes(bytes(data))
    dst = tmp_path / "dst"
    with pytest.raises(IntegrityError, match="shard-00003-of-00004.safetensors"):
        consolidate(src, str(dst), max_shard_size=20_000)
    assert not (dst / MODEL_INDEX).exists()
    assert not dst.exists() or os.listdir(dst) == []  # partial files are removed too
    res = CliRunner().invoke(app, ["consolidate", src, str(tmp_path / "dst2")])
    assert res.exit_code == 1 and "shard-00003-of-00004.safetensors" in res.output
    assert "CRC32C" in res.output and len(res.output.strip().splitlines()) == 1


def test_existing_dst_refused_then_overwritten(ckpts: dict, tmp_path: Path) -> None:
    dst = tmp_path / "o"
    consolidate(ckpts[(3, 1)], str(dst), max_shard_size=10_000)
    before = sorted(os.listdir(dst))
    (dst / "config.json").write_text("{}")
    (dst / "model.safetensors").write_bytes(b"stale")  # transformers would prefer it to the index
    with pytest.raises(ConfigError, match="overwrite"):
        consolidate(ckpts[(3, 1)], str(dst))
    r = consolidate(ckpts[(4, 1)], str(dst), overwrite=True)
    after = sorted(os.listdir(dst))
    assert len(r.files) == 1 and len(before) > 4
    assert after == sorted(["config.json", MODEL_INDEX, PROVENANCE, r.files[0][0]])  # stale removed
    assert tensors(dst)  # readable
    with pytest.raises(ConfigError, match="destination is the source"):
        consolidate(ckpts[(3, 1)], ckpts[(3, 1)], overwrite=True)


def test_uncommitted_source_refused(ckpts: dict, tmp_path: Path) -> None:
    src = tmp_path / "torn"
    synth.synthesize(str(src), PARAMS, 2, seed=SEED)
    (src / "manifest.json").unlink()
    with pytest.raises(IncompleteCheckpointError, match="never committed"):
        consolidate(str(src), str(tmp_path / "o"))
    assert not (tmp_path / "o").exists()


# ------------------------------------------------------------------------------------------ CLI


def test_cli(ckpts: dict, tmp_path: Path) -> None:
    runner = CliRunner()
    src = ckpts[(3, 1)]
    res = runner.invoke(app, ["consolidate", src, str(tmp_path / "o"), "--dtype", "fp32",
                              "--max-shard-size", "20KB", "--optimizer", "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.output)
    assert doc["dtype"] == "float32" and len(doc["files"]) > 1 and doc["optimizer_files"]
    res = runner.invoke(app, ["consolidate", src, str(tmp_path / "o"), "--max-shard-size", "1e9"])
    assert res.exit_code != 0 and "--overwrite" in res.output
    res = runner.invoke(app, ["consolidate", src, str(tmp_path / "o"), "--overwrite", "--max-shard-size", "0.5GB"])
    assert res.exit_code == 0 and "1 files" in res.output
    for args, code, words in [
        (["--dtype", "fp8"], 2, "unknown dtype 'fp8'"),
        (["--component", "ema"], 2, "no component 'ema'"),
        (["--max-shard-size", "lots"], 2, "--max-shard-size lots: expected a size in bytes"),
    ]:
        res = runner.invoke(app, ["consolidate", src, str(tmp_path / "x"), *args])
        assert res.exit_code == code and words in res.output, res.output
    res = runner.invoke(app, ["consolidate", str(tmp_path / "missing"), str(tmp_path / "x")])
    assert res.exit_code == 1 and "missing: no such checkpoint" in res.output
    assert not (tmp_path / "x").exists()


def test_one_size_parser_for_every_option() -> None:
    """--max-shard-size, every --buffer and the importers' sizes share one parser: '64B' is 64
    bytes everywhere, G and GB mean 10**9, Gi and GiB 2**30."""
    from shardckpt.cli.common import parse_bytes

    assert parse_bytes("5GB", "s") == 5_000_000_000 and parse_bytes("500MB", "s") == 500_000_000
    assert parse_bytes("1e9", "s") == 1_000_000_000 and parse_bytes("2GiB", "s") == 2 << 30
    assert parse_bytes("64k", "s") == 64_000 and parse_bytes("123", "s") == 123
    assert parse_bytes("64B", "s") == parse_bytes("64", "s") == 64 and parse_bytes("5G", "s") == 5 * 10**9
    assert parse_bytes("2Gi", "s") == 2 << 30


def test_weights_only_read_fetches_about_the_weights(tmp_path: Path) -> None:
    """Format 1.0 keeps each file's master weights contiguous, so consolidating 64 shards whose
    per-group slots are smaller than a checksum chunk fetches the weights plus at most the two
    boundary chunks of each file — not the moments between (about 3x with the 0.1 order) — from
    a local source (mapped) and from a remote-like one (memory://, ranged reads, chunk cache)."""
    from shardckpt.storage import Storage

    src = tmp_path / "ck"
    m = synth.synthesize(str(src), params=150_000, ranks=64, units=4, chunk_size=4096)
    comp = m.components["model"]
    slots = [s for s in CheckpointReader(str(src)).slots.values() if s.name.endswith(".master")]
    assert max(s.end - s.begin for s in slots) < 4096  # each group's slot is below a chunk
    master = 64 * sum(s.end - s.begin for s in slots)
    total = sum(f.size for f in m.files)
    assert total > 3 * master
    bound = master + 2 * 4096 * len(m.files)
    local = consolidate(str(src), str(tmp_path / "hf"), dtype="float32", buffer_bytes=1 << 16)
    assert master <= local.bytes_read <= bound, (local.bytes_read, bound)
    mem = f"memory://consolidate-{os.getpid()}"
    Storage(mem).put("manifest.json", (src / "manifest.json").read_bytes())
    for f in m.files:
        Storage(mem).put(f.path, (src / f.path).read_bytes())
    remote = consolidate(mem, str(tmp_path / "hf2"), dtype="float32", buffer_bytes=1 << 16)
    assert master <= remote.bytes_read <= bound, (remote.bytes_read, bound)
    assert len(comp.layout.groups) >= 5
    assert (tmp_path / "hf" / "model.safetensors.index.json").exists()
