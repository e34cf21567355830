"""The node-local checkpoint tier: where each node keeps its checkpoints, whose files it keeps a
copy of, what it holds, and which files a resuming rank must fetch from other nodes. No torch:
pure helpers and local-disk I/O (the transfers themselves are :mod:`shardckpt.training.peer_copy`).

A node's directory (``LocalTier.path`` with ``{node}`` replaced by the node's number) holds
``step-XXXXXXXX/`` checkpoints in the ordinary format: the manifest of the whole checkpoint
(the same bytes on every node) and the files this node holds: those its ranks wrote and the
copies of other nodes' files its ranks keep for them. Rules:

* a step counts on a node once its ``manifest.json`` exists there, created (create-only) only
  after every rank has reported its files and their peer copies durable;
* a step whose manifest exists on any node is committed: every file it names was durable on its
  writer's node and on its peers' nodes before any manifest was created;
* a node keeps its newest ``keep`` committed steps (and those they reference,
  :mod:`.node_files`); older steps, and uncommitted debris older than its newest committed step,
  are removed at its next commit.
"""

from __future__ import annotations

import errno
import logging
import os
import posixpath
from dataclasses import dataclass
from typing import Any
from collections.abc import Iterable, Mapping, Sequence

from shardckpt.checkpoint.manifest_memo import manifest_digest, parsed
from shardckpt.checkpoint.reader import read_manifest
from shardckpt.checkpoint.references import RunFiles, frozen_stand_ins, parent_of
from shardckpt.checkpoint.run_dir import STEP_DIR, CheckpointManager, step_dir
from shardckpt.errors import (
    CommitConflictError, ConfigError, IncompleteCheckpointError, InsufficientSpaceError, ShardckptError,
)
from shardckpt.format.layout import Layout
from shardckpt.format.manifest import MANIFEST_NAME, MAX_MANIFEST_BYTES, FileEntry, Manifest, to_json
from shardckpt.format.manifest_parse import parse
from shardckpt.format.records import per_rank_state
from shardckpt.format.reshard_plan import plan_reshard
from shardckpt.storage import NotFoundError, Storage
from shardckpt.storage import commit as commit_steps
from shardckpt.storage import local_path, private_storage

log = logging.getLogger(__name__)

#: Room left for safetensors headers when a save's size is estimated from its tensors.
HEADER_ALLOWANCE = 1 << 16
#: The spare file of each rank's next save, in its node's directory (``LocalTier.preallocate``).
SPARE_NAME = ".spare-rank-{rank:05d}"


@dataclass(frozen=True, kw_only=True, slots=True)
class LocalTier:
    """Where and how often each node keeps checkpoints of its own.

    ``path``: a local directory (``/dev/shm/run`` or node-local NVMe); ``{node}`` in it is
    replaced by the node's number (one directory per simulated node on one machine). ``every``:
    save to this tier every ``every`` steps. ``keep``: committed checkpoints a node keeps.
    ``peers``: ranks on other nodes that keep a copy of each rank's files. ``ranks_per_node``:
    default ``LOCAL_WORLD_SIZE`` (torchrun sets it), else the whole world is one node.
    ``quota_bytes``: the most a node's directory may hold; a save that would pass it (or a disk
    that is full) turns the tier off with one warning, and saves go to the durable tier alone.
    ``preallocate``: once the run trains (a ``save`` call that saves nothing) and after each
    save, each rank allocates its next shard file (the size of the one it wrote) in the
    background, ``.spare-rank-NNNNN`` in its node's directory, and its next save writes over
    those pages instead of new ones (on tmpfs that save's write takes about 0.6 of the time; the
    room is the room the next save takes anyway, held between saves). Counted in
    ``quota_bytes``; given back when the tier turns off and at ``Checkpointer.close()``.
    """

    path: str
    every: int
    keep: int = 2
    peers: int = 1
    ranks_per_node: int | None = None
    quota_bytes: int | None = None
    preallocate: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.path, str) or not self.path or local_path(self.path) is None:
            raise ConfigError(f"LocalTier.path: {self.path!r} is not a local directory (a path on "
                              "this machine: /dev/shm/..., or node-local disk)")
        for name, least in (("every", 1), ("keep", 1), ("peers", 0)):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < least:
                raise ConfigError(f"LocalTier.{name}: {v!r}; expected an integer >= {least}")
        rpn = self.ranks_per_node
        if rpn is not None and (not isinstance(rpn, int) or isinstance(rpn, bool) or rpn < 1):
            raise ConfigError(f"LocalTier.ranks_per_node: {rpn!r}; expected an integer >= 1")
        if not isinstance(self.preallocate, bool):
            raise ConfigError(f"LocalTier.preallocate: {self.preallocate!r}; expected True or False")
        q = self.quota_bytes
        if q is not None and (not isinstance(q, int) or isinstance(q, bool) or q < 0):
            raise ConfigError(f"LocalTier.quota_bytes: {q!r}; expected an integer >= 0")

    def node_url(self, node: int) -> str:
        return self.path.replace("{node}", str(node))

    def topology(self, world_size: int, environ: Mapping[str, str] | None = None) -> Nodes:
        """The job's nodes: ``ranks_per_node``, else ``LOCAL_WORLD_SIZE``, else one node."""
        env = os.environ if environ is None else environ
        rpn = self.ranks_per_node
        if rpn is None:
            raw = env.get("LOCAL_WORLD_SIZE", "")
            rpn = int(raw) if raw.isdigit() and int(raw) > 0 else world_size
        if world_size % rpn:
            raise ConfigError(f"LocalTier.ranks_per_node: {rpn} does not divide the world size "
                              f"{world_size}")
        return Nodes(world_size, rpn)


