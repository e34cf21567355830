"""Every listener of a job binds where the job was told (SECURITY.md, "The network"): with
``MASTER_ADDR=127.0.0.1`` rank 0's store listens on 127.0.0.1, not on every interface
(``torch.distributed``'s own ``tcp://``/``env://`` rendezvous listens on ``*:MASTER_PORT``).

One launch, 2 ranks, no process group of the launcher's: each rank joins a job through the
offline tools' :func:`~shardckpt.tools.distributed.job_from_environment`, reads the sockets it
listens on from ``/proc/self/net/tcp{,6}``, leaves, then joins again through the runtime's
:func:`~shardckpt.runtime.mesh.init_distributed` on another port and reads them again.
"""

from __future__ import annotations

from testing.ranks import free_port, run_ranks


def job(rank: int, world: int, second_port: int) -> dict:
    import os

    import torch.distributed as dist

    from shardckpt.runtime.mesh import init_distributed
    from shardckpt.tools.distributed import job_from_environment
    from testing.listeners import listening

    out = {}
    with job_from_environment() as j:
        assert j is not None
        dist.barrier()
        out["tools"] = listening()
        dist.barrier()
    os.environ["MASTER_PORT"] = str(second_port)
    init_distributed(backend="gloo")
    dist.barrier()
    out["runtime"] = listening()
    dist.barrier()
    return out


def test_stores_and_gloo_listen_on_master_addr_only():
    port = free_port()
    results = run_ranks(job, 2, args=(port,), init_process_group=False, timeout_s=120)
    for r in results:
        assert r.ok, r.describe()
        for how in ("tools", "runtime"):
            seen = r.value[how]
            assert seen and all(a.startswith("127.0.0.1:") for a in seen), (r.rank, how, seen)
    # rank 0 hosts the store: on the port it was given, on 127.0.0.1
    assert f"127.0.0.1:{port}" in results[0].value["runtime"], results[0].value


_WORKER = """
import os, sys, time
path = os.path.join(sys.argv[1], f"pid-{os.environ['RANK']}")
with open(path + ".tmp", "w") as f:
    f.write(str(os.getpid()))
os.replace(path + ".tmp", path)  # whole or absent: the test never reads a half-written pid
end = time.monotonic() + 120
while not os.path.exists(os.path.join(sys.argv[1], "go")) and time.monotonic() < end:
    time.sleep(0.05)
"""


def test_the_watch_jobs_torchrun_store_listens_on_localhost_only(tmp_path):
    """The ``watch`` job's launcher (``job_argv``'s), running a job of 2 workers: every socket
    the launcher and its workers listen on is on the loopback address."""
    import subprocess
    import sys
    import time

    from shardckpt.watch import job as watch_job
    from testing.listeners import listening

    script = tmp_path / "worker.py"
    script.write_text(_WORKER)
    argv = [sys.executable, "-m", "shardckpt.watch.launcher", "--standalone", "--nproc_per_node",
            "2", str(script), str(tmp_path)]
    assert watch_job.job_argv.__code__.co_consts.count("shardckpt.watch.launcher") == 1
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        seen: dict = {}
        end = time.monotonic() + 120
        files = [tmp_path / f"pid-{r}" for r in range(2)]
        # the workers start in any order: wait for both, and stop waiting if the launcher died
        while time.monotonic() < end and proc.poll() is None and not all(f.exists() for f in files):
            time.sleep(0.05)
        started = all(f.exists() for f in files)
        if started:
            pids = [proc.pid] + [int(f.read_text()) for f in files]
            seen = {pid: listening(pid) for pid in pids}
    finally:
        (tmp_path / "go").write_text("")
        _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err.decode()[-2000:]
    assert started, ("the workers did not start within 120 s", err.decode()[-2000:])
    assert seen[proc.pid], seen  # the launcher hosts the store
    every = [a for addrs in seen.values() for a in addrs]
    assert all(a.startswith(("127.0.0.1:", "::1:")) for a in every), seen
