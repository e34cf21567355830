"""bench/gpu_io.py: the prepared GPU I/O run works end to end on CPU at a tiny size."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "gpu_io.py"

TOP = ("save_vs_disk_8", "load_vs_disk_8", "save_vs_dcp_best", "load_vs_dcp_best",
       "first_async_blocked_s")


def test_small_cpu_run_measures_every_part_and_writes_the_ratios(tmp_path):
    out = tmp_path / "io.json"
    res = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--small", "--out",
                          str(out), "--workdir", str(tmp_path / "w")], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["errors"] == {} and doc["skipped"] == {}
    parts = {"ours_async_save", "ours_sync_save", "ours_load", "pinned_copy", "disk_8", "disk_1",
             "dcp_save_t1", "dcp_save_t8", "dcp_load", "dcp_async_save", "dcp_async_pinned",
             "dcp_sc_save", "dcp_sc_load", "ours_local_async"}
    assert set(doc["parts"]) == parts
    for key in TOP:
        assert isinstance(doc[key], float) and doc[key] > 0, key
    # every load gave the saved state back, bit for bit, into zeroed shards
    assert doc["loads_bit_equal"] == {"ours_load": True, "dcp_load": True, "dcp_sc_load": True}
    assert all(len(p["s"]) == 3 for k, p in doc["parts"].items() if "s" in p)
    assert doc["parts"]["disk_8"]["streams"] == 8 and doc["parts"]["dcp_save_t8"]["thread_count"] == 8
    assert len(doc["parts"]["ours_async_save"]["saves"]) == 4  # the first, then the median of 3
    assert doc["staging_bytes"] == doc["settings"]["state_bytes"]
    local = doc["parts"]["ours_local_async"]
    assert len(local["saves"]) == 4 and isinstance(doc["local_async_blocked_s"], float)
    # the node directory it used (tmpfs where it had room) is gone once the part is done
    assert local["where"].startswith(("/dev/shm/", str(tmp_path))) and not Path(local["where"]).exists()
    # the pinned stager: either measured, or every refusal recorded as the result
    pinned = doc["parts"]["dcp_async_pinned"]
    assert pinned.get("blocked_median_s") is not None or pinned["refused"]
    assert "save_vs_disk_8" in res.stdout and "page-cache hits" in res.stdout
    assert not (tmp_path / "w").exists() or not any((tmp_path / "w").iterdir())
