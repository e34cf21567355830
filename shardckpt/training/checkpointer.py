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
background; with ``async_save`` the write too, the next update waiting for it), and commits the
same checkpoint at ``run_url`` every M steps, copied from the node directories in the
background; ``resume`` takes the newest checkpoint it can assemble from the local tier (own
copies, then peers') or the durable one (:mod:`shardckpt.training.tiers`,
:mod:`shardckpt.checkpoint.resume_policy`); the newer checkpoints it passed over are put aside.
Each tier is a :class:`~shardckpt.training.tier.Tier` (call order there).
Without ``local``, every ``save`` goes to ``run_url`` (or every M-th step with ``durable_every``).

Hugging Face config: ``extras["hf_config"]`` of every save holds the model's ``config.json`` dict
(``hf_config=``, else the wrapped module's own config: the built-in Llama, or a ``transformers``
model), so that ``shardckpt consolidate`` can write ``config.json``.
"""

from __future__ import annotations

import copy
import logging
from typing import Any
from collections.abc import Mapping

from shardckpt.checkpoint.collective import is_distributed, rank_and_world
from shardckpt.checkpoint.resume_policy import resume_newest
from shardckpt.checkpoint.run_dir import CheckpointManager
from shardckpt.checkpoint.thin import resign_with
from shardckpt.checkpoint.tiers import LocalTier
from shardckpt.checkpoint.trust import SigningKey, Trust, signing_key as load_signing_key
from shardckpt.errors import ConfigError
from shardckpt.format.manifest import Manifest
from shardckpt.format.records import RunExtras
from shardckpt.training.durable_tier import DurableTier
from shardckpt.training.hf_record import default_hf_config, hf_config_dict  # noqa: F401 - public here too
from shardckpt.training.run_state import RunState, rng_state, set_rng_state  # noqa: F401 - public here too
from shardckpt.training.save_executor import SaveExecutor
from shardckpt.training.save_load import LoadResult, Sharded
from shardckpt.training.staging import Staging
from shardckpt.training.tier import Tier
from shardckpt.training.tiers import NodeTier

log = logging.getLogger(__name__)


class JsonState:
    """A plain JSON-serializable dict with the ``state_dict`` protocol."""

    def __init__(self, data: dict[str, Any] | None = None) -> None:
        self.data = dict(data or {})

    def state_dict(self) -> dict[str, Any]:
        return copy.deepcopy(self.data)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.data = copy.deepcopy(dict(state))


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
        if durable_every is not None and (not isinstance(durable_every, int) or durable_every < 1):
            raise ConfigError(f"durable_every: {durable_every!r}; expected an integer >= 1 or None")
        if local is not None and not isinstance(local, LocalTier):
            raise ConfigError(f"local: a {type(local).__name__}; expected a LocalTier")
        self.engine = engine
        self.rank, self.world_size = rank_and_world()
        self.state = RunState(engine, dict(app_state or {}), seed, self.rank, self.world_size,
                              storage_options, chunk_size, load_signing_key(signing_key))
        key = self.state.signing_key
        self.manager = CheckpointManager(run_url, keep_last, storage_options, keep_every=keep_every,
                                         keep_optimizer_last=keep_optimizer_last,
                                         resign=resign_with(key) if key else None)
        self.async_save = async_save
        self.hf_config = (hf_config_dict(hf_config) if hf_config is not None
                          else default_hf_config(engine))
        #: where the last resume came from: tier ("local", "durable" or None), step, files fetched
        self.last_resume: dict[str, Any] | None = None
        self._group: Any = None
        if (async_save or local is not None) and is_distributed():
            import torch.distributed as dist

            # checkpoint collectives run in a background thread: keep them off the training group
            self._group = dist.new_group(backend="gloo")
        # async: the host copies of the shards, allocated in the background from now on
        self._stager = Staging(engine.local_shards(), max_staging_bytes) if async_save else None
        self.durable = DurableTier(self.manager, self.state, durable_every, self._group, self._stager)
        #: node-local first: at each save, the first tier that takes it
        self.tiers: list[Tier] = [self.durable]
        if local is not None:
            self.tiers.insert(0, NodeTier(local, self.state, self._group, run_url, self.durable,
                                          background=async_save))
        self._executor = SaveExecutor()
        self._staged = self._executor.staged
        # the staging copy runs in the background: the next update waits until it is done
        self._hooks: list[Any] = []
        self._hooked: set[int] = set()  # ids of optimizers hooked directly
        self._engine_hooked = False     # the engine's hook covers whatever optimizer it gets
        update_pre_hook = getattr(engine, "register_update_pre_hook", None)
        if async_save and callable(update_pre_hook):
            self._hooks.append(update_pre_hook(self._before_step))
            self._engine_hooked = True

    @property
    def tier(self) -> NodeTier | None:
        """The node-local tier, if any."""
        return next((t for t in self.tiers if isinstance(t, NodeTier)), None)

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

    @property
    def staging_bytes(self) -> int:
        """Host memory held for async saves' staging (0 before it is allocated, or without)."""
        return self._stager.bytes if self._stager is not None else 0

    def save(self, step: int, extras: Mapping[str, Any] | None = None) -> None:
        """Save ``step`` on every rank: synchronously, or async (see the module docstring); with
        tiers, to the tiers due at ``step`` (none: nothing is done)."""
        self.wait()  # at most one in flight; raises the previous save's error here
        if not any(t.due(step) for t in self.tiers):
            for t in self.tiers:  # a step that saves nothing: the tiers may prepare meanwhile
                t.under_way()
            return
        where = self.manager.url_for(step)
        tier_extras = {k: v for t in self.tiers for k, v in t.extras().items()}
        # the caller's keys sit between hf_config and the Checkpointer's own, which win
        ext = RunExtras.from_doc({**({"hf_config": self.hf_config} if self.hf_config is not None else {}),
                                  **dict(extras or {}), "step": step, "seed": self.state.seed,
                                  "app": self.state.app_json(), **tier_extras}, "extras", f"save of {where}").to_doc()
        for tier in self.tiers:
            if self.async_save and tier.due(step):
                self._hook_optimizer()
            pending = tier.save(step, ext)
            if pending is not None:
                self._executor.run(pending)
                return

    def _before_step(self, *_: Any) -> None:
        self._staged.wait()

    def wait_staged(self) -> None:
        """Block until the save in flight has copied the shards aside (then they may change)."""
        self._staged.wait()

    def wait(self) -> Manifest | None:
        """Wait for the save in flight, if any; raise its error."""
        return self._executor.wait()

    @property
    def in_flight(self) -> bool:
        return self._executor.in_flight

    def close(self) -> None:
        """Wait for the save in flight (raising its error), then destroy the private group (its
        threads are joined before this returns)."""
        try:
            self.wait()
        finally:
            for tier in self.tiers:
                tier.close()
            for handle in self._hooks:
                handle.remove()
            self._hooks, self._hooked, self._engine_hooked = [], set(), False
            self._release_group()

    def _release_group(self) -> None:
        """Destroy the private group, and drop every reference to it, so that its gloo
        threads are joined now: a group left to the interpreter's exit can abort the process
        there (a gloo thread that needs the interpreter after it has begun to finalize)."""
        if self._group is None:
            return
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group(self._group)
        self._group = None
        for tier in self.tiers:
            tier.group = None

    # ---------------------------------------------------------------------------- resume

    def resume(self, full_verify: bool = False, strict: bool = True) -> int:
        """Load the newest committed checkpoint that checks out; return its step (0 if none).

        Over every tier (:func:`~shardckpt.checkpoint.resume_policy.resume_newest`): rank 0
        checks each committed checkpoint of the run (manifest and sizes, or every checksum with
        ``full_verify``), newest first, and every rank loads the first that passes; a local step
        is assembled from the nodes' directories. If a checksum fails on any rank while loading,
        all of them fall back to the next older one alike (nothing is deleted); the newer ones
        passed over are put aside. Raises if every candidate fails its checksums.
        """
        self.wait()  # a save in flight reads the state a load would overwrite
        got = resume_newest([t.source(full_verify, strict) for t in self.tiers])
        c = got.candidate
        self.last_resume = {"tier": c.tier if c else None, "step": got.step, "url": c.url if c else None,
                            "fetched": (got.outcome.value or 0) if c and got.outcome and c.tier == "local" else 0}
        return got.step

    def load(self, url: str, strict: bool = True, weights_only: bool = False,
             storage_options: Mapping[str, Any] | None = None, trust: Trust | None = None) -> LoadResult:
        """Load ``url`` (model, optimizer, application and per-rank state) on every rank, with
        ``storage_options`` (default: the run's); ``trust``: public keys that must have signed
        it, as :func:`~shardckpt.training.save_load.load`'s."""
        self.wait()  # a save in flight reads the state a load would overwrite
        return self.state.load(url, strict, weights_only, storage_options, trust)