@dataclass(frozen=True, slots=True)
class Nodes:
    """Ranks on nodes: node ``rank // ranks_per_node``. Pure."""

    world_size: int
    ranks_per_node: int

    @property
    def count(self) -> int:
        return self.world_size // self.ranks_per_node

    def node_of(self, rank: int) -> int:
        return rank // self.ranks_per_node

    def leader(self, node: int) -> int:
        """The rank that commits on ``node`` (its lowest)."""
        return node * self.ranks_per_node

    def ranks_of(self, node: int) -> range:
        return range(node * self.ranks_per_node, (node + 1) * self.ranks_per_node)

    def peers_of(self, rank: int, peers: int) -> list[int]:
        """The ranks that keep copies of ``rank``'s files: the same local rank on each of the next
        ``peers`` nodes (fewer where there are fewer other nodes)."""
        n = min(peers, self.count - 1)
        return [(rank + i * self.ranks_per_node) % self.world_size for i in range(1, n + 1)]


# ----------------------------------------------------------------------- what a node holds


def node_storage(tier: LocalTier, node: int) -> Storage:
    """``node``'s directory, created ``0700`` and refused where another user owns or may write
    it (:func:`~shardckpt.storage.private_dir.private_storage`)."""
    return private_storage(tier.node_url(node), f"local tier directory of node {node}")


def holdings(storage: Storage) -> dict[str, Any]:
    """What a node's directory holds, as JSON: step -> ``{"manifest": save id or None,
    "digest": :func:`manifest_digest` of its manifest or None, "files": {path: size},
    "committed": whether a manifest file is there}`` for every step directory, committed or
    not (a manifest that does not parse: committed, save id and digest None)."""
    out: dict[str, Any] = {}
    for name in storage.ls(""):
        m = STEP_DIR.match(name)
        if not m:
            continue
        step = storage.child(name)
        files: dict[str, int] = {}
        for sub in step.ls(""):
            if step.isdir(sub):
                files.update({f"{sub}/{f}": size for f, size in step.list_sizes(sub).items()})
        save_id = digest = None
        committed = step.exists(MANIFEST_NAME)
        if committed:
            try:
                data = step.read_limited(MANIFEST_NAME, MAX_MANIFEST_BYTES)
                save_id = parsed(data, step.url_of(MANIFEST_NAME)).save_id
                digest = manifest_digest(data)
            except ShardckptError as e:
                log.warning("local tier: ignoring %s: %s", step.url, e)
        out[str(int(m.group(1)))] = {"manifest": save_id, "digest": digest, "files": files,
                                     "committed": committed}
    return out


def committed_steps(held: Sequence[Mapping[str, Any]]) -> list[tuple[int, str]]:
    """(step, save id) of the steps some node has a manifest of, newest first; a step whose nodes
    disagree on the save id (two runs in one directory) is left out."""
    ids: dict[int, set[str]] = {}
    for h in held:
        for key, info in h.items():
            if info["manifest"] is not None:
                ids.setdefault(int(key), set()).add(info["manifest"])
    out: list[tuple[int, str]] = []
    for step, seen in sorted(ids.items(), reverse=True):
        if len(seen) == 1:
            out.append((step, next(iter(seen))))
        else:
            log.warning("local tier: step %d has manifests of different saves %s on different "
                        "nodes; not used", step, sorted(seen))
    return out


