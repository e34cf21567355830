"""Hugging Face folders as a source (torch-free): headers, index, planned reads, bad input, import.

The bytes each rank reads are counted by a recording ``memory://``-style filesystem, not by the
code under test.
"""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from shardckpt.errors import ConfigError, IncompatibleLayoutError, IntegrityError, ManifestError
from shardckpt.interop.hf.import_ import fetch, import_hf, import_layout, match_tensors, plan_shard_reads
from shardckpt.interop.hf.source import open_hf
from shardckpt.format.layout import Mesh, ParamInfo, build_layout
from testing.cli import cli_process

SHAPES = {"model.embed_tokens.weight": (50, 8), "model.layers.0.mlp.up_proj.weight": (12, 8),
          "model.layers.0.input_layernorm.weight": (8,), "model.layers.1.mlp.up_proj.weight": (12, 8),
          "model.layers.1.input_layernorm.weight": (8,), "model.norm.weight": (8,),
          "lm_head.weight": (50, 8)}


def tensors(seed: int = 0, dtype: Any = np.float32) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {n: rng.standard_normal(s).astype(dtype) for n, s in SHAPES.items()}


def write_folder(path: Path, values: dict[str, np.ndarray], files: int = 3,
                 config: dict | None = None) -> Path:
    """A Hugging Face folder: ``files`` safetensors files and an index (one file: no index)."""
    path.mkdir(parents=True, exist_ok=True)
    names = list(values)
    if files == 1:
        save_file(values, str(path / "model.safetensors"))
    else:
        weight_map = {}
        for i in range(files):
            part = names[i::files]
            fname = f"model-{i + 1:05d}-of-{files:05d}.safetensors"
            save_file({n: values[n] for n in part}, str(path / fname))
            weight_map.update((n, fname) for n in part)
        (path / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map}))
    if config is not None:
        (path / "config.json").write_text(json.dumps(config))
    return path


def layout_for(shapes: dict[str, tuple[int, ...]], S: int, R: int = 1):  # noqa: ANN201
    infos = [ParamInfo(n, s, "float32", True, ".".join(n.split(".")[:3]) if ".layers." in n else "")
             for n, s in shapes.items()]
    return build_layout(infos, Mesh.hsdp(R, S), prefix="model.")


# --------------------------------------------------------------------------------- planning


@pytest.mark.parametrize("S", [1, 2, 3, 5, 16])
def test_reads_cover_every_shard_element_once(tmp_path: Path, S: int) -> None:
    src = open_hf(str(write_folder(tmp_path / "m", tensors())))
    layout = layout_for(SHAPES, S)
    seen: dict[str, np.ndarray] = {n: np.zeros(int(np.prod(s)), int) for n, s in SHAPES.items()}
    for r in range(S):
        covered = {g.name: np.zeros(layout.shard_numel(g), int) for g in layout.groups}
        for rd in plan_shard_reads(layout, r, src.tensors, max_bytes=40):
            assert (rd.stop - rd.start) * 4 <= 40
            seen[rd.tensor.name][rd.start:rd.stop] += 1
            covered[rd.group][rd.dst_offset:rd.dst_offset + rd.stop - rd.start] += 1
            p = layout.param(rd.tensor.name)
            lo, _ = layout.shard_range(p.group, r)
            assert lo + rd.dst_offset == p.offset + rd.start  # lands where the layout puts it
        for g in layout.groups:  # unpadded elements once, padding never
            lo, hi = layout.shard_range(g, r)
            want = (np.arange(lo, hi) < g.numel).astype(int)
            assert (covered[g.name] == want).all()
    assert all((v == 1).all() for v in seen.values())


def test_fetch_gives_the_file_bytes(tmp_path: Path) -> None:
    values = tensors(3)
    src = open_hf(str(write_folder(tmp_path / "m", values)))
    layout = layout_for(SHAPES, 3)
    for r in range(3):
        reads = plan_shard_reads(layout, r, src.tensors, max_bytes=64)
        for rd, raw in fetch(src, reads, buffer_bytes=100, workers=2):
            assert bytes(raw) == values[rd.tensor.name].reshape(-1)[rd.start:rd.stop].tobytes()


