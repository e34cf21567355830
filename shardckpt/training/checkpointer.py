"""What a training loop adds: save every so often (optionally in the background), resume.

::

    ckpt = Checkpointer("s3://bucket/run", engine, app_state={"scheduler": sched, "data": loader},
                        keep_last=3, keep_optimizer_last=1, keep_every=1000, async_save=True)
    start = ckpt.resume()              # newest committed checkpoint that checks out, or 0
    for step in range(start, steps):
        ...train...
        if step % 100 == 0:
            ckpt.save(step)            # returns once the shards are copied to staging
    ckpt.close()                       # waits for the last save, surfacing its error

Application state: every object in ``app_state`` has ``state_dict()`` / ``load_state_dict()``
returning JSON-serializable data (LR schedulers, a data loader's position, a plain dict through
:class:`JsonState`); it is stored in the manifest under ``extras["app"]`` (rank 0's copy: it must
be the same on every rank). Per-rank state (the torch RNG states) goes to
``rank-XXXXX.safetensors``. After a change of world size per-rank state cannot be restored:
each rank is re-seeded with ``seed + rank`` (documented rule; ``resume`` reports it).

Async save: the call returns at once; a background thread copies each rank's shards into a
staging buffer allocated once (pinned on CUDA) — the optimizer's next ``step()`` waits for that
copy (whichever optimizer the engine has by then, whenever it was created), while the next
forward and backward overlap it — then writes and commits over a process group of its own; at
most one save is in flight; the next ``save``, ``wait`` or ``close`` raises its error, and the
previous checkpoint stays intact (the manifest is the last thing written). With the optimizer
offloaded to files (``offload_optimizer="nvme"``) the trained groups are not copied into memory:
their offload files and master shards are copied into a snapshot directory on the same disk
(``copy_file_range``; a reflink where blocks are shared), streamed, and removed when it ends.

Resume tries the newest committed checkpoint that checks out and holds what the job needs (not one
retention thinned to weights, :mod:`shardckpt.checkpoint.retention`, where the job has an optimizer);
if a checksum fails while loading it (on any rank), every rank falls back to the next older one.

Tiers: with ``local=LocalTier(path=..., every=K, keep=2, peers=1)`` and ``durable_every=M``,
``save(step)`` writes to each node's directory every K steps (peer copies and commit in the
background), and commits the same checkpoint at ``run_url`` every M steps, copied from the node
directories in the background; ``resume`` takes the newest checkpoint it can assemble from the
local tier (own copies, then peers') or the durable one (:mod:`shardckpt.training.tiers`,
:mod:`shardckpt.training.resume`); the newer checkpoints it passed over are put aside.
Without ``local``, every ``save`` goes to ``run_url`` (or every M-th step with ``durable_every``).

Hugging Face config: ``extras["hf_config"]`` of every save holds the model's ``config.json`` dict
(``hf_config=``, else the wrapped module's own config: the built-in Llama, or a ``transformers``
model), so that ``shardckpt consolidate`` can write ``config.json``.
"""

from __future__ import annotations

import copy
import json
import logging
import threading
from concurrent.futures import Future
from typing import Any
from collections.abc import Mapping, Sequence

from shardckpt.checkpoint.trust import SigningKey, Trust, signing_key as load_signing_key
from shardckpt.checkpoint.collective import agree, is_distributed, rank_and_world
from shardckpt.errors import CollectiveError, ConfigError, IntegrityError, ShardckptError
from shardckpt.checkpoint.run_dir import CheckpointManager
from shardckpt.checkpoint.thin import resign_with
from shardckpt.checkpoint.set_aside import raise_damaged_role
from shardckpt.format.manifest import Manifest
from shardckpt.format.records import RunExtras, per_rank_state, run_extras
from shardckpt.checkpoint.tiers import LocalTier, Transfer
from shardckpt.training.staging import Staging
from shardckpt.training.save_load import LoadResult, SaveJob, Sharded, begin_save, load, read_rank_state
from shardckpt.training.direct_load import load_direct
from shardckpt.training.resume import resume_durable, resume_tiers
from shardckpt.training.tiers import LocalSave, NodeTier
from shardckpt.training.hf_record import default_hf_config, hf_config_dict  # noqa: F401 - public here too

log = logging.getLogger(__name__)


class JsonState:
    """A plain JSON-serializable dict with the ``state_dict`` protocol."""

    def __init__(self, data: dict[str, Any] | None = None) -> None:
        self.data = dict(data or {})

    def state_dict(self) -> dict[str, Any]:
        return copy.deepcopy(self.data)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.data = copy.deepcopy(dict(state))


