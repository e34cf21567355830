"""An optional job secret that authenticates what the ranks tell each other.

The ranks of a job trust the job's network as ``torch.distributed`` does: anyone who can reach
the store and the ranks' ports can join the conversation. Where that network is shared,
``SHARDCKPT_JOB_SECRET`` (the same value in every rank's environment; ``torchrun`` passes its
environment on) makes shardckpt authenticate its own messages:

* **peer streams** (:mod:`shardckpt.training.peer_copy`): the two ranks of a transfer each
  contribute a random 16-byte nonce; every message after that (the offer, the answer, the spans
  asked for, each piece of the file) carries an HMAC-SHA256 over the stream's nonces, its
  direction, its sequence number in the stream and its bytes. A message whose tag fails is not
  used: an offer is refused, a piece is dropped and its file not kept, an answer or a request for
  spans stops the sender;
* **agreements** (:func:`shardckpt.checkpoint.collective.agree`, which every tier decision goes
  through): each rank's report carries an HMAC over the agreement's name, the rank, the
  agreement's number on its process group (the same on every rank: they run in the same order)
  and the report; a report whose tag fails fails the agreement on every rank, naming the rank.

The key is SHA-256 of the secret, so any string will do. Without the variable nothing changes
on the wire. What it does not cover (the stores, ``torch.distributed``'s own collectives) is in
SECURITY.md, "The network". Pure stdlib (``hmac``, ``hashlib``, ``secrets``).
"""

from __future__ import annotations

import hashlib
import hmac
import itertools
import os
import secrets
from collections.abc import Mapping

SECRET_VARIABLE = "SHARDCKPT_JOB_SECRET"
TAG_BYTES = 32
NONCE_BYTES = 16


def job_key(environ: Mapping[str, str] | None = None) -> bytes | None:
    """The key from ``SHARDCKPT_JOB_SECRET``; None where it is unset or empty."""
    secret = (os.environ if environ is None else environ).get(SECRET_VARIABLE, "")
    if not secret:
        return None
    return hashlib.sha256(b"shardckpt job secret\0" + secret.encode("utf-8", "surrogatepass")).digest()


def tag(key: bytes, *parts: bytes | memoryview) -> bytes:
    """HMAC-SHA256 of ``parts``, each prefixed by its length (no two lists of parts collide)."""
    mac = hmac.new(key, digestmod=hashlib.sha256)
    for p in parts:
        mac.update(len(p).to_bytes(8, "little"))
        mac.update(p)
    return mac.digest()


def same(a: bytes, b: bytes) -> bool:
    return hmac.compare_digest(a, b)


def nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)


class Numbering:
    """Numbers the agreements of each process group in the order this process runs them (every
    rank runs them in the same order, so the numbers agree across ranks)."""

    def __init__(self) -> None:
        self._next: dict[int, itertools.count[int]] = {}

    def next(self, group: object) -> int:
        return next(self._next.setdefault(id(group), itertools.count()))


#: The agreement numbers of this process (per group).
AGREEMENTS = Numbering()


def sign_report(key: bytes, rank: int, number: int, report: bytes) -> bytes:
    """``report`` with its tag appended: rank ``rank``'s report in agreement ``number``."""
    return report + tag(key, b"agree", rank.to_bytes(8, "little"), number.to_bytes(8, "little"), report)


def open_reports(key: bytes, number: int, signed: list[bytes]) -> tuple[list[bytes], list[int]]:
    """Every rank's report from ``signed`` (in group rank order), and the ranks whose tag fails."""
    out, bad = [], []
    for r, data in enumerate(signed):
        report, got = data[:-TAG_BYTES], data[-TAG_BYTES:]
        if len(data) < TAG_BYTES or not same(got, tag(key, b"agree", r.to_bytes(8, "little"),
                                                      number.to_bytes(8, "little"), report)):
            bad.append(r)
        out.append(report)
    return out, bad