def test_each_rank_reads_its_share_through_a_recording_filesystem(tmp_path: Path) -> None:
    import fsspec
    from fsspec.implementations.memory import MemoryFileSystem

    class Recording(MemoryFileSystem):
        protocol = ("recmem",)
        nbytes = 0

        @classmethod
        def _strip_protocol(cls, path: str) -> str:
            return MemoryFileSystem._strip_protocol(path.removeprefix("recmem://"))

        def cat_file(self, path: str, start: Any = None, end: Any = None, **kw: Any) -> bytes:
            data = super().cat_file(path, start=start, end=end, **kw)
            type(self).nbytes += len(data)
            return data

    fsspec.register_implementation("recmem", Recording, clobber=True)
    big = {n: np.ones((s[0] * 40,) + s[1:], np.float32) for n, s in SHAPES.items()}
    local = write_folder(tmp_path / "m", big)
    fs = Recording()
    for f in local.iterdir():
        fs.pipe_file(f"/hf/{f.name}", f.read_bytes())
    total = sum(v.nbytes for v in big.values())
    metadata = sum(f.stat().st_size for f in local.iterdir()) - total
    shapes = {n: v.shape for n, v in big.items()}
    layout, S = layout_for(shapes, 4), 4
    per_rank = []
    for r in range(S):
        Recording.nbytes = 0
        src = open_hf("recmem:///hf")
        for _ in fetch(src, plan_shard_reads(layout, r, src.tensors, 1 << 12), 1 << 12):
            pass
        per_rank.append(Recording.nbytes - metadata)
    assert sum(per_rank) == total
    assert max(per_rank) <= total / S * 1.1, (per_rank, total)


# ------------------------------------------------------------------------------- bad input


def test_a_missing_shard_file_is_named(tmp_path: Path) -> None:
    folder = write_folder(tmp_path / "m", tensors())
    (folder / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(IntegrityError, match=r"model-00002-of-00003\.safetensors: missing; "
                                             r"model\.safetensors\.index\.json names it"):
        open_hf(str(folder))


def test_a_truncated_file_is_named_with_a_tensor(tmp_path: Path) -> None:
    folder = write_folder(tmp_path / "m", tensors(), files=1)
    f = folder / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-10])
    with pytest.raises(IntegrityError, match=r"model\.safetensors: tensor '.*': data_offsets"):
        open_hf(str(folder))


def test_header_offsets_past_the_end_are_refused(tmp_path: Path) -> None:
    folder = write_folder(tmp_path / "m", {"w": np.zeros(4, np.float32)}, files=1)
    f = folder / "model.safetensors"
    raw = f.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    header["w"]["data_offsets"] = [0, 400]
    header["w"]["shape"] = [100]
    text = json.dumps(header).encode()
    f.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n:])
    with pytest.raises(IntegrityError, match=r"model\.safetensors: tensor 'w': data_offsets \[0, 400\]"):
        open_hf(str(folder))


def test_a_header_length_past_the_end_is_refused(tmp_path: Path) -> None:
    folder = write_folder(tmp_path / "m", {"w": np.zeros(4, np.float32)}, files=1)
    f = folder / "model.safetensors"
    f.write_bytes(struct.pack("<Q", 10_000) + f.read_bytes()[8:])
    with pytest.raises(IntegrityError, match=r"model\.safetensors: header length 10000 runs past"):
        open_hf(str(folder))


def test_an_index_naming_a_tensor_the_file_lacks(tmp_path: Path) -> None:
    folder = write_folder(tmp_path / "m", tensors())
    idx = folder / "model.safetensors.index.json"
    doc = json.loads(idx.read_text())
    doc["weight_map"]["ghost.weight"] = "model-00001-of-00003.safetensors"
    idx.write_text(json.dumps(doc))
    with pytest.raises(IntegrityError, match=r"00001-of-00003\.safetensors: .* places ghost\.weight"):
        open_hf(str(folder))


