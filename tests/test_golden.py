"""The golden v0.1 checkpoint (``tests/golden/v0_1``, written once by ``make_golden.py``) still reads.

Later format versions must keep passing this file unchanged: it is the proof that they read what
v0.1 wrote. Never regenerate the golden files; add a new ``v0_N`` beside them instead.
"""

from __future__ import annotations

import struct
from pathlib import Path

import crc32c as crc32c_pkg
import numpy as np
import pytest
from safetensors import safe_open

from shardckpt.checkpoint.reader import CheckpointReader

from shardckpt.checkpoint.verify import verify
from shardckpt.format.layout import Mesh
from shardckpt.format.manifest_parse import parse

from golden.make_golden import element as state_elements  # located through the layout only

GOLDEN = Path(__file__).resolve().parent / "golden" / "v0_1"
SAVE_ID = "20261129T102728Z-07fface4"
FILES = [  # path, size, crc32c (as recorded by the generator)
    (f"{SAVE_ID}/shard-00000-of-00002.safetensors", 23936, 0x5EAAF3ED),
    (f"{SAVE_ID}/shard-00001-of-00002.safetensors", 23936, 0x1F2FBB63),
    (f"{SAVE_ID}/buffers.safetensors", 188, 0x4744EC81),
]
GROUPS = [  # name, unit, numel, padded_numel, state kinds
    ("model.u0000.float32", "model.layers.0", 848, 864, ("master", "exp_avg", "exp_avg_sq")),
    ("model.u0001.float32", "model.layers.1", 848, 864, ("master", "exp_avg", "exp_avg_sq")),
    ("model.u0002.float32", "", 2056, 2080, ("master", "exp_avg", "exp_avg_sq")),
    ("model.u0002.float32.frozen", "", 8, 32, ("master",)),
]
PROBES = [  # fqn, kind, first element, 4 fp32 values as bit patterns (printed by make_golden.py)
    ("model.layers.0.self_attn.q_proj.weight", "master", 0, (0xBB31836B, 0xBCAD84DD, 0x3CB9880E, 0x3BB7FEE0)),
    ("model.norm.weight", "master", 0, (0x3F807064, 0x3F7CE60B, 0x3F7FD3BB, 0x3F800E65)),
    ("model.embed_tokens.weight", "exp_avg_sq", 0, (0x32AE7682, 0x35894B0F, 0x33A43261, 0x36CDFF11)),
    ("model.embed_tokens.weight", "master", 1038, (0xBCF25D15, 0x3C32846D, 0xBD47787E, 0x3A3FA61E)),
    ("model.frozen_scale", "master", 0, (0x3B390D42, 0x3CC560D2, 0xBD044F8E, 0xBC55A632)),
]


def test_golden_is_small_and_complete() -> None:
    files = sorted(p.relative_to(GOLDEN).as_posix() for p in GOLDEN.rglob("*") if p.is_file())
    assert files == sorted(["manifest.json"] + [f for f, _, _ in FILES])
    assert sum(p.stat().st_size for p in GOLDEN.rglob("*") if p.is_file()) < 100_000


def test_golden_manifest_parses() -> None:
    m = parse((GOLDEN / "manifest.json").read_bytes())
    assert m.version == (0, 1) and m.save_id == SAVE_ID and m.created_at == "2026-11-29T10:27:29Z"
    assert m.mesh == Mesh.hsdp(1, 2) and m.chunk_size == 4096
    comp = m.components["model"]
    assert [(g.name, g.unit, g.numel, g.padded_numel, tuple(k for k, _ in comp.states[g.name]))
            for g in comp.layout.groups] == GROUPS
    assert len(comp.layout.params) == 21 and comp.aliases == {"lm_head.weight": "model.embed_tokens.weight"}
    assert [(b.fqn, b.shape, b.dtype) for b in comp.buffers] == [("model.rotary_emb.inv_freq", (1,), "float32")]
    assert [(f.path, f.size, f.crc32c) for f in m.files] == FILES
    assert [len(f.chunk_crc32c) for f in m.files] == [6, 6, 1]
    assert m.optimizer is not None and m.optimizer.name == "AdamW"
    assert [pg["step"] for pg in m.optimizer.param_groups] == [42, 42]
    assert [pg["hparams"]["weight_decay"] for pg in m.optimizer.param_groups] == [0.1, 0.0]
    assert m.extras == {"step": 42, "samples_seen": 672, "user": {"synthetic": True, "seed": 1234}}


