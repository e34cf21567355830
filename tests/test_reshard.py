"""reshard: N -> M -> N byte identity, HSDP meshes, workers, bounded reads, and bad input."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from typer.testing import CliRunner

from shardckpt.checkpoint.reader import CheckpointReader

from shardckpt.checkpoint.verify import verify
from shardckpt.cli.main import app
from shardckpt.errors import ConfigError, IncompatibleLayoutError, IntegrityError
from shardckpt.format.manifest import MANIFEST_NAME
from shardckpt.tools.reshard import MIN_BUFFER, reshard
from shardckpt.tools.synth import synthesize, values

PARAMS = 300_000


def slot_bytes(url: str) -> dict[tuple[int, str], bytes]:
    r = CheckpointReader(url)
    out = {}
    for name in r.slots:
        g, k = name.rsplit(".", 1)
        for s in range(r.manifest.mesh.shard_degree):
            out[(s, name)] = bytes(r.read_state(s, g, k))
    return out


def global_param(url: str, fqn: str, kind: str = "master") -> np.ndarray:
    """A parameter's state reassembled from the shards (independently of the plan code)."""
    r = CheckpointReader(url)
    layout = r.manifest.components["model"].layout
    p = layout.param(fqn)
    s = layout.shard_numel(p.group)
    parts = []
    for shard in range(layout.shard_degree):
        parts.append(np.frombuffer(bytes(r.read_state(shard, p.group, kind)), np.float32))
    flat = np.concatenate(parts)
    assert flat.size == s * layout.shard_degree
    return flat[p.offset:p.offset + p.numel]


@pytest.fixture(scope="module")
def src4(tmp_path_factory):
    d = tmp_path_factory.mktemp("src") / "ck4"
    synthesize(str(d), PARAMS, ranks=4, units=2, seed=3)
    return str(d)


@pytest.mark.parametrize("m", [1, 3, 7, 16, 64])
def test_n_to_m_to_n_is_byte_identical(tmp_path, src4, m):
    mid, back = str(tmp_path / "mid"), str(tmp_path / "back")
    r = reshard(src4, mid, to=m, from_=4)
    assert r.manifest.mesh.world_size == m
    assert r.source_world_size == 4
    reshard(mid, back, to=4, from_=m)
    assert slot_bytes(back) == slot_bytes(src4)
    result = verify(mid)
    assert result, result.problems


def test_values_survive_reshard(tmp_path, src4):
    out = str(tmp_path / "m7")
    reshard(src4, out, to=7)
    r = CheckpointReader(out)
    for p in r.manifest.components["model"].layout.params:
        for kind in ("master", "exp_avg_sq") if p.group.endswith("float32") else ("master",):
            got = global_param(out, p.fqn, kind)
            np.testing.assert_array_equal(got, values(3, p.fqn, kind, 0, p.numel))


def test_padding_is_zero_after_reshard(tmp_path, src4):
    out = str(tmp_path / "m3")
    reshard(src4, out, to=3)
    r = CheckpointReader(out)
    for g in r.manifest.components["model"].layout.groups:
        flat = np.concatenate([np.frombuffer(bytes(r.read_state(s, g.name, "master")), np.uint8)
                               for s in range(3)])
        assert not flat[g.numel * 4:].any()


def test_hsdp_mesh_and_workers(tmp_path, src4):
    out = str(tmp_path / "hsdp")
    r = reshard(src4, out, to=8, replicate=2, workers=2)
    assert dict(r.manifest.mesh.axes) == {"dp_replicate": 2, "dp_shard": 4}
    assert r.manifest.per_rank_state["dropped_from_world_size"] == 4
    # HSDP 2x4 holds the same shards as 4 ranks: identical tensor bytes.
    assert slot_bytes(out) == slot_bytes(src4)
    assert r.manifest.extras == CheckpointReader(src4).manifest.extras
    assert r.manifest.optimizer == CheckpointReader(src4).manifest.optimizer


def test_reads_each_source_byte_about_once(tmp_path, src4):
    r = reshard(src4, str(tmp_path / "m2"), to=2, buffer_bytes=64 << 10)
    src_bytes = CheckpointReader(src4).manifest.total_bytes
    assert r.bytes_read <= 1.05 * src_bytes + 2 * (1 << 20)


