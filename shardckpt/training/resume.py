"""Resume of a :class:`~shardckpt.training.checkpointer.Checkpointer`: pick the newest checkpoint
that loads, on every rank alike, and put aside the newer ones it passed over.

Two policies, one shape:

* :func:`resume_durable` (no local tier): rank 0 checks the committed checkpoints of the run,
  newest first (manifest and sizes, or every checksum with ``full_verify``); every rank loads
  the first that passes; a checksum that fails while loading, on any rank, moves every rank on
  to the next older one alike.
* :func:`resume_tiers` (a local tier): the candidates are the local steps committed on some node
  and the durable committed ones, newest first (local first at equal steps); a local step is
  assembled from the nodes' directories (:meth:`~shardckpt.training.tiers.NodeTier.assemble`)
  and loaded straight into the shards. A node's own copy of a shard file that fails its
  checksums is moved aside and the same step is loaded again, that file now taken from a node
  that holds a copy; only a step that no node can give whole is passed over.

Every read that can fail runs inside an agreement of the ranks (:func:`agree`), so a failure on
one rank is a failure on every rank, and every rank moves on alike.

Once a checkpoint is loaded, every committed checkpoint newer than it, on every node and in the
durable tier, is put aside (:mod:`shardckpt.checkpoint.set_aside`), with why it was passed over:
else the run's next save of the same step would meet its manifest, at every restart.
"""

from __future__ import annotations

import logging
from typing import Any

from shardckpt.checkpoint.collective import agree, failed_with
from shardckpt.checkpoint.run_dir import LATEST, STEP_DIR, CheckpointManager, Found, step_dir
from shardckpt.checkpoint.set_aside import DamagedCopyError, put_aside_all
from shardckpt.checkpoint.tiers import committed_steps
from shardckpt.errors import CollectiveError, IntegrityError, ShardckptError
from shardckpt.format.manifest import MANIFEST_NAME
from shardckpt.training.direct_load import direct_ready
from shardckpt.training.tiers import NodeTier
from shardckpt.training.tier_guard import foreign_reason

log = logging.getLogger(__name__)


def _damaged(e: CollectiveError, url: str, rank: int, damaged: list[str], what: str) -> str:
    """Note a load of ``url`` that failed its checksums (``e``); why it is passed over."""
    ranks = failed_with(e, IntegrityError)
    damaged.append(f"{url}: {e.failures[ranks[0]]}")
    if rank == 0:
        log.warning("%s fails its checksums on rank(s) %s (%s); trying the %s (nothing is "
                    "deleted)", url, ranks, e.failures[ranks[0]], what)
    return f"it fails its checksums ({e.failures[ranks[0]]})"


def put_aside_durable(manager: CheckpointManager, above: int, why: dict[int, str]) -> None:
    """Rank 0, after a resume at step ``above``: put aside the run's committed checkpoints newer
    than it (``why``: step -> why it was passed over), and point ``latest`` at the newest one
    left (or remove it), so that no save references a passed-over checkpoint's files."""
    try:
        committed = manager.committed()
        newer = {f.name: why.get(f.step) or _problem(manager, f) for f in committed if f.step > above}
        if not newer:
            return
        put_aside_all(manager.storage, newer, manager.url)
        left = [f.name for f in committed if f.step <= above]
        if manager.read_latest() in newer:
            if left:
                manager.storage.put(LATEST, (left[-1] + "\n").encode())
            else:
                manager.storage.rm(LATEST)
    except ShardckptError as e:
        log.warning("%s: could not put aside the checkpoints newer than step %d: %s",
                    manager.url, above, e)


def _start_fresh(damaged: list[str], none_loads: str, rank: int, none_found: str) -> None:
    """Where no checkpoint was loaded: an error if some failed their checksums (a run never
    starts over silently past damaged ones), else the log line that it starts at step 0."""
    if damaged:
        raise IntegrityError(f"{none_loads}; {len(damaged)} failed their checksums: " + "; ".join(damaged))
    if rank == 0:
        log.info("%s; starting at step 0", none_found)


