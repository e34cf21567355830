"""The offline tools under torchrun: 1, 2 and 4 gloo processes on 127.0.0.1 give the same bytes as
the single-process command (reshard, consolidate, verify, diff, and the imports from Hugging Face,
DeepSpeed and DCP); a process killed mid-run fails the job, commits nothing, and a rerun
succeeds."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from shardckpt.checkpoint.verify import verify
from shardckpt.format.manifest import MANIFEST_NAME
from shardckpt.tools.synth import synthesize
from testing.cli import cli_process
from testing.torchrun import contents, kill_when, torchrun

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def src(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = str(tmp_path_factory.mktemp("dist") / "src")
    synthesize(path, 300_000, ranks=4, units=3, seed=5)
    return path


@pytest.fixture(scope="module")
def reference(src: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = str(tmp_path_factory.mktemp("ref") / "ref")
    r = cli_process("reshard", src, out, "--to", "6")
    assert r.returncode == 0, r.stderr
    return contents(out)


@pytest.mark.parametrize("nproc", [1, 2, 4])
def test_reshard_under_torchrun_equals_one_process(tmp_path: Path, src: str,
                                                   reference: dict[str, Any], nproc: int) -> None:
    dst = str(tmp_path / "dst")
    r = torchrun(nproc, "reshard", src, dst, "--to", "6")
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count("resharded ") == 1, r.stdout  # rank 0 reports, once
    assert verify(dst), verify(dst).problems
    assert contents(dst) == reference
    # the attempt's lease went with the commit: only the manifest and the save directory remain
    m = json.loads(Path(dst, MANIFEST_NAME).read_text())
    assert sorted(os.listdir(dst)) == sorted([MANIFEST_NAME, m["save_id"]])
    assert not [f for f in os.listdir(Path(dst, m["save_id"])) if f.startswith(".lease-")]


def test_a_write_failing_on_one_process_fails_every_process_and_leaves_nothing(
        tmp_path: Path, src: str) -> None:
    """The last source shard is damaged: only the process writing the last target shards reads
    it, yet every process fails with its error, and the attempt's files are removed."""
    import shutil

    bad, dst = str(tmp_path / "bad"), str(tmp_path / "dst")
    shutil.copytree(src, bad)
    m = json.loads(Path(bad, MANIFEST_NAME).read_text())
    last = [f for f in m["files"] if f["role"] == "shard"][-1]
    data = bytearray(Path(bad, last["path"]).read_bytes())
    data[-100] ^= 0xFF
    Path(bad, last["path"]).write_bytes(bytes(data))
    r = torchrun(2, "reshard", bad, dst, "--to", "6")
    assert r.returncode != 0
    errs = [line for line in r.stderr.splitlines() if "error: " in line]
    assert len(errs) == 2 and all(last["path"].split("/")[-1] in e for e in errs), r.stderr[-3000:]
    assert not os.path.exists(dst) or os.listdir(dst) == []


@pytest.mark.parametrize("victim", [0, 1])
def test_sigkill_of_a_process_commits_nothing_and_a_rerun_succeeds(tmp_path: Path,
                                                                   victim: int) -> None:
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    synthesize(src, 4_000_000, ranks=4, units=4)  # ~50 MB
    proc = torchrun(2, "reshard", src, dst, "--to", "8", "--buffer", "64KiB", wait=False)

    def both_writing() -> bool:
        return len([f for _, _, fs in os.walk(dst) for f in fs if f.startswith("shard-")]) >= 3
    killed, err = kill_when(proc, both_writing, victim)
    assert killed is not None, "the job finished before a process could be killed; make it bigger"
    assert proc.returncode != 0, err[-3000:]
    assert not os.path.exists(os.path.join(dst, MANIFEST_NAME))
    assert not verify(dst)
    # the rerun: as a job where the job's root was killed, else on its own
    r = torchrun(2, "reshard", src, dst, "--to", "8", "--overwrite") if victim == 0 else \
        cli_process("reshard", src, dst, "--to", "8", "--overwrite")
    assert r.returncode == 0, r.stderr[-3000:]
    result = verify(dst)
    assert result, result.problems
    # the killed attempt's directory went with the rerun (its lease's writer is gone)
    assert sorted(os.listdir(dst)) == sorted([MANIFEST_NAME, result.manifest.save_id])


def tree(path: str) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(Path(path).rglob("*")) if p.is_file()}


def test_consolidate_under_torchrun_equals_one_process(tmp_path: Path, src: str) -> None:
    one, job = str(tmp_path / "one"), str(tmp_path / "job")
    opts = ["--max-shard-size", "300KB", "--optimizer"]
    r = cli_process("consolidate", src, one, *opts)
    assert r.returncode == 0, r.stderr
    r = torchrun(3, "consolidate", src, job, *opts)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count("consolidated ") == 1, r.stdout
    out = tree(job)
    assert len([n for n in out if n.endswith(".safetensors")]) >= 4  # split over the processes
    assert out == tree(one)


