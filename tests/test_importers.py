"""The importers behind one interface: the registry, the options and their checks, describing a
source, plan-then-write, and the ``import`` commands the registry drives."""

from __future__ import annotations

import dataclasses
import json
import pickle
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from shardckpt.errors import ConfigError, ManifestError
from shardckpt.interop.dcp.importer import DcpConfig
from shardckpt.interop.deepspeed.importer import DeepSpeedConfig
from shardckpt.interop.hf.importer import HF, HFConfig
from shardckpt.interop.importer import (
    IMPORTERS, ImportOptions, Importer, OptionError, get_importer, run_importer, with_config,
)
from testing.cli import cli, one_line_error

DEEPSPEED = Path(__file__).parent / "fixtures" / "deepspeed" / "zero2-fp32-2"


def tensors() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {"model.embed_tokens.weight": rng.standard_normal((8, 4), dtype=np.float32),
            "model.layers.0.w": rng.standard_normal((4, 4), dtype=np.float32),
            "model.layers.1.w": rng.standard_normal((4, 4), dtype=np.float32),
            "model.norm.weight": np.ones(4, np.float32)}


def write_folder(path: Path, values: dict[str, np.ndarray]) -> Path:
    """A Hugging Face folder: one tensor per file, ``model.safetensors.index.json``."""
    path.mkdir(parents=True)
    names = list(values)
    files = [f"model-{i + 1:05d}-of-{len(names):05d}.safetensors" for i in range(len(names))]
    for name, f in zip(names, files):
        save_file({name: values[name]}, str(path / f))
    index = {"metadata": {}, "weight_map": dict(zip(names, files))}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    return path


def test_the_registry_names_every_importer() -> None:
    assert set(IMPORTERS) == {"hf", "deepspeed", "dcp"}
    for name in IMPORTERS:
        imp = get_importer(name)
        assert isinstance(imp, Importer) and imp.name == name
        assert dataclasses.is_dataclass(imp.Config)
        assert getattr(imp.Config, "__dataclass_params__").frozen
    with pytest.raises(ConfigError, match="no importer 'zip'"):
        get_importer("zip")


def test_options_are_frozen_slotted_and_checked_by_field() -> None:
    o = ImportOptions("a", "b", 4, 2, ["x", "y"])  # type: ignore[arg-type]  # a list is kept as a tuple
    assert o.units == ("x", "y") and not hasattr(o, "__dict__")
    with pytest.raises(dataclasses.FrozenInstanceError):
        o.ranks = 8  # type: ignore[misc]
    with pytest.raises(OptionError) as e:
        ImportOptions("a", "b", 6, 4)
    assert str(e.value) == "ranks 6 must be a positive multiple of replicate 4"
    assert e.value.spelled(lambda f: f"--{f}") == "--ranks 6 must be a positive multiple of --replicate 4"
    assert pickle.loads(pickle.dumps(e.value)).fields == ("ranks", "replicate")
    with pytest.raises(OptionError, match="buffer_bytes 0"):
        ImportOptions("a", "b", 2, buffer_bytes=0)


def test_each_config_checks_its_own_fields_and_its_combinations() -> None:
    with pytest.raises(OptionError, match=r"frozen needs ranks"):
        ImportOptions("a", "b", config=DcpConfig(frozen=("w",)))
    config = ImportOptions("a", "b", 2, config=DcpConfig(frozen=["w"])).config  # type: ignore[arg-type]
    assert isinstance(config, DcpConfig) and config.frozen == ("w",)
    with pytest.raises(OptionError, match=r"frozen pattern '\(' is not a regular expression"):
        DcpConfig(frozen=("(",))
    with pytest.raises(OptionError, match="import hf needs ranks"):
        ImportOptions("a", "b", config=HFConfig())
    with pytest.raises(OptionError, match="import deepspeed needs ranks"):
        ImportOptions("a", "b", config=DeepSpeedConfig())
    with pytest.raises(OptionError, match="workers 0"):
        HFConfig(workers=0)
    with pytest.raises(OptionError, match="config is a DcpConfig; import hf takes a HFConfig"):
        with_config(HF, ImportOptions("a", "b", 2, config=DcpConfig()))
    assert isinstance(with_config(HF, ImportOptions("a", "b", 2)).config, HFConfig)