def files_needed(m: Manifest, layout: Layout | None, world_size: int) -> dict[int, list[str]]:
    """The files a load of ``m`` by each rank of a job of ``layout`` reads (rank -> paths,
    sorted): the source shards the reshard plan names for the rank's shard, the buffers, and
    the rank's own state where it is restorable; every file where the manifest is not one of
    flat groups. The same on every rank (no agreement needed); the plan is made once."""
    if "model" not in m.components or layout is None:
        every = sorted(f.path for f in m.files)
        return {r: every for r in range(world_size)}
    plan = plan_reshard(m.components["model"].layout, layout, strict=False)
    same_world = per_rank_state(m).restorable_on(world_size)
    by_shard: dict[int, list[str]] = {}
    common: list[str] = []
    own: dict[int, str] = {}
    for f in m.files:
        if f.role == "buffers":
            common.append(f.path)
        elif f.index is None:
            continue
        elif f.role in ("shard", "frozen"):
            by_shard.setdefault(f.index, []).append(f.path)
        elif f.role == "rank" and same_world:
            own[f.index] = f.path
    sources: dict[int, list[str]] = {}  # shard -> the source files its load reads
    out = {}
    for r in range(world_size):
        shard = layout.mesh.shard_rank(r)
        if shard not in sources:
            sources[shard] = [p for i in plan.src_shards_for(shard) for p in by_shard.get(i, ())]
        out[r] = sorted(sources[shard] + common + ([own[r]] if r in own else []))
    return out


@dataclass(frozen=True, slots=True)
class Transfer:
    """File ``path`` goes from ``src``'s node directory to ``dst``'s."""

    path: str
    src: int
    dst: int


def fetch_plan(nodes: Nodes, needs: Mapping[int, Iterable[str]],
               held: Mapping[int, set[str]]) -> tuple[list[Transfer], list[str]]:
    """The transfers that give every rank the files it ``needs`` (rank -> paths) in its node's
    directory, from ``held`` (node -> paths it holds whole): one fetch per missing file and
    node, by the node's lowest rank that needs it, from the least used holding node (ties: the
    lowest), sent by that node's rank of the same local index. Returns the transfers in the order to run them (sorted) and the files no node holds.
    Pure."""
    plan: list[Transfer] = []
    lost: set[str] = set()
    load: dict[int, int] = {}
    fetched: set[tuple[int, str]] = set()
    for rank in sorted(needs):
        node = nodes.node_of(rank)
        for path in sorted(set(needs[rank])):
            if path in held.get(node, set()) or (node, path) in fetched:
                continue
            sources = [n for n in sorted(held) if path in held[n] and n != node]
            if not sources:
                lost.add(path)
                continue
            src = min(sources, key=lambda n: (load.get(n, 0), n))
            load[src] = load.get(src, 0) + 1
            fetched.add((node, path))
            # the rank of the same local index sends: the pairs of two nodes work side by side
            sender = nodes.leader(src) + rank % nodes.ranks_per_node
            plan.append(Transfer(path, sender, rank))
    return sorted(plan, key=lambda t: (t.src, t.dst, t.path)), sorted(lost)


# ------------------------------------------------------------------------- writing a node


def used_bytes(storage: Storage) -> int:
    """Bytes of every file below a node's directory."""
    root = storage.full("")
    total = 0
    for d, _, names in os.walk(root):
        for n in names:
            try:
                total += os.lstat(os.path.join(d, n)).st_size
            except FileNotFoundError:
                continue
    return total


def ensure_room(tier: LocalTier, storage: Storage, nbytes: int, what: str) -> None:
    """Raise :class:`InsufficientSpaceError` where writing ``nbytes`` more below the node's
    directory would pass ``tier.quota_bytes``, or its file system has not that much free."""
    if tier.quota_bytes is not None:
        used = used_bytes(storage)
        if used + nbytes > tier.quota_bytes:
            raise InsufficientSpaceError(
                f"{what}: {storage.url} holds {used} bytes and needs {nbytes} more, past its quota "
                f"of {tier.quota_bytes} bytes (LocalTier.quota_bytes)", storage.url)
    storage.ensure_free_space("", nbytes, what)