def test_verify_under_torchrun_reports_what_one_process_does(tmp_path: Path, src: str) -> None:
    import shutil

    bad = str(tmp_path / "bad")
    shutil.copytree(src, bad)
    m = json.loads(Path(bad, MANIFEST_NAME).read_text())
    for f in (m["files"][1], m["files"][3]):  # one damaged file for each of two processes
        data = bytearray(Path(bad, f["path"]).read_bytes())
        data[-5] ^= 0xFF
        Path(bad, f["path"]).write_bytes(bytes(data))
    one = cli_process("verify", bad, "--json")
    assert one.returncode == 1
    r = torchrun(2, "verify", bad, "--json")
    assert r.returncode != 0
    assert json.loads(r.stdout) == json.loads(one.stdout)
    assert len(json.loads(r.stdout)["problems"]) == 2


def test_diff_under_torchrun_reports_what_one_process_does(tmp_path: Path, src: str) -> None:
    other = str(tmp_path / "other")
    synthesize(other, 300_000, ranks=2, units=3, seed=6)
    one = cli_process("diff", src, other, "--json")
    assert one.returncode == 1, one.stderr
    r = torchrun(2, "diff", src, other, "--json")
    assert r.returncode != 0
    a, b = json.loads(one.stdout), json.loads(r.stdout)
    for doc in (a, b):  # time, and bytes read (whole checksum chunks, per process) differ
        doc.pop("seconds"), doc.pop("bytes_read")
    assert a == b and a["differences"]


# ------------------------------------------------------------------------------------ import

FIXTURES = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "deepspeed"


@pytest.fixture(scope="module")
def hf_src(src: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    """A Hugging Face folder of several safetensors files and an index: ``src`` consolidated."""
    out = str(tmp_path_factory.mktemp("hf") / "hf")
    r = cli_process("consolidate", src, out, "--max-shard-size", "300KB")
    assert r.returncode == 0, r.stderr
    return out


@pytest.fixture(scope="module")
def dcp_src(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A stock DCP checkpoint of a model (two blocks, a buffer) and AdamW after one step."""
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    torch.manual_seed(3)
    m = torch.nn.Module()
    m.layers = torch.nn.ModuleList([torch.nn.Linear(40, 40) for _ in range(2)])
    m.head = torch.nn.Linear(40, 9)
    m.register_buffer("pos", torch.arange(5.0))
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    x = torch.randn(3, 40)
    m.head(m.layers[1](m.layers[0](x))).pow(2).sum().backward()
    opt.step()
    msd, osd = get_state_dict(m, opt)
    path = str(tmp_path_factory.mktemp("dcp") / "src")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
    return path


def _import_alone(kind: str, source: str, dst: str) -> None:
    if kind == "hf":
        from shardckpt.interop.hf.import_ import import_hf

        import_hf(source, dst, 4)
    elif kind == "deepspeed":
        from shardckpt.interop.deepspeed.import_ import import_deepspeed

        import_deepspeed(source, dst, 4)
    else:
        from shardckpt.interop.dcp.to_flat import import_dcp_flat

        import_dcp_flat(source, dst, 4)


@pytest.mark.parametrize("kind", ["hf", "deepspeed", "dcp"])
def test_import_under_torchrun_equals_one_process(tmp_path: Path, kind: str, hf_src: str,
                                                  dcp_src: str) -> None:
    """Two processes write the shard files of ``import KIND SRC DST --ranks 4`` between them:
    the same manifest (save id and time apart) and the same bytes as the import alone."""
    source = {"hf": hf_src, "deepspeed": str(FIXTURES / "zero2-bf16-3"), "dcp": dcp_src}[kind]
    one, job = str(tmp_path / "one"), str(tmp_path / "job")
    _import_alone(kind, source, one)
    r = torchrun(2, "import", kind, source, job, "--ranks", "4", "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads(r.stdout)  # rank 0 reports, once
    assert summary["destination"] == job and summary["ranks"] == 4
    assert contents(job) == contents(one)
    m = json.loads(Path(job, MANIFEST_NAME).read_text())
    assert sorted(os.listdir(job)) == sorted([MANIFEST_NAME, m["save_id"]])  # lease released
    assert verify(job), verify(job).problems


def test_sigkill_of_a_process_mid_import_commits_nothing(tmp_path: Path) -> None:
    """``import hf`` of 32 MiB into 8 shard files: the second process is killed once a first
    target file is there; the job fails and no manifest is written."""
    import numpy as np
    from safetensors.numpy import save_file

    source, dst = tmp_path / "hf", str(tmp_path / "dst")
    source.mkdir()
    rng = np.random.default_rng(0)
    weight_map = {}
    for f in range(2):  # 2 files x 4 tensors of 4 MiB
        names = [f"model.layers.{4 * f + i}.w" for i in range(4)]
        save_file({n: rng.standard_normal(1 << 20, np.float32) for n in names},
                  str(source / f"model-{f}.safetensors"))
        weight_map.update({n: f"model-{f}.safetensors" for n in names})
    (source / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": 32 << 20}, "weight_map": weight_map}))
    proc = torchrun(2, "import", "hf", str(source), dst, "--ranks", "8", "--buffer", "64KiB",
                    wait=False)

    def writing() -> bool:  # mid-write: a first target file is there
        return any(f.startswith("shard-") for _, _, fs in os.walk(dst) for f in fs)
    killed, err = kill_when(proc, writing, 1)
    assert killed is not None, "the job finished before a process could be killed; make it bigger"
    assert proc.returncode != 0, err[-3000:]
    assert not os.path.exists(os.path.join(dst, MANIFEST_NAME))
    assert not verify(dst)
