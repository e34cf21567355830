"""The manifest's own integrity: its checksum, structural order, hostile text, hostile sizes."""

from __future__ import annotations

import copy
import json
import tracemalloc
from typing import Any

import pytest

from shardckpt.errors import ManifestError
from shardckpt.format.manifest import VERSION, to_json
from shardckpt.format.manifest_parse import parse
from shardckpt.format.integrity import CHECKSUM_FIELD, MAX_FREE, MAX_NAME, crc32c, seal

Doc = dict[str, Any]
SRC = "s3://b/run/manifest.json"


def refuses(data: bytes | str, *needles: str) -> str:
    with pytest.raises(ManifestError) as ei:
        parse(data, SRC)
    msg = str(ei.value)
    assert msg.startswith(f"{SRC}: "), msg
    for n in needles:
        assert n in msg, f"{n!r} not in {msg!r}"
    return msg


def _params(doc: Doc) -> list[Doc]:
    return doc["components"]["model"]["params"]


# ------------------------------------------------------------------------------- checksum


def test_writers_seal_the_manifest(manifest_doc: Doc) -> None:
    data = seal(manifest_doc)
    assert data == to_json(parse(data))
    assert VERSION == (1, 1) and json.loads(data)["version"] == "1.1"
    assert list(json.loads(data))[-1] == CHECKSUM_FIELD
    # the checksum covers every byte before the member's key (docs/FORMAT.md 3.8)
    at = data.rindex(b'"manifest_crc32c"')
    assert json.loads(data)[CHECKSUM_FIELD] == f"{crc32c(data[:at]):08x}"


def test_flipped_digit_that_stays_valid_json_is_refused(manifest_doc: Doc) -> None:
    data = seal(manifest_doc)
    seen = manifest_doc["extras"]["samples_seen"]
    assert data.count(b'"samples_seen": %d' % seen) == 1
    damaged = data.replace(b'"samples_seen": %d' % seen, b'"samples_seen": %d' % (seen + 1))
    json.loads(damaged)  # still valid JSON, every field still valid
    msg = refuses(damaged, CHECKSUM_FIELD, "mismatch")
    recorded = json.loads(data)[CHECKSUM_FIELD]
    at = damaged.rindex(b'"manifest_crc32c"')
    assert recorded in msg and f"{crc32c(damaged[:at]):08x}" in msg  # both CRCs named


def test_damage_that_breaks_a_field_names_the_field_and_the_checksum(manifest_doc: Doc) -> None:
    data = seal(manifest_doc)
    damaged = data.replace(b'"dp_shard"', b'"dp_shard_"', 1)
    refuses(damaged, "mesh", "dp_shard", CHECKSUM_FIELD, "mismatch")


def test_1_1_without_checksum_refused_older_accepted(manifest_doc: Doc) -> None:
    del manifest_doc[CHECKSUM_FIELD]
    for version in ("1.1", "1.7"):
        manifest_doc["version"] = version
        refuses(json.dumps(manifest_doc), f"format {version} requires the {CHECKSUM_FIELD}", "missing")
    for version in ("1.0", "0.1"):
        manifest_doc["version"] = version
        assert parse(json.dumps(manifest_doc)).version == tuple(int(x) for x in version.split("."))


def test_checksum_must_be_last_and_well_formed(manifest_doc: Doc) -> None:
    data = seal(manifest_doc)
    doc = json.loads(data)
    moved = {CHECKSUM_FIELD: doc[CHECKSUM_FIELD], **{k: v for k, v in doc.items() if k != CHECKSUM_FIELD}}
    refuses(json.dumps(moved, indent=1), CHECKSUM_FIELD, "last member")
    doc[CHECKSUM_FIELD] = doc[CHECKSUM_FIELD].upper()
    refuses(json.dumps(doc, indent=1), CHECKSUM_FIELD, "8 lowercase hex")
    # a 1.0 manifest that carries one has it checked too
    manifest_doc["version"] = "1.0"
    data = seal(manifest_doc)
    parse(data)
    refuses(data.replace(b'"1.0"', b'"1.00"', 1).replace(b'"version": "1.00"', b'"version": "1.0" ', 1),
            "mismatch")


def test_checksum_member_nested_in_extras_is_not_taken_for_it(manifest_doc: Doc) -> None:
    manifest_doc["extras"]["user"] = {CHECKSUM_FIELD: "00000000"}
    parse(seal(manifest_doc))


# --------------------------------------------------------------------- structural order


def _same_shape_pair(doc: Doc) -> tuple[int, int]:
    seen: dict[tuple[str, tuple[int, ...]], int] = {}
    for i, p in enumerate(_params(doc)):
        key = (p["group"], tuple(p["shape"]))
        if key in seen:
            return seen[key], i
        seen[key] = i
    raise AssertionError("no two params of one shape in one group")


def test_swapped_offsets_of_same_shape_params_refused(manifest_doc: Doc) -> None:
    i, j = _same_shape_pair(manifest_doc)
    ps = _params(manifest_doc)
    ps[i]["offset"], ps[j]["offset"] = ps[j]["offset"], ps[i]["offset"]
    refuses(seal(manifest_doc), "components.model.params", "out of flat order",
            repr(ps[j]["fqn"]), repr(ps[i]["fqn"]))


def test_params_of_different_groups_may_interleave(manifest_doc: Doc) -> None:
    ps = _params(manifest_doc)
    last_of_first = max(k for k, p in enumerate(ps) if p["group"] == ps[0]["group"])
    ps.insert(0, ps.pop(last_of_first + 1))  # a param of the second group first
    parse(seal(manifest_doc))