def is_full(e: BaseException) -> bool:
    """Whether ``e`` (or what caused it) says the disk or quota is full."""
    seen: BaseException | None = e
    while seen is not None:
        if isinstance(seen, InsufficientSpaceError):
            return True
        if isinstance(seen, OSError) and seen.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def as_full(e: BaseException, url: str) -> BaseException:
    """``e`` as an :class:`InsufficientSpaceError` if it says the disk is full (so that every
    rank can tell it apart after an exchange), else ``e``."""
    if is_full(e) and not isinstance(e, InsufficientSpaceError):
        err = InsufficientSpaceError(f"{url}: the local tier is full ({e})", url)
        err.__cause__ = e
        return err
    return e


def commit_node(storage: Storage, m: Manifest, held: Iterable[FileEntry]) -> None:
    """Create ``manifest.json`` in one node's checkpoint directory ``storage``, once the files
    this node must hold (``held``) are there with their sizes; create-only (the same bytes
    there already are success: a commit retried)."""
    data = to_json(m)
    parse(data, storage.url_of(MANIFEST_NAME))
    by_dir: dict[str, list[FileEntry]] = {}
    for f in held:
        by_dir.setdefault(posixpath.dirname(f.path), []).append(f)
    bad = []
    for d, entries in by_dir.items():
        sizes = storage.list_sizes(d)
        bad += [f.path for f in entries if sizes.get(posixpath.basename(f.path)) != f.size]
    if bad:
        raise IncompleteCheckpointError(f"{storage.url}: not committed on this node: "
                                        f"{', '.join(sorted(bad)[:5])} not as written")
    commit_steps.sync_dirs(storage, m.save_id)
    try:
        storage.create_only(MANIFEST_NAME, data)
    except CommitConflictError:
        if commit_steps.current_manifest(storage) != data:
            raise


def put_manifest(storage: Storage, data: bytes) -> None:
    """A committed step's manifest, as the ranks agreed on it, into this node's directory: where
    the node has a copy that differs (damaged: every node's copy is the same bytes), that copy
    is moved aside to ``manifest.json.damaged-<n>``, with a warning, and replaced."""
    try:
        storage.create_only(MANIFEST_NAME, data)
        return
    except CommitConflictError:
        pass
    try:
        if commit_steps.current_manifest(storage) == data:
            return
    except ShardckptError:
        pass  # unreadable: damaged as well
    n = 1
    while storage.exists(f"{MANIFEST_NAME}.damaged-{n}"):
        n += 1
    aside = f"{MANIFEST_NAME}.damaged-{n}"
    if storage.rename(MANIFEST_NAME, aside):
        log.warning("local tier: %s differs from the other nodes' copy (damaged); moved aside to %s "
                    "and replaced by that copy", storage.url_of(MANIFEST_NAME), storage.url_of(aside))
        storage.create_only(MANIFEST_NAME, data)


def durable_references(dst: Storage, m: Manifest) -> dict[str, str]:
    """For a durable copy of local checkpoint ``m`` into ``dst`` (a step directory of the run):
    its frozen files that the run's latest committed durable checkpoint holds with the same bytes
    (:func:`~shardckpt.checkpoint.references.frozen_stand_ins`) and that are still there with
    their size, path -> the reference to write instead. Empty where there is no such checkpoint
    or it cannot be read (the files are then copied whole)."""
    run = parent_of(dst)
    name = dst.url.rstrip("/").rpartition("/")[2]
    if run is None or not STEP_DIR.match(name):
        return {}
    try:
        latest = CheckpointManager(run).read_latest()
        if latest is None or latest == name or not STEP_DIR.match(latest):
            return {}
        prev = read_manifest(run.child(latest))
    except ShardckptError as e:
        log.info("%s: the run's latest checkpoint is unreadable (%s); copying the frozen files",
                 dst.url, e)
        return {}
    files = RunFiles(dst)
    out = {}
    sizes = {f.path: f.size for f in m.files}
    for path, ref in frozen_stand_ins(m, prev, latest).items():
        try:
            there = files.size(ref) == sizes[path]
        except (NotFoundError, ShardckptError) as e:
            log.info("%s: not referencing %s (%s); copying the frozen file", dst.url, ref, e)
            continue
        if there:
            out[path] = ref
    return out


def step_url(tier: LocalTier, node: int, step: int) -> str:
    return node_storage(tier, node).url_of(step_dir(step))
