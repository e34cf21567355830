"""`shardckpt synth / inspect / verify`: output, options, and one clear error per bad input."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import struct
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner, Result

from testing.ckpts import TINY_PARAMS, make_ckpt
from testing.cli import cli, one_line_error
from shardckpt import storage as storage_mod
from shardckpt.cli.common import parse_storage_options
from shardckpt.cli.main import app
from shardckpt.format.manifest import Manifest, to_json
from shardckpt.format.manifest_parse import parse
from shardckpt.storage import crc32c

runner = CliRunner()


def error_lines(r: Result) -> list[str]:
    lines = r.stderr.strip().splitlines()
    assert all(line.startswith("error: ") for line in lines), r.stderr
    return lines


@pytest.fixture
def ckpt(tmp_path: Path) -> tuple[Path, Manifest]:
    path, m = make_ckpt(tmp_path)
    return Path(path), m


def rewrite_manifest(root: Path, m: Manifest, files: dict[str, bytes]) -> None:
    """Replace file contents and record their true size and checksums in a new manifest."""
    entries = []
    for f in m.files:
        if f.path in files:
            data = files[f.path]
            (root / f.path).write_bytes(data)
            cs = m.chunk_size
            f = dataclasses.replace(f, size=len(data), crc32c=crc32c(data),
                                    chunk_crc32c=tuple(crc32c(data[i:i + cs]) for i in range(0, len(data), cs)))
        entries.append(f)
    (root / "manifest.json").write_bytes(to_json(dataclasses.replace(m, files=tuple(entries))))


# ------------------------------------------------------------------------------- happy paths


def test_synth_inspect_verify_text_and_json(tmp_path: Path) -> None:
    dst = str(tmp_path / "c")
    r = cli("synth", dst, "--params", str(TINY_PARAMS), "--ranks", "4", "--replicate", "2", "--step", "7")
    assert r.exit_code == 0, r.output
    assert r.stdout.startswith(f"wrote {dst}: 3 files") and "dp_replicate=2 x dp_shard=2" in r.stdout
    r = cli("verify", dst)
    assert r.exit_code == 0 and r.stdout.startswith(f"ok: {dst}: 3 files") and r.stderr == ""
    r = cli("verify", dst, "--json")
    rep = json.loads(r.stdout)
    assert r.exit_code == 0 and rep["ok"] is True and rep["problems"] == []
    assert len(rep["files"]) == 3 and all(f["ok"] for f in rep["files"])
    r = cli("inspect", dst, "--json")
    s = json.loads(r.stdout)
    assert r.exit_code == 0
    assert s["format_version"] == "1.1" and s["mesh"] == {"dp_replicate": 2, "dp_shard": 2}
    assert s["world_size"] == 4 and s["step"] == 7 and s["optimizer"]["name"] == "adamw"
    assert [f["role"] for f in s["files"]] == ["shard", "shard", "buffers"]
    m = parse(Path(dst, "manifest.json").read_bytes())
    assert s["save_id"] == m.save_id and s["total_bytes"] == m.total_bytes
    comp = s["components"]["model"]
    assert comp["aliases"] == {"lm_head.weight": "model.embed_tokens.weight"}
    assert comp["elements"] == sum(p.numel for p in m.components["model"].layout.params)
    r = runner.invoke(app, ["inspect", dst], env={"COLUMNS": "250"})  # rich wraps narrow tables
    assert r.exit_code == 0
    for needle in ("format 1.1", m.save_id, "step 7", "adamw", "model.u0000.float32", "exp_avg_sq",
                   "shard-00001-of-00002.safetensors", "tied: lm_head.weight"):
        assert needle in r.stdout, needle
    r = cli("synth", str(tmp_path / "d"), "--params", "3e3", "--ranks", "1", "--json")
    assert r.exit_code == 0 and json.loads(r.stdout)["world_size"] == 1


def test_memory_urls_within_one_process() -> None:
    url = f"memory://cli-{uuid.uuid4().hex}/run/step-1"
    try:
        assert cli("synth", url, "--params", "3k", "--ranks", "3").exit_code == 0
        r = cli("verify", url, "--json")
        assert r.exit_code == 0 and json.loads(r.stdout)["ok"] is True
        r = cli("inspect", url, "--json")
        assert r.exit_code == 0 and json.loads(r.stdout)["world_size"] == 3
        one_line_error(cli("inspect", url + "-missing"), url + "-missing", "no such checkpoint")
    finally:
        storage_mod.Storage(url.split("/run")[0]).rm("", recursive=True)


def test_storage_option_parsing(monkeypatch: pytest.MonkeyPatch) -> None:
    assert parse_storage_options(None) == {}
    assert parse_storage_options([
        "anon=true", "n=3", "name=plain text", "client_kwargs.endpoint_url=http://127.0.0.1:9000",
        "client_kwargs.region_name=us-east-1", 'config={"a": [1, 2]}', "eq=a=b", "empty=",
    ]) == {"anon": True, "n": 3, "name": "plain text", "config": {"a": [1, 2]}, "eq": "a=b", "empty": "",
           "client_kwargs": {"endpoint_url": "http://127.0.0.1:9000", "region_name": "us-east-1"}}
    # through the CLI: the options reach the Storage
    seen: list[dict[str, Any]] = []
    real = storage_mod.storage_options_from_env

    def spy(url: str, options: Any) -> dict[str, Any]:
        seen.append(dict(options or {}))
        return real(url, options)
    monkeypatch.setattr(storage_mod.backend, "storage_options_from_env", spy)  # where parse_for looks it up
    url = f"memory://opt-{uuid.uuid4().hex}"
    try:
        assert cli("synth", url, "--params", "3k", "--ranks", "2", "-o", "skip_instance_cache=false").exit_code == 0
        r = cli("inspect", url, "--storage-option", "skip_instance_cache=false", "-o",
                "listings_expiry_time=2", "--json")
        assert r.exit_code == 0, r.output
        assert {"skip_instance_cache": False, "listings_expiry_time": 2} in seen
        # an option the backend does not know is refused, named (nested keys reach it whole)
        one_line_error(cli("inspect", url, "-o", "x.y=2"), "storage option x:", "memory://", code=2)
        assert {"x": {"y": 2}} in seen
    finally:
        storage_mod.Storage(url).rm("", recursive=True)
    one_line_error(cli("inspect", url, "-o", "noequals"), "--storage-option 'noequals'", "KEY=VALUE", code=2)


def test_bad_options_exit_2(tmp_path: Path) -> None:
    one_line_error(cli("synth", str(tmp_path / "x"), "--params", "lots", "--ranks", "2"),
                   "--params lots: expected a count", code=2)
    one_line_error(cli("synth", str(tmp_path / "x"), "--params", "1M", "--ranks", "0"), "--ranks 0", code=2)
    one_line_error(cli("synth", str(tmp_path / "x"), "--params", "1M", "--ranks", "6", "--replicate", "4"),
                   "not divisible", code=2)
    assert not (tmp_path / "x").exists()


# ----------------------------------------------------------------------------------- bad input


def test_missing_checkpoint(tmp_path: Path) -> None:
    p = str(tmp_path / "nope")
    for cmd in ("inspect", "verify"):
        one_line_error(cli(cmd, p), p, "no such checkpoint")


def test_directory_without_manifest(ckpt: tuple[Path, Manifest]) -> None:
    root, _ = ckpt
    (root / "manifest.json").unlink()  # shards written, never committed
    for cmd in ("inspect", "verify"):
        one_line_error(cli(cmd, str(root)), str(root), "manifest.json", "never committed")


def test_missing_shard(ckpt: tuple[Path, Manifest]) -> None:
    root, m = ckpt
    path = m.shard_file(1).path
    (root / path).unlink()
    line = one_line_error(cli("verify", str(root)), f"{root}/{path}", "missing")
    assert line == f"error: {root}/{path}: missing"
    rep = json.loads(cli("verify", str(root), "--json").stdout)
    assert not rep["ok"] and [f["ok"] for f in rep["files"]] == [True, False, True]


def test_truncated_shard(ckpt: tuple[Path, Manifest]) -> None:
    root, m = ckpt
    f = root / m.shard_file(0).path
    f.write_bytes(f.read_bytes()[:-100])
    r = cli("verify", str(root))
    assert r.exit_code == 1
    lines = error_lines(r)
    assert any(f"{f}: truncated: {m.shard_file(0).size - 100} bytes, the manifest records "
               f"{m.shard_file(0).size}" in line for line in lines), lines
    assert all(str(f) in line for line in lines)


def test_extended_shard(ckpt: tuple[Path, Manifest]) -> None:
    root, m = ckpt
    f = root / m.shard_file(1).path
    with open(f, "ab") as fh:
        fh.write(b"\0")
    lines = error_lines(cli("verify", str(root)))
    assert f"error: {f}: extended: {m.shard_file(1).size + 1} bytes, the manifest records {m.shard_file(1).size}" in lines


def test_flipped_byte(ckpt: tuple[Path, Manifest]) -> None:
    root, m = ckpt
    e = m.shard_file(1)
    f = root / e.path
    data = bytearray(f.read_bytes())
    pos = e.size - 5000                     # in the data section, chunk (size - 5000) // 4096
    data[pos] ^= 0x40
    f.write_bytes(bytes(data))
    c = pos // m.chunk_size
    line = one_line_error(cli("verify", str(root)), str(f), "1 chunk(s) fail their CRC32C check",
                          f"[{c * m.chunk_size}, {(c + 1) * m.chunk_size})", "corrupted")
    assert line.startswith(f"error: {f}: ")


def test_all_problems_listed(ckpt: tuple[Path, Manifest]) -> None:
    root, m = ckpt
    s0, s1, b = (root / m.shard_file(0).path, root / m.shard_file(1).path, root / m.buffers_file().path)
    data = bytearray(s0.read_bytes())
    data[100] ^= 1                          # in the header
    data[-1] ^= 1                           # in the last chunk
    s0.write_bytes(bytes(data))
    s1.write_bytes(s1.read_bytes()[:50])
    b.unlink()
    r = cli("verify", str(root))
    assert r.exit_code == 1
    lines = error_lines(r)
    assert any(str(s0) in ln and "2 chunk(s) fail" in ln for ln in lines), lines
    assert any(str(s1) in ln and "truncated" in ln for ln in lines), lines
    assert f"error: {b}: missing" in lines
    rep = json.loads(cli("verify", str(root), "--json").stdout)
    assert [f["ok"] for f in rep["files"]] == [False, False, False]
    assert set(rep["problems"]) == {ln[len("error: "):] for ln in lines}


@pytest.mark.parametrize("edit,needles", [
    (lambda d: d.pop("save_id"), ("top level", "missing field 'save_id'")),
    (lambda d: d["files"][0].update(size=-3), ("files[0].size", "outside")),
    (lambda d: d["files"][0].update(path="../../etc/passwd"), ("files[0].path", "not a plain relative path")),
    (lambda d: d["components"]["model"]["groups"][0].update(padded_numel=17), ("padded_numel",)),
])
def test_malformed_manifest(ckpt: tuple[Path, Manifest], edit: Any, needles: tuple[str, ...]) -> None:
    root, _ = ckpt
    doc = json.loads((root / "manifest.json").read_bytes())
    edit(doc)
    (root / "manifest.json").write_text(json.dumps(doc))
    for cmd in ("inspect", "verify"):
        one_line_error(cli(cmd, str(root)), f"{root}/manifest.json", *needles)


def test_manifest_not_json(ckpt: tuple[Path, Manifest]) -> None:
    root, _ = ckpt
    (root / "manifest.json").write_bytes(b'{"format": "shardckpt", "version": ')
    for cmd in ("inspect", "verify"):
        one_line_error(cli(cmd, str(root)), f"{root}/manifest.json", "not valid manifest JSON")


def test_newer_major_version(ckpt: tuple[Path, Manifest]) -> None:
    root, _ = ckpt
    doc = json.loads((root / "manifest.json").read_bytes())
    doc["version"] = "2.0"
    (root / "manifest.json").write_text(json.dumps(doc))
    for cmd in ("inspect", "verify"):
        one_line_error(cli(cmd, str(root)), f"{root}/manifest.json", "format 2.0 is newer", "upgrade shardckpt")


def test_hostile_header_length_past_eof(ckpt: tuple[Path, Manifest]) -> None:
    """A shard whose u64 header length points past the end, with checksums that match the bytes:
    only the header check can catch it."""
    root, m = ckpt
    e = m.shard_file(0)
    data = bytearray((root / e.path).read_bytes())
    data[:8] = struct.pack("<Q", 10_000_000)
    rewrite_manifest(root, m, {e.path: bytes(data)})
    line = one_line_error(cli("verify", str(root)), f"{root}/{e.path}",
                          f"header length 10000000 runs past the end of the {e.size}-byte file")
    assert "CRC32C" not in line
    data[:8] = struct.pack("<Q", 2**40)
    rewrite_manifest(root, m, {e.path: bytes(data)})
    one_line_error(cli("verify", str(root)), f"{root}/{e.path}", "exceeds the 100000000-byte limit")


def test_header_that_disagrees_with_the_manifest(ckpt: tuple[Path, Manifest]) -> None:
    root, m = ckpt
    e = m.shard_file(1)
    raw = (root / e.path).read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = raw[8:8 + n].replace(b"exp_avg_sq", b"exp_avg_zz")
    rewrite_manifest(root, m, {e.path: raw[:8] + header + raw[8 + n:]})
    one_line_error(cli("verify", str(root)), f"{root}/{e.path}", "header tensors differ from the manifest",
                   "exp_avg_zz")


# ---------------------------------------------------------------------------- the real script


def shardckpt_script() -> str:
    found = shutil.which("shardckpt") or os.path.join(os.path.dirname(sys.executable), "shardckpt")
    assert os.access(found, os.X_OK), f"console script not installed: {found}"
    return found


def test_real_script_end_to_end(tmp_path: Path) -> None:
    exe = shardckpt_script()
    dst = str(tmp_path / "c")

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([exe, *args], capture_output=True, text=True, timeout=60)

    r = run("synth", dst, "--params", "3k", "--ranks", "2")
    assert r.returncode == 0 and r.stdout.startswith(f"wrote {dst}"), r.stderr
    r = run("verify", dst)
    assert r.returncode == 0 and r.stdout.startswith(f"ok: {dst}") and r.stderr == ""
    r = run("inspect", dst, "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["world_size"] == 2
    r = run("inspect", str(tmp_path / "none"))
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr == f"error: {tmp_path / 'none'}: no such checkpoint (nothing is there)\n"


def test_help_does_not_import_torch() -> None:
    """What keeps ``--help`` quick: the CLI's import does not pull in torch."""
    code = ("import sys, shardckpt.cli.main as m\n"
            "try:\n    m.app(['--help'])\nexcept SystemExit as e:\n    assert e.code == 0, e.code\n"
            "heavy = [k for k in ('torch', 'numpy', 'safetensors', 's3fs') if k in sys.modules]\n"
            "assert 'torch' not in sys.modules, heavy\n"
            "print('heavy:', heavy)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "synth" in r.stdout and "verify" in r.stdout and "inspect" in r.stdout
    r2 = subprocess.run([shardckpt_script(), "--help"], capture_output=True, text=True, timeout=60)
    assert r2.returncode == 0 and "verify" in r2.stdout


def test_console_script_registers_each_command_from_its_module() -> None:
    """The console script registers only the module of the command it runs: its table names
    every command the modules register, with the module that registers it, and a command's
    help is the same through it as through the whole application."""
    from shardckpt.cli import main as everything
    from shardckpt.cli.run import COMMAND_MODULES

    app = everything.app
    registered = {c.name or c.callback.__name__: c.callback.__module__.rsplit(".", 1)[-1]
                  for c in app.registered_commands}
    registered.update({g.name: {c.callback.__module__.rsplit(".", 1)[-1]
                                for c in g.typer_instance.registered_commands}.pop()
                       for g in app.registered_groups})
    assert registered == COMMAND_MODULES
    for name in ("reshard", "inspect", "import", "export"):
        whole = subprocess.run([sys.executable, "-m", "shardckpt.cli.main", name, "--help"],
                               capture_output=True, text=True, timeout=60)
        alone = subprocess.run([shardckpt_script(), name, "--help"], capture_output=True, text=True,
                               timeout=60)
        assert whole.returncode == alone.returncode == 0, (whole.stderr, alone.stderr)
        assert alone.stdout == whole.stdout.replace("python -m shardckpt.cli.main", "shardckpt")


# --------------------------------------------------------------- progress totals from the library


def test_jobs_open_progress_with_the_bytes_they_move(tmp_path: Path, ckpt: tuple[Path, Manifest]) -> None:
    """The commands' progress totals come from the library's plans: a reshard and a verify
    count the source's bytes, a diff the bytes its plan compares; synth_bytes is what synthesize
    counts."""
    from contextlib import contextmanager
    from typing import Iterator

    from shardckpt.errors import ConfigError
    from shardckpt.tools.diff import plan_diff
    from shardckpt.tools.jobs import run_diff, run_reshard, run_verify
    from shardckpt.tools.synth import synth_bytes, synthesize

    path, m = ckpt
    totals: list[int] = []

    @contextmanager
    def bar(total: int) -> Iterator[Any]:
        totals.append(total)
        yield lambda n: None

    assert run_verify(str(path), {}, 2, None, bar).ok
    out = str(tmp_path / "r")
    r = run_reshard(str(path), out, 2, None, 1, 1, False, {}, 1 << 20, None, bar)
    assert run_diff(str(path), out, {}, 1 << 20, None, bar).equal
    assert totals == [m.total_bytes, m.total_bytes, plan_diff(m, r.manifest).total_bytes]
    counted: list[int] = []
    synthesize(str(tmp_path / "s"), TINY_PARAMS, 4, 2, progress=counted.append)
    assert sum(counted) == synth_bytes(TINY_PARAMS, 4, 2)
    with pytest.raises(ConfigError, match="--to 0"):  # checked before the source is opened
        run_reshard(str(tmp_path / "nothing"), out, 0, None, 1, 1, False, {}, 1 << 20, None, bar)
