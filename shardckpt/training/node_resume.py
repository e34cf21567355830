"""Resume from the node-local tier (:class:`~shardckpt.training.tiers.NodeTier`): its resume source.

Every rank lists its node's directory (:func:`survey`); the candidates are the local steps with a
manifest on some node (those of this run: :mod:`.tier_guard`). A local step is taken where
every file each rank's load reads (its reshard plan's source shards, the buffers, its rank
state on the same world size) is whole on some node (:func:`assemble`): a missing shard file
that one rank of its node alone reads goes from a node that holds it straight into that rank's
shards during the load (every chunk's CRC32C checked as it arrives, nothing written); any other
missing file is fetched into the rank's node directory, checked, then loaded from there (every
chunk's CRC32C checked again as it is read). A node's own copy of a shard file that fails its
checksums is moved aside and the same step is loaded again, that file now taken from a node
that holds a copy; only a step that no node can give whole is passed over. After the resume,
each node's leader puts aside the steps newer than the one loaded that have a manifest there.
"""

from __future__ import annotations

import itertools
import logging
from collections import Counter
from dataclasses import dataclass, replace
from typing import Any, Protocol
from collections.abc import Mapping

from shardckpt.checkpoint.collective import agree, broadcast_from, failed_with
from shardckpt.checkpoint.manifest_memo import manifest_digest, parsed
from shardckpt.checkpoint.node_files import below_node, held_whole
from shardckpt.checkpoint.resume_policy import LOADED, PASSED, Candidate, Outcome, damaged
from shardckpt.checkpoint.run_dir import STEP_DIR, step_dir
from shardckpt.checkpoint.set_aside import DamagedCopyError, put_aside_all
from shardckpt.checkpoint.tiers import (
    Nodes, Transfer, committed_steps, fetch_plan, files_needed, holdings, put_manifest,
)
from shardckpt.errors import CollectiveError, IntegrityError, ShardckptError
from shardckpt.format.manifest import MANIFEST_NAME, MAX_MANIFEST_BYTES, Manifest
from shardckpt.storage import Storage
from shardckpt.checkpoint.loss_flag import LossFlag, lost_contact
from shardckpt.training.direct_load import direct_fits, direct_kinds
from shardckpt.training.peer_copy import run_transfers
from shardckpt.training.run_state import RunState
from shardckpt.training.tier_guard import foreign_reason, own_holdings

log = logging.getLogger(__name__)


class NodeTier(Protocol):
    """What a resume reads of :class:`~shardckpt.training.tiers.NodeTier`: this rank, its node,
    the node's directory and the run's identity."""

    rank: int
    node: int
    nodes: Nodes
    storage: Storage
    run: str

    def url_for(self, step: int) -> str: ...

#: Numbers the resumes' fetches (the same on every rank): each gets a loss flag of its own.
FETCHES = itertools.count()


@dataclass(frozen=True)
class Assembled:
    """A local step made loadable: this node's URL of it, the files taken from peers in all
    (to disk, or in ``peers`` straight into memory during the load), the loss flag's key
    for that load, and the step's manifest."""

    url: str
    fetched: int
    peers: list[Transfer]
    flag_key: str
    manifest: Manifest  # the one the ranks agreed on, read once


def held_here(node: NodeTier) -> dict[str, Any]:
    """This rank's node holdings (its part of a survey)."""
    return own_holdings(node.storage, holdings(node.storage), node.run)


def survey(node: NodeTier) -> list[Any]:
    """Every rank's node holdings (collective)."""
    _, reports = agree(lambda: held_here(node), "survey of the local tier")
    return [r["payload"] for r in reports]


