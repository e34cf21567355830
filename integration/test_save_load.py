"""Save from a running ZeRO-3 job, load on other world sizes, meshes and unit policies.

One job saves a 4-rank checkpoint of the small Llama after 3 AdamW steps; jobs of 1, 2, 3 and 4
ranks, a 2 x 2 HSDP mesh and another unit policy load it into freshly (differently) initialized
engines and compare every local shard with the checkpoint's tensors reassembled independently;
the 2-rank job trains 5 more steps and compares with plain PyTorch started from the same state.
Reads go through a counting fsspec filesystem.

One launch per world size, shared by every test here (module-scoped) and with
``integration/test_offload_runtime.py`` (:mod:`testing.save_runs`): the 4-rank job runs first,
saves, then loads on 4 ranks and on the 2 x 2 mesh, then saves from a 2 x 2 mesh of its own; the
3-rank job loads with either unit policy; the 2- and 1-rank jobs load. Each scenario reports on
its own (a scenario that raises reports its traceback; the job goes on).
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from testing.engines import llama_batches, llama_engine, train_llama
from testing.fsspec_probes import CountingFS, RecordingFS, register
from testing.models import LLAMA
from testing.ranks import selected_modules
from testing.reference import compare_shards, optimizer_tensors, reference_train
from testing import save_runs

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
SAVED_STEPS = 3
MORE_STEPS = 5
CHUNK = 4096


def global_tensor(reader, fqn: str, kind: str) -> torch.Tensor:
    """A parameter's state reassembled from the checkpoint's shards by plain arithmetic."""
    layout = reader.manifest.components["model"].layout
    p = layout.param(fqn)
    dtype = dict(reader.manifest.components["model"].states[p.group])[kind]
    flat = np.concatenate([np.frombuffer(bytes(reader.read_state(s, p.group, kind)), dtype)
                           for s in range(layout.shard_degree)])
    return torch.from_numpy(flat[p.offset:p.offset + p.numel].copy()).reshape(p.shape)


# ----------------------------------------------------------------------------------- jobs


def job_save(rank: int, world: int, root: str) -> dict:
    from shardckpt.runtime import init_distributed
    from shardckpt.training.save_load import save

    pm = init_distributed(timeout_s=60)
    cfg, engine, opt = llama_engine(pm, seed=0)
    train_llama(engine, opt, llama_batches(cfg, pm.rank, world), range(SAVED_STEPS))
    m = save(engine, f"{root}/ck4", extras={"step": SAVED_STEPS}, chunk_size=CHUNK)
    return {"save_id": m.save_id}


def job_load(rank: int, world: int, root: str, replicate: int, policy: str, more: bool) -> dict:
    from shardckpt.checkpoint.reader import CheckpointReader
    from shardckpt.runtime import init_distributed
    from shardckpt.training.save_load import load, save

    register()
    pm = init_distributed(timeout_s=60, replicate=replicate)
    cfg, engine, opt = llama_engine(pm, seed=123, policy=policy)
    before = CountingFS.bytes_read
    # the reshard into another unit policy goes through a ring of one chunk-sized buffer, three
    # readers: every span of the four source files straddles buffers (the pipelined load)
    ring = {"SHARDCKPT_IO_BUFFERS": "1", "SHARDCKPT_IO_BUFFER_SIZE": str(CHUNK),
            "SHARDCKPT_IO_THREADS": "3"} if policy == "mlp_attn" else {}
    os.environ.update(ring)
    try:
        res = load(engine, f"countfile://{root}/ck4")
    finally:
        for key in ring:
            del os.environ[key]
    read = CountingFS.bytes_read - before
    reader = CheckpointReader(f"{root}/ck4")
    problems = []
    fqns = [p.fqn for p in engine.layout.params]
    for kind in ("master", "exp_avg", "exp_avg_sq"):
        problems += compare_shards(engine, {f: global_tensor(reader, f, kind) for f in fqns}, kind)
    steps = [g["step"] for g in opt.optimizer_metadata()["param_groups"]]
    if steps != [SAVED_STEPS, SAVED_STEPS]:
        problems.append(f"optimizer steps {steps}, expected {SAVED_STEPS}")
    if not torch.equal(engine.buffers()["calibration"], torch.arange(5, dtype=torch.float32)):
        problems.append(f"buffer not restored: {engine.buffers()['calibration']}")
    if res.missing or res.unexpected or res.mismatched:
        problems.append(f"unexpected lists {res.missing} {res.unexpected} {res.mismatched}")
    out = {"problems": problems, "bytes_read": read, "shard": pm.shard_rank}
    if more:
        data = llama_batches(cfg, pm.rank, world)
        train_llama(engine, opt, data, range(SAVED_STEPS, SAVED_STEPS + MORE_STEPS))
        out["problems"] += continue_reference(engine, reader, cfg, world)
        save(engine, f"{root}/final")
        tokens = data.batch(99)
        with torch.no_grad():
            logits = engine(tokens)
        if rank == 0:
            from safetensors.torch import save_file
            save_file({"tokens": tokens, "logits": logits.contiguous()}, f"{root}/logits.safetensors")
    return out


def continue_reference(engine, reader, cfg, world: int) -> list[str]:
    """Plain PyTorch from the checkpoint's state, MORE_STEPS steps, compared bit for bit."""
    from shardckpt.runtime.models.llama import LlamaForCausalLM, causal_lm_loss

    ref = LlamaForCausalLM(cfg)
    named = dict(ref.named_parameters())
    with torch.no_grad():
        for fqn, p in named.items():
            p.copy_(global_tensor(reader, fqn, "master"))
    names = {id(p): n for n, p in named.items()}

    def make_opt(groups):
        o = torch.optim.AdamW(groups, lr=3e-3, betas=(0.9, 0.95), foreach=False)
        for g in o.param_groups:
            for p in g["params"]:
                n = names[id(p)]
                o.state[p] = {"step": torch.tensor(float(SAVED_STEPS)),
                              "exp_avg": global_tensor(reader, n, "exp_avg"),
                              "exp_avg_sq": global_tensor(reader, n, "exp_avg_sq")}
        return o

    data = [llama_batches(cfg, r, world) for r in range(world)]
    ropt = reference_train(ref, make_opt, lambda step, r: data[r].batch(step + SAVED_STEPS),
                           causal_lm_loss, world, MORE_STEPS, 0.1)
    problems = compare_shards(engine, named)
    for kind in ("exp_avg", "exp_avg_sq"):
        problems += compare_shards(engine, optimizer_tensors(ropt, names, kind), kind)
    return [f"after {MORE_STEPS} more steps: {p}" for p in problems]