def test_swapped_shard_indices_refused(manifest_doc: Doc) -> None:
    f = manifest_doc["files"]
    f[0]["index"], f[1]["index"] = f[1]["index"], f[0]["index"]
    refuses(seal(manifest_doc), "files", "shard entry 0", "has index 1", "shard entry 1", "has index 0")


def test_swapped_shard_paths_refused(manifest_doc: Doc) -> None:
    f = manifest_doc["files"]
    f[0]["path"], f[1]["path"] = f[1]["path"], f[0]["path"]
    refuses(seal(manifest_doc), "files", "shard entry 0", "not named shard-00000-of-00002",
            "shard entry 1")


def test_every_offender_named_in_one_error(manifest_doc: Doc) -> None:
    doc = copy.deepcopy(manifest_doc)
    for f in doc["files"][:2]:
        f["size"] += 4
    refuses(seal(doc), "files", doc["files"][0]["path"], doc["files"][1]["path"], "does not match")
    # a gap in two groups: both named
    doc = copy.deepcopy(manifest_doc)
    firsts = {}
    for p in _params(doc):
        firsts.setdefault(p["group"], p)
    a, b = list(firsts.values())[:2]
    for p in (a, b):
        for q in _params(doc):
            if q["group"] == p["group"] and q is not p:
                q["offset"] += 1
    refuses(seal(doc), "components.model.params", "group 'model.u0000.float32'",
            "group 'model.u0001.float32'", "gap")


# ----------------------------------------------------------------------------- hostile text


def test_huge_save_id_refused(manifest_doc: Doc) -> None:
    manifest_doc["save_id"] = "a" * (1 << 20)
    msg = refuses(seal(manifest_doc), "save_id", "1048576 characters", "at most 256")
    assert len(msg) < 400


@pytest.mark.parametrize("where", ["fqn", "group", "buffer", "unit", "optimizer"])
def test_long_names_refused(manifest_doc: Doc, where: str) -> None:
    long = "x" * (MAX_NAME + 1)
    if where == "fqn":
        _params(manifest_doc)[0]["fqn"] = long
    elif where == "group":
        manifest_doc["components"]["model"]["groups"][0]["name"] = long
    elif where == "buffer":
        manifest_doc["components"]["model"]["buffers"][0]["fqn"] = long
    elif where == "unit":
        manifest_doc["components"]["model"]["groups"][0]["unit"] = long
    else:
        manifest_doc["optimizer"]["name"] = long
    refuses(seal(manifest_doc), "characters", "at most")


def test_long_free_text_refused(manifest_doc: Doc) -> None:
    manifest_doc["extras"]["user"] = {"notes": ["y" * (MAX_FREE + 1)]}
    refuses(seal(manifest_doc), "extras.user.notes[0]", "at most 65536")
    del manifest_doc["extras"]["user"]
    manifest_doc["optimizer"]["param_groups"][0]["hparams"]["k" * (MAX_FREE + 1)] = 1
    refuses(seal(manifest_doc), "hparams", "a key of")


def test_byte_order_mark_refused(manifest_doc: Doc) -> None:
    data = seal(manifest_doc)
    refuses(b"\xef\xbb\xbf" + data, "not valid manifest JSON", "byte order mark")
    refuses("\ufeff" + data.decode(), "byte order mark")


def test_not_utf8_refused(manifest_doc: Doc) -> None:
    refuses(json.dumps(manifest_doc).encode("utf-16"), "not valid manifest JSON")
    refuses(seal(manifest_doc).replace(b'"step"', b'"st\xffep"'), "not UTF-8")


@pytest.mark.parametrize("edit,where", [
    (lambda d: _params(d)[0].update(fqn="w\udcff"), "components.model.params[0].fqn"),
    (lambda d: d["extras"]["user"].update(note="\ud800x"), "extras.user.note"),
    (lambda d: d["extras"]["user"].update({"\udfffk": 1}), "extras.user (a key)"),
])
def test_lone_surrogates_refused(manifest_doc: Doc, edit: Any, where: str) -> None:
    edit(manifest_doc)
    refuses(seal(manifest_doc), where, "lone UTF-16 surrogate")


def test_paired_surrogates_and_escaped_backslashes_accepted(manifest_doc: Doc) -> None:
    manifest_doc["extras"]["user"]["note"] = "\U0001f600 and \\ud800 as text"
    data = seal(manifest_doc)
    assert b"\\ud83d\\ude00" in data and b"\\\\ud800" in data
    assert parse(data).extras["user"]["note"] == "\U0001f600 and \\ud800 as text"


# ----------------------------------------------------------------------------- hostile sizes


def test_mesh_the_files_cannot_describe_refused_in_small_memory(manifest_doc: Doc) -> None:
    S = 1 << 24
    manifest_doc["mesh"]["axes"][1]["size"] = S
    for g in manifest_doc["components"]["model"]["groups"]:
        g["padded_numel"] = 16 * S
    data = seal(manifest_doc)
    assert len(data) < 16 << 10
    tracemalloc.start()
    try:
        refuses(data, "files", f"{S} shard ranks", "2 shard files")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 8 << 20, peak


def test_format_md_checksum_example() -> None:
    """docs/FORMAT.md 3.8: the worked example of section 11 as a 1.1 manifest, sealed by hand."""
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "FORMAT.md").read_text()
    example = re.search(r"```json\n(.*?)```", text, re.S).group(1)
    assert '"manifest_crc32c": "a193144f"' in text
    assert example.endswith("\n ]\n}\n")
    sealed = (example.replace('"version": "1.0"', '"version": "1.1"', 1)[:-len("\n ]\n}\n")]
              + '\n ],\n "manifest_crc32c": "a193144f"\n}')
    m = parse(sealed.encode())
    assert m.version == (1, 1)
    refuses(sealed.replace('"a193144f"', '"a193144e"'), "records a193144e", "give a193144f")