def test_an_empty_folder(tmp_path: Path) -> None:
    with pytest.raises(ManifestError, match="holds neither model.safetensors"):
        open_hf(str(tmp_path))


def test_every_offender_in_one_error(tmp_path: Path) -> None:
    values = tensors()
    values["model.norm.weight"] = np.zeros(9, np.float32)         # wrong shape
    values["model.layers.0.input_layernorm.weight"] = np.zeros(8, np.int64)  # not a float
    values["extra.bias"] = np.zeros(2, np.float32)                  # unexpected
    del values["model.layers.1.mlp.up_proj.weight"]                 # missing
    src = open_hf(str(write_folder(tmp_path / "m", values)))
    targets = {n: (s, "float32") for n, s in SHAPES.items()}
    m = match_tensors(targets, src.tensors)
    err = m.error(src.url)
    assert isinstance(err, IncompatibleLayoutError)
    text = str(err)
    for needle in ("missing from the file: model.layers.1.mlp.up_proj.weight",
                   "not in the model: extra.bias",
                   "model.norm.weight (model-00002-of-00003.safetensors: [9] float32; model: [8]",
                   "model.layers.0.input_layernorm.weight (model-00003-of-00003.safetensors: [8] "
                   "int64; model: [8] float32)"):
        assert needle in text, text
    assert m.error(src.url, strict=False) is not None  # shapes and dtypes: always refused
    assert set(err.mismatched) == {"model.norm.weight", "model.layers.0.input_layernorm.weight"}


def test_name_maps_and_tied_aliases(tmp_path: Path) -> None:
    values = {"transformer.wte": np.zeros((50, 8), np.float32), "head": np.zeros((50, 8), np.float32),
              "skip.me": np.zeros(3, np.float32)}
    src = open_hf(str(write_folder(tmp_path / "m", values, files=1)))
    targets = {"model.embed_tokens.weight": ((50, 8), "float32")}
    aliases = {"lm_head.weight": "model.embed_tokens.weight"}
    as_dict = match_tensors(targets, src.tensors, aliases,
                            {"transformer.wte": "model.embed_tokens.weight", "head": "lm_head.weight"})
    assert as_dict.unexpected == ("skip.me",) and as_dict.sources["model.embed_tokens.weight"].name == "transformer.wte"
    assert [(c, t.name) for c, t in as_dict.tied] == [("model.embed_tokens.weight", "head")]
    as_fn = match_tensors(targets, src.tensors, aliases,
                          lambda n: {"head": "lm_head.weight"}.get(n))  # None: skip
    assert as_fn.sources["model.embed_tokens.weight"].name == "head" and not as_fn.unexpected
    with pytest.raises(ConfigError, match="sends both"):
        match_tensors(targets, src.tensors, aliases, lambda n: "model.embed_tokens.weight")


# ------------------------------------------------------------------------------------ import


def test_import_layout_units_and_tied_head(tmp_path: Path) -> None:
    values = tensors()
    del values["lm_head.weight"]
    src = open_hf(str(write_folder(tmp_path / "m", values, config={"tie_word_embeddings": True})))
    layout, aliases = import_layout(src, Mesh.for_world(2))
    assert aliases == {"lm_head.weight": "model.embed_tokens.weight"}
    assert {g.unit for g in layout.groups} == {"", "model.layers.0", "model.layers.1"}
    layout2, _ = import_layout(src, Mesh.for_world(2), units=[r"model\.layers\.[01]\.mlp"])
    assert {g.unit for g in layout2.groups} == {"", "model.layers.0.mlp", "model.layers.1.mlp"}
    with pytest.raises(ConfigError, match="not a regular expression"):
        import_layout(src, Mesh.for_world(2), units=["("])