# ---------------------------------------------------------------------------------- tests


#: a load's test id -> (world, replicate, unit policy, train MORE_STEPS more steps)
LOADS = {"w1": (1, 1, "layers", False), "w2+5steps": (2, 1, "layers", True),
         "w3": (3, 1, "layers", False), "w4": (4, 1, "layers", False),
         "hsdp2x2": (4, 2, "layers", False), "w3-other-policy": (3, 1, "mlp_attn", False)}


def _scenario(fn, *args) -> dict:
    """``fn(*args)``, or the traceback it raised (the job goes on with its next scenario)."""
    import traceback

    try:
        return fn(*args)
    except Exception:  # noqa: BLE001 - reported to the test of this scenario
        return {"error": traceback.format_exc()}


def names_for(world: int) -> list[str]:
    """The scenarios of the job of ``world`` ranks, in the order they run."""
    loads = [name for name, (w, *_) in LOADS.items() if w == world]
    return ["save", *loads, "hsdp_save"] if world == 4 else loads


def run(rank: int, world: int, root: str, names: list[str]) -> dict:
    """This module's part of the job of each world size: its scenarios one after another in
    one process group (on 4 ranks the save, then the loads, then the save from a 2 x 2 mesh)."""
    import torch.distributed as dist

    out = {}
    for name in names:
        if name == "save":
            out[name] = _scenario(job_save, rank, world, root)
        elif name == "hsdp_save":
            out[name] = _scenario(job_save_hsdp, rank, world, root)
        else:
            _, replicate, policy, more = LOADS[name]
            out[name] = _scenario(job_load, rank, world, root, replicate, policy, more)
        dist.barrier()
    return out


save_runs.register(__name__, "run", names_for)


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory) -> tuple[str, dict[str, list[dict]]]:
    """The checkpoints' root, and each scenario's per-rank reports."""
    reports: dict[str, list[dict]] = {}
    for world in (4, 3, 2, 1):
        reports.update(save_runs.world_reports(__name__, world, tmp_path_factory,
                                               selected_modules(request.session)))
    return save_runs.session_root(tmp_path_factory), reports


def reported(runs, name: str) -> list[dict]:
    """The per-rank reports of scenario ``name``; fails with any rank's traceback."""
    out = runs[1][name]
    errors = [o["error"] for o in out if "error" in o]
    assert not errors, errors[0]
    return out


