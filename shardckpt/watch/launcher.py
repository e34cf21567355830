"""``torchrun`` for the watcher's jobs, its rendezvous store listening on the rendezvous host.

``python -m torch.distributed.run --standalone`` hosts two stores on ``localhost`` (the c10d
rendezvous backend's, and the one its workers share), but both listen on every interface
(``::``): ``torch.distributed``'s elastic agent creates each ``TCPStore`` without saying where
to listen. ``python -m shardckpt.watch.launcher ARGS`` runs the same ``torchrun`` with ``ARGS``
after giving both a ``TCPStore`` whose server listens on the host it is named by only (the
socket bound here and handed over as ``master_listen_fd``). The integration test of
the listeners checks it against the sockets a real job holds, so a ``torch`` that changes this
seam fails that test rather than listening on every interface again.
"""

from __future__ import annotations

from typing import Any

from shardckpt.checkpoint.rendezvous import listening_socket


def _host_bound(tcp_store: Any) -> Any:
    """``TCPStore`` as the rendezvous backend calls it, its server bound to ``host`` only."""

    def make(host: str, port: int, *args: Any, is_master: bool = False, **kwargs: Any) -> Any:
        if not is_master or "master_listen_fd" in kwargs:
            return tcp_store(host, port, *args, is_master=is_master, **kwargs)
        s = listening_socket(host, port)
        return tcp_store(host, s.getsockname()[1], *args, is_master=True,
                         master_listen_fd=s.detach(), **kwargs)
    return make


def _shared_server(handler: Any, master_addr: str, master_port: int) -> Any:
    """The store the workers share (``DynamicRendezvousHandler._create_tcp_store_server``)."""
    import torch.distributed as dist

    s = listening_socket(master_addr, master_port)
    return dist.TCPStore(host_name=master_addr, port=s.getsockname()[1], is_master=True,
                         multi_tenant=True, master_listen_fd=s.detach())


def main() -> None:
    from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend, dynamic_rendezvous
    from torch.distributed.run import main as torchrun

    c10d_rendezvous_backend.TCPStore = _host_bound(c10d_rendezvous_backend.TCPStore)  # type: ignore[misc]
    dynamic_rendezvous.DynamicRendezvousHandler._create_tcp_store_server = _shared_server  # type: ignore[method-assign,assignment]
    torchrun()


if __name__ == "__main__":
    main()
