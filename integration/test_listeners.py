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