@pytest.fixture(scope="module")
def saved(runs) -> str:
    reported(runs, "save")
    return runs[0]


def test_saved_checkpoint_passes_offline_tools(saved):
    from shardckpt.checkpoint.reader import CheckpointReader
    from shardckpt.checkpoint.verify import verify
    from shardckpt.tools.diff import diff
    from shardckpt.tools.reshard import reshard

    result = verify(f"{saved}/ck4")
    assert result, result.problems
    m = CheckpointReader(f"{saved}/ck4").manifest
    assert m.mesh.world_size == 4 and m.optimizer.name == "adamw"
    assert [g["step"] for g in m.optimizer.param_groups] == [SAVED_STEPS] * 2
    assert m.components["model"].aliases == {"lm_head.weight": "model.embed_tokens.weight"}
    reshard(f"{saved}/ck4", f"{saved}/ck3", to=3)
    assert diff(f"{saved}/ck4", f"{saved}/ck3").equal


@pytest.mark.parametrize("name", list(LOADS))
def test_load_anywhere(runs, saved, name):
    world, replicate, policy, more = LOADS[name]
    out = reported(runs, name)
    assert len(out) == world
    problems = [p for o in out for p in o["problems"]]
    assert not problems, problems
    size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(f"{saved}/ck4") for f in fs
               if f.startswith("shard-"))
    total = sum(o["bytes_read"] for o in out)
    # each replica reads the shards it needs: about one checkpoint per replica, never more
    # than the chunk-aligned slack around each range
    assert total <= replicate * size * 1.1 + world * 64 * CHUNK, (total, size)
    if replicate == 1 and world > 1:
        assert max(o["bytes_read"] for o in out) < 0.8 * size  # no rank reads everything
    if more:
        check_hf_round_trip(saved)


def check_hf_round_trip(root: str) -> None:
    """consolidate + config.json load in transformers; logits equal the sharded model's."""
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import load_file

    from shardckpt.tools.consolidate import consolidate
    from shardckpt.runtime.models.llama_config import LlamaConfig

    out = f"{root}/hf"
    consolidate(f"{root}/final", out, dtype="float32")
    with open(f"{out}/config.json", "w") as f:
        json.dump(LlamaConfig(**LLAMA).to_hf_config(), f)
    os.environ["HF_HUB_OFFLINE"] = "1"
    model = transformers.LlamaForCausalLM.from_pretrained(out, torch_dtype=torch.float32)
    saved = load_file(f"{root}/logits.safetensors")
    with torch.no_grad():
        logits = model(saved["tokens"]).logits
    assert torch.equal(logits, saved["logits"])


def job_save_hsdp(rank: int, world: int, root: str) -> dict:
    from shardckpt.runtime import init_distributed
    from shardckpt.training.save_load import save

    register()
    pm = init_distributed(timeout_s=60, replicate=2)
    cfg, engine, opt = llama_engine(pm, seed=0)
    train_llama(engine, opt, llama_batches(cfg, pm.rank, world), range(2))
    save(engine, f"recordfile://{root}/hsdp")
    return {"written": [os.path.basename(p) for p in RecordingFS.written],
            "shard": pm.shard_rank, "replica": pm.replicate_rank}


def test_save_from_hsdp_writes_each_shard_once_spread_over_replicas(runs):
    from shardckpt.checkpoint.reader import CheckpointReader
    from shardckpt.checkpoint.verify import verify

    out = reported(runs, "hsdp_save")
    root = runs[0]
    m = CheckpointReader(f"{root}/hsdp").manifest
    assert dict(m.mesh.axes) == {"dp_replicate": 2, "dp_shard": 2}
    shards = [f for f in m.files if f.role == "shard"]
    assert sorted(f.index for f in shards) == [0, 1]
    result = verify(f"{root}/hsdp")
    assert result, result.problems
    # what each rank actually opened for writing: every shard once, spread over both replicas
    by_file: dict[str, list[tuple[int, int]]] = {}
    for rank, o in enumerate(out):
        for name in o["written"]:
            if not name.startswith("manifest.json"):
                by_file.setdefault(name, []).append((rank, o["replica"]))
    shard_writers = {n: w for n, w in by_file.items() if n.startswith("shard-")}
    assert sorted(shard_writers) == ["shard-00000-of-00002.safetensors", "shard-00001-of-00002.safetensors"]
    assert all(len(w) == 1 for w in shard_writers.values()), shard_writers
    assert {w[0][1] for w in shard_writers.values()} == {0, 1}, shard_writers
    assert [r for r, _ in by_file.get("buffers.safetensors", [])] == [0]
