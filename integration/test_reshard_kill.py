"""kill -9 of a running `shardckpt reshard`: DST has no manifest; a rerun with --overwrite works and
removes the killed attempt's files."""

from __future__ import annotations

import os
import signal
import subprocess
import time

from shardckpt.checkpoint.verify import verify
from shardckpt.format.manifest import MANIFEST_NAME
from shardckpt.tools.synth import synthesize
from testing.cli import CLI_COMMAND, cli_process


def test_kill_9_midway_leaves_no_manifest(tmp_path):
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    synthesize(src, 8_000_000, ranks=8, units=4)  # ~100 MB
    proc = subprocess.Popen([*CLI_COMMAND, "reshard", src, dst, "--to", "16", "--buffer", "64KiB"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    killed = False
    while time.monotonic() < deadline and proc.poll() is None:
        # kill once the first target shard is complete and the second has begun
        files = [f for _, _, fs in os.walk(dst) for f in fs if f.startswith("shard-")]
        if len(files) >= 2:
            os.kill(proc.pid, signal.SIGKILL)
            killed = True
            break
        time.sleep(0.005)
    proc.wait(30)
    assert killed, "reshard finished before it could be killed; make the checkpoint bigger"
    assert proc.returncode == -signal.SIGKILL
    assert not os.path.exists(os.path.join(dst, MANIFEST_NAME))
    result = verify(dst)
    assert not result and "never committed" in result.problems[0]
    r = cli_process("reshard", src, dst, "--to", "16", "--overwrite", timeout=120)
    assert r.returncode == 0, r.stderr
    result = verify(dst)
    assert result, result.problems
    # the killed attempt's directory went with the rerun (its writer's lease ended with it)
    assert sorted(os.listdir(dst)) == sorted([MANIFEST_NAME, result.manifest.save_id])
