"""The exporters behind one interface, the twin of the importers': the registry, the options,
and the ``export`` commands the registry drives (each command's help, options and output)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from shardckpt.errors import ConfigError
from shardckpt.interop.exporter import Exporter, ExportOptions, run_exporter, with_export_config
from shardckpt.tools.exporters import EXPORTERS, get_exporter
from testing.ckpts import make_ckpt
from testing.cli import cli


def test_the_registry_names_every_exporter() -> None:
    assert set(EXPORTERS) == {"dcp", "deepspeed", "hf"}
    for name in EXPORTERS:
        exp = get_exporter(name)
        assert isinstance(exp, Exporter) and exp.name == name
        assert exp.Config.__dataclass_params__.frozen
    with pytest.raises(ConfigError, match="no exporter 'zip'; exporters: dcp, deepspeed, hf"):
        get_exporter("zip")


def test_a_config_is_the_exporters_own_and_required_fields_are_asked_for() -> None:
    from shardckpt.interop.dcp.exporter import DcpExportConfig
    from shardckpt.interop.deepspeed.exporter import DeepSpeedExportConfig
    from shardckpt.tools.consolidate_plan import DEFAULT_MAX_SHARD_SIZE
    from shardckpt.tools.hf_export import HFExportConfig

    dcp, ds = get_exporter("dcp"), get_exporter("deepspeed")
    assert with_export_config(dcp, ExportOptions("a", "b")).config == DcpExportConfig()
    with pytest.raises(ConfigError, match="export deepspeed needs a DeepSpeedExportConfig \\(its ranks\\)"):
        with_export_config(ds, ExportOptions("a", "b"))
    with pytest.raises(ConfigError, match="config is a DcpExportConfig; export deepspeed takes"):
        run_exporter(ds, ExportOptions("a", "b", config=DcpExportConfig()))
    assert DeepSpeedExportConfig(8).stage == 2
    assert HFExportConfig().max_shard_size == DEFAULT_MAX_SHARD_SIZE


def test_the_commands_come_from_the_registry(tmp_path: Path) -> None:
    for name in EXPORTERS:
        exp = get_exporter(name)
        r = cli("export", name, "--help")
        assert r.exit_code == 0 and exp.source_help.split()[0] in r.output
        for f in dataclasses.fields(exp.Config):
            assert f.metadata.get("flag", "--" + f.name.replace("_", "-")) in r.output
    assert "--ranks" in cli("export", "deepspeed", "--help").output
    r = cli("export", "dcp", str(tmp_path / "a"), str(tmp_path / "b"), "--buffer", "lots")
    assert r.exit_code == 2 and "--buffer" in r.output


def test_export_hf_writes_what_consolidate_writes(tmp_path: Path) -> None:
    src, _ = make_ckpt(tmp_path)
    r = cli("export", "hf", str(src), str(tmp_path / "hf"), "--dtype", "fp32", "--json")
    assert r.exit_code == 0, r.output
    exported = json.loads(r.output)
    r = cli("consolidate", str(src), str(tmp_path / "c"), "--dtype", "fp32", "--json")
    assert r.exit_code == 0, r.output
    consolidated = json.loads(r.output)
    for key in ("save_id", "step", "dtype", "tensors", "total_size", "files"):
        assert exported[key] == consolidated[key], key
    for f in exported["files"]:
        assert (tmp_path / "hf" / f["name"]).read_bytes() == (tmp_path / "c" / f["name"]).read_bytes()
    line = cli("export", "hf", str(src), str(tmp_path / "hf2"), "--max-shard-size", "1KB")
    assert line.exit_code == 0 and line.output.startswith(f"exported {src} -> {tmp_path / 'hf2'}: ")


def test_export_hf_of_a_run_directory_exports_the_checkpoint_latest_names(tmp_path: Path) -> None:
    from testing.ckpts import make_run_dir

    run = make_run_dir(tmp_path / "run")
    (run / "latest").write_text("step-00000200\n")
    r = cli("export", "hf", str(run), str(tmp_path / "hf"), "--json")
    assert r.exit_code == 0, r.output
    summary = json.loads(r.output)
    assert summary["src"].endswith("step-00000200") and summary["step"] == 200