def test_without_mmap_the_ranged_read_path_gives_same_bytes(tmp_path, src4, monkeypatch):
    """Where local files cannot be mapped (``can_map`` false: not POSIX), reshard reads them with
    checked ranged reads instead: same bytes, each source byte read about once."""
    from shardckpt.storage import core, local

    mapped, ranged = str(tmp_path / "mapped"), str(tmp_path / "ranged")
    reshard(src4, mapped, to=3)
    real = core.Storage.__init__

    def no_map(self, *a, **k):
        real(self, *a, **k)
        self.backend.can_map = False
    monkeypatch.setattr(core.Storage, "__init__", no_map)
    monkeypatch.setattr(local.LocalBackend, "map_range", None)  # must not be reached
    r = reshard(src4, ranged, to=3, buffer_bytes=64 << 10)
    assert slot_bytes(ranged) == slot_bytes(mapped)
    src_bytes = CheckpointReader(src4).manifest.total_bytes
    assert r.bytes_read <= 1.05 * src_bytes + 2 * (1 << 20)
    monkeypatch.undo()
    back = str(tmp_path / "back")
    reshard(ranged, back, to=4)
    assert slot_bytes(back) == slot_bytes(src4)


def test_bounded_buffer_gives_same_bytes(tmp_path, src4):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    reshard(src4, a, to=3, buffer_bytes=MIN_BUFFER)  # the smallest batch allowed
    reshard(src4, b, to=3)
    assert slot_bytes(a) == slot_bytes(b)


def test_bad_arguments(tmp_path, src4):
    with pytest.raises(IncompatibleLayoutError, match="--from 5 does not match"):
        reshard(src4, str(tmp_path / "x"), to=2, from_=5)
    with pytest.raises(ConfigError, match="not divisible"):
        reshard(src4, str(tmp_path / "x"), to=3, replicate=2)
    with pytest.raises(ConfigError, match=">= 1"):
        reshard(src4, str(tmp_path / "x"), to=0)
    with pytest.raises(ConfigError, match="is the source"):
        reshard(src4, src4, to=2, overwrite=True)
    assert not os.path.exists(tmp_path / "x")


def test_existing_dst_needs_overwrite_and_keeps_old_until_commit(tmp_path, src4):
    dst = str(tmp_path / "d")
    reshard(src4, dst, to=2)
    with pytest.raises(ConfigError, match="--overwrite"):
        reshard(src4, dst, to=3)
    assert CheckpointReader(dst).manifest.mesh.world_size == 2
    r = reshard(src4, dst, to=3, overwrite=True)
    assert CheckpointReader(dst).manifest.mesh.world_size == 3
    assert sorted(os.listdir(dst)) == sorted([MANIFEST_NAME, r.manifest.save_id])
    result = verify(dst)
    assert result, result.problems


def test_corrupt_source_midway_leaves_no_manifest(tmp_path):
    src = str(tmp_path / "src")
    m = synthesize(src, PARAMS, ranks=4, units=2)
    last = m.shard_file(3)
    with open(os.path.join(src, last.path), "r+b") as f:
        f.seek(last.size - 100)
        b = f.read(1)
        f.seek(last.size - 100)
        f.write(bytes([b[0] ^ 0x40]))
    dst = str(tmp_path / "dst")
    with pytest.raises(IntegrityError, match=r"shard-00003-of-00004.*CRC32C"):
        reshard(src, dst, to=2)
    assert not os.path.exists(os.path.join(dst, MANIFEST_NAME))


def test_cli_reshard_json_and_errors(tmp_path, src4):
    runner = CliRunner()
    dst = str(tmp_path / "c")
    r = runner.invoke(app, ["reshard", src4, dst, "--from", "4", "--to", "2", "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.output)
    assert doc["from"] == 4 and doc["to"] == 2 and doc["bytes_written"] > 0
    r = runner.invoke(app, ["reshard", src4, dst, "--to", "2"])
    assert r.exit_code != 0 and "--overwrite" in r.output
    r = runner.invoke(app, ["reshard", src4, str(tmp_path / "e"), "--to", "2", "--from", "8"])
    assert r.exit_code != 0 and "does not match" in r.output
    r = runner.invoke(app, ["reshard", str(tmp_path / "nope"), str(tmp_path / "f"), "--to", "2"])
    assert r.exit_code != 0 and "nope" in r.output
    r = runner.invoke(app, ["reshard", src4, str(tmp_path / "g"), "--to", "4", "--replicate", "3"])
    assert r.exit_code == 2 and "divisible" in r.output