def test_golden_checksums_independently() -> None:
    m = parse((GOLDEN / "manifest.json").read_bytes())
    for f in m.files:
        data = (GOLDEN / f.path).read_bytes()
        assert len(data) == f.size and crc32c_pkg.crc32c(data) == f.crc32c
        cs = m.chunk_size
        assert f.chunk_crc32c == tuple(crc32c_pkg.crc32c(data[i:i + cs]) for i in range(0, len(data), cs))
        assert struct.unpack("<Q", data[:8])[0] == f.header_size and f.header_size % 8 == 0


def test_golden_verifies() -> None:
    result = verify(str(GOLDEN))
    assert result and result.problems == () and result.manifest is not None
    assert [(r.path, r.ok, r.problems) for r in result.reports] == [(f, True, ()) for f, _, _ in FILES]


@pytest.mark.parametrize("fqn,kind,start,bits", PROBES, ids=[f"{p[0]}.{p[1]}@{p[2]}" for p in PROBES])
def test_golden_values(fqn: str, kind: str, start: int, bits: tuple[int, ...]) -> None:
    r = CheckpointReader(str(GOLDEN))
    got = state_elements(r, fqn, kind, start, 4)
    assert tuple(int(x) for x in got.view(np.uint32)) == bits


def test_golden_shards_open_in_safetensors() -> None:
    r = CheckpointReader(str(GOLDEN))
    with safe_open(str(GOLDEN / FILES[0][0]), framework="numpy") as f:
        assert f.metadata() == {"format": "shardckpt", "version": "0.1", "save_id": SAVE_ID,
                                "shard": "0", "shard_degree": "2"}
        master = f.get_tensor("model.u0000.float32.master")
        assert master.shape == (432,)
        # q_proj starts after input_layernorm (8 elements) in unit 0's group
        assert tuple(int(x) for x in master[8:12].view(np.uint32)) == PROBES[0][3]
        np.testing.assert_array_equal(master, np.frombuffer(r.read_state(0, "model.u0000.float32", "master"), np.float32))
    slot, data = r.read_buffer("model.rotary_emb.inv_freq")
    assert slot.shape == (1,) and np.frombuffer(data, np.float32).tolist() == [1.0]


# ------------------------------------------------------------- docs/FORMAT.md worked example

FORMAT_MD = Path(__file__).resolve().parent.parent / "docs" / "FORMAT.md"


def test_format_doc_worked_example() -> None:
    """The example manifest in docs/FORMAT.md parses, and its sizes, header and checksums are what
    a writer produces for the data it describes (master 1..20, zero moments)."""
    import re

    from shardckpt.format.manifest import shard_slots
    from shardckpt.format.safetensors_header import build_header

    text = FORMAT_MD.read_text()
    example = re.search(r"```json\n(.*?)```", text, re.S).group(1)
    m = parse(example.encode())
    comp = m.components["model"]
    g = comp.layout.groups[0]
    assert (g.numel, g.padded_numel) == (20, 32)
    assert [(p.fqn, p.offset) for p in comp.layout.params] == [("w", 0), ("b", 15)]
    assert m.version == (1, 0)
    slots = shard_slots(m.components, m.mesh, m.version)
    assert [(s.name, s.begin, s.end) for s in slots] == [
        ("model.u0000.float32.master", 0, 64), ("model.u0000.float32.exp_avg", 64, 128),
        ("model.u0000.float32.exp_avg_sq", 128, 192)]
    flat = {"master": np.arange(1, 21, dtype=np.float32), "exp_avg": np.zeros(20, np.float32),
            "exp_avg_sq": np.zeros(20, np.float32)}
    for f in m.files:
        header = build_header(slots, {"format": "shardckpt", "version": "1.0", "save_id": m.save_id,
                                      "shard": str(f.index), "shard_degree": "2"})
        data = b""
        for s in slots:
            buf = np.zeros(32, np.float32)
            buf[:20] = flat[s.name.rsplit(".", 1)[1]]
            data += buf[f.index * 16:(f.index + 1) * 16].tobytes()
        blob = header + data
        assert (len(blob), len(header) - 8) == (f.size, f.header_size) == (576, 376)
        assert crc32c_pkg.crc32c(blob) == f.crc32c == f.chunk_crc32c[0]
        if f.index == 0:
            shown = re.search(r'\n(\{"__metadata__".*?\})\n', text).group(1)
            assert header[8:].rstrip(b" ").decode() == shown
        else:  # b[2] = 18.0 at byte 388 of shard 1
            assert np.frombuffer(blob[388:392], np.float32)[0] == 18.0
