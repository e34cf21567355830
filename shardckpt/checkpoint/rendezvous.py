"""The job's store, listening only on the address the job was given.

``torch.distributed``'s own TCP rendezvous (``init_method="tcp://..."``, ``env://``) makes rank 0
host a ``TCPStore`` that listens on every interface (``*:MASTER_PORT``), whatever ``MASTER_ADDR``
says: with ``MASTER_ADDR=127.0.0.1`` the store of a one-machine job is still reachable from the
network, and the store holds what the ranks exchange to connect and the checkpoint tiers' flags.
Here rank 0 binds the listening socket itself, to ``MASTER_ADDR`` (as resolved on rank 0), and
hands it to the ``TCPStore`` (``master_listen_fd``); the other ranks connect as before.

Under a launcher that hosts the store itself (``torchrun``: ``TORCHELASTIC_USE_AGENT_STORE``)
every rank is a client and the launcher decides where it listens; ``torchrun``'s store listens
on every interface and cannot be told otherwise (see SECURITY.md, "The network").
Imports torch only inside its functions.
"""

from __future__ import annotations

import datetime
import os
import socket
from typing import Any

AGENT_STORE_VARIABLE = "TORCHELASTIC_USE_AGENT_STORE"


def listening_socket(addr: str, port: int) -> socket.socket:
    """A TCP socket listening on ``addr:port`` (``port`` 0: a free one), for a store's server."""
    family, kind, proto, _, where = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)[0]
    s = socket.socket(family, kind, proto)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(where)
        s.listen(socket.SOMAXCONN)
    except BaseException:
        s.close()
        raise
    return s


def bound_store(addr: str, port: int, world_size: int, is_master: bool, timeout: datetime.timedelta,
                listener: socket.socket | None = None) -> Any:
    """A ``TCPStore`` on ``addr:port``; the master's listens on ``addr`` only (``listener``, if
    given, is the socket to serve on; the store owns it from then on)."""
    import torch.distributed as dist

    if not is_master:
        return dist.TCPStore(addr, port, world_size, False, timeout)
    s = listener or listening_socket(addr, port)
    port = s.getsockname()[1]
    return dist.TCPStore(addr, port, world_size, True, timeout, master_listen_fd=s.detach(),
                         use_libuv=True)


def init_default_group(backend: str, addr: str, port: int, rank: int, world_size: int,
                       timeout: datetime.timedelta) -> None:
    """``torch.distributed.init_process_group`` over a store that rank 0 serves on ``addr``
    only (a client of the launcher's store where the launcher hosts one)."""
    import torch.distributed as dist

    if os.environ.get(AGENT_STORE_VARIABLE) == "True":
        dist.init_process_group(backend, init_method=f"tcp://{addr}:{port}", rank=rank,
                                world_size=world_size, timeout=timeout)
        return
    store = bound_store(addr, port, world_size, rank == 0, timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
