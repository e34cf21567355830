"""Text read from a checkpoint is printed as text, never as markup, and every failure of every
command is one line on stderr: hostile names in every printed field, locations that cannot be
opened, and I/O errors that no layer below named."""

from __future__ import annotations

import errno
import json
import socket
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest

from shardckpt.checkpoint.reader import as_storage

from shardckpt.checkpoint.writer import CheckpointSpec, CheckpointWriter
from shardckpt.cli.common import safe_text
from shardckpt.format.integrity import seal
from shardckpt.format.layout import Mesh, ParamInfo, build_layout
from shardckpt.format.manifest import Component, OptimizerInfo, TensorSlot, default_states
from testing.cli import cli, one_line_error

MARKUP = "[/]"
BOLD_CLOSE = "[/bold]"
ESCAPE = "w[/bold]\x1b[2J:smile:"     # markup, a terminal escape sequence and an emoji code
ESCAPE_SHOWN = "w[/bold]\\x1b[2J:smile:"
ALIAS = "[bold]tied[/]"


def write_hostile(dst: str, fill: float = 0.0, ranks: int = 2) -> None:
    """A checkpoint whose parameter names, unit, alias, optimizer name, hyper-parameters and
    extras are markup, escape sequences and emoji codes."""
    infos = [ParamInfo(MARKUP, (4, 4), "float32", True, BOLD_CLOSE),
             ParamInfo(ESCAPE, (8,), "float32", True, ""), ParamInfo("plain.weight", (3,), "float32")]
    mesh = Mesh.for_world(ranks)
    layout = build_layout(infos, mesh)
    states = {g.name: default_states(g, ("exp_avg",)) for g in layout.groups}
    comp = Component("model", layout, states, {ALIAS: "plain.weight"})
    opt = OptimizerInfo("[/]adamw", ({"params": [p.fqn for p in layout.params],
                                      "hparams": {"weight_decay": MARKUP, "lr": "[red"}, "step": 3},))
    spec = CheckpointSpec(mesh, {"model": comp}, opt, {"step": 7, "note": MARKUP, "label": BOLD_CLOSE})
    writer = CheckpointWriter(as_storage(dst), spec)

    def produce(slot: TensorSlot) -> Iterator[Any]:
        yield np.full((slot.end - slot.begin) // 4, fill, np.float32)

    writer.commit([writer.write_shard(s, produce) for s in range(ranks)])


@pytest.fixture
def hostile(tmp_path: Path) -> str:
    dst = str(tmp_path / "hostile")
    write_hostile(dst)
    return dst


def test_inspect_prints_hostile_names_as_text(hostile: str) -> None:
    r = cli("inspect", hostile)
    assert r.exit_code == 0, (r.output, r.exception)
    out = r.stdout
    for needle in ("step 7", "optimizer [/]adamw", f"wd={MARKUP}", f"│ {MARKUP} ",
                   BOLD_CLOSE + " ", ESCAPE_SHOWN, f"tied: {ALIAS} -> plain.weight"):
        assert needle in out, needle
    assert "\x1b" not in out  # the escape sequence is shown, not sent to the terminal
    doc = json.loads(cli("inspect", hostile, "--json").stdout)
    assert doc["step"] == 7 and doc["extras"]["note"] == MARKUP and doc["extras"]["label"] == BOLD_CLOSE
    assert {p["fqn"] for p in doc["components"]["model"]["params"]} == {MARKUP, ESCAPE, "plain.weight"}
    assert doc["components"]["model"]["aliases"] == {ALIAS: "plain.weight"}


def test_a_step_that_is_not_a_number_is_one_error(hostile: str) -> None:
    """shardckpt's own extras keys are typed (FORMAT.md 3.9): markup where the step goes is
    refused by the commands that read the step, in one line naming the key."""
    doc = json.loads(Path(hostile, "manifest.json").read_text())
    doc["extras"]["step"] = BOLD_CLOSE
    doc.pop("manifest_crc32c", None)
    Path(hostile, "manifest.json").write_bytes(seal(doc))
    one_line_error(cli("inspect", hostile), "extras.step: expected an integer")


def test_diff_prints_hostile_names_as_text(tmp_path: Path, hostile: str) -> None:
    other = str(tmp_path / "other")
    write_hostile(other, fill=1.0)
    r = cli("diff", hostile, other)
    assert r.exit_code == 1 and "Traceback" not in r.output, (r.output, r.exception)
    assert f"│ {MARKUP} " in r.stdout and ESCAPE_SHOWN in r.stdout and "\x1b" not in r.stdout
    doc = json.loads(cli("diff", hostile, other, "--json").stdout)
    assert {d["name"] for d in doc["differences"]} == {MARKUP, ESCAPE, "plain.weight"}


def test_verify_and_consolidate_of_hostile_names(tmp_path: Path, hostile: str) -> None:
    r = cli("verify", hostile)
    assert r.exit_code == 0 and r.stdout.startswith(f"ok: {hostile}"), (r.output, r.exception)
    out = tmp_path / "hf"
    r = cli("consolidate", hostile, str(out), "--dtype", "fp32")
    assert r.exit_code == 0 and r.stdout.startswith("consolidated"), (r.output, r.exception)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == {MARKUP, ESCAPE, "plain.weight"}
    # an error message naming a hostile path is one line too
    bad = str(tmp_path / "x[/]\x1b[2J")
    one_line_error(cli("inspect", bad), "x[/]\\x1b[2J", "no such checkpoint")


def test_lone_surrogates_never_raise(tmp_path: Path, hostile: str) -> None:
    """A lone surrogate (undecodable bytes in a path, or an unpaired escape in a manifest) is
    printed escaped or refused with one line; it never ends in a UnicodeEncodeError."""
    doc = json.loads(Path(hostile, "manifest.json").read_text())
    doc["extras"]["note"] = "\udc80"
    Path(hostile, "manifest.json").write_text(json.dumps(doc))  # ensure_ascii: "\udc80" escaped
    for cmd in ("inspect", "verify"):
        r = cli(cmd, hostile)
        assert r.exit_code in (0, 1) and "Traceback" not in r.output, (r.output, r.exception)
        assert r.exception is None or isinstance(r.exception, SystemExit), r.exception
        if r.exit_code:
            one_line_error(r, hostile)
    odd = str(tmp_path / "caf\udce9")  # how Python decodes a non-UTF-8 byte in argv
    one_line_error(cli("inspect", odd), "caf\\udce9", "no such checkpoint")
    assert safe_text("a\udc80b\nc") == "a\\udc80b\\nc"
    assert safe_text("plain [/] text") == "plain [/] text"


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("url", [f"ftp://127.0.0.1:{closed_port()}/x", "zip://x::/nonexistent/none.zip"])
def test_locations_that_cannot_be_opened(tmp_path: Path, url: str) -> None:
    out = str(tmp_path / "out")
    for args in (["inspect", url], ["verify", url], ["consolidate", url, out], ["diff", url, url],
                 ["reshard", url, out, "--to", "1"]):
        one_line_error(cli(*args), url, "cannot open this location")
    assert not Path(out).exists()


def test_os_errors_nobody_named_are_one_line(monkeypatch: pytest.MonkeyPatch, hostile: str) -> None:
    import shardckpt.tools.summary

    def broken(*a: Any, **k: Any) -> None:
        raise OSError(errno.EIO, "Input/output error", "/dev/sdz")
    monkeypatch.setattr(shardckpt.tools.summary, "summarize", broken)
    one_line_error(cli("inspect", hostile), "/dev/sdz", "Input/output error")
    import shardckpt.tools.estimate

    monkeypatch.setattr(shardckpt.tools.estimate, "estimate_all", broken)
    one_line_error(cli("estimate", "--params", "7B", "--ranks", "8"), "/dev/sdz", "Input/output error")
