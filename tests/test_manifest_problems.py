"""The manifest parser names every problem in one error; a file entry has one JSON form."""

from __future__ import annotations

import json
from typing import Any

import pytest

from testing.ckpts import TINY_PARAMS, manifest_from_spec
from shardckpt.errors import ManifestError
from shardckpt.format.integrity import seal
from shardckpt.format.manifest import FileEntry, to_json
from shardckpt.format.manifest_parse import parse
from shardckpt.format.parse_context import MAX_LISTED, Problem
from shardckpt.tools.synth import synth_spec

Doc = dict[str, Any]
SOURCE = "s3://b/run/manifest.json"


def problems(doc: Doc) -> tuple[str, list[str]]:
    """The error's message and its problems, one a line after the first."""
    with pytest.raises(ManifestError) as ei:
        parse(seal(doc), SOURCE)
    msg = str(ei.value)
    assert msg.startswith(f"{SOURCE}: "), msg
    lines = msg.split("\n")
    return msg, [line.strip() for line in lines[1:]] if len(lines) > 1 else [msg[len(SOURCE) + 2:]]


def test_three_independent_faults_all_named(manifest_doc: Doc) -> None:
    manifest_doc["save_id"] = "../x"
    manifest_doc["components"]["model"]["params"][1]["shape"] = [8, "8"]
    manifest_doc["files"][0]["crc32c"] = "ABCDEF01"
    msg, found = problems(manifest_doc)
    assert msg.startswith(f"{SOURCE}: 3 problems:\n"), msg
    assert len(found) == 3, found
    assert found[0].startswith("save_id: '../x' is not a plain name")
    assert found[1].startswith("components.model.params[1].shape[1]: expected an integer")
    assert found[2].startswith("files[0].crc32c: expected 8 lowercase hex digits")


def test_every_faulty_entry_of_a_list_named(manifest_doc: Doc) -> None:
    for f in manifest_doc["files"]:
        f["size"] = -1
    manifest_doc["extras"] = []
    _, found = problems(manifest_doc)
    assert found == ["extras: expected an object, found list"] + [
        f"files[{i}].size: -1 is outside [0, {2**53}]" for i in range(len(manifest_doc["files"]))]


def test_one_fault_reads_as_before(manifest_doc: Doc) -> None:
    manifest_doc["chunk_size"] = 100
    msg, _ = problems(manifest_doc)
    assert msg == f"{SOURCE}: chunk_size: 100 is outside [4096, 1073741824]"


def test_checks_on_a_faulty_part_are_skipped(manifest_doc: Doc) -> None:
    """A group that does not parse: its parameters are not 'in a group that does not exist',
    tiling and the optimizer's parameters are not checked against a half-read component."""
    groups = manifest_doc["components"]["model"]["groups"]
    groups[0]["numel"] = "many"
    manifest_doc["optimizer"]["param_groups"][0]["step"] = -1
    _, found = problems(manifest_doc)
    assert found == ["components.model.groups[0].numel: expected an integer, found str",
                     f"optimizer.param_groups[0].step: -1 is outside [0, {2**53}]"]


def test_files_checked_against_the_rest_only_when_all_parse(manifest_doc: Doc) -> None:
    del manifest_doc["files"][1]  # one shard file short: found only once every field parses
    manifest_doc["mesh"]["axes"][1]["size"] = 0
    _, found = problems(manifest_doc)
    assert found == ["mesh.axes[1].size: 0 is outside [1, 16777216]"]


def test_a_fault_that_makes_the_rest_meaningless_is_alone(manifest_doc: Doc) -> None:
    manifest_doc["version"] = "2.0"
    manifest_doc["save_id"] = "../x"
    msg, _ = problems(manifest_doc)
    assert msg.startswith(f"{SOURCE}: version: format 2.0 is newer") and "save_id" not in msg
    manifest_doc["version"] = "1.1"
    manifest_doc["requires"] = ["quantum_tensors"]
    msg, _ = problems(manifest_doc)
    assert msg.startswith(f"{SOURCE}: requires: this checkpoint needs 'quantum_tensors'")
    assert "save_id" not in msg


def test_many_problems_are_counted_past_the_listed(manifest_doc: Doc) -> None:
    params = manifest_doc["components"]["model"]["params"]
    assert len(params) > MAX_LISTED
    for p in params:
        p["offset"] = -1
    msg, found = problems(manifest_doc)
    assert msg.startswith(f"{SOURCE}: {len(params)} problems:\n")
    assert len(found) == MAX_LISTED + 1 and found[-1] == f"and {len(params) - MAX_LISTED} more"


# ------------------------------------------------------------------------ file entry codec


def test_file_entry_doc_round_trip() -> None:
    m = manifest_from_spec(synth_spec(TINY_PARAMS, 2), rank_files=1)
    doc = json.loads(to_json(m))
    assert [f.to_doc() for f in m.files] == doc["files"]
    for i, f in enumerate(m.files):
        assert FileEntry.from_doc(f.to_doc()) == f
        assert FileEntry.from_doc(json.loads(json.dumps(f.to_doc())), f"files[{i}]", m.chunk_size) == f


def test_file_entry_from_doc_refuses_by_name() -> None:
    m = manifest_from_spec(synth_spec(TINY_PARAMS, 2), rank_files=1)
    doc = m.files[0].to_doc() | {"path": "../etc/passwd"}
    with pytest.raises(Problem, match=r"^file entry: from rank 3\.path: '\.\./etc/passwd' is not a plain"):
        FileEntry.from_doc(doc, "from rank 3")
    short = m.files[0].to_doc()
    short["chunk_crc32c"] = short["chunk_crc32c"][:-1]
    with pytest.raises(ManifestError, match=r"file\.chunk_crc32c: .*8 lowercase hex digits per chunk"):
        FileEntry.from_doc(short)


def test_cli_prints_every_problem_on_one_line(manifest_doc: Doc, tmp_path) -> None:
    """The command line shows the whole list, not only its first line ("N problems:")."""
    from testing.cli import cli, one_line_error

    manifest_doc["save_id"] = "../x"
    manifest_doc["files"][0]["crc32c"] = "ABCDEF01"
    (tmp_path / "manifest.json").write_bytes(seal(manifest_doc))
    line = one_line_error(cli("inspect", str(tmp_path)), "2 problems:",
                          "save_id: '../x' is not a plain name", "files[0].crc32c: expected 8 lowercase")
    assert "; files[0].crc32c" in line, line
