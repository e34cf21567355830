"""safetensors headers: ours open in the safetensors library; hostile ones are refused."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors import safe_open

from shardckpt.checkpoint.reader import CheckpointReader
from shardckpt.errors import IntegrityError
from shardckpt.format.dtypes import DTYPES
from shardckpt.format.manifest import Manifest, TensorSlot
from shardckpt.format.safetensors_header import MAX_HEADER, build_header, header_length, parse_header

NP = {"float64": np.float64, "float32": np.float32, "float16": np.float16, "int64": np.int64,
      "int32": np.int32, "int16": np.int16, "int8": np.int8, "uint8": np.uint8, "bool": np.bool_}


def slots_for(tensors: list[tuple[str, str, tuple[int, ...]]]) -> list[TensorSlot]:
    out, pos = [], 0
    for name, dtype, shape in tensors:
        n = int(np.prod(shape, dtype=np.int64)) * DTYPES[dtype][0]
        out.append(TensorSlot(name, dtype, shape, pos, pos + n))
        pos += n
    return out


def test_our_files_open_in_safetensors(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    spec = [("a.master", "float32", (37,)), ("b", "float16", (3, 5)), ("c", "int64", (2, 2, 2)),
            ("empty", "int8", (0, 4)), ("scalar", "float64", ()), ("mask", "bool", (9,)),
            ("u", "uint8", (13,)), ("i", "int32", (1,)), ("h", "int16", (7,))]
    slots = slots_for(spec)
    arrays = {}
    for s in slots:
        dt = NP[s.dtype]
        arr = (rng.standard_normal(s.shape) * 100).astype(dt) if dt is not np.bool_ else \
            rng.integers(0, 2, s.shape).astype(bool)
        arrays[s.name] = np.array(arr, dt).reshape(s.shape)  # ascontiguousarray would make 0-d 1-d
    header = build_header(slots, {"format": "shardckpt", "shard": 3})
    assert (len(header) - 8) % 8 == 0, "data section must start 8-byte aligned"
    assert struct.unpack("<Q", header[:8])[0] == len(header) - 8
    assert header[8:].rstrip(b" ").endswith(b"}") and len(header[8:]) - len(header[8:].rstrip(b" ")) < 8
    path = tmp_path / "t.safetensors"
    path.write_bytes(header + b"".join(arrays[s.name].tobytes() for s in slots))
    with safe_open(str(path), framework="numpy") as f:
        assert f.metadata() == {"format": "shardckpt", "shard": "3"}
        assert sorted(f.keys()) == sorted(arrays)
        for name, want in arrays.items():
            got = f.get_tensor(name)
            assert got.dtype == want.dtype and got.shape == want.shape
            np.testing.assert_array_equal(got, want)
    # and our own parser reads back exactly the slots we built
    size = path.stat().st_size
    n = header_length(header[:8], size, str(path))
    tensors, meta = parse_header(header[8:8 + n], size, str(path))
    assert tensors == {s.name: s for s in slots} and meta == {"format": "shardckpt", "shard": "3"}


def test_header_without_metadata(tmp_path: Path) -> None:
    header = build_header(slots_for([("x", "float32", (4,))]))
    assert b"__metadata__" not in header
    p = tmp_path / "x.safetensors"
    p.write_bytes(header + np.arange(4, dtype=np.float32).tobytes())
    with safe_open(str(p), framework="numpy") as f:
        np.testing.assert_array_equal(f.get_tensor("x"), np.arange(4, dtype=np.float32))


def test_shard_files_open_in_safetensors_and_match_the_reader(tiny_ckpt: tuple[str, Manifest]) -> None:
    path, m = tiny_ckpt
    r = CheckpointReader(path)
    comp = m.components["model"]
    for f in m.files:
        with safe_open(str(Path(path, f.path)), framework="numpy") as st:
            meta = st.metadata()
            assert meta["format"] == "shardckpt" and meta["version"] == "1.1"
            assert meta["save_id"] == m.save_id
            if f.role != "shard":
                continue
            assert meta["shard"] == str(f.index) and meta["shard_degree"] == "2"
            for g in comp.layout.groups:
                for kind, dtype in comp.states[g.name]:
                    got = st.get_tensor(f"{g.name}.{kind}")
                    want = np.frombuffer(r.read_state(f.index, g.name, kind), NP[dtype])
                    assert got.shape == (g.padded_numel // 2,)
                    np.testing.assert_array_equal(got, want)


# ---------------------------------------------------------------------------- hostile headers


def hostile(doc: Any, data_size: int, raw: bytes | None = None) -> IntegrityError:
    body = raw if raw is not None else json.dumps(doc).encode()
    with pytest.raises(IntegrityError) as ei:
        parse_header(body, 8 + len(body) + data_size, "bad.safetensors")
    assert str(ei.value).startswith("bad.safetensors: ")
    return ei.value


def t(dtype: str, shape: list[int], begin: int, end: int) -> dict[str, Any]:
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


def test_length_past_end_of_file() -> None:
    prefix = struct.pack("<Q", 1000)
    with pytest.raises(IntegrityError, match="header length 1000 runs past the end of the 500-byte file"):
        header_length(prefix, 500, "s.safetensors")
    assert header_length(prefix, 1008, "s.safetensors") == 1000


def test_length_over_limit() -> None:
    assert MAX_HEADER == 100_000_000
    with pytest.raises(IntegrityError, match="exceeds the 100000000-byte limit"):
        header_length(struct.pack("<Q", MAX_HEADER + 1), 10**12, "s.safetensors")
    with pytest.raises(IntegrityError, match="exceeds"):
        header_length(struct.pack("<Q", 2**64 - 1), 2**63, "s.safetensors")


def test_file_too_short() -> None:
    with pytest.raises(IntegrityError, match="too short"):
        header_length(b"\x01\x02", 2, "s.safetensors")


def test_offsets_outside_data() -> None:
    assert "outside the 16-byte data section" in str(hostile({"x": t("F32", [5], 0, 20)}, 16))
    hostile({"x": t("F32", [1], -4, 0), "y": t("F32", [4], 0, 16)}, 16)
    hostile({"x": t("F32", [1], 8, 4)}, 16)                     # end before begin


def test_overlap() -> None:
    e = hostile({"a": t("F32", [4], 0, 16), "b": t("F32", [2], 8, 16)}, 16)
    assert "overlaps" in str(e) and "'b'" in str(e)


def test_hole() -> None:
    e = hostile({"a": t("F32", [2], 0, 8), "b": t("F32", [1], 12, 16)}, 16)
    assert "hole at byte 8" in str(e)
    e = hostile({"a": t("F32", [2], 0, 8)}, 16)                # trailing bytes nobody owns
    assert "cover 8 bytes of a 16-byte data section" in str(e)


def test_shape_times_dtype_must_equal_span() -> None:
    e = hostile({"a": t("F32", [3], 0, 16)}, 16)
    assert "needs 12 bytes, data_offsets span 16" in str(e)
    hostile({"a": t("BF16", [4], 0, 16)}, 16)
    hostile({"a": t("F64", [2**62, 4], 0, 16)}, 16)            # huge shape, tiny span


def test_duplicate_keys() -> None:
    raw = b'{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}'
    assert "duplicate key 'a'" in str(hostile(None, 8, raw))


@pytest.mark.parametrize("raw", [b"[]", b'"x"', b"17", b"null"])
def test_non_object_json(raw: bytes) -> None:
    assert "not a JSON object" in str(hostile(None, 0, raw))


@pytest.mark.parametrize("raw", [b"{", b"\xff\xfe{}", b"{'a': 1}", b"[" * 200_000])
def test_malformed_json(raw: bytes) -> None:
    hostile(None, 0, raw)


@pytest.mark.parametrize("code", ["F128", "f32", "float32", None, 4, "C64"])
def test_bad_dtype(code: Any) -> None:
    assert "unknown dtype" in str(hostile({"a": {"dtype": code, "shape": [1], "data_offsets": [0, 4]}}, 4))


@pytest.mark.parametrize("entry", [
    {"dtype": "F32", "shape": [1.0], "data_offsets": [0, 4]},
    {"dtype": "F32", "shape": [True], "data_offsets": [0, 4]},
    {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]},
    {"dtype": "F32", "shape": "1", "data_offsets": [0, 4]},
    {"dtype": "F32", "shape": [1] * 17, "data_offsets": [0, 4]},
    {"dtype": "F32", "shape": [1], "data_offsets": [0]},
    {"dtype": "F32", "shape": [1], "data_offsets": [0, 4.0]},
    {"dtype": "F32", "shape": [1], "data_offsets": [False, 4]},
    {"dtype": "F32", "shape": [1]},
    [1, 2, 3],
])
def test_bad_entries(entry: Any) -> None:
    hostile({"a": entry}, 4)


@pytest.mark.parametrize("meta", [{"k": 1}, ["x"], "x", {"k": None}])
def test_metadata_must_map_strings_to_strings(meta: Any) -> None:
    assert "__metadata__" in str(hostile({"__metadata__": meta, "a": t("F32", [1], 0, 4)}, 4))


def test_empty_tensors_and_padding_whitespace_accepted() -> None:
    body = json.dumps({"e": t("F32", [0], 0, 0), "a": t("I8", [3], 0, 3), "z": t("U8", [0, 2], 3, 3)}).encode()
    body += b" " * 5
    tensors, meta = parse_header(body, 8 + len(body) + 3, "ok.safetensors")
    assert set(tensors) == {"e", "a", "z"} and meta == {}
    assert tensors["a"] == TensorSlot("a", "int8", (3,), 0, 3)
