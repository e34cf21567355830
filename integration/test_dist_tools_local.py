"""The offline tools under torchrun: 1, 2 and 4 gloo processes on 127.0.0.1 give the same bytes as
the single-process command; a process killed mid-run fails the job, commits nothing, and a rerun
succeeds."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest

from shardckpt.checkpoint.verify import verify
from shardckpt.format.manifest import MANIFEST_NAME
from shardckpt.tools.synth import synthesize
from testing.cli import cli_process
from testing.torchrun import contents, kill_rank, torchrun

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
    killed = None
    deadline = time.monotonic() + 120
    try:
        while time.monotonic() < deadline and proc.poll() is None and killed is None:
            files = [f for _, _, fs in os.walk(dst) for f in fs if f.startswith("shard-")]
            if len(files) >= 3:  # both processes are writing
                killed = kill_rank(proc, victim)
            time.sleep(0.005)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
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