@pytest.mark.parametrize("ranks,replicate,files", [(3, 1, 3), (4, 2, 1)])
def test_import_then_consolidate_gives_back_every_byte(tmp_path: Path, ranks: int, replicate: int,
                                                       files: int) -> None:
    from shardckpt.checkpoint.reader import CheckpointReader
    from shardckpt.tools.consolidate import consolidate

    values = tensors(5)
    config = {"model_type": "llama", "tie_word_embeddings": False}
    folder = write_folder(tmp_path / "m", values, files=files, config=config)
    m = import_hf(str(folder), str(tmp_path / "ck"), ranks, replicate, buffer_bytes=96)
    assert m.extras["hf_config"] == config and m.optimizer is None
    assert m.mesh == Mesh.for_world(ranks, replicate)
    assert all(k == (("master", "float32"),) for k in m.components["model"].states.values())
    CheckpointReader(str(tmp_path / "ck"))
    consolidate(str(tmp_path / "ck"), str(tmp_path / "out"), dtype="fp32")
    got: dict[str, np.ndarray] = {}
    for f in (tmp_path / "out").glob("*.safetensors"):
        got.update(load_file(str(f)))
    assert set(got) == set(values)
    for n, v in values.items():
        assert got[n].dtype == v.dtype and got[n].tobytes() == v.tobytes(), n


def test_import_refuses_an_existing_checkpoint(tmp_path: Path) -> None:
    folder = write_folder(tmp_path / "m", tensors())
    import_hf(str(folder), str(tmp_path / "ck"), 2)
    before = (tmp_path / "ck" / "manifest.json").read_bytes()
    with pytest.raises(ConfigError, match="manifest.json exists"):
        import_hf(str(folder), str(tmp_path / "ck"), 2)
    assert (tmp_path / "ck" / "manifest.json").read_bytes() == before


def test_a_failed_import_leaves_no_checkpoint(tmp_path: Path) -> None:
    folder = write_folder(tmp_path / "m", tensors())
    victim = folder / "model-00003-of-00003.safetensors"
    raw = victim.read_bytes()
    src = open_hf(str(folder))
    victim.write_bytes(raw[:len(raw) // 2])  # shrinks after the headers were read
    with pytest.raises(IntegrityError, match="00003-of-00003.safetensors"):
        import_hf(src, str(tmp_path / "ck"), 2)
    assert not (tmp_path / "ck" / "manifest.json").exists()
    assert not list((tmp_path / "ck").iterdir())  # its own files removed too, lease included


def test_cli_import_hf(tmp_path: Path) -> None:
    folder = write_folder(tmp_path / "m", tensors(), config={"model_type": "llama"})
    ok = cli_process("import", "hf", str(folder), str(tmp_path / "ck"), "--ranks", "4",
                     "--replicate", "2", "--json")
    assert ok.returncode == 0, ok.stderr
    summary = json.loads(ok.stdout)
    assert summary["ranks"] == 4 and summary["params"] == len(SHAPES) and summary["hf_config"]
    assert summary["units"] == 3  # the root and one per block
    units = cli_process("import", "hf", str(folder), str(tmp_path / "ck1"), "--ranks", "2", "--json",
                        "--unit", r"model\.layers\.\d+\.mlp", "--unit", r"model\.embed_tokens")
    assert units.returncode == 0 and json.loads(units.stdout)["units"] == 4, units.stderr
    (folder / "model-00001-of-00003.safetensors").unlink()
    bad = cli_process("import", "hf", str(folder), str(tmp_path / "ck2"), "--ranks", "2")
    assert bad.returncode == 1 and bad.stderr.count("\n") == 1
    assert "model-00001-of-00003.safetensors: missing" in bad.stderr
    usage = cli_process("import", "hf", str(folder), str(tmp_path / "ck3"), "--ranks", "3",
                        "--replicate", "2")
    assert usage.returncode == 2 and "--replicate" in usage.stderr


def test_import_does_not_import_torch(tmp_path: Path) -> None:
    folder = write_folder(tmp_path / "m", tensors())
    code = ("import sys; from shardckpt.interop.hf.import_ import import_hf; "
            f"import_hf({str(folder)!r}, {str(tmp_path / 'ck')!r}, 2); "
            "assert 'torch' not in sys.modules, 'torch imported'")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
