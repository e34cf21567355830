"""The golden v1.1 checkpoint (``tests/golden/v1_1``, written once by ``make_golden.py``): its
manifest carries its own checksum, and it holds exactly what the v1.0 golden holds.

Both were written from the same seed, so every state of every group is equal bit for bit, and so
are the shard files' bytes apart from the ``save_id`` and version in their headers. Never
regenerate these files.
"""

from __future__ import annotations

import json
from pathlib import Path

import crc32c as crc32c_pkg
import pytest

from shardckpt.checkpoint.reader import CheckpointReader

from shardckpt.checkpoint.verify import verify
from shardckpt.errors import ManifestError
from shardckpt.format.manifest_parse import parse

HERE = Path(__file__).resolve().parent / "golden"
V11, V10 = HERE / "v1_1", HERE / "v1_0"
SAVE_ID = "20261201T154156Z-376cb5e0"
MANIFEST = (7660, 0x1B12E27A, "36189ab6")  # size, CRC32C of the file, its manifest_crc32c
FILES = [  # path, size, crc32c (as recorded by the generator)
    (f"{SAVE_ID}/shard-00000-of-00002.safetensors", 23936, 0xDCF92634),
    (f"{SAVE_ID}/shard-00001-of-00002.safetensors", 23936, 0x58CB22BD),
    (f"{SAVE_ID}/buffers.safetensors", 188, 0x06450390),
]


def test_golden_v1_1_files_unchanged_and_verify() -> None:
    files = sorted(p.relative_to(V11).as_posix() for p in V11.rglob("*") if p.is_file())
    assert files == sorted(["manifest.json"] + [f for f, _, _ in FILES])
    raw = (V11 / "manifest.json").read_bytes()
    assert (len(raw), crc32c_pkg.crc32c(raw), json.loads(raw)["manifest_crc32c"]) == MANIFEST
    for rel, size, crc in FILES:
        data = (V11 / rel).read_bytes()
        assert (len(data), crc32c_pkg.crc32c(data)) == (size, crc), rel
    result = verify(str(V11))
    assert result and result.manifest is not None and result.manifest.version == (1, 1)
    assert len(result.reports) == len(FILES)


def test_golden_v1_1_equals_v1_0_state_for_state() -> None:
    new, old = CheckpointReader(str(V11)), CheckpointReader(str(V10))
    assert new.manifest.components == old.manifest.components
    comp = new.manifest.components["model"]
    for g in comp.layout.groups:
        for kind, _ in comp.states[g.name]:
            for shard in range(new.manifest.mesh.shard_degree):
                a, b = new.read_state(shard, g.name, kind), old.read_state(shard, g.name, kind)
                assert bytes(a) == bytes(b), (g.name, kind, shard)
    name = "model.rotary_emb.inv_freq"
    assert bytes(new.read_buffer(name)[1]) == bytes(old.read_buffer(name)[1])


def test_golden_v1_1_manifest_damage_refused() -> None:
    raw = (V11 / "manifest.json").read_bytes()
    assert raw.count(b'"step": 42') == 3
    with pytest.raises(ManifestError, match="manifest_crc32c: mismatch"):
        parse(raw.replace(b'"step": 42', b'"step": 43', 1))
