"""The manifest codec: round trips, and every malformed or hostile manifest refused by name."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any, Callable

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from testing.ckpts import TINY_PARAMS, manifest_from_spec
from shardckpt.format import manifest as manifest_mod
from shardckpt.format import manifest_parse
from shardckpt.checkpoint.reader import read_manifest
from shardckpt.errors import ManifestError
from shardckpt.format.layout import Mesh
from shardckpt.format.manifest import MAX_INT, VERSION, Manifest, buffer_slots, shard_slots, to_json
from shardckpt.format.manifest_parse import parse
from shardckpt.format.integrity import seal
from shardckpt.storage import Storage
from shardckpt.tools.synth import synth_spec

Doc = dict[str, Any]


def dumps(doc: Doc) -> bytes:
    """Encode an edited document with a fresh checksum, so only the edit itself can be refused."""
    return seal(doc)


def refuses(data: bytes | str, *needles: str) -> ManifestError:
    with pytest.raises(ManifestError) as ei:
        parse(data, "s3://b/run/manifest.json")
    msg = str(ei.value)
    assert msg.startswith("s3://b/run/manifest.json: "), msg
    for n in needles:
        assert n in msg, f"{n!r} not in {msg!r}"
    return ei.value


# ------------------------------------------------------------------------------- round trip


def test_round_trip_equal(manifest_doc: Doc) -> None:
    m = manifest_from_spec(synth_spec(TINY_PARAMS, 4, replicate=2, units=3), rank_files=4)
    data = to_json(m)
    back = parse(data)
    assert back == m
    assert to_json(back) == data
    assert back.version == VERSION == (1, 1)
    assert json.loads(data)["version"] == "1.1" and json.loads(data)["format"] == "shardckpt"
    assert back.mesh.axes == (("dp_replicate", 2), ("dp_shard", 2))
    assert back.components["model"].layout.groups == m.components["model"].layout.groups
    assert back.shard_file(1).index == 1 and back.buffers_file() is not None
    assert back.total_bytes == sum(f.size for f in m.files)


def test_file_entry_encoding() -> None:
    m = manifest_from_spec(synth_spec(TINY_PARAMS, 2), rank_files=1)
    doc = json.loads(to_json(m))
    for f, e in zip(doc["files"], m.files):
        assert f["crc32c"] == f"{e.crc32c:08x}" and len(f["crc32c"]) == 8
        assert f["chunk_crc32c"] == "".join(f"{c:08x}" for c in e.chunk_crc32c)
        assert ("index" in f) == (e.role in ("shard", "rank"))
    assert [f["role"] for f in doc["files"]] == ["shard", "shard", "buffers", "rank"]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(params=st.integers(1, 3_000_000), R=st.integers(1, 4), S=st.integers(1, 64),
       units=st.integers(0, 4), step=st.integers(0, 2**40), seed=st.integers(0, 2**31),
       chunk=st.sampled_from([4096, 65536, 1 << 20, 4 << 20]), rank_files=st.integers(0, 3))
def test_round_trip_synth_specs(params: int, R: int, S: int, units: int, step: int, seed: int,
                                chunk: int, rank_files: int) -> None:
    spec = synth_spec(params, R * S, R, units, step, seed)
    spec.chunk_size = chunk
    m = manifest_from_spec(spec, rank_files=min(rank_files, R * S), seed=seed)
    back = parse(to_json(m))
    assert back == m
    assert shard_slots(back.components, back.mesh) == shard_slots(m.components, m.mesh)
    assert buffer_slots(back.components) == buffer_slots(m.components)


def test_round_trip_of_a_written_checkpoint(tiny_ckpt: tuple[str, Manifest]) -> None:
    path, m = tiny_ckpt
    raw = Path(path, "manifest.json").read_bytes()
    assert parse(raw) == m
    assert to_json(parse(raw)) == raw


# ---------------------------------------------------------------------- hostile / malformed


def _set(path: str, value: Any) -> Callable[[Doc], None]:
    """Mutator setting ``a.b[0].c`` style paths."""
    def mutate(doc: Doc) -> None:
        cur: Any = doc
        keys = path.replace("[", ".").replace("]", "").split(".")
        for k in keys[:-1]:
            cur = cur[int(k)] if isinstance(cur, list) else cur[k]
        last = keys[-1]
        if isinstance(cur, list):
            cur[int(last)] = value
        else:
            cur[last] = value
    return mutate


def _del(path: str) -> Callable[[Doc], None]:
    def mutate(doc: Doc) -> None:
        cur: Any = doc
        keys = path.split(".")
        for k in keys[:-1]:
            cur = cur[k]
        del cur[keys[-1]]
    return mutate


G0 = "components.model.groups[0]"
P1 = "components.model.params[1]"
F0 = "files[0]"


def _params(doc: Doc) -> list[Doc]:
    return doc["components"]["model"]["params"]


def _overlap(doc: Doc) -> None:
    _params(doc)[1]["offset"] -= 1


def _gap(doc: Doc) -> None:
    _params(doc)[1]["offset"] += 1


def _numel_short(doc: Doc) -> None:
    doc["components"]["model"]["groups"][0]["numel"] -= 1


def _dup_path(doc: Doc) -> None:
    doc["files"][1]["path"] = doc["files"][0]["path"]


def _drop_shard(doc: Doc) -> None:
    del doc["files"][1]


def _shard_size(doc: Doc) -> None:
    doc["files"][0]["size"] += 8


def _short_chunks(doc: Doc) -> None:
    doc["files"][0]["chunk_crc32c"] = doc["files"][0]["chunk_crc32c"][:-1]


def _prefixed_chunks(doc: Doc) -> None:
    doc["files"][0]["chunk_crc32c"] = "0x123456"


def _no_buffers_file(doc: Doc) -> None:
    doc["files"] = [f for f in doc["files"] if f["role"] != "buffers"]


def _two_buffers_files(doc: Doc) -> None:
    extra = copy.deepcopy(next(f for f in doc["files"] if f["role"] == "buffers"))
    extra["path"] = extra["path"].replace("buffers", "buffers2")
    doc["files"].append(extra)


def _dup_rank_file(doc: Doc) -> None:
    extra = copy.deepcopy(doc["files"][3])
    assert extra["role"] == "rank"
    extra["path"] = extra["path"].replace("rank-", "rank-again-")
    doc["files"].append(extra)


def _dup_param(doc: Doc) -> None:
    _params(doc)[1]["fqn"] = _params(doc)[0]["fqn"]


def _dup_group(doc: Doc) -> None:
    gs = doc["components"]["model"]["groups"]
    gs[1]["name"] = gs[0]["name"]


def _repeat_kind(doc: Doc) -> None:
    st_ = doc["components"]["model"]["groups"][0]["states"]
    st_[1]["kind"] = st_[0]["kind"]


def _second_component_same_group(doc: Doc) -> None:
    doc["components"]["ema"] = copy.deepcopy(doc["components"]["model"])


def _bad_alias(doc: Doc) -> None:
    doc["components"]["model"]["aliases"] = {"lm_head.weight": "no.such.param"}


def _alias_is_param(doc: Doc) -> None:
    first = _params(doc)[0]["fqn"]
    doc["components"]["model"]["aliases"] = {first: _params(doc)[1]["fqn"]}


def _unknown_opt_param(doc: Doc) -> None:
    doc["optimizer"]["param_groups"][0]["params"].append("ghost.weight")


def _opt_param_twice(doc: Doc) -> None:
    pg = doc["optimizer"]["param_groups"]
    pg[1]["params"].append(pg[0]["params"][0])


def _dup_buffer(doc: Doc) -> None:
    b = doc["components"]["model"]["buffers"]
    b.append(dict(b[0]))


def _master_not_first(doc: Doc) -> None:
    st_ = doc["components"]["model"]["groups"][0]["states"]
    st_[0], st_[1] = st_[1], st_[0]


def _buffer_named_like_param(doc: Doc) -> None:
    doc["components"]["model"]["buffers"][0]["fqn"] = _params(doc)[0]["fqn"]


HOSTILE: list[tuple[str, Callable[[Doc], None], tuple[str, ...]]] = [
    ("master not first", _master_not_first, ("groups[0].states", "'master'")),
    ("buffer named like a param", _buffer_named_like_param, ("buffers", "both a buffer and a parameter")),
    # wrong types
    ("format", _set("format", "safetensors"), ("format", "'shardckpt'")),
    ("save_id type", _set("save_id", 5), ("save_id", "expected a string")),
    ("save_id path", _set("save_id", "../x"), ("save_id", "not a plain name")),
    ("chunk_size type", _set("chunk_size", "4096"), ("chunk_size", "expected an integer")),
    ("chunk_size float", _set("chunk_size", 4096.0), ("chunk_size", "expected an integer")),
    ("chunk_size small", _set("chunk_size", 100), ("chunk_size", "outside")),
    ("mesh type", _set("mesh", [1, 2]), ("mesh", "expected an object")),
    ("mesh size float", _set("mesh.axes[1].size", 1.5), ("mesh.axes[1].size", "integer")),
    ("mesh size zero", _set("mesh.axes[1].size", 0), ("mesh.axes[1].size", "outside")),
    ("mesh no shard axis", _set("mesh.axes[1].name", "tp"), ("mesh", "dp_shard")),
    ("components type", _set("components", []), ("components", "expected an object")),
    ("component name", lambda d: d["components"].update({"a/b": d["components"].pop("model")}),
     ("components.a/b", "component names")),
    ("requires_grad type", _set(f"{G0}.requires_grad", "yes"), (f"{G0}.requires_grad",)),
    ("numel bool", _set(f"{G0}.numel", True), (f"{G0}.numel", "expected an integer")),
    ("group name", _set(f"{G0}.name", "a b"), (f"{G0}.name",)),
    ("state kind", _set(f"{G0}.states[0].kind", "ma-ster"), (f"{G0}.states[0].kind",)),
    ("states type", _set(f"{G0}.states", {}), (f"{G0}.states", "expected a list")),
    ("shape type", _set(f"{P1}.shape", "8"), (f"{P1}.shape", "expected a list")),
    ("shape dim type", _set(f"{P1}.shape", [8, "8"]), (f"{P1}.shape[1]", "expected an integer")),
    ("shape rank", _set(f"{P1}.shape", [1] * 17), (f"{P1}.shape", "at most 16")),
    ("param group unknown", _set(f"{P1}.group", "nope"), (f"{P1}.group", "'nope'")),
    ("param missing field", _del("components.model.params"), ("components.model", "'params'")),
    ("files type", _set("files", {}), ("files", "expected a list")),
    ("extras type", _set("extras", []), ("extras", "expected an object")),
    ("per_rank_state type", _set("per_rank_state", 3), ("per_rank_state", "expected an object")),
    ("optimizer type", _set("optimizer", "adam"), ("optimizer", "expected an object")),
    ("optimizer step", _set("optimizer.param_groups[0].step", "1"),
     ("optimizer.param_groups[0].step",)),
    ("optimizer hparams", _set("optimizer.param_groups[0].hparams", [1]),
     ("optimizer.param_groups[0].hparams",)),
    ("index type", _set(f"{F0}.index", "0"), (f"{F0}.index", "expected an integer")),
    ("shard index missing", lambda d: d["files"][0].pop("index"), (F0, "'index'")),
    # negative and huge sizes
    ("negative size", _set(f"{F0}.size", -1), (f"{F0}.size", "outside")),
    ("negative offset", _set(f"{P1}.offset", -8), (f"{P1}.offset", "outside")),
    ("negative numel", _set(f"{G0}.numel", -1), (f"{G0}.numel", "outside")),
    ("negative dim", _set(f"{P1}.shape", [-1, 8]), (f"{P1}.shape[0]", "outside")),
    ("huge size", _set(f"{F0}.size", 2**53 + 1), (f"{F0}.size", "outside")),
    ("huge padded", _set(f"{G0}.padded_numel", 2**64), (f"{G0}.padded_numel", "outside")),
    ("huge offset", _set(f"{P1}.offset", 10**30), (f"{P1}.offset", "outside")),
    ("huge header", _set(f"{F0}.header_size", 100_000_001), (f"{F0}.header_size", "outside")),
    ("header past size", _set(f"{F0}.header_size", 10**7), (f"{F0}.header_size", "does not fit")),
    ("shape overflow", _set(f"{P1}.shape", [2**30, 2**30]), (f"{P1}.shape", "2**53")),
    ("shape overflow late", _set(f"{P1}.shape", [2**20] * 3 + [0]), (f"{P1}.shape", "2**53")),
    # layout consistency
    ("overlap", _overlap, ("components.model.params", "overlaps")),
    ("gap", _gap, ("components.model.params", "gap")),
    ("group numel", _numel_short, ("components.model.groups", "says")),
    ("padded not multiple", lambda d: _set(f"{G0}.padded_numel", d["components"]["model"]["groups"][0]["padded_numel"] + 16)(d),
     (f"{G0}.padded_numel", "multiple of 16 x 2")),
    ("padded too small", _set(f"{G0}.padded_numel", 32), (f"{G0}.padded_numel",)),
    ("padded zero", _set(f"{G0}.padded_numel", 0), (f"{G0}.padded_numel",)),
    ("dup param", _dup_param, ("components.model.params[1]", "appears twice")),
    ("dup group", _dup_group, ("components.model.groups[1].name", "appears twice")),
    ("repeated state kind", _repeat_kind, (f"{G0}.states", "repeat")),
    ("group in two components", _second_component_same_group, ("components", "both")),
    ("alias to nothing", _bad_alias, ("components.model.aliases.lm_head.weight",)),
    ("alias shadows param", _alias_is_param, ("components.model.aliases.",)),
    ("dup buffer", _dup_buffer, ("components.model.buffers", "repeat")),
    ("unknown optimizer param", _unknown_opt_param, ("optimizer.param_groups[0].params", "ghost.weight")),
    ("param in two param groups", _opt_param_twice, ("optimizer.param_groups[1].params", "two param groups")),
    # dtypes and roles
    ("unknown group dtype", _set(f"{G0}.dtype", "float128"), (f"{G0}.dtype", "'float128'")),
    ("unknown state dtype", _set(f"{G0}.states[1].dtype", "F32"), (f"{G0}.states[1].dtype", "'F32'")),
    ("unknown buffer dtype", _set("components.model.buffers[0].dtype", "complex64"),
     ("components.model.buffers[0].dtype",)),
    ("unknown role", _set(f"{F0}.role", "weights"), (f"{F0}.role", "'weights'")),
    # file paths
    ("dotdot", lambda d: _set(f"{F0}.path", d["save_id"] + "/../../etc/passwd")(d), (f"{F0}.path", "plain relative")),
    ("absolute", _set(f"{F0}.path", "/etc/passwd"), (f"{F0}.path", "plain relative")),
    ("backslash", _set(f"{F0}.path", "a\\shard.safetensors"), (f"{F0}.path",)),
    ("s3 url", _set(f"{F0}.path", "s3://bucket/shard.safetensors"), (f"{F0}.path",)),
    ("s3 colon", _set(f"{F0}.path", "s3:shard.safetensors"), (f"{F0}.path",)),
    ("empty segment", _set(f"{F0}.path", "a//b.safetensors"), (f"{F0}.path",)),
    ("dot segment", _set(f"{F0}.path", "./b.safetensors"), (f"{F0}.path",)),
    ("trailing slash", _set(f"{F0}.path", "dir/"), (f"{F0}.path",)),
    ("space", _set(f"{F0}.path", "a b.safetensors"), (f"{F0}.path",)),
    ("nul", _set(f"{F0}.path", "a\u0000.safetensors"), (f"{F0}.path",)),
    ("dup path", _dup_path, ("files", "appears twice")),
    # shard set and sizes
    ("missing shard", _drop_shard, ("files", "2 shard ranks", "1 shard files")),
    ("shard index out of range", _set("files[1].index", 2), ("files", "shard entry 1", "has index 2")),
    ("shard size", _shard_size, ("files", "size", "does not match")),
    ("buffers size", lambda d: d["files"][2].update(size=d["files"][2]["size"] + 4), ("files", "buffers.safetensors", "does not match")),
    ("no buffers file", _no_buffers_file, ("files", "no buffers file")),
    ("two buffers files", _two_buffers_files, ("files", "more than one buffers file")),
    ("rank index twice", _dup_rank_file, ("files", "rank files need distinct indices", "[0, 0]")),
    ("rank index past world", _set("files[3].index", 2), ("files", "below the world size 2", "[2]")),
    # checksums
    ("crc length", _set(f"{F0}.crc32c", "abc"), (f"{F0}.crc32c", "8 lowercase hex")),
    ("crc upper", _set(f"{F0}.crc32c", "ABCDEF01"), (f"{F0}.crc32c", "8 lowercase hex")),
    ("crc int", _set(f"{F0}.crc32c", 12345678), (f"{F0}.crc32c", "expected a string")),
    ("chunk crc length", _short_chunks, (f"{F0}.chunk_crc32c", "chunk checksums")),
    ("chunk crc too many", lambda d: d["files"][0].update(chunk_crc32c=d["files"][0]["chunk_crc32c"] * 2),
     (f"{F0}.chunk_crc32c", "2 chunk checksums for 1 chunks")),
    ("chunk crc upper", _set(f"{F0}.chunk_crc32c", "ABCDEF01"), (f"{F0}.chunk_crc32c", "hex")),
    ("chunk crc 0x", _prefixed_chunks, (f"{F0}.chunk_crc32c", "hex")),
    ("chunk crc spaces", _set(f"{F0}.chunk_crc32c", " 1234567"), (f"{F0}.chunk_crc32c", "hex")),
    ("chunk crc underscore", _set(f"{F0}.chunk_crc32c", "1_234567"), (f"{F0}.chunk_crc32c", "hex")),
    # version
    ("newer major", _set("version", "2.0"), ("version", "2.0", "newer", "upgrade shardckpt")),
    ("much newer major", _set("version", "17.3"), ("version", "upgrade shardckpt")),
    ("version number", _set("version", 0.1), ("version", "expected a string")),
    ("version format", _set("version", "v0.1"), ("version", "MAJOR.MINOR")),
    ("version three parts", _set("version", "0.1.2"), ("version", "MAJOR.MINOR")),
    ("version missing", _del("version"), ("top level", "'version'")),
]


@pytest.mark.parametrize("mutate,needles", [(m, n) for _, m, n in HOSTILE],
                         ids=[name for name, _, _ in HOSTILE])
def test_hostile_manifest_refused(manifest_doc: Doc, mutate: Callable[[Doc], None],
                                  needles: tuple[str, ...]) -> None:
    parse(dumps(manifest_doc))  # the unmutated document is valid
    mutate(manifest_doc)
    refuses(dumps(manifest_doc), *needles)


def test_duplicate_json_keys_refused(manifest_doc: Doc) -> None:
    raw = json.dumps(manifest_doc)
    assert raw.startswith('{"format": "shardckpt", ')
    refuses(raw.replace('{"format": "shardckpt", ', '{"format": "shardckpt", "format": "shardckpt", ', 1),
            "duplicate key 'format'")
    # nested: two "size" keys in one file entry (json keeps the last; we refuse)
    f0 = manifest_doc["files"][0]
    raw = json.dumps(manifest_doc).replace(f'"size": {f0["size"]}', f'"size": 8, "size": {f0["size"]}', 1)
    refuses(raw, "duplicate key 'size'")


@pytest.mark.parametrize("token", ["NaN", "Infinity", "-Infinity"])
def test_nan_constants_refused(manifest_doc: Doc, token: str) -> None:
    raw = dumps(manifest_doc).decode().replace('"extras": {', f'"extras": {{"loss": {token}, ', 1)
    refuses(raw, token.lstrip("-"))


def test_overflowing_float_refused(manifest_doc: Doc) -> None:
    """``1e400`` parses to inf in Python: as hostile as ``Infinity``, and could not be re-encoded."""
    raw = dumps(manifest_doc).decode().replace('"extras": {', '"extras": {"loss": 1e400, ', 1)
    refuses(raw, "1e400")


@pytest.mark.parametrize("data,needle", [
    (b"", "not valid manifest JSON"),
    (b"{", "not valid manifest JSON"),
    (b"\xff\xfe\x00", "not valid manifest JSON"),
    (b"[]", "top level"),
    (b'"manifest"', "top level"),
    (b"[" * 100_000 + b"]" * 100_000, "not valid manifest JSON"),
    (b'{"format": "shardckpt"}', "'version'"),
])
def test_not_a_manifest(data: bytes, needle: str) -> None:
    refuses(data, needle)


def test_older_major_refused(manifest_doc: Doc, monkeypatch: pytest.MonkeyPatch) -> None:
    # this reader reads 0.x and 1.x, so "older major" is shown by pretending it reads only 2.x
    monkeypatch.setattr(manifest_parse, "VERSION", (2, 0))
    monkeypatch.setattr(manifest_parse, "READABLE_MAJORS", (2,))
    manifest_doc["version"] = "1.4"
    refuses(dumps(manifest_doc), "version", "1.4", "older")


def test_format_0_still_parses(manifest_doc: Doc) -> None:
    """Format 0.x (group-major shard files) is read, and its slots keep their 0.x order."""
    manifest_doc["version"] = "0.1"
    m = parse(dumps(manifest_doc))
    assert m.version == (0, 1)
    comp = m.components["model"]
    assert [s.name for s in shard_slots(m.components, m.mesh, m.version)] == [
        f"{g.name}.{k}" for g in comp.layout.groups for k, _ in comp.states[g.name]]


def test_newer_minor_with_unknown_fields_accepted(manifest_doc: Doc) -> None:
    """Minor versions add optional fields; this reader ignores them (forward compatibility)."""
    base = parse(dumps(manifest_doc))
    manifest_doc["version"] = f"{VERSION[0]}.{VERSION[1] + 7}"
    manifest_doc["compression"] = {"codec": "zstd"}
    manifest_doc["mesh"]["axes"][0]["device_type"] = "cuda"
    manifest_doc["components"]["model"]["groups"][0]["quantized"] = False
    manifest_doc["components"]["model"]["params"][0]["tp_dim"] = None
    manifest_doc["components"]["model"]["lora"] = []
    manifest_doc["files"][0]["xxh3_64"] = "00" * 8  # sha256 is known from 1.4
    manifest_doc["components"]["model"]["groups"][0]["states"][0]["scale"] = 1.0
    m = parse(dumps(manifest_doc))
    assert m.version == (VERSION[0], VERSION[1] + 7)
    assert m.components == base.components and m.files == base.files and m.mesh == base.mesh


def test_optional_fields_may_be_absent(manifest_doc: Doc) -> None:
    for k in ("created_at", "extras", "per_rank_state", "optimizer"):
        manifest_doc.pop(k)
    c = manifest_doc["components"]["model"]
    c.pop("aliases")
    for g in c["groups"]:
        g.pop("unit")
    m = parse(dumps(manifest_doc))
    assert m.optimizer is None and m.extras == {} and m.created_at == ""
    assert all(g.unit == "" for g in m.components["model"].layout.groups)


def test_oversized_manifest_refused_before_parsing(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                   manifest_doc: Doc) -> None:
    monkeypatch.setattr(manifest_parse, "MAX_MANIFEST_BYTES", 1000)
    # not even JSON: refused for its size, so the JSON parser never saw it
    refuses(b"x" * 1001, "size", "1001 bytes", "at most 1000")
    # through storage: one read of at most limit + 1 bytes, whatever the file's size
    import shardckpt.checkpoint.reader as ckpt_mod
    monkeypatch.setattr(ckpt_mod, "MAX_MANIFEST_BYTES", 1000)
    (tmp_path / "manifest.json").write_bytes(b" " * 5000)
    st_ = Storage(str(tmp_path))
    reads: list[tuple[str, int]] = []
    real_read = st_.read_prefix
    st_.read_prefix = lambda rel, n: reads.append((rel, n)) or real_read(rel, n)  # type: ignore[method-assign]
    with pytest.raises(ManifestError, match=r"manifest.json: more than 1000 bytes; a larger manifest is refused"):
        read_manifest(st_)
    assert reads == [("manifest.json", 1001)]


def test_real_size_limit_is_generous() -> None:
    # a 70B / 1024-rank manifest is ~10 MB; the cap must be well above it and below memory abuse
    assert 64 << 20 <= manifest_mod.MAX_MANIFEST_BYTES <= 1 << 30
    assert MAX_INT == 2**53


def test_exactly_2_pow_53_is_accepted_where_sizes_allow(manifest_doc: Doc) -> None:
    manifest_doc["extras"]["samples_seen"] = 2**64  # extras are free-form JSON
    assert parse(dumps(manifest_doc)).extras["samples_seen"] == 2**64
    manifest_doc["optimizer"]["param_groups"][0]["step"] = 2**53
    assert parse(dumps(manifest_doc)).optimizer.param_groups[0]["step"] == 2**53
    manifest_doc["optimizer"]["param_groups"][0]["step"] = 2**53 + 1
    refuses(dumps(manifest_doc), "optimizer.param_groups[0].step", "outside")


def test_shard_slots_order_and_offsets() -> None:
    """Format 1.0: kind-major (every group's master, then every exp_avg, ...), contiguous; a group
    without a kind (frozen: master only) is skipped in that kind's run. 0.x: group-major."""
    m = manifest_from_spec(synth_spec(TINY_PARAMS, 4))
    slots = shard_slots(m.components, m.mesh)
    comp = m.components["model"]
    groups = comp.layout.groups
    assert any(len(comp.states[g.name]) == 1 for g in groups)  # a frozen group is in the spec
    names = [f"{g.name}.{k}" for k in ("master", "exp_avg", "exp_avg_sq") for g in groups
             if k in dict(comp.states[g.name])]
    assert [s.name for s in slots] == names
    old = shard_slots(m.components, m.mesh, (0, 1))
    assert [s.name for s in old] == [f"{g.name}.{k}" for g in groups for k, _ in comp.states[g.name]]
    assert old[-1].end == slots[-1].end and [s.name for s in old] != [s.name for s in slots]
    master = [s for s in slots if s.name.endswith(".master")]
    assert master == slots[:len(master)]  # the weights are one contiguous range
    pos = 0
    for s in slots:
        g = comp.layout.group(s.name.rsplit(".", 1)[0])
        assert s.begin == pos and s.shape == (g.padded_numel // 4,)
        assert s.end - s.begin == s.shape[0] * (4 if s.dtype == "float32" else 2)
        pos = s.end
    assert m.shard_file(0).size == 8 + m.shard_file(0).header_size + pos


def test_mesh_round_trips_axis_order() -> None:
    m = manifest_from_spec(synth_spec(TINY_PARAMS, 6, replicate=3))
    assert parse(to_json(m)).mesh == Mesh.hsdp(3, 2)


@pytest.mark.parametrize("chunked, frozen_files, digests, version", [
    (None, False, None, (1, 1)), ("section", False, None, (1, 2)), (None, True, None, (1, 3)),
    (None, False, "sha256", (1, 4)), ("section", False, "sha256", (1, 4)), (None, True, "sha256", (1, 4)),
    (None, False, "blake3", (1, 5)), ("section", True, "blake3", (1, 5)),
])
def test_the_format_layer_names_the_lowest_version_that_holds_what_a_manifest_records(
        chunked: object, frozen_files: bool, digests: str | None, version: tuple[int, int]) -> None:
    from types import SimpleNamespace

    from shardckpt.format.versions import version_for

    spec = SimpleNamespace(chunked=chunked, frozen_files=frozen_files, digest_algorithm=digests)
    assert version_for(spec) == version


def test_a_writer_writes_the_version_the_format_layer_names(tmp_path: Path) -> None:
    from shardckpt.checkpoint.writer import CheckpointSpec, CheckpointWriter
    from shardckpt.format.layout import Mesh
    from shardckpt.format.versions import version_for
    from shardckpt.storage import Storage

    for spec in (CheckpointSpec(Mesh.for_world(2), {}), CheckpointSpec(Mesh.for_world(2), {}, digests=True)):
        assert CheckpointWriter(Storage(str(tmp_path)), spec).manifest(()).version == version_for(spec)


def test_each_data_file_header_records_the_version_of_its_kind() -> None:
    from shardckpt.format.versions import file_version

    assert [file_version(r) for r in ("shard", "buffers", "rank", "chunks", "frozen")] == \
        ["1.1", "1.1", "1.1", "1.2", "1.3"]
