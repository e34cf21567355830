"""What a training loop adds: save every so often (optionally in the background), resume.

::

    ckpt = Checkpointer("s3://bucket/run", engine, app_state={"scheduler": sched, "data": loader},
                        keep_last=3, async_save=True)
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
copy, while the next forward and backward overlap it — then writes and commits over a process
group of its own; at most one save is in flight; the next ``save``, ``wait`` or
``close`` raises its error, and the previous checkpoint stays intact (the manifest is the last
thing written).
"""

from __future__ import annotations

import copy
import json
import logging
import threading
from concurrent.futures import Future
from typing import Any, Mapping

from shardckpt.checkpoint import CheckpointReader
from shardckpt.collective import is_distributed, rank_and_world
from shardckpt.errors import ConfigError, ShardckptError
from shardckpt.manager import CheckpointManager
from shardckpt.manifest import Manifest
from shardckpt.save_load import LoadResult, SaveJob, Sharded, begin_save, load, read_rank_state

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
                 keep_last: int | None = 3, async_save: bool = False, seed: int = 0,
                 storage_options: Mapping[str, Any] | None = None, chunk_size: int | None = None) -> None:
        for name, obj in (app_state or {}).items():
            if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
                raise ConfigError(f"app_state[{name!r}] has no state_dict()/load_state_dict()")
        self.engine = engine
        self.app_state = dict(app_state or {})
        self.manager = CheckpointManager(run_url, keep_last, storage_options)
        self.storage_options = storage_options
        self.chunk_size = chunk_size
        self.seed = seed
        self.async_save = async_save
        self.rank, self.world_size = rank_and_world()
        self._group: Any = None
        self._staging: dict[str, dict[str, Any]] | None = None
        self._pending: Future[Manifest] | None = None
        self._staged = threading.Event()
        self._thread: threading.Thread | None = None
        self._staged.set()
        if async_save and is_distributed():
            import torch.distributed as dist

            # checkpoint collectives run in a background thread: keep them off the training group
            self._group = dist.new_group(backend="gloo")
        optimizer = getattr(engine, "optimizer", None)
        if async_save and optimizer is not None and hasattr(optimizer, "register_step_pre_hook"):
            # the staging copy runs in the background: the next update waits until it is done
            optimizer.register_step_pre_hook(self._before_step)

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

    def _staging_buffers(self) -> dict[str, dict[str, Any]]:
        import torch

        if self._staging is None:
            pin = torch.cuda.is_available()
            self._staging = {
                g: {k: (torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin))
                    for k, t in kinds.items()}
                for g, kinds in self.engine.local_shards().items()}
        return self._staging

    def save(self, step: int, extras: Mapping[str, Any] | None = None) -> None:
        """Save ``step`` on every rank: synchronously, or async (see the module docstring)."""
        self.wait()  # at most one in flight; raises the previous save's error here
        url = self.manager.url_for(step)
        ext = {**dict(extras or {}), "step": step, "seed": self.seed, "app": self._app_json()}
        staging = self._staging_buffers() if self.async_save else None
        job = begin_save(self.engine, url, ext, self.storage_options, self.chunk_size,
                         self._group, rank_state=rng_state(), staging=staging)
        if not self.async_save:
            self._finish(job, step)
            return
        fut: Future[Manifest] = Future()
        self._staged.clear()

        def run() -> None:
            try:
                job.stage()
            finally:
                self._staged.set()
            try:
                fut.set_result(self._finish(job, step))
            except BaseException as e:  # noqa: BLE001 - surfaced by wait()
                fut.set_exception(e)

        thread = threading.Thread(target=run, name=f"shardckpt-save-{step}", daemon=True)
        thread.start()
        self._pending, self._thread = fut, thread

    def _before_step(self, *_: Any) -> None:
        self._staged.wait()

    def wait_staged(self) -> None:
        """Block until the save in flight has copied the shards aside (then they may change)."""
        self._staged.wait()

    def _finish(self, job: SaveJob, step: int) -> Manifest:
        m = job.run()
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
            if self._group is not None:
                import torch.distributed as dist

                if dist.is_initialized():
                    dist.destroy_process_group(self._group)
                self._group = None

    # ---------------------------------------------------------------------------- resume

    def resume(self, full_verify: bool = False, strict: bool = True) -> int:
        """Load the newest committed checkpoint that checks out; return its step (0 if none).

        Rank 0 chooses (skipping uncommitted or damaged directories) and tells the others.
        """
        from shardckpt.collective import broadcast_bytes

        choice = b""
        if self.rank == 0:
            found = self.manager.resume_point(full_verify)
            choice = f"{found.step}".encode() if found is not None else b"-"
        choice = broadcast_bytes(choice if self.rank == 0 else None, 0) if is_distributed() else choice
        if choice == b"-":
            return 0
        step = int(choice.decode())
        self.load(self.manager.url_for(step), strict=strict)
        return step

    def load(self, url: str, strict: bool = True, weights_only: bool = False) -> LoadResult:
        self.wait()  # a save in flight reads the state a load would overwrite
        res = load(self.engine, url, strict=strict, weights_only=weights_only,
                   storage_options=self.storage_options)
        extras = res.manifest.extras
        for name, obj in self.app_state.items():
            state = extras.get("app", {}).get(name)
            if state is None:
                if strict:
                    raise ShardckptError(f"{url}: no application state {name!r} in the checkpoint")
                continue
            obj.load_state_dict(state)
        per_rank = res.manifest.per_rank_state
        same_world = (per_rank.get("world_size") == self.world_size
                      and not per_rank.get("dropped_from_world_size"))
        state = read_rank_state(CheckpointReader(url, self.storage_options), self.rank) if same_world else None
        if state is not None:
            set_rng_state(state)
        else:
            import torch

            seed = int(extras.get("seed", self.seed)) + self.rank
            torch.manual_seed(seed)
            log.info("per-rank state not restorable (world %s -> %s); RNG re-seeded with %d",
                     per_rank.get("world_size"), self.world_size, seed)
        return res