def test_describe_plan_and_write(tmp_path: Path) -> None:
    values = tensors()
    folder = write_folder(tmp_path / "m", values)
    info = HF.describe_source(str(folder))
    assert info.format == "hf" and info.tensors == len(values) and len(info.files) == 4
    assert info.bytes == sum((folder / f).stat().st_size for f in info.files)
    options = with_config(HF, ImportOptions(str(folder), str(tmp_path / "ck"), 2))
    with HF.plan(options) as plan:
        assert plan.spec.mesh.world_size == 2 and not (tmp_path / "ck" / "manifest.json").exists()
        m = HF.write(plan)
    assert (tmp_path / "ck" / "manifest.json").exists()
    assert len(m.components["model"].layout.params) == len(values)
    with pytest.raises(ConfigError, match="manifest.json exists"):
        run_importer(HF, options)

    ds = get_importer("deepspeed").describe_source(str(DEEPSPEED))
    assert ds.details == {"tag": ds.details["tag"], "world_size": 2} and ds.tensors is None
    assert all((DEEPSPEED / f).is_file() for f in ds.files)


def test_the_commands_come_from_the_registry(tmp_path: Path) -> None:
    folder = write_folder(tmp_path / "m", tensors())
    for name in IMPORTERS:
        r = cli("import", name, "--help")
        assert r.exit_code == 0 and get_importer(name).source_help.split()[0] in r.output
    assert "--tag" in cli("import", "deepspeed", "--help").output
    assert "--frozen" in cli("import", "dcp", "--help").output
    assert "--frozen" not in cli("import", "hf", "--help").output
    one_line_error(cli("import", "hf", str(folder), str(tmp_path / "x"), "--ranks", "3",
                       "--replicate", "2"), "--ranks 3 must be a positive multiple of --replicate 2",
                   code=2)
    one_line_error(cli("import", "dcp", str(folder), str(tmp_path / "x"), "--frozen", "w"),
                   "--frozen needs --ranks (chunks keep every tensor as it is)", code=2)
    assert not (tmp_path / "x").exists()
    r = cli("import", "hf", str(folder), str(tmp_path / "ck"), "--ranks", "2", "--json")
    assert r.exit_code == 0, r.output
    summary = json.loads(r.output)
    assert summary["ranks"] == 2 and summary["params"] == len(tensors())
    shard = load_file(str(next((tmp_path / "ck").rglob("shard-00000-of-00002.safetensors"))))
    assert all(v.dtype == np.float32 for v in shard.values())


def test_each_importer_registers_its_origin_and_summary_and_the_format_layer_names_none() -> None:
    """Where an import came from is its importer's record: the format layer's extras know no
    importer's key, and what an import's summary says of its source is the importer's to say."""
    from shardckpt.format.records import Origin, RunExtras
    from shardckpt.interop.dcp.config import DcpOrigin
    from shardckpt.interop.deepspeed.config import DeepSpeedOrigin

    origins = {name: get_importer(name).origin for name in IMPORTERS}
    assert origins == {"hf": None, "deepspeed": DeepSpeedOrigin, "dcp": DcpOrigin}
    for name, origin in origins.items():
        assert name not in RunExtras.KEYS
        assert origin is None or (issubclass(origin, Origin) and origin.KEY == name)
    ds = DeepSpeedOrigin("0.14", 3, 8, "global_step5", "bf16")
    extras = RunExtras.from_doc(RunExtras(step=5, other=ds.entry()).to_doc(), "extras")
    assert extras.origin(DeepSpeedOrigin) == ds and extras.origin(DcpOrigin) is None
    assert get_importer("deepspeed").summary(extras, "d") == {
        "step": 5, "zero_stage": 3, "source_world_size": 8}
    assert get_importer("dcp").summary(extras, "d") == {"step": 5}
    assert get_importer("hf").summary(extras, "d") == {"hf_config": False}
    bad = RunExtras.from_doc({"deepspeed": {"stage": "3"}}, "extras")
    with pytest.raises(ManifestError, match=r"^s3://b/ck: extras\.deepspeed\.stage: expected an integer"):
        get_importer("deepspeed").summary(bad, "s3://b/ck")