class LocalSource:
    """The local tier's steps as resume candidates (module docstring)."""

    name = "local"
    where = "the local tier"

    def __init__(self, node: NodeTier, state: RunState, strict: bool) -> None:
        self.node, self.state, self.strict = node, state, strict
        self.held: list[Any] = []
        self.newest = 0  # the newest step with a manifest file on any node (the survey's)

    def survey(self) -> dict[str, Any]:
        """This rank's node holdings, and the newest step there with a manifest file (any:
        another run's, one that does not parse), which :meth:`put_aside` would look at."""
        raw = holdings(self.node.storage)
        newest = max((int(k) for k, info in raw.items() if info["committed"]), default=0)
        return {"held": own_holdings(self.node.storage, raw, self.node.run), "newest": newest}

    def candidates(self, surveyed: list[Any]) -> list[Candidate]:
        node = self.node
        self.held = [s["held"] for s in surveyed]
        self.newest = max(s["newest"] for s in surveyed)
        per_node = [self.held[node.nodes.leader(n)] for n in range(node.nodes.count)]
        return [Candidate(s, self.name, node.url_for(s), sid) for s, sid in committed_steps(per_node)]

    def _try(self, c: Candidate) -> tuple[str, Any]:
        """One attempt at local step ``c``: ``("loaded", (url, fetched))``, ``("passed", why)``,
        ``("again", why)`` (a node's own damaged copy was moved aside: try the same step again)
        or ``("damaged", error)`` (a checksum failed: pass it over)."""
        engine = self.state.engine
        got = assemble(self.node, c.step, c.key, self.held, engine.layout, self.state.world_size,
                       kinds=direct_kinds(engine))
        if isinstance(got, str):
            return "passed", got
        try:
            self.state.load(got.url, strict=self.strict, storage_options={}, direct=True,
                            peers=got.peers, flag_key=got.flag_key, manifest=got.manifest)
        except CollectiveError as e:
            if failed_with(e, DamagedCopyError):
                return "again", e
            if not failed_with(e, IntegrityError):
                raise
            return "damaged", e
        return "loaded", (got.url, got.fetched)

    def attempt(self, c: Candidate, last_resort: bool) -> Outcome:
        node, rank = self.node, self.node.rank
        moved = ""  # what the attempts before found damaged (and moved aside)
        for _ in range(2 * node.nodes.count + 1):  # each time, one more own copy moved aside
            outcome, detail = self._try(c)
            if outcome != "again":
                break
            moved = f"{detail}; then "
            if rank == 0:
                log.warning("local step %d: %s; loading it again with copies from other "
                            "nodes", c.step, detail)
            self.held = survey(node)
        if outcome == "passed":
            if rank == 0:
                log.warning("local tier: step %d cannot be assembled: %s", c.step, detail)
            return Outcome(PASSED, f"{moved}it cannot be assembled: {detail}")
        if outcome in ("damaged", "again"):
            return damaged(detail, c.url)
        url, fetched = detail
        return Outcome(LOADED, value=fetched, note=(f"the local tier, {fetched} file(s) from peers"
                                                    if fetched else "the local tier, each rank's own node"))

    def newer_than(self, above: int) -> bool:
        return self.newest > above

    def put_aside(self, above: int, why: Mapping[int, str]) -> None:
        """After a resume at ``above`` (inside the policy's agreement): each node's leader puts
        aside the steps newer than it that have a manifest there."""
        node = self.node
        if node.rank != node.nodes.leader(node.node):
            return
        storage = node.storage
        try:
            names = [n for n in storage.ls("") if (m := STEP_DIR.match(n)) and int(m.group(1)) > above
                     and storage.exists(f"{n}/{MANIFEST_NAME}")]
        except ShardckptError as e:
            log.warning("local tier: could not list %s to put aside passed-over steps: %s",
                        storage.url, e)
            return
        newer = {n: why.get(int(n[5:])) or foreign_reason(storage, int(n[5:]), node.run)
                 or "its nodes hold manifests of different saves, or none that parses" for n in names}
        put_aside_all(storage, newer, f"local tier, node {node.node}")


