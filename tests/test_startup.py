"""What the offline commands import: each runs in a fresh interpreter, as the console script would,
and reports which heavy modules it loaded by the time it exited. Import checks, not timings: the
modules a command loads are what its start-up costs, whatever the machine."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from shardckpt.tools.synth import synthesize

#: Never loaded by an offline command on local paths: the training stack, the S3 client stack,
#: fsspec (local paths go through ``os``) and pydantic (option values are plain strings and numbers).
NEVER = ("torch", "s3fs", "aiobotocore", "botocore", "fsspec", "pydantic")
#: Loaded only to print help the rich way (markdown, syntax highlighting, panels).
RICH_HELP = ("typer.rich_utils", "rich", "rich.markdown", "pygments", "markdown_it")
#: The part of it that a command printing its own tables (rich.table) still never needs.
HELP_ONLY = ("typer.rich_utils", "rich.markdown")
#: The ``crc32c`` package's ``__init__`` (it reads its version through ``importlib.metadata``):
#: shardckpt loads only its C extension.
CRC_PACKAGE = ("crc32c", "importlib.metadata")
WATCHED = NEVER + RICH_HELP + CRC_PACKAGE + ("numpy", "shardckpt.storage.s3", "shardckpt.tools.estimate")

# Runs ``python -m shardckpt.cli.main ARGS`` in this interpreter and, however it ends, writes the
# watched modules it loaded as JSON to the file named first; the exit code is the command's.
_WRAPPER = """
import json, runpy, sys
out, args, watched = sys.argv[1], sys.argv[2:], {watched!r}
sys.argv = ["shardckpt", *args]
try:
    runpy.run_module("shardckpt.cli.main", run_name="__main__")
finally:
    with open(out, "w") as f:
        json.dump(sorted(m for m in watched if m in sys.modules), f)
"""


def loaded_by(tmp_path: Path, *args: str, code: int = 0) -> set[str]:
    """The watched modules ``shardckpt ARGS`` has loaded when it exits with ``code``."""
    out = tmp_path / "modules.json"
    out.unlink(missing_ok=True)
    r = subprocess.run([sys.executable, "-c", _WRAPPER.format(watched=WATCHED), str(out), *args],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == code, (args, r.returncode, r.stdout[-2000:], r.stderr[-2000:])
    return set(json.loads(out.read_text()))


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """Two tiny local checkpoints (2 ranks) that differ in their seed."""
    root = tmp_path_factory.mktemp("startup")
    a, b = str(root / "a"), str(root / "b")
    synthesize(a, 3_000, 2, seed=0)
    synthesize(b, 3_000, 2, seed=1)
    return a, b


def test_help_imports_no_array_or_rich_help_stack(tmp_path: Path) -> None:
    """``--help`` builds the command table only: no numpy, no pydantic coercion, no rich help."""
    mods = loaded_by(tmp_path, "--help")
    assert not mods & set(NEVER + RICH_HELP + ("numpy", "shardckpt.tools.estimate")), mods


def test_command_help_and_usage_errors_stay_plain(tmp_path: Path) -> None:
    """A command's help and a usage error print without rich's help machinery."""
    assert not loaded_by(tmp_path, "inspect", "--help") & set(NEVER + RICH_HELP + ("numpy",))
    assert not loaded_by(tmp_path, "import", "--help") & set(NEVER + RICH_HELP + ("numpy",))
    assert not loaded_by(tmp_path, "verify", code=2) & set(NEVER + RICH_HELP + ("numpy",))


@pytest.mark.parametrize("command", ["inspect", "inspect --json", "verify", "reshard"])
def test_byte_moving_commands_load_no_arrays(tmp_path: Path, ckpts: tuple[str, str],
                                             command: str) -> None:
    """Reading a manifest, checking checksums and resharding move bytes: numpy is not needed,
    nor torch, nor S3's client stack, fsspec or pydantic for a local path, nor the metadata
    machinery the crc32c package's ``__init__`` loads."""
    a, _ = ckpts
    args = command.split() + [a]
    if command == "reshard":
        args += [str(tmp_path / "r"), "--to", "1"]
    mods = loaded_by(tmp_path, *args)
    assert not mods & set(NEVER + HELP_ONLY + CRC_PACKAGE + ("numpy",)), mods


@pytest.mark.parametrize("command", ["inspect", "verify"])
def test_local_reads_load_no_s3_code(tmp_path: Path, ckpts: tuple[str, str], command: str) -> None:
    """shardckpt's own S3 code (multipart uploads, the create-only PUT) loads for ``s3://`` only."""
    mods = loaded_by(tmp_path, command, ckpts[0])
    assert "shardckpt.storage.s3" not in mods and not mods & set(NEVER), mods


@pytest.mark.parametrize("command", ["synth", "consolidate", "diff"])
def test_array_commands_load_no_torch_or_s3(tmp_path: Path, ckpts: tuple[str, str],
                                            command: str) -> None:
    """Commands that make arrays load numpy, and still neither torch, the S3 client stack, fsspec
    nor pydantic."""
    a, b = ckpts
    args, code = {
        "synth": (["synth", str(tmp_path / "s"), "--params", "3k", "--ranks", "2"], 0),
        "consolidate": (["consolidate", a, str(tmp_path / "hf")], 0),
        "diff": (["diff", a, b], 1),  # different seeds: they differ, exit 1
    }[command]
    mods = loaded_by(tmp_path, *args, code=code)
    assert not mods & set(NEVER + HELP_ONLY), mods
