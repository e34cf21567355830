"""The launches behind ``integration/test_dcp_fsdp2.py`` and ``integration/test_dcp_interop.py``,
shared by both modules: one launch per stage, each running several scenarios' rank functions one
after another in the same process group and writing each one's per-rank result as it finishes.

The scenarios and what the tests assert are those of one launch each before; only the launches
are fewer (5 for both modules instead of 19), since a launch's cost is mostly the ranks' start
(spawn, ``import torch``, the rendezvous), not the tiny models' work. Stages, in order of need:

* ``2a`` (2 ranks): FSDP2 trains and saves (``dcp/ck``, ``dcp/ck-async``), loads ``ck`` again at
  2 ranks and saves it (``again-2``), loads ``ck-async``; the plain DcpCheckpointer loop saves
  steps 1-3. FSDP2 saves with stock DCP (``interop/stock``); the Llama runs save (``llama``,
  ``frozen``, ``zero``). Then, in the test process: the loop's committed steps are noted and step 3
  damaged; ``stock`` is imported and exported back, ``llama`` imported for 3 ranks, ``zero``
  exported.
* ``3`` (3 ranks, after ``2a``): FSDP2 loads ``ck`` (and saves ``again-3``), the imported stock
  checkpoint and its export; ZeroEngine loads the 2-rank FSDP2 Llama; FSDP2 loads ``zero``. Then
  the 3-rank FSDP2 save and ``frozen`` are imported for 2 ranks.
* ``2b`` (2 ranks, after ``3``): stock ``dcp.load`` of the export; the 3 -> 2 directions and
  frozen parameters; the checkpointer loop resumes past the damaged step; last, rank 1 is
  SIGKILLed in the middle of a save (nothing after it in this launch).
* ``4`` (4 ranks, after ``2a``): the HSDP (2, 2) load of ``ck``; HSDP <-> ZeroEngine replicate 2.
* ``1`` (1 rank, after ``2a``): FSDP2 loads ``ck``; stock ``dcp.load`` of the export.

A stage runs when a test first asks for one of its parts (so no test waits for more than the
launches it needs, and a stage that fails fails the tests that read it), with only the parts of
the modules selected in the session; its result is kept for the session. ::

    @pytest.fixture(scope="module")
    def runs(request, tmp_path_factory) -> Runs:
        return shared_runs(request, tmp_path_factory)

    out = runs["load-3"]          # that part's value on each rank (runs stage 3 if not yet run)
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Callable
from typing import Any

from testing.dcp_llama import (
    FROZEN, engine_job, engine_save_job, fsdp2_from_flat_job, fsdp2_llama_job, hsdp_job,
    two_ranks_job,
)
from testing.fsdp2_dcp import (
    STEPS, build, compare_with_reference, full_state, kill_job, load_job, save_job, state,
    tp_tensor, train_step,
)
from testing.ranks import DistributedFailure, RankResult, run_ranks, selected_modules

FSDP2, INTEROP = "test_dcp_fsdp2", "test_dcp_interop"
PG_TIMEOUT_S = 30.0
#: The part whose launch ends with a rank SIGKILLed on purpose (always the last part run).
KILL = "kill"


# ------------------------------------------------------------------------- rank functions


def loop_job(rank: int, world: int, run: str, steps: int) -> dict[str, Any]:
    """A plain FSDP2 loop: resume from the newest good checkpoint, train, save every step."""
    from shardckpt.interop.dcp.checkpointer import DcpCheckpointer

    model, opt, _ = build(world, 0)
    ckpt = DcpCheckpointer(run, keep_last=2)
    sd = state(model, opt, world, 0)
    start = ckpt.load_latest(sd)
    if start is not None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    first = 0 if start is None else start
    for s in range(first, first + steps):
        train_step(model, opt, s, rank)
        ckpt.save(s + 1, state(model, opt, world, 0))
    ckpt.close()
    return {"start": start}


def stock_save_job(rank: int, world: int, root: str) -> dict[str, Any]:
    """Train, save with DCP's own FileSystemWriter to ``root/stock``, write the reference."""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file

    model, opt, _ = build(world, 0)
    for s in range(STEPS):
        train_step(model, opt, s, rank)
    dcp.save(state(model, opt, world, 0), checkpoint_id=f"{root}/stock")
    flat, groups = full_state(model, opt)
    full_tp = tp_tensor(world, 0).full_tensor()
    if rank == 0:
        flat["tp.w"] = full_tp
        save_file(flat, f"{root}/reference.safetensors")
        Path(root, "reference.json").write_text(json.dumps(groups))
    return {"next_loss": train_step(model, opt, STEPS, rank)}


