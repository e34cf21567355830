"""`shardckpt watch` against a Ceph RADOS Gateway: `example_train.py` writes checkpoints while a
watcher, reaching Ceph through the fault proxy (10% of requests faulted) and SIGKILLed at random
points ten times, consolidates each to Hugging Face safetensors and reshards it to another world
size. Every checkpoint is processed once, outputs verify and equal a run by hand; a checkpoint
damaged on purpose is dead-lettered and the next one is processed."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from shardckpt.checkpoint.reader import read_manifest

from shardckpt.checkpoint.verify import verify
from shardckpt.tools.consolidate import consolidate
from shardckpt.checkpoint.run_dir import CheckpointManager
from shardckpt.storage import Storage
from shardckpt.tools.synth import synthesize

pytestmark = [pytest.mark.slow, pytest.mark.s3]

EXAMPLE = os.path.join(os.path.dirname(__file__), "example_train.py")
KEYS = ["1-verify", "2-consolidate", "3-reshard"]
WEIGHTS = "model-00001-of-00001.safetensors"

# The watcher's own entry: log each step that ran to completion (a step done twice shows twice).
CHILD = r'''
import json, os, sys
from shardckpt.watch import service as watch
from shardckpt.watch import steps as watch_steps
from shardckpt.cli.main import app
log = sys.argv[2]
real = watch_steps.run_step
def run_step(ctx):
    with open(log + ".started", "a") as f:
        f.write(json.dumps([ctx.checkpoint, ctx.spec.key, os.getpid()]) + "\n")
    facts = real(ctx)
    with open(log, "a") as f:
        f.write(json.dumps([ctx.checkpoint, ctx.spec.key, os.getpid()]) + "\n")
    return facts
watch_steps.run_step = run_step
real_pass = watch.Watcher.process_pass
def process_pass(self):
    open(f"{log}.ready-{os.getpid()}", "w").close()  # imports done: watching from now on
    return real_pass(self)
watch.Watcher.process_pass = process_pass
try:
    app(["watch", sys.argv[1], "-q", *sys.argv[3:]])
except SystemExit as e:
    sys.exit(e.code)
'''


def toml_value(v: Any) -> str:
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k} = {toml_value(x)}" for k, x in v.items()) + "}"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    return json.dumps(v)


def write_pipeline(path: Path, bucket: str, options: dict[str, Any]) -> None:
    path.write_text(f"""\