def _problem(manager: CheckpointManager, found: Found) -> str:
    problems = manager.check(found)
    return problems[0] if problems else "it was not loaded (see the resume's warnings)"


def resume_durable(ckpt: Any, full_verify: bool, strict: bool) -> int:
    """The newest committed checkpoint of ``ckpt``'s run that loads, on every rank (see the
    module docstring); its step, or 0."""
    rank, manager = ckpt.rank, ckpt.manager
    why: dict[int, str] = {}
    todo: list[Found] | None = None
    # a job with an optimizer that loads everything needs optimizer state: a checkpoint that
    # retention thinned into weights only is passed over while an older one holds it
    needs_optimizer = getattr(ckpt.engine, "optimizer", None) is not None
    weights_only: list[Found] = []

    def choose() -> int | None:  # rank 0 checks one candidate at a time, the others follow
        nonlocal todo
        if rank != 0:
            return None
        if todo is None:
            todo = manager.committed()
        while todo:
            found = todo.pop()
            problems = manager.check(found, full_verify)
            lacking = [] if problems else manager.lacks(found, needs_optimizer)
            if not problems and not lacking:
                return found.step
            if lacking:
                weights_only.append(found)
            why[found.step] = (problems or lacking)[0]
            log.warning("passing over %s: %s", found.url, why[found.step])
        if weights_only:  # better the newest weights with a fresh optimizer than step 0
            found = weights_only[0]
            log.warning("no committed checkpoint of %s holds optimizer state; resuming from the "
                        "weights of %s with a fresh optimizer", manager.url, found.url)
            why.pop(found.step, None)
            return found.step
        return -1

    damaged: list[str] = []
    while True:
        _, reports = agree(choose, f"choice of the checkpoint of {manager.url} to resume from")
        step = int(reports[0]["payload"])
        if step < 0:
            break
        url = manager.url_for(step)
        try:
            ckpt.load(url, strict=strict)
        except CollectiveError as e:
            if not failed_with(e, IntegrityError):
                raise
            why[step] = _damaged(e, url, rank, damaged, "previous committed checkpoint")
            continue
        if rank == 0:
            log.info("resumed from %s (step %d)", url, step)
        _put_aside_run(manager, rank, step, why)
        return step
    _start_fresh(damaged, f"{manager.url}: no committed checkpoint loads", rank,
                 f"no committed checkpoint below {manager.url}")
    _put_aside_run(manager, rank, 0, why)
    return 0


def _put_aside_run(manager: CheckpointManager, rank: int, above: int, why: dict[int, str]) -> None:
    """:func:`put_aside_durable` on rank 0 while the others wait: none of them may write a step
    that rank 0 is still moving away."""
    agree(lambda: put_aside_durable(manager, above, why) if rank == 0 else None,
          f"putting aside the checkpoints of {manager.url} newer than {step_dir(above)}")


def _try_local(ckpt: Any, node: NodeTier, step: int, save_id: str, held: list[Any],
               strict: bool) -> tuple[str, Any]:
    """One attempt at local ``step``: ``("loaded", (url, fetched))``, ``("passed", why)``,
    ``("again", why)`` (a node's own damaged copy was moved aside: try the same step again)
    or ``("damaged", error)`` (a checksum failed: pass it over)."""
    got = node.assemble(step, save_id, held, ckpt.engine.layout, ckpt.world_size,
                        direct=lambda m: direct_ready(ckpt.engine, m))
    if isinstance(got, str):
        return "passed", got
    try:
        ckpt.load(got.url, strict=strict, storage_options={}, direct=True, peers=got.peers,
                  flag_key=got.flag_key, manifest=got.manifest)
    except CollectiveError as e:
        if failed_with(e, DamagedCopyError):
            return "again", e
        if not failed_with(e, IntegrityError):
            raise
        return "damaged", e
    return "loaded", (got.url, got.fetched)


