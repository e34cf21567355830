"""What a training run's checkpoints hold and restore, apart from where they go: the engine's
shards, the application state (``state_dict`` / ``load_state_dict``, JSON in the manifest), the
per-rank RNG states, the seed. The :class:`~shardckpt.training.checkpointer.Checkpointer` builds
one :class:`RunState` and hands it to its tiers: they begin saves and load through it, and never
call back up into the Checkpointer.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any
from collections.abc import Mapping, Sequence

from shardckpt.checkpoint.collective import agree
from shardckpt.checkpoint.set_aside import raise_damaged_role
from shardckpt.checkpoint.tiers import Transfer
from shardckpt.checkpoint.trust import SigningKey, Trust
from shardckpt.errors import ConfigError, IntegrityError, ShardckptError
from shardckpt.format.manifest import Manifest
from shardckpt.format.records import per_rank_state, run_extras
from shardckpt.training.direct_load import load_direct
from shardckpt.training.save_load import LoadResult, SaveJob, Sharded, begin_save, load, read_rank_state

log = logging.getLogger(__name__)


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


@dataclass
class RunState:
    """One rank's state of the run, and how a checkpoint of it begins and loads."""

    engine: Sharded
    app_state: dict[str, Any]
    seed: int
    rank: int
    world_size: int
    storage_options: Mapping[str, Any] | None
    chunk_size: int | None
    signing_key: SigningKey | None

    @property
    def needs_optimizer(self) -> bool:
        """Whether a resume needs optimizer state (the engine has an optimizer)."""
        return getattr(self.engine, "optimizer", None) is not None

    def app_json(self) -> dict[str, Any]:
        out = {}
        for name, obj in self.app_state.items():
            state = obj.state_dict()
            try:
                json.dumps(state, allow_nan=False)
            except (TypeError, ValueError) as e:
                raise ConfigError(f"app_state[{name!r}].state_dict() is not JSON-serializable: {e}") from e
            out[name] = state
        return out

    def begin(self, url: str, ext: Mapping[str, Any], storage_options: Mapping[str, Any] | None,
              group: Any, **kwargs: Any) -> SaveJob:
        """:func:`begin_save` of the engine at ``url``, with this rank's RNG state."""
        return begin_save(self.engine, url, ext, storage_options, self.chunk_size, group,
                          rank_state=rng_state(), signing_key=self.signing_key, **kwargs)

    def load(self, url: str, strict: bool = True, weights_only: bool = False,
             storage_options: Mapping[str, Any] | None = None, trust: Trust | None = None, *,
             direct: bool = False, peers: Sequence[Transfer] = (), flag_key: str | None = None,
             manifest: Manifest | None = None) -> LoadResult:
        """Load ``url`` (model, optimizer, application and per-rank state) on every rank, with
        ``storage_options`` (default: the run's; ``{}`` for a node-local directory). ``direct``:
        ``url`` is a directory on this machine; read its shards straight into the engine's, and
        take the shard files ``peers`` names from other ranks' directories on the way
        (:mod:`shardckpt.training.direct_load`; ``flag_key`` names that load's loss flag;
        ``manifest``: the one the ranks agreed on, not read again; ``trust``: public keys that
        must have signed it, as :func:`load`'s, never ``direct``)."""
        options = self.storage_options if storage_options is None else storage_options
        held: list[dict[str, Any] | None] = []  # this rank's per-rank state, once read

        def rank_state(reader: Any, m: Manifest) -> dict[str, Any] | None:
            if not per_rank_state(m, url).restorable_on(self.world_size):
                return None
            try:
                return read_rank_state(reader, self.rank)
            except IntegrityError as e:
                if not direct:
                    raise
                raise_damaged_role(reader.files, m, "rank", self.rank, e)

        if direct and not weights_only and trust is None:
            # every rank reads its own per-rank file inside the load's agreement
            res = load_direct(self.engine, url, strict=strict, peers=peers, flag_key=flag_key,
                              manifest=manifest,
                              then=lambda reader: held.append(rank_state(reader, reader.manifest)))
        else:
            res = load(self.engine, url, strict=strict, weights_only=weights_only,
                       storage_options=options, trust=trust)
        extras = run_extras(res.manifest, url)
        app = extras.app or {}
        absent = [name for name in self.app_state if name not in app]
        if absent and strict:
            raise ShardckptError(f"{url}: no application state {absent} in the checkpoint; "
                                 "load with strict=False to keep the current state of those")
        if not held:
            reader = res.reader
            assert reader is not None  # the load's reader, flat groups and chunks alike
            # every rank reads its own file: agree, so that a damaged one fails all ranks alike
            # (in a tuple: not sent to the peers)
            got, _ = agree(lambda: (rank_state(reader, res.manifest),),
                           f"load of per-rank state from {url}")
            held.append(got[0] if got else None)
        state = held[0]
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
                         "%d + rank", per_rank_state(res.manifest, url).world_size,
                         self.world_size, seed)
        return res