def assemble(node: NodeTier, step: int, save_id: str, held: list[Any], layout: Any, world_size: int,
             kinds: Any = None) -> Assembled | str:
    """Make local ``step`` loadable from every rank's node directory (collective): the
    manifest and the files each rank's load reads, fetched from other nodes where missing.
    Where every rank's model loads the manifest straight into its shards (:func:`direct_fits`
    of the rank's ``kinds``, :func:`direct_kinds`), a missing shard file that one rank of its
    node alone reads is not fetched here: the load takes it from the peer into memory
    (:attr:`Assembled.peers`). One agreement gives every rank every rank's ``kinds`` and the
    digest of the manifest; then the holder broadcasts the manifest, one copy to each rank.
    Whether each node holds the same copy is in the survey (``held``); what each rank reads
    follows from the manifest, alike on every rank. Returns what was done, or why it cannot
    be done."""
    nodes = node.nodes
    holder = min(r for r in range(world_size) if held[r].get(str(step), {}).get("manifest") == save_id)
    here = node.storage.child(step_dir(step))
    leader = node.rank == nodes.leader(node.node)

    read: list[bytes] = []
    what = f"read of local step {step}'s manifest"

    def read_manifest() -> dict[str, Any]:  # inside the agreement: a read that fails fails everywhere
        out: dict[str, Any] = {"kinds": kinds, "digest": None}
        if node.rank == holder:
            read.append(here.read_limited(MANIFEST_NAME, MAX_MANIFEST_BYTES))
            parsed(read[0], here.url_of(MANIFEST_NAME))
            out["digest"] = manifest_digest(read[0])
        return out
    try:
        _, got = agree(read_manifest, what)
    except CollectiveError as e:
        if lost_contact(e):
            raise
        return f"its manifest on rank {holder}'s node cannot be read: {e}"
    reports = [r["payload"] for r in got]
    # the manifest itself goes out once, not padded into every rank's report (an all-gather of
    # a 7 MB manifest at 1024 ranks would be 7 GB on every rank); checked against the digest
    # the holder reported in the agreement (signed under a job secret)
    data = broadcast_from(read[0] if read else None, holder, what)
    url = f"{here.url_of(MANIFEST_NAME)} (from rank {holder})"
    digest = reports[holder]["digest"]
    if manifest_digest(data) != digest:
        raise IntegrityError(f"{url}: the bytes received do not match the digest rank {holder} "
                             "reported for them")
    m = parsed(data, url)
    needs = files_needed(m, layout, world_size)
    by_node = {nodes.node_of(r): held_whole(held[r], step, m) for r in range(world_size)}
    plan, lost = fetch_plan(nodes, needs, by_node)
    if lost:
        return f"{len(lost)} file(s) are whole on no node ({', '.join(lost[:3])})"
    entries = {f.path: f for f in m.files}
    readers = Counter((nodes.node_of(r), p) for r, paths in needs.items() for p in paths)
    peers: list[Transfer] = []
    if all(direct_fits(rep["kinds"], m) for rep in reports):
        peers = [t for t in plan if entries[t.path].role in ("shard", "frozen")
                 and not entries[t.path].is_reference and readers[(nodes.node_of(t.dst), t.path)] == 1]
    files = [t for t in plan if t not in peers and not entries[t.path].is_reference]
    # a referenced file goes where the referenced step holds it, below the node's directory
    refs = [replace(t, path=below_node(t.path)) for t in plan if entries[t.path].is_reference]
    below = {below_node(p): replace(e, path=below_node(p)) for p, e in entries.items() if e.is_reference}

    def fetch() -> int:
        n = run_transfers(files, node.rank, here, entries, m.chunk_size, None)
        n += run_transfers(refs, node.rank, node.storage, below, m.chunk_size, None)
        if leader:
            put_manifest(here, data)  # the agreed copy, where this node's is gone or damaged
        return n

    if not files and not refs and all(held[nodes.leader(n)].get(str(step), {}).get("digest") == digest
                                      for n in range(nodes.count)):
        # nothing to fetch or put: every node holds what its ranks read (one round saved)
        return Assembled(here.url, len(plan), peers, f"direct/{save_id}/{next(FETCHES)}", m)
    flag = LossFlag.for_group(None, f"fetch/{save_id}/{next(FETCHES)}")
    try:
        agree(fetch, f"assembly of local step {step}", None, flag=flag)
    except CollectiveError as e:
        if lost_contact(e):
            raise
        return f"fetching from peers failed: {e}"
    return Assembled(here.url, len(plan), peers, f"direct/{save_id}/{next(FETCHES)}", m)
