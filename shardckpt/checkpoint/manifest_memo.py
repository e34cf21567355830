"""Manifests of the node-local tier parsed once per process, not once per read.

A resume from the local tier reads each local step's manifest several times (its node's
holdings, the run-identity guard, the agreed copy every rank parses) and the save's pruning reads
them again; a manifest of a large model takes tens of milliseconds to validate. :func:`parsed`
is :func:`~shardckpt.format.manifest_parse.parse`, remembered for the last few manifests by their
exact bytes: the same bytes validate to the same manifest, so nothing is trusted that was not
validated, and a manifest whose bytes changed is parsed again. Failures are not remembered (each
read names its own file). The manifests returned are shared: callers treat them as read-only, as
every caller of ``parse`` does.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict

from shardckpt.format.manifest import Manifest
from shardckpt.format.manifest_parse import parse

#: Manifests remembered (a node keeps a few steps; each resume or prune reads them all).
KEPT = 8

_memo: OrderedDict[bytes, Manifest] = OrderedDict()
_lock = threading.Lock()


def parsed(data: bytes, source: str) -> Manifest:
    """``parse(data, source)``, from memory where these exact bytes were parsed before."""
    key = bytes(data)
    with _lock:
        m = _memo.get(key)
        if m is not None:
            _memo.move_to_end(key)
            return m
    m = parse(key, source)
    with _lock:
        _memo[key] = m
        while len(_memo) > KEPT:
            _memo.popitem(last=False)
    return m


def forget() -> None:
    """Drop every remembered manifest (a resume starts from what the nodes hold now)."""
    with _lock:
        _memo.clear()


def manifest_digest(data: bytes) -> str:
    """SHA-256 of a manifest's bytes: two nodes' copies are the same save's when these match."""
    return hashlib.sha256(data).hexdigest()