name = "ceph"
watch = "{bucket}/run"
state = "{bucket}/derived"
interval_s = 0.2
retries = 4
backoff_s = 0.05
lease_ttl_s = 30
storage_options = {toml_value({**options, "shardckpt_deadline_s": 60})}
[[steps]]
kind = "verify"
[[steps]]
kind = "consolidate"
dst = "{bucket}/hf/{{name}}"
[[steps]]
kind = "reshard"
dst = "{bucket}/ws3/{{name}}"
to = 3
""")


def watcher(pipeline: Path, log: Path, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", CHILD, str(pipeline), str(log), *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def kill_mid_step(w: subprocess.Popen, tmp: Path, train: subprocess.Popen, rng: random.Random) -> None:
    """SIGKILL ``w`` a random moment (0-0.5 s) after it starts a step; once training is over
    and the work is done, a moment after it starts watching."""
    ready, started = tmp / f"log.ready-{w.pid}", tmp / "log.started"
    idle_since = None
    for _ in range(60000):  # a bound on a hang, not a timing assertion
        if w.poll() is not None:
            break
        if started.exists() and f", {w.pid}]" in started.read_text():
            break
        if ready.exists() and train.poll() is not None:
            idle_since = idle_since or time.monotonic()
            if time.monotonic() - idle_since > 3:
                break
        time.sleep(0.005)
    time.sleep(rng.uniform(0.0, 0.5))
    w.send_signal(signal.SIGKILL)
    w.wait(timeout=60)


def test_watch_ceph_training_kills_faults_and_dead_letter(ceph_server, s3_bucket, fault_proxy,
                                                          tmp_path: Path) -> None:
    proxy = fault_proxy(ceph_server)
    b = s3_bucket(ceph_server)
    direct = b.storage_options
    for i, kind in enumerate(("slowdown", "internal_error", "reset", "truncate")):
        proxy.add_rule(kind, probability=0.025, seed=i)
    pipeline, log = tmp_path / "p.toml", tmp_path / "log"
    write_pipeline(pipeline, b.url, ceph_server.storage_options(proxy.endpoint_url))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "AWS_ENDPOINT_URL_S3": ceph_server.endpoint_url,
           "AWS_ACCESS_KEY_ID": ceph_server.key, "AWS_SECRET_ACCESS_KEY": ceph_server.secret,
           "AWS_DEFAULT_REGION": "us-east-1"}
    train = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone",
                              "--nproc_per_node=2", EXAMPLE, "--ckpt-dir", f"{b.url}/run",
                              "--steps", "10", "--save-every", "5"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    rng = random.Random(11)
    for _ in range(10):  # SIGKILL the watcher at random points of its steps while training saves
        w = watcher(pipeline, log)
        kill_mid_step(w, tmp_path, train, rng)
    out, err = train.communicate(timeout=600)
    assert train.returncode == 0, err[-3000:]
    final = watcher(pipeline, log, "--once")
    out, err = final.communicate(timeout=600)
    assert final.returncode == 0, err[-3000:]

    names = [f.name for f in CheckpointManager(f"{b.url}/run", storage_options=direct).committed()]
    assert names == ["step-00000005", "step-00000010"]
    check_outputs(b.url, direct, names, log, tmp_path)
    assert proxy.faulted > 0

    # a damaged checkpoint goes to dead-letter; the next one is processed
    for s in (15, 20):
        synthesize(f"{b.url}/run/step-{s:08d}", 3000, 2, step=s, storage_options=direct)
    bad = Storage(f"{b.url}/run/step-00000015", direct)
    shard = next(f.path for f in read_manifest(bad).files if f.role == "shard")
    data = bytearray(bad.read(shard))
    data[-7] ^= 0x10
    bad.put(shard, bytes(data))
    again = watcher(pipeline, log, "--once")
    out, err = again.communicate(timeout=600)
    assert again.returncode == 1 and "1 dead-lettered" in out, (out, err[-3000:])
    state = Storage(f"{b.url}/derived/.watch/ceph", direct)
    assert state.ls("step-00000015") == ["1-verify", "1-verify.dead"]
    reason = json.loads(state.read("step-00000015/1-verify.dead"))["reason"]
    assert "CRC32C" in reason and "\n" not in reason
    assert not Storage(f"{b.url}/hf/step-00000015", direct).ls("")
    check_outputs(b.url, direct, ["step-00000005", "step-00000010", "step-00000020"], log, tmp_path)


def check_outputs(bucket: str, opts: dict, names: list[str], log: Path, tmp: Path) -> None:
    ran: dict[tuple[str, str], int] = {}
    for ckpt, key, _ in (json.loads(x) for x in log.read_text().splitlines()):
        ran[(ckpt, key)] = ran.get((ckpt, key), 0) + 1
    state = Storage(f"{bucket}/derived/.watch/ceph", opts)
    for name in names:
        recs = [n for n in state.ls(name) if n.endswith((".done", ".dead"))]
        assert recs == [f"{k}.done" for k in KEYS], (name, recs)
        for key in KEYS[1:]:
            rec = json.loads(state.read(f"{name}/{key}.done"))
            n = ran.get((name, key), 0)
            # once; or never in the log when a kill fell between the commit and the log line,
            # and then the output was adopted, not written again
            assert n == 1 or (n == 0 and rec.get("adopted")), (name, key, n, rec)
        src = f"{bucket}/run/{name}"
        hand = tmp / "hand" / name
        if not hand.exists():
            consolidate(src, str(hand), storage_options=opts)
        hf = Storage(f"{bucket}/hf/{name}", opts)
        # the index names the weights: a consolidation rerun after a kill that left complete
        # files under the usual names writes its own under names with a token
        index = json.loads(hf.read("model.safetensors.index.json"))
        (weights,) = set(index["weight_map"].values())
        assert hf.read(weights) == (hand / WEIGHTS).read_bytes()
        ws3 = f"{bucket}/ws3/{name}"
        assert verify(ws3, opts)
        assert read_manifest(Storage(ws3, opts)).mesh.world_size == 3
        assert json.loads(state.read(f"{name}/3-reshard.done"))["identity"] == \
            read_manifest(Storage(ws3, opts)).save_id
        back = tmp / "back" / name
        if not back.exists():
            consolidate(ws3, str(back), storage_options=opts)
        assert (back / WEIGHTS).read_bytes() == (hand / WEIGHTS).read_bytes()
