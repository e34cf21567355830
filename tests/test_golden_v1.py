"""The golden v1.0 checkpoint (``tests/golden/v1_0``, written once by ``make_golden.py``) still reads,
and holds exactly what the v0.1 golden holds, with its tensors in the 1.0 order.

Both were written from the same seed, so every state of every group must be equal bit for bit
whichever order the shard files use; only the byte offsets differ. Never regenerate these files.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import crc32c as crc32c_pkg
import numpy as np

from shardckpt.checkpoint.reader import CheckpointReader

from shardckpt.checkpoint.verify import verify
from shardckpt.format.manifest import shard_slots

HERE = Path(__file__).resolve().parent / "golden"
V1, V0 = HERE / "v1_0", HERE / "v0_1"
SAVE_ID = "20261129T125557Z-319202f0"
FILES = [  # path, size, crc32c (as recorded by the generator)
    (f"{SAVE_ID}/shard-00000-of-00002.safetensors", 23936, 0x9B1D3FED),
    (f"{SAVE_ID}/shard-00001-of-00002.safetensors", 23936, 0x1F2F3B64),
    (f"{SAVE_ID}/buffers.safetensors", 188, 0x30E26E53),
]
KIND_ORDER = ("master", "exp_avg", "exp_avg_sq")


def _header_names(path: Path) -> list[str]:
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    return [k for k in json.loads(raw[8:8 + n]) if k != "__metadata__"]  # JSON keeps file order


def test_golden_v1_files_unchanged_and_verify() -> None:
    files = sorted(p.relative_to(V1).as_posix() for p in V1.rglob("*") if p.is_file())
    assert files == sorted(["manifest.json"] + [f for f, _, _ in FILES])
    for rel, size, crc in FILES:
        data = (V1 / rel).read_bytes()
        assert (len(data), crc32c_pkg.crc32c(data)) == (size, crc), rel
    result = verify(str(V1))
    assert result and result.manifest is not None and result.manifest.version == (1, 0)
    assert all(r.ok for r in result.reports) and len(result.reports) == len(FILES)


def test_golden_v1_is_kind_major() -> None:
    m = CheckpointReader(str(V1)).manifest
    comp = m.components["model"]
    want = [f"{g.name}.{k}" for k in KIND_ORDER for g in comp.layout.groups
            if k in dict(comp.states[g.name])]
    for rel, _, _ in FILES[:2]:
        assert _header_names(V1 / rel) == want
    assert [s.name for s in shard_slots(m.components, m.mesh, m.version)] == want
    # the 0.1 golden, same groups, is group-major: the two orders really differ here
    m0 = CheckpointReader(str(V0)).manifest
    assert _header_names(V0 / m0.shard_file(0).path) == [
        f"{g.name}.{k}" for g in comp.layout.groups for k, _ in comp.states[g.name]] != want


def test_golden_v1_equals_v0_state_for_state() -> None:
    new, old = CheckpointReader(str(V1)), CheckpointReader(str(V0))
    assert new.manifest.components == old.manifest.components
    comp = new.manifest.components["model"]
    compared = 0
    for g in comp.layout.groups:
        for kind, _ in comp.states[g.name]:
            for shard in range(new.manifest.mesh.shard_degree):
                a = bytes(new.read_state(shard, g.name, kind))
                b = bytes(old.read_state(shard, g.name, kind))
                assert a == b, (g.name, kind, shard)
                compared += len(a)
    assert compared == sum(new.manifest.shard_file(s).size - new.manifest.shard_file(s).data_start
                           for s in range(2))
    _, a = new.read_buffer("model.rotary_emb.inv_freq")
    assert np.frombuffer(a, np.float32).tolist() == [1.0]


def test_reshard_of_v0_writes_v1_with_the_same_content(tmp_path: Path) -> None:
    """Resharding a 0.1 checkpoint writes the current format; its content is the 0.1 golden's
    (and the 1.0 golden's) whatever the world size, and its weights are one range per file."""
    from shardckpt.tools.diff import diff
    from shardckpt.tools.reshard import reshard

    for to in (2, 3):
        dst = tmp_path / f"to{to}"
        m = reshard(str(V0), str(dst), to).manifest
        assert m.version[0] == 1
        assert diff(str(dst), str(V0)).equal
        d1 = diff(str(dst), str(V1))  # the 1.0 golden was written after synth renamed "AdamW"
        assert d1.identical == d1.compared == 62 and not d1.differences
        assert d1.metadata == ("optimizer differs: AdamW vs adamw",)
        names = _header_names(dst / m.shard_file(0).path)
        masters = [n for n in names if n.endswith(".master")]
        assert names[:len(masters)] == masters and len(masters) == 4