def resume_tiers(ckpt: Any, node: NodeTier, full_verify: bool, strict: bool) -> int:
    """Load the newest checkpoint that can be assembled from the local tier (own copies, then
    peers' copies) or is committed durably; every rank alike. Returns its step, or 0."""
    rank, manager = ckpt.rank, ckpt.manager
    held, durable = node.survey(manager)
    per_node = [held[node.nodes.leader(n)] for n in range(node.nodes.count)]
    local = committed_steps(per_node)
    candidates = sorted([(s, 1, sid) for s, sid in local] + [(s, 0, "") for s in durable],
                        reverse=True)
    why: dict[tuple[int, int], str] = {}
    damaged: list[str] = []
    for step, is_local, save_id in candidates:
        fetched = 0
        if is_local:
            moved = ""  # what the attempts before found damaged (and moved aside)
            for _ in range(2 * node.nodes.count + 1):  # each time, one more own copy moved aside
                outcome, detail = _try_local(ckpt, node, step, save_id, held, strict)
                if outcome != "again":
                    break
                moved = f"{detail}; then "
                if rank == 0:
                    log.warning("local step %d: %s; loading it again with copies from other "
                                "nodes", step, detail)
                held, _ = node.survey(manager)
            if outcome == "passed":
                why[(step, 1)] = f"{moved}it cannot be assembled: {detail}"
                if rank == 0:
                    log.warning("local tier: step %d cannot be assembled: %s", step, detail)
                continue
            if outcome in ("damaged", "again"):
                url = node.url_for(step)
                why[(step, 1)] = _damaged(detail, url, rank, damaged, "next checkpoint")
                continue
            url, fetched = detail
            source = (f"the local tier, {fetched} file(s) from peers" if fetched
                      else "the local tier, each rank's own node")
        else:
            url = manager.url_for(step)
            problem = node.check_durable(manager, step, full_verify,
                                         getattr(ckpt.engine, "optimizer", None) is not None)
            if problem:
                why[(step, 0)] = problem
                if rank == 0:
                    log.warning("skipping %s: %s", url, problem)
                continue
            try:
                ckpt.load(url, strict=strict)
            except CollectiveError as e:
                if not failed_with(e, IntegrityError):
                    raise
                why[(step, 0)] = _damaged(e, url, rank, damaged, "next checkpoint")
                continue
            source = "the durable tier"
        if rank == 0:
            passed = "; ".join(f"{'local' if t else 'durable'} step {s}: {w}"
                               for (s, t), w in sorted(why.items(), reverse=True))
            log.info("resumed from %s at step %d: %s%s", source, step, url,
                     f" (passed over: {passed})" if passed else "")
        ckpt.last_resume = {"tier": "local" if is_local else "durable", "step": step,
                            "fetched": fetched, "url": url}
        _put_aside_tiers(node, manager, step, why)
        return step
    _start_fresh(damaged, f"{manager.url} and the local tier: no checkpoint loads", rank,
                 f"no checkpoint in the local tier or below {manager.url}")
    ckpt.last_resume = {"tier": None, "step": 0, "fetched": 0, "url": None}
    _put_aside_tiers(node, manager, 0, why)
    return 0


def _put_aside_tiers(node: NodeTier, manager: CheckpointManager, above: int,
                     why: dict[tuple[int, int], str]) -> None:
    """After a resume at ``above`` (collective): each node's leader puts aside the steps newer
    than it that have a manifest there; rank 0 those of the durable tier. No rank goes on
    (to a save that may write one of those steps again) before every node is done."""

    def work() -> None:
        if node.rank == 0:
            put_aside_durable(manager, above, {s: w for (s, t), w in why.items() if not t})
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
        newer = {n: why.get((int(n[5:]), 1)) or foreign_reason(storage, int(n[5:]), node.run)
                 or "its nodes hold manifests of different saves, or none that parses" for n in names}
        put_aside_all(storage, newer, f"local tier, node {node.node}")

    agree(work, f"putting aside the steps newer than {step_dir(above)}", None)
