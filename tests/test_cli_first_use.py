"""What a new user of the command line meets first: ``--version``, a top-level ``--help`` that
names every command, and one line that says what a foreign or missing path is and what to run."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from testing.ckpts import TINY_PARAMS
from testing.cli import cli, ok, one_line_error
from shardckpt import __version__
from shardckpt.tools.synth import synthesize


def test_version() -> None:
    r = ok(cli("--version"))
    assert r.stdout == f"shardckpt {__version__}\n"


def test_help_names_every_command() -> None:
    from shardckpt.cli.run import COMMAND_MODULES

    text = ok(cli("--help")).stdout
    intro = text.split("Options:")[0]  # the description, not click's (truncated) command list
    words = set(re.findall(r"[a-z]+", intro))
    missing = sorted(set(COMMAND_MODULES) - words)
    assert not missing, (missing, intro)


# ------------------------------------------------------ run folders and foreign folders


FIXTURES = Path(__file__).parent / "fixtures" / "deepspeed"
COMMANDS = (["inspect"], ["verify"], ["consolidate", "{out}"])


def each_command(path: Path, tmp: Path, *needles: str) -> None:
    """inspect, verify and consolidate on ``path``: one line with every needle, exit 1, nothing
    written."""
    for args in COMMANDS:
        argv = [a.format(out=tmp / "out") for a in args]
        one_line_error(cli(argv[0], str(path), *argv[1:]), *needles)
    assert not (tmp / "out").exists()


@pytest.mark.parametrize("names, label", [
    (["checkpoint-100", "checkpoint-200", "checkpoint-300"], "is a Trainer run directory"),
    (["epoch=0-step=100.ckpt", "epoch=1-step=200.ckpt", "last.ckpt"],
     "is a run directory of Lightning checkpoints"),
])
def test_a_trainer_or_lightning_run_lists_its_committed_checkpoints(
        tmp_path: Path, names: list[str], label: str) -> None:
    run = tmp_path / "run"
    for i, name in enumerate(names):
        synthesize(str(run / name), TINY_PARAMS, 1, step=100 * (i + 1))
    (run / names[1] / "manifest.json").unlink()  # a save that never committed: not listed
    newest = names[2] if names[2] != "last.ckpt" else names[0]
    each_command(run, tmp_path, f"{run} {label}, not a checkpoint", names[0], names[2],
                 f"Name one, e.g. {run / newest}")
    line = one_line_error(cli("inspect", str(run)))
    assert names[1] not in line


def test_foreign_folders_and_files_say_what_they_are_and_what_to_run(tmp_path: Path) -> None:
    ds = FIXTURES / "zero2-fp32-2"
    each_command(ds, tmp_path, "is a DeepSpeed checkpoint folder (latest: global_step3)",
                 f"shardckpt import deepspeed {ds} DST --ranks N")
    each_command(ds / "global_step3", tmp_path, "is a DeepSpeed checkpoint tag folder",
                 f"shardckpt import deepspeed {ds / 'global_step3'} DST --ranks N")
    dcp = tmp_path / "dcp"
    dcp.mkdir()
    (dcp / ".metadata").write_bytes(b"\x80\x04.")
    (dcp / "__0_0.distcp").write_bytes(b"")
    each_command(dcp, tmp_path, "is a torch.distributed.checkpoint (DCP) folder",
                 f"shardckpt import dcp {dcp} DST")
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    (hf / "model.safetensors").write_bytes(b"")
    each_command(hf, tmp_path, "is a Hugging Face model folder",
                 f"shardckpt import hf {hf} DST --ranks N")
    (hf / "model.safetensors").rename(hf / "pytorch_model.bin")
    each_command(hf, tmp_path, "pickled weights", "safe_serialization=True")
    import torch

    pt = tmp_path / "model.pt"
    torch.save({"w": torch.zeros(2)}, pt)
    each_command(pt, tmp_path, f"{pt} is a torch.save file (a pickle)", "never unpickles it",
                 "shardckpt import hf model.safetensors DST --ranks N")
    each_command(tmp_path / "nothing", tmp_path, f"{tmp_path / 'nothing'}: no such checkpoint")


def test_import_deepspeed_accepts_a_tag_folder(tmp_path: Path) -> None:
    whole, tag = tmp_path / "whole", tmp_path / "tag"
    ok(cli("import", "deepspeed", str(FIXTURES / "zero2-fp32-2"), str(whole), "--ranks", "1"))
    r = ok(cli("import", "deepspeed", str(FIXTURES / "zero2-fp32-2" / "global_step3"), str(tag),
               "--ranks", "1", "--json"))
    assert json.loads(r.stdout)["source_world_size"] == 2
    assert ok(cli("diff", str(whole), str(tag))).stdout.startswith("equal: ")