def rng_state() -> dict[str, Any]:
    import torch

    state = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["torch_cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: Mapping[str, Any]) -> None:
    import torch

    torch.set_rng_state(state["torch_cpu"])
    if "torch_cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["torch_cuda"])


class Checkpointer:
    """Save and resume one run of ``engine`` below ``run_url`` (``<run>/step-XXXXXXXX``).

    Construct on every rank (with ``async_save`` this creates a process group, a collective).
    """

    def __init__(self, run_url: str, engine: Sharded, *, app_state: Mapping[str, Any] | None = None,
                 keep_last: int | None = 3, keep_optimizer_last: int | None = None,
                 keep_every: int | None = None, async_save: bool = False, seed: int = 0,
                 storage_options: Mapping[str, Any] | None = None, chunk_size: int | None = None,
                 hf_config: Any = None, local: LocalTier | None = None,
                 durable_every: int | None = None, max_staging_bytes: int | None = None,
                 signing_key: str | SigningKey | None = None) -> None:
        for name, obj in (app_state or {}).items():
            if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
                raise ConfigError(f"app_state[{name!r}] has no state_dict()/load_state_dict()")
        self.engine = engine
        self.signing_key = load_signing_key(signing_key)  # a path: read once, here
        self.app_state = dict(app_state or {})
        self.manager = CheckpointManager(run_url, keep_last, storage_options, keep_every=keep_every, keep_optimizer_last=keep_optimizer_last,
                                         resign=resign_with(self.signing_key) if self.signing_key else None)
        self.storage_options = storage_options
        self.chunk_size = chunk_size
        self.seed = seed
        self.async_save = async_save
        self.hf_config = (hf_config_dict(hf_config) if hf_config is not None
                          else default_hf_config(engine))
        if durable_every is not None and (not isinstance(durable_every, int) or durable_every < 1):
            raise ConfigError(f"durable_every: {durable_every!r}; expected an integer >= 1 or None")
        if local is not None and not isinstance(local, LocalTier):
            raise ConfigError(f"local: a {type(local).__name__}; expected a LocalTier")
        self.durable_every = durable_every
        self.rank, self.world_size = rank_and_world()
        #: where the last resume came from: tier ("local", "durable" or None), step, files fetched
        self.last_resume: dict[str, Any] | None = None
        self._group: Any = None
        # async: the host copies of the shards, allocated in the background from now on
        self._stager = Staging(engine.local_shards(), max_staging_bytes) if async_save else None
        self._pending: Future[Manifest] | None = None
        self._staged = threading.Event()
        self._thread: threading.Thread | None = None
        self._staged.set()
        if (async_save or local is not None) and is_distributed():
            import torch.distributed as dist

            # checkpoint collectives run in a background thread: keep them off the training group
            self._group = dist.new_group(backend="gloo")
        self.tier = NodeTier(local, self.rank, self.world_size, self._group, run_url) if local else None
        # the staging copy runs in the background: the next update waits until it is done
        self._hooks: list[Any] = []
        self._hooked: set[int] = set()  # ids of optimizers hooked directly
        self._engine_hooked = False     # the engine's hook covers whatever optimizer it gets
        update_pre_hook = getattr(engine, "register_update_pre_hook", None)
        if async_save and callable(update_pre_hook):
            self._hooks.append(update_pre_hook(self._before_step))
            self._engine_hooked = True

    def _hook_optimizer(self) -> None:
        """An engine without update hooks: hook its optimizer of now (at each save, so that one
        created or replaced after construction is covered too)."""
        opt = getattr(self.engine, "optimizer", None)
        if (self._engine_hooked or opt is None or id(opt) in self._hooked
                or not hasattr(opt, "register_step_pre_hook")):
            return
        self._hooks.append(opt.register_step_pre_hook(self._before_step))
        self._hooked.add(id(opt))

    # ------------------------------------------------------------------------------ save

    def _app_json(self) -> dict[str, Any]:
        out = {}
        for name, obj in self.app_state.items():
            state = obj.state_dict()
            try:
                json.dumps(state, allow_nan=False)
            except (TypeError, ValueError) as e:
                raise ConfigError(f"app_state[{name!r}].state_dict() is not JSON-serializable: {e}") from e
            out[name] = state
        return out

    @property
    def staging_bytes(self) -> int:
        """Host memory held for async saves' staging (0 before it is allocated, or without)."""
        return self._stager.bytes if self._stager is not None else 0

    def _offload_snapshot(self) -> tuple[set[str], Any]:
        """The optimizer's offload snapshot (nvme): its groups and the empty snapshot."""
        opt = getattr(self.engine, "optimizer", None)
        snap = getattr(opt, "offload_snapshot", lambda: None)()
        return snap if snap is not None else (set(), None)

    def save(self, step: int, extras: Mapping[str, Any] | None = None) -> None:
        """Save ``step`` on every rank: synchronously, or async (see the module docstring); with
        tiers, to the tiers due at ``step`` (none: nothing is done)."""
        self.wait()  # at most one in flight; raises the previous save's error here
        tier = self.tier if self.tier is not None and self.tier.enabled else None
        local_due = tier is not None and step % tier.tier.every == 0
        durable_due = self.durable_every is None or step % self.durable_every == 0
        if not (local_due or durable_due):
            return
        url = self.manager.url_for(step)
        # the caller's keys sit between hf_config and the Checkpointer's own, which win
        ext = RunExtras.from_doc({**({"hf_config": self.hf_config} if self.hf_config is not None else {}),
                                  **dict(extras or {}), "step": step, "seed": self.seed,
                                  "app": self._app_json(), **({"run": tier.run} if tier else {})}, "extras", f"save of {url}").to_doc()
        if tier is not None and local_due and self._save_local(tier, step, ext, durable_due):
            return
        if not durable_due:
            return
        staging, snapshot = None, None
        if self.async_save:
            self._hook_optimizer()
            on_disk, snapshot = self._offload_snapshot()
        try:
            if self.async_save:
                assert self._stager is not None  # None while it is being allocated: see run()
                staging = self._stager.get(self.engine.local_shards(), on_disk, wait=False)
            job = begin_save(self.engine, url, ext, self.storage_options, self.chunk_size,
                             self._group, rank_state=rng_state(), staging=staging, snapshot=snapshot,
                             previous=self.manager.latest_url(), signing_key=self.signing_key)
        except BaseException:
            if snapshot is not None:
                snapshot.remove()
            raise
        if not self.async_save:
            self._finish(job, step)
            return
        fut: Future[Manifest] = Future()
        self._staged.clear()

        def run() -> None:
            try:
                try:
                    if job.staging is None and job.shard is not None and self._stager is not None:
                        job.staging = self._stager.get(self.engine.local_shards(), on_disk, True)
                    job.stage()
                finally:  # without staging (max_staging_bytes), updates wait for the write
                    if job.staging is not None or job.shard is None:
                        self._staged.set()
                fut.set_result(self._finish(job, step))
            except BaseException as e:  # noqa: BLE001 - surfaced by wait()
                fut.set_exception(e)
            finally:
                self._staged.set()
                job.release()  # the offload snapshot, if any

        thread = threading.Thread(target=run, name=f"shardckpt-save-{step}", daemon=True)
        thread.start()
        self._pending, self._thread = fut, thread

    def _save_local(self, tier: NodeTier, step: int, ext: Mapping[str, Any], durable: bool) -> bool:
        """Write ``step`` to the local tier, then copy to peers, commit, and (``durable``) copy to
        the durable tier in the background. False where the local tier is full (it is then off,
        and the durable save, if due, is the caller's)."""
        job = begin_save(self.engine, tier.url_for(step), ext, None, self.chunk_size, self._group,
                         rank_state=rng_state(), signing_key=self.signing_key)
        written = tier.write(job, step)
        if written is None:
            return False
        fut: Future[Manifest] = Future()

        def run() -> None:
            try:
                fut.set_result(self._finish_tiers(tier, written, durable))
            except BaseException as e:  # noqa: BLE001 - surfaced by wait()
                fut.set_exception(e)

        thread = threading.Thread(target=run, name=f"shardckpt-tiers-{step}", daemon=True)
        thread.start()
        self._pending, self._thread = fut, thread
        return True

    def _finish_tiers(self, tier: NodeTier, written: LocalSave, durable: bool) -> Manifest:
        local = tier.commit(written)
        m = local
        if durable:
            step = written.step
            try:
                m = tier.copy_to_durable(written, self.manager.url_for(step), self.storage_options)
            except CollectiveError:
                if self.rank == 0 and self.manager.is_committed(step):
                    self.manager.mark_committed(step)
                raise
            finally:
                if local is None:  # the peer copy found no room: nothing committed locally
                    tier.discard(written.step)
            if self.rank == 0:
                self.manager.mark_committed(step)
        elif local is None:
            tier.discard(written.step)
        return m if m is not None else written.writer.manifest(written.entries)

    def _before_step(self, *_: Any) -> None:
        self._staged.wait()

    def wait_staged(self) -> None:
        """Block until the save in flight has copied the shards aside (then they may change)."""
        self._staged.wait()

    def _finish(self, job: SaveJob, step: int) -> Manifest:
        try:
            m = job.run()
        except CollectiveError:
            # a rank lost during the final exchange may leave a committed checkpoint: resume
            # picks it, so latest must name it too
            if self.rank == 0:
                try:
                    if self.manager.is_committed(step):
                        self.manager.mark_committed(step)
                except ShardckptError as e:
                    log.warning("could not point latest at %s: %s", self.manager.url_for(step), e)
            raise
        if self.rank == 0:
            self.manager.mark_committed(step)
        return m

    def wait(self) -> Manifest | None:
        """Wait for the save in flight, if any; raise its error."""
        fut, self._pending = self._pending, None
        if fut is None:
            return None
        try:
            return fut.result()
        finally:
            if self._thread is not None:
                self._thread.join()  # the thread owns collectives until it has fully ended
                self._thread = None

    @property
    def in_flight(self) -> bool:
        return self._pending is not None and not self._pending.done()

    def close(self) -> None:
        """Wait for the save in flight (raising its error), then release the private group."""
        try:
            self.wait()
        finally:
            for handle in self._hooks:
                handle.remove()
            self._hooks, self._hooked, self._engine_hooked = [], set(), False
            if self._group is not None:
                import torch.distributed as dist

                if dist.is_initialized():
                    dist.destroy_process_group(self._group)
                self._group = None

    # ---------------------------------------------------------------------------- resume

    def resume(self, full_verify: bool = False, strict: bool = True) -> int:
        """Load the newest committed checkpoint that checks out; return its step (0 if none).

        Rank 0 picks the newest committed checkpoint that passes the check (manifest and sizes,
        or every checksum with ``full_verify``) and tells the others; every rank loads it. If a
        checksum fails on any rank while loading, all of them fall back to the next older one
        alike (nothing is deleted). Raises if every candidate fails.
        """
        if self.tier is not None:
            self.wait()
            return resume_tiers(self, self.tier, full_verify, strict)
        return resume_durable(self, full_verify, strict)

    def load(self, url: str, strict: bool = True, weights_only: bool = False,
             storage_options: Mapping[str, Any] | None = None, direct: bool = False,
             peers: Sequence[Transfer] = (), flag_key: str | None = None,
             manifest: Manifest | None = None, trust: Trust | None = None) -> LoadResult:
        """Load ``url`` (model, optimizer, application and per-rank state) on every rank, with
        ``storage_options`` (default: the run's; ``{}`` for a node-local directory). ``direct``:
        ``url`` is a directory on this machine; read its shards straight into the engine's, and
        take the shard files ``peers`` names from other ranks' directories on the way
        (:mod:`shardckpt.training.direct_load`; ``flag_key`` names that load's loss flag;
        ``manifest``: the one the ranks agreed on, not read again; ``trust``: public keys that
        must have signed it, as :func:`load`'s, never ``direct``)."""
        self.wait()  # a save in flight reads the state a load would overwrite
        options = self.storage_options if storage_options is None else storage_options
        if direct and not weights_only and trust is None:
            res = load_direct(self.engine, url, strict=strict, peers=peers, flag_key=flag_key,
                              manifest=manifest)
        else:
            res = load(self.engine, url, strict=strict, weights_only=weights_only,
                       storage_options=options, trust=trust)
        extras = run_extras(res.manifest, url)
        app = extras.app or {}
        absent = [name for name in self.app_state if name not in app]
        if absent and strict:
            raise ShardckptError(f"{url}: no application state {absent} in the checkpoint; "
                                 "load with strict=False to keep the current state of those")
        per_rank = per_rank_state(res.manifest, url)
        same_world = per_rank.restorable_on(self.world_size)

        def rank_state() -> tuple[dict[str, Any] | None]:  # a tuple: not sent to the peers
            if not same_world:
                return (None,)
            assert res.reader is not None  # the load's reader, flat groups and chunks alike
            try:
                return (read_rank_state(res.reader, self.rank),)
            except IntegrityError as e:
                if not direct:
                    raise
                raise_damaged_role(res.reader.files, res.manifest, "rank", self.rank, e)

        # every rank reads its own file: agree, so that a damaged one fails all ranks alike
        held, _ = agree(rank_state, f"load of per-rank state from {url}")
        state = held[0] if held else None
        for name, obj in self.app_state.items():
            if name not in absent:
                obj.load_state_dict(app[name])
        if state is not None:
            set_rng_state(state)
        else:
            import torch

            seed = self.seed if extras.seed is None else extras.seed
            torch.manual_seed(seed + self.rank)
            if self.rank == 0:
                log.info("per-rank state not restorable (world %s -> %s); RNG re-seeded with "
                         "%d + rank", per_rank.world_size, self.world_size, seed)
        return res
