"""One peer stream over the process group: point-to-point messages between this rank and
``peer``, each followed by its HMAC-SHA256 tag where the job has a secret
(:mod:`shardckpt.checkpoint.job_secret`); without one, plain ``send``/``recv`` and nothing else.

:meth:`Channel.open` exchanges the two random nonces (the sender's first); every message then
carries a tag over both nonces, its direction, its sequence number in that direction and its
bytes, so a message cannot be forged, replayed from another stream or moved within this one.
"""

from __future__ import annotations

from typing import Any

from shardckpt.checkpoint.job_secret import NONCE_BYTES, TAG_BYTES, job_key, nonce, same, tag


class Channel:
    """This rank's end of a stream with ``peer`` on ``group``; ``sending``: this end offers."""

    def __init__(self, peer: int, group: Any, sending: bool, key: bytes | None = None) -> None:
        self.peer, self.group, self.sending = peer, group, sending
        self.key = job_key() if key is None else key
        self.nonces = b""
        self.sent = self.received = 0

    def open(self) -> None:
        """Exchange the nonces (the sender's, then the receiver's); nothing without a key."""
        if self.key is None:
            return
        import torch
        import torch.distributed as dist

        mine = torch.frombuffer(bytearray(nonce()), dtype=torch.uint8)
        theirs = torch.zeros(NONCE_BYTES, dtype=torch.uint8)
        if self.sending:
            dist.send(mine, self.peer, group=self.group)
            dist.recv(theirs, self.peer, group=self.group)
        else:
            dist.recv(theirs, self.peer, group=self.group)
            dist.send(mine, self.peer, group=self.group)
        first, second = (mine, theirs) if self.sending else (theirs, mine)
        self.nonces = bytes(first.numpy()) + bytes(second.numpy())

    def _tag(self, outgoing: bool, n: int, data: Any) -> bytes:
        assert self.key is not None
        direction = b"s" if outgoing == self.sending else b"r"  # the offering end's messages: "s"
        return tag(self.key, self.nonces, direction, n.to_bytes(8, "little"), memoryview(data.numpy()).cast("B"))

    def send(self, t: Any) -> None:
        import torch
        import torch.distributed as dist

        dist.send(t, self.peer, group=self.group)
        if self.key is not None:
            mac = self._tag(True, self.sent, t)
            self.sent += 1
            dist.send(torch.frombuffer(bytearray(mac), dtype=torch.uint8), self.peer, group=self.group)

    def recv(self, t: Any) -> bool:
        """Receive into ``t``; False where the job has a secret and its tag fails (``t`` then
        holds bytes that must not be used)."""
        import torch
        import torch.distributed as dist

        dist.recv(t, self.peer, group=self.group)
        if self.key is None:
            return True
        got = torch.zeros(TAG_BYTES, dtype=torch.uint8)
        dist.recv(got, self.peer, group=self.group)
        ok = same(bytes(got.numpy()), self._tag(False, self.received, t))
        self.received += 1
        return ok
