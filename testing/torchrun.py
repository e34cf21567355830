"""The offline tools under ``torchrun``, and what must be equal whoever wrote a checkpoint."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

import fsspec

from shardckpt.format.manifest import MANIFEST_NAME

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


def kill_rank(proc: Any, rank: int) -> int | None:
    """SIGKILL the worker of torchrun job ``proc`` whose RANK is ``rank``; its pid, or None while
    that worker is not (or no longer) there."""
    import signal

    import psutil

    for child in psutil.Process(proc.pid).children(recursive=True):
        try:
            if child.environ().get("RANK") == str(rank):
                child.send_signal(signal.SIGKILL)
                return child.pid
        except psutil.Error:
            continue
    return None


def kill_when(proc: Any, ready: "Callable[[], bool]", rank: int, poll_s: float = 0.005,
              timeout_s: float = 120.0) -> tuple[int | None, str]:
    """SIGKILL worker ``rank`` of torchrun job ``proc`` once ``ready()`` holds (the job is
    mid-run), then wait for the job: (the killed pid or None, the job's stderr). A job still
    running at the end is killed."""
    import time

    killed = None
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline and proc.poll() is None and killed is None:
            if ready():
                killed = kill_rank(proc, rank)
            time.sleep(poll_s)
        _, err = proc.communicate(timeout=timeout_s)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return killed, err