def stock_load_job(rank: int, world: int, path: str, ref: str) -> dict[str, Any]:
    """Stock ``dcp.load(checkpoint_id=path)`` into a fresh FSDP2 model; compare; train a step."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    model, opt, _ = build(world, 1)
    train_step(model, opt, 99, rank)
    sd = state(model, opt, world, 1)
    dcp.load(sd, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    return compare_with_reference(model, opt, sd, ref, rank)


def three_ranks_job(rank: int, world: int, root: str) -> dict[str, Any]:
    """The import through ShardckptReader, then the export with stock ``dcp.load``."""
    return {"reader": load_job(rank, world, f"{root}/ck", root),
            "stock": stock_load_job(rank, world, f"{root}/exported", root)}


JOBS: dict[str, Callable[..., Any]] = {f.__name__: f for f in (
    save_job, load_job, kill_job, loop_job, stock_save_job, stock_load_job, three_ranks_job,
    fsdp2_llama_job, engine_job, engine_save_job, fsdp2_from_flat_job, two_ranks_job, hsdp_job)}


def stage_job(rank: int, world: int, records: str, parts: list[tuple[str, str, list]]) -> None:
    """Run each (name, job, args) in order; write its value to ``records/<name>-<rank>.json``
    before the next starts (so what ran before a rank was killed on purpose is kept)."""
    for name, job, args in parts:
        value = JOBS[job](rank, world, *args)
        path = Path(records, f"{name}-{rank}.json")
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(value))
        os.replace(tmp, path)


# ------------------------------------------------------------------- stages (test process)


@dataclass
class Stage:
    world: int
    after: tuple[str, ...]
    parts: list[tuple[str, str, str, tuple]]  # (module, part, job, args)
    host: Callable[[], None] | None = None  # steps in the test process once the launch is done
    timeout_s: float = 300.0


@dataclass
class Runs:
    """The shared launches of one session (see the module docstring)."""

    base: Path
    modules: frozenset[str]
    values: dict[str, list[Any]] = field(default_factory=dict)
    #: Results of the steps run in the test process (manifests, the loop's committed steps).
    host: dict[str, Any] = field(default_factory=dict)
    ranks: dict[str, list[RankResult]] = field(default_factory=dict)
    _state: dict[str, BaseException | None] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("dcp", "loop", "kill", "interop", "llama", "zero", "records"):
            (self.base / name).mkdir(parents=True, exist_ok=True)

    def dir(self, name: str) -> str:
        return str(self.base / name)

    def __getitem__(self, part: str) -> list[Any]:
        """``part``'s value on each rank (its stage run first if it has not been)."""
        self.need(self.stage_of(part))
        return self.values[part]

    def ran(self, part: str) -> None:
        """Make sure ``part`` has run (for a test that reads only the files it wrote)."""
        self.need(self.stage_of(part))

    def kill_ranks(self) -> list[RankResult]:
        """What each rank of the launch ending with the killed save reported."""
        stage = self.stage_of(KILL)
        self.need(stage)
        return self.ranks[stage]

    def stage_of(self, part: str) -> str:
        return next(name for name, s in self.stages().items()
                    if any(p == part for _, p, _, _ in s.parts))

    def need(self, name: str) -> None:
        if name not in self._state:
            stage = self.stages()[name]
            try:
                for dep in stage.after:
                    self.need(dep)
                self._launch(name, stage)
                if stage.host is not None:
                    stage.host()
                self._state[name] = None
            except BaseException as exc:  # noqa: BLE001 - kept, raised again for every reader
                self._state[name] = exc
        if self._state[name] is not None:
            raise self._state[name]

    def _launch(self, name: str, stage: Stage) -> None:
        parts = [(p, job, list(args)) for m, p, job, args in stage.parts if m in self.modules]
        if not parts:
            return
        records = self.base / "records" / name
        records.mkdir()
        results = run_ranks(stage_job, stage.world, args=(str(records), parts),
                            timeout_s=stage.timeout_s, pg_timeout_s=PG_TIMEOUT_S)
        self.ranks[name] = results
        kept = [p for p, _, _ in parts if p != KILL]
        missing = [(p, r) for p in kept for r in range(stage.world)
                   if not (records / f"{p}-{r}.json").exists()]
        if missing or (len(kept) == len(parts) and not all(r.ok for r in results)):
            raise DistributedFailure(results)
        for p in kept:
            self.values[p] = [json.loads((records / f"{p}-{r}.json").read_text())
                              for r in range(stage.world)]

    def stages(self) -> dict[str, Stage]:
        dcp, loop, kill = self.dir("dcp"), f"{self.dir('loop')}/run", self.dir("kill")
        interop, llama, zero = self.dir("interop"), self.dir("llama"), self.dir("zero")
        ck = f"{dcp}/ck"

        def load(world: int, hsdp: bool = False) -> tuple:
            return (ck, dcp, hsdp, None, f"{dcp}/again-{world}{'-hsdp' if hsdp else ''}")

        return {
            "2a": Stage(2, (), [
                (FSDP2, "save", "save_job", (dcp, dcp)),
                (FSDP2, "load-2", "load_job", load(2)),
                (FSDP2, "async", "load_job", (f"{dcp}/ck-async", dcp)),
                (FSDP2, "loop", "loop_job", (loop, 3)),
                (INTEROP, "stock-save", "stock_save_job", (interop,)),
                (INTEROP, "llama", "fsdp2_llama_job", (llama,)),
                (INTEROP, "zero-save", "engine_save_job", (zero,)),
            ], host=self._after_2a),
            "3": Stage(3, ("2a",), [
                (FSDP2, "load-3", "load_job", load(3)),
                (INTEROP, "three", "three_ranks_job", (interop,)),
                (INTEROP, "engine", "engine_job",
                 ([(f"{llama}/flat", "flat"), (f"{llama}/llama-chunked", "chunked")],)),
                (INTEROP, "fsdp2-from-zero", "fsdp2_from_flat_job", (zero,)),
            ], host=self._after_3),
            "2b": Stage(2, ("3",), [
                (INTEROP, "stock-load-2", "stock_load_job", (f"{interop}/exported", interop)),
                (INTEROP, "two", "two_ranks_job", (llama, zero)),
                (FSDP2, "loop-resume", "loop_job", (loop, 1)),
                (FSDP2, KILL, "kill_job", (kill,)),  # last: rank 1 dies, rank 0's save fails
            ]),
            "4": Stage(4, ("2a",), [
                (FSDP2, "load-hsdp", "load_job", load(4, hsdp=True)),
                (INTEROP, "hsdp", "hsdp_job", (zero,)),
            ]),
            "1": Stage(1, ("2a",), [
                (FSDP2, "load-1", "load_job", load(1)),
                (INTEROP, "stock-load-1", "stock_load_job", (f"{interop}/exported", interop)),
            ]),
        }

    def _after_2a(self) -> None:
        if FSDP2 in self.modules:
            from shardckpt.checkpoint.run_dir import CheckpointManager

            run = Path(self.dir("loop"), "run")
            mgr = CheckpointManager(str(run))
            self.host["loop-committed"] = [f.step for f in mgr.committed()]
            self.host["loop-latest"] = mgr.read_latest()
            # damage a byte of step 3's data and leave an uncommitted step 4: resume from step 2
            victim = sorted((run / "step-00000003").rglob("chunks-00000.safetensors"))[0]
            data = bytearray(victim.read_bytes())
            data[-5] ^= 0xFF
            victim.write_bytes(bytes(data))
            (run / "step-00000004" / "x").mkdir(parents=True)
        if INTEROP in self.modules:
            from shardckpt.interop.dcp.export import export_dcp
            from shardckpt.interop.dcp.import_ import import_dcp
            from shardckpt.interop.dcp.to_flat import import_dcp_flat

            interop, llama, zero = self.dir("interop"), self.dir("llama"), self.dir("zero")
            import_dcp(f"{interop}/stock", f"{interop}/ck")
            export_dcp(f"{interop}/ck", f"{interop}/exported")
            self.host["flat"] = import_dcp_flat(f"{llama}/llama", f"{llama}/flat", 3)
            export_dcp(f"{zero}/zero", f"{zero}/zero-exported")

    def _after_3(self) -> None:
        if INTEROP in self.modules:
            from shardckpt.interop.dcp.to_flat import import_dcp_flat

            llama, zero = self.dir("llama"), self.dir("zero")
            import_dcp_flat(f"{zero}/fsdp2-3", f"{zero}/fsdp2-3-flat", 2)
            self.host["frozen-flat"] = import_dcp_flat(f"{llama}/frozen", f"{llama}/frozen-flat",
                                                       2, frozen=[FROZEN])


_RUNS: dict[frozenset[str], Runs] = {}


def shared_runs(request: Any, tmp_path_factory: Any) -> Runs:
    """The session's :class:`Runs` for the DCP modules selected in it (the asking one always)."""
    selected = {m.rsplit(".", 1)[-1] for m in selected_modules(request.session)}
    modules = frozenset(selected & {FSDP2, INTEROP}) | {request.module.__name__.rsplit(".", 1)[-1]}
    if modules not in _RUNS:
        _RUNS[modules] = Runs(tmp_path_factory.mktemp("dcp-runs"), modules)
    return _RUNS[modules]

