"""``consolidate --overwrite`` killed at any step leaves the previous consolidation loadable (its
index and every file it names, with the old tensors) or the new one complete, never neither."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open

from shardckpt.tools import synth
from shardckpt.tools.consolidate import MODEL_INDEX, consolidate

PARAMS = 20_000

#: The child: consolidate, pausing forever before the Nth write, rename, put or remove, after
#: writing the step's name to a marker file (the parent then kills it with SIGKILL).
CHILD = r"""
import os, sys, time
import shardckpt.tools.consolidate as c
from shardckpt.storage import Storage

src, dst, pause_at, marker, limit = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], int(sys.argv[5])
count = [0]

def hook(name, fn):
    def paused(*args, **kwargs):
        count[0] += 1
        if count[0] == pause_at:
            with open(marker, "w") as f:
                f.write(f"{name} {args[1:2]}")
            time.sleep(3600)
        return fn(*args, **kwargs)
    return paused

c._write_file = hook("write", c._write_file)
Storage.put = hook("put", Storage.put)
Storage.rm = hook("rm", Storage.rm)
os.replace = hook("replace", os.replace)
c.consolidate(src, dst, dtype="fp32", max_shard_size=limit, overwrite=True)
"""


def load(dst: Path) -> dict[str, np.ndarray]:
    """Every tensor the index names, read with safetensors; fails if a named file is missing."""
    index = json.loads((dst / MODEL_INDEX).read_text())
    out: dict[str, np.ndarray] = {}
    for name in sorted(set(index["weight_map"].values())):
        with safe_open(str(dst / name), "np") as f:
            for k in f.keys():
                out[k] = f.get_tensor(k)
    assert set(out) == set(index["weight_map"]), dst
    return out


def same(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def run_paused(src: str, dst: Path, k: int, marker: Path, limit: int) -> bool:
    """Run the child until it pauses at step ``k`` (then kill it: True) or ends (False)."""
    proc = subprocess.Popen([sys.executable, "-c", CHILD, src, str(dst), str(k), str(marker), str(limit)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        for _ in range(6000):  # a safety net, not a bound: the child normally pauses in a second
            if marker.exists() or proc.poll() is not None:
                break
            time.sleep(0.05)
        if marker.exists():
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=60)
            return True
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err.decode()
        return False
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=60)


@pytest.mark.parametrize("new_limit", [12_000, 1_000_000_000], ids=["same-names", "one-file"])
def test_kill_at_every_step_leaves_old_or_new(tmp_path: Path, new_limit: int) -> None:
    old_src, new_src = str(tmp_path / "old"), str(tmp_path / "new")
    synth.synthesize(old_src, PARAMS, 2, seed=1)
    synth.synthesize(new_src, PARAMS, 3, seed=2)
    pristine = tmp_path / "pristine"
    r = consolidate(old_src, str(pristine), dtype="fp32", max_shard_size=12_000)
    assert len(r.files) >= 3
    (pristine / "README.md").write_text("kept")
    old = load(pristine)
    consolidate(new_src, str(tmp_path / "ref"), dtype="fp32", max_shard_size=new_limit)
    new = load(tmp_path / "ref")
    assert not same(old, new)
    outcomes = []
    for k in range(1, 100):
        dst, marker = tmp_path / f"dst{k}", tmp_path / f"marker{k}"
        shutil.copytree(pristine, dst)
        killed = run_paused(new_src, dst, k, marker, new_limit)
        got = load(dst)
        assert same(got, old) or same(got, new), (k, marker.read_text() if killed else "end")
        assert (dst / "README.md").read_text() == "kept"
        outcomes.append("old" if same(got, old) else "new")
        if not killed:
            break
    else:
        pytest.fail("the child never ran to the end")
    assert outcomes[0] == "old" and outcomes[-1] == "new" and len(outcomes) >= 6, outcomes
    final = tmp_path / f"dst{len(outcomes)}"
    named = set(json.loads((final / MODEL_INDEX).read_text())["weight_map"].values())
    leftovers = {n for n in os.listdir(final) if n.endswith(".safetensors") or ".partial-" in n}
    assert leftovers == named  # the old weight files are gone once the new index is in place


def test_overwrite_on_an_object_store(tmp_path: Path) -> None:
    """memory:// (no rename): the new files get names of their own, the index is put last, and
    the old files are removed after it."""
    import uuid

    from shardckpt.storage import Storage

    old_src, new_src = str(tmp_path / "old"), str(tmp_path / "new")
    synth.synthesize(old_src, PARAMS, 2, seed=1)
    synth.synthesize(new_src, PARAMS, 3, seed=2)
    url = f"memory://overwrite-{uuid.uuid4().hex}/hf"
    store = Storage(url)
    try:
        first = consolidate(old_src, url, dtype="fp32", max_shard_size=12_000)
        second = consolidate(new_src, url, dtype="fp32", max_shard_size=12_000, overwrite=True)
        old_names, new_names = {n for n, _ in first.files}, {n for n, _ in second.files}
        assert len(old_names) == len(new_names) and not old_names & new_names
        index = json.loads(store.read(MODEL_INDEX))
        assert set(index["weight_map"].values()) == new_names
        assert set(store.ls("")) == new_names | {MODEL_INDEX, "shardckpt_consolidated.json"}
        consolidate(new_src, str(tmp_path / "ref"), dtype="fp32", max_shard_size=12_000)
        for name in new_names:  # same bytes as a fresh consolidation, under other names
            fresh = name.rsplit("-", 1)[0] + ".safetensors"
            assert store.read(name) == (tmp_path / "ref" / fresh).read_bytes()
    finally:
        store.rm("", recursive=True)
