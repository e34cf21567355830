"""The offline tools under torchrun: 1, 2 and 4 gloo processes on 127.0.0.1 give the same bytes as
the single-process command; a process killed mid-run fails the job, commits nothing, and a rerun
succeeds."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import fsspec
import psutil
import pytest

from shardckpt.checkpoint.verify import verify
from shardckpt.format.manifest import MANIFEST_NAME
from shardckpt.tools.synth import synthesize

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parent.parent


def torchrun(nproc: int, *args: str, wait: bool = True, timeout: float = 120) -> Any:
    """``torchrun --standalone --nproc_per_node NPROC -m shardckpt ARGS`` (a finished
    CompletedProcess, or the running Popen with ``wait=False``)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
           str(nproc), "-m", "shardckpt", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "SHARDCKPT_DIST_TIMEOUT_S": "60",
           "PYTHONPATH": str(ROOT)}
    if not wait:
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                                cwd=ROOT)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)


def shardckpt(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shardckpt", *args], capture_output=True,
                          text=True, timeout=120, cwd=ROOT)


def contents(ckpt: str, fs: Any = None) -> dict[str, Any]:
    """Every file's bytes and the manifest, with the save id (and creation time) taken out: what
    must be equal, bit for bit, whoever wrote the checkpoint (``fs``: an fsspec file system for
    ``ckpt``; local by default)."""
    fs = fs or fsspec.filesystem("file")
    raw = fs.cat_file(f"{ckpt}/{MANIFEST_NAME}")
    m = json.loads(raw)
    sid = m["save_id"].encode()
    files = {f["path"].replace(m["save_id"], "S"): fs.cat_file(f"{ckpt}/{f['path']}").replace(sid, b"S")
             for f in m["files"]}
    doc = json.loads(raw.replace(sid, b"S"))
    for k in ("created_at", "manifest_crc32c"):
        doc.pop(k)
    for f in doc["files"]:  # checksums cover the header, which names the save: the bytes are compared
        f.pop("crc32c"), f.pop("chunk_crc32c")
    return {"manifest": doc, "files": files}


@pytest.fixture(scope="module")
def src(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = str(tmp_path_factory.mktemp("dist") / "src")
    synthesize(path, 300_000, ranks=4, units=3, seed=5)
    return path


@pytest.fixture(scope="module")
def reference(src: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = str(tmp_path_factory.mktemp("ref") / "ref")
    r = shardckpt("reshard", src, out, "--to", "6")
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
                for child in psutil.Process(proc.pid).children(recursive=True):
                    try:
                        if child.environ().get("RANK") == str(victim):
                            child.send_signal(signal.SIGKILL)
                            killed = child.pid
                    except psutil.Error:
                        continue
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
        shardckpt("reshard", src, dst, "--to", "8", "--overwrite")
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
    r = shardckpt("consolidate", src, one, *opts)
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
    one = shardckpt("verify", bad, "--json")
    assert one.returncode == 1
    r = torchrun(2, "verify", bad, "--json")
    assert r.returncode != 0
    assert json.loads(r.stdout) == json.loads(one.stdout)
    assert len(json.loads(r.stdout)["problems"]) == 2


def test_diff_under_torchrun_reports_what_one_process_does(tmp_path: Path, src: str) -> None:
    other = str(tmp_path / "other")
    synthesize(other, 300_000, ranks=2, units=3, seed=6)
    one = shardckpt("diff", src, other, "--json")
    assert one.returncode == 1, one.stderr
    r = torchrun(2, "diff", src, other, "--json")
    assert r.returncode != 0
    a, b = json.loads(one.stdout), json.loads(r.stdout)
    for doc in (a, b):  # time, and bytes read (whole checksum chunks, per process) differ
        doc.pop("seconds"), doc.pop("bytes_read")
    assert a == b and a["differences"]
