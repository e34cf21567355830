"""Start a sharded run from Hugging Face weights on real gloo process groups.

A tiny random ``transformers.LlamaForCausalLM`` (tied and untied; fp32 and bf16 files, sharded
into several files with an index) is saved with ``save_pretrained``. On 3 ranks and on HSDP 2 x 2
every rank builds the built-in Llama on the meta device (``init_fn=skip_weight_init``), loads the
files with ``load_hf`` and:

* the logits equal ``transformers``' bit for bit (fp32 compute; bf16 files widen exactly);
* two deterministic AdamW steps, a save and ``consolidate --dtype fp32`` give the weights of a
  plain single-process PyTorch fine-tune of ``transformers``' model from the same start, bit for
  bit (per-rank micro-batches run in turn, gradients summed in rank order, then divided);
* a recording filesystem (not the loader's own counter) shows that each rank reads its share of
  the tensor bytes plus the index, config and headers, and that the shard ranks together read
  every tensor byte exactly once.

A folder with a missing file, a truncated file, a header whose offsets run past the end, a dtype
the masters cannot take or a mis-shaped tensor gives every rank the same error naming the file and
the tensor; stages 1 and 2 load the same logits; and a checkpoint made
offline by ``import_hf`` on another world size starts a run the same way.

One launch of 4 ranks runs it all: HSDP 2 x 2 in the launcher's group, then ranks 0-2 in a new
group of 3. The ranks never import ``transformers``: the test process computes its logits and
the plain fine-tunes once (one thread, as the ranks run), and the ranks compare against those.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import contextlib  # noqa: E402
import dataclasses  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
from collections.abc import Iterator  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import pytest  # noqa: E402

from testing.ckpt_runs import coordinator, new_world  # noqa: E402
from testing.ranks import run_distributed  # noqa: E402

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.slow

PG_TIMEOUT_S = 300

VARIANTS = {"tied-fp32": (True, "float32"), "untied-bf16": (False, "bfloat16"),
            "tied-bf16": (True, "bfloat16"), "untied-fp32": (False, "float32")}
VOCAB, STEPS = 128, 2
#: The token batches whose logits are compared with transformers': the variants', the stages'
#: and the import's.
LOGITS_AT, STAGES_AT, IMPORT_AT = 99, 3, 5
WORLDS = {"world3": (3, False), "hsdp2x2": (4, True)}
#: Damage -> (what the error must name besides the file).
BROKEN = {"missing": "missing", "truncated": "data_offsets", "offsets": "data_offsets",
          "dtype": "int32", "shape": "[64, 32]"}


def _recording_fs() -> Any:
    """A local filesystem under ``recfile://`` that counts the bytes it hands out."""
    import fsspec
    from fsspec.implementations.local import LocalFileSystem

    class Recording(LocalFileSystem):
        protocol = ("recfile",)
        nbytes = 0

        @classmethod
        def _strip_protocol(cls, path: str) -> str:
            return LocalFileSystem._strip_protocol(path.removeprefix("recfile://"))

        def cat_file(self, path: str, start: int | None = None, end: int | None = None,
                     **kwargs: Any) -> bytes:
            data = super().cat_file(path, start=start, end=end, **kwargs)
            type(self).nbytes += len(data)
            return data

    fsspec.register_implementation("recfile", Recording, clobber=True)
    return Recording


def _transformers() -> Any:
    """transformers, in the test process only (the ranks never import it)."""
    return pytest.importorskip("transformers")


@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
    """One intra-op thread, as the launcher gives every rank (bit-exact comparisons)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def save_tiny(path: Path, tied: bool, dtype: str) -> None:
    transformers = _transformers()
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                                   tie_word_embeddings=tied)
    torch.manual_seed(7)
    model = transformers.LlamaForCausalLM(cfg).to(getattr(torch, dtype))
    model.save_pretrained(path, max_shard_size="24KB")


def tokens(step: int, rank: int) -> Any:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, VOCAB, (2, 10), generator=g)


def _engine(pm: Any, path: str, stage: int = 3) -> Any:
    from shardckpt.runtime import ZeroEngine
    from shardckpt.runtime.init import skip_weight_init
    from shardckpt.runtime.models.llama import LLAMA_POLICY, LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig.from_hf_config(json.loads(Path(path, "config.json").read_text()))
    with torch.device("meta"):  # fp32 compute whatever the file's dtype
        model = LlamaForCausalLM(dataclasses.replace(cfg, torch_dtype="float32"))
    return ZeroEngine(model, policy=LLAMA_POLICY, process_mesh=pm, deterministic=True,
                      init_fn=skip_weight_init, stage=stage)


def _hf_logits(path: str, step: int) -> Any:
    """transformers' own load and forward of ``tokens(step, 0)``, in fp32."""
    hf = _transformers().LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(tokens(step, 0)).logits


def _expected(folder: str) -> dict[str, Any]:
    """The logits of transformers that the ranks compare with, by ``{variant}/{step}``."""
    from safetensors.torch import load_file

    return load_file(f"{folder}/expected-logits.safetensors")


def _stages(pm: Any, folder: str) -> list[str]:
    """Stages 1 and 2 (parameters whole on every rank between steps) load the same weights."""
    from shardckpt.training.hf_load import load_hf

    path, problems = f"{folder}/untied-bf16", []
    hf = _expected(folder)[f"untied-bf16/{STAGES_AT}"]
    for stage in (1, 2):
        engine = _engine(pm, path, stage)
        load_hf(engine, path)
        with torch.no_grad():
            if not torch.equal(engine(tokens(STAGES_AT, 0)), hf):
                problems.append(f"stage {stage}: logits differ from transformers'")
    return problems


def _reference(path: str, world: int) -> Any:
    """Plain PyTorch data parallelism on one process, from transformers' own load."""
    from shardckpt.runtime.models.llama import causal_lm_loss

    ref = _transformers().LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    named = list(ref.named_parameters())
    opt = torch.optim.AdamW([p for _, p in named], lr=1e-2, weight_decay=0.1, foreach=False)
    for step in range(STEPS):
        per_rank = []
        for r in range(world):
            ref.zero_grad(set_to_none=True)
            causal_lm_loss(ref(tokens(step, r)).logits, tokens(step, r)).backward()
            per_rank.append([p.grad.clone() for _, p in named])
        for i, (_, p) in enumerate(named):
            total = per_rank[0][i].clone()
            for r in range(1, world):
                total += per_rank[r][i]
            p.grad = total / world
        opt.step()
    return {n: p.detach() for n, p in named}


def _variant(pm: Any, folder: str, name: str, out: str) -> dict[str, Any]:
    from shardckpt.tools.consolidate import consolidate
    from shardckpt.runtime import ShardedAdamW
    from shardckpt.training.hf_load import load_hf
    from shardckpt.runtime.models.llama import causal_lm_loss
    from shardckpt.training.save_load import save

    path, problems = f"{folder}/{name}", []
    engine = _engine(pm, path)
    rec = _recording_fs()
    rec.nbytes = 0
    result = load_hf(engine, f"recfile://{path}", buffer_bytes=4096)
    nbytes = rec.nbytes
    if result.missing or result.unexpected:
        problems.append(f"missing {result.missing}, unexpected {result.unexpected}")
    with torch.no_grad():
        if not torch.equal(engine(tokens(LOGITS_AT, 0)), _expected(folder)[f"{name}/{LOGITS_AT}"]):
            problems.append("logits differ from transformers'")
    opt = ShardedAdamW(engine, lr=1e-2, weight_decay=0.1)
    for step in range(STEPS):
        causal_lm_loss(engine(tokens(step, pm.rank)), tokens(step, pm.rank)).backward()
        opt.step()
        opt.zero_grad()
    url = f"{out}/{name}-{pm.mesh.describe().replace(' ', '')}"
    save(engine, url)
    if pm.rank == 0:  # the test compares it with the plain PyTorch fine-tune
        consolidate(url, f"{url}-hf", dtype="fp32")
    return {"problems": problems, "bytes": nbytes, "shard": pm.shard_rank,
            "replica": pm.mesh.replicate_rank(pm.rank), "consolidated": f"{url}-hf"}


def _broken(pm: Any, folder: str) -> dict[str, str]:
    from shardckpt.training.hf_load import load_hf

    engine = _engine(pm, f"{folder}/tied-fp32")
    out = {}
    for kind in BROKEN:
        try:
            load_hf(engine, f"{folder}/broken-{kind}")
            out[kind] = "no error"
        except Exception as e:  # noqa: BLE001 - reported to the parent
            out[kind] = f"{type(e).__name__}: {e}"
    return out


def _from_import(pm: Any, folder: str, imported: str) -> list[str]:
    """A run starts from an offline import made for another world size, fresh optimizer."""
    from shardckpt.runtime import ShardedAdamW
    from shardckpt.runtime.models.llama import causal_lm_loss
    from shardckpt.training.save_load import load

    engine = _engine(pm, f"{folder}/untied-bf16")
    load(engine, imported)
    problems = []
    with torch.no_grad():
        if not torch.equal(engine(tokens(IMPORT_AT, 0)), _expected(folder)[f"untied-bf16/{IMPORT_AT}"]):
            problems.append("logits after load of the import differ from transformers'")
    opt = ShardedAdamW(engine, lr=1e-2)
    causal_lm_loss(engine(tokens(0, pm.rank)), tokens(0, pm.rank)).backward()
    opt.step()
    if [g["step"] for g in opt.optimizer_metadata()["param_groups"]] != [1]:
        problems.append("the optimizer did not start fresh")
    return problems


def _report(pm: Any, folder: str, out: str, imported: str) -> dict[str, Any]:
    report: dict[str, Any] = {name: _variant(pm, folder, name, out) for name in VARIANTS}
    report["broken"] = _broken(pm, folder)
    report["import"] = _from_import(pm, folder, imported)
    report["stages"] = _stages(pm, folder)
    return report


def _job(rank: int, world: int, folder: str, out: str, imported: str) -> dict[str, Any]:
    """HSDP 2 x 2 on the launcher's 4 ranks, then ranks 0-2 in a new group of 3."""
    import torch.distributed as dist

    from shardckpt.format.layout import Mesh
    from shardckpt.runtime.mesh import ProcessMesh

    store = coordinator()
    reports = {"hsdp2x2": _report(ProcessMesh.from_process_group(Mesh.hsdp(2, world // 2)),
                                  folder, out, imported)}
    if new_world(store, "world3", 3, rank):
        dist.init_process_group("gloo", init_method="env://",
                                timeout=datetime.timedelta(seconds=PG_TIMEOUT_S))
        reports["world3"] = _report(ProcessMesh.from_process_group(Mesh.for_world(3)), folder,
                                    out, imported)
    return reports


@pytest.fixture(scope="module")
def hf_folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from shardckpt.interop.hf.import_ import import_hf

    root = tmp_path_factory.mktemp("hf")
    for name, (tied, dtype) in VARIANTS.items():
        save_tiny(root / name, tied, dtype)
    index = json.loads((root / "tied-fp32" / "model.safetensors.index.json").read_text())
    victim = index["weight_map"]["model.norm.weight"]
    for kind in BROKEN:
        shutil.copytree(root / "tied-fp32", root / f"broken-{kind}")
        damage(root / f"broken-{kind}" / victim, kind)
    import_hf(str(root / "untied-bf16"), str(root / "imported"), ranks=3)
    from safetensors.torch import save_file

    with _one_thread():
        expected = {f"{name}/{LOGITS_AT}": _hf_logits(str(root / name), LOGITS_AT)
                    for name in VARIANTS}
        for step in (STAGES_AT, IMPORT_AT):
            expected[f"untied-bf16/{step}"] = _hf_logits(str(root / "untied-bf16"), step)
    save_file(expected, str(root / "expected-logits.safetensors"))
    return {"root": str(root), "victim": victim}


@pytest.fixture(scope="module")
def run(hf_folders: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = hf_folders["root"]
    out = str(tmp_path_factory.mktemp("hf-runs"))
    values = run_distributed(_job, 4, args=(root, out, f"{root}/imported"), timeout_s=600,
                             pg_timeout_s=PG_TIMEOUT_S)
    return {name: [v[name] for v in values if name in v] for name in WORLDS}


def damage(f: Path, kind: str) -> None:
    """Break the file holding ``model.norm.weight`` in one way."""
    import struct

    from safetensors.torch import load_file, save_file

    raw = f.read_bytes()
    if kind == "missing":
        f.unlink()
    elif kind == "truncated":
        f.write_bytes(raw[:-8])
    elif kind == "offsets":
        (n,) = struct.unpack("<Q", raw[:8])
        header = json.loads(raw[8:8 + n])
        a, _ = header["model.norm.weight"]["data_offsets"]
        header["model.norm.weight"]["data_offsets"] = [a, a + 4 * 10**6]
        header["model.norm.weight"]["shape"] = [10**6]
        text = json.dumps(header).encode()
        f.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n:])
    else:
        sd = load_file(str(f))
        w = sd["model.norm.weight"]
        sd["model.norm.weight"] = w.to(torch.int32) if kind == "dtype" else torch.ones(64, 32)
        save_file(sd, str(f), metadata={"format": "pt"})


def _data_bytes(folder: Path) -> tuple[int, int]:
    """(tensor bytes, everything else a loader must read: index, config, headers)."""
    import struct

    tensors, meta = 0, 0
    for f in folder.glob("*.safetensors"):
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
        tensors += f.stat().st_size - 8 - n
        meta += 8 + n
    for name in ("model.safetensors.index.json", "config.json"):
        meta += (folder / name).stat().st_size
    return tensors, meta


@pytest.mark.parametrize("mesh", list(WORLDS))
def test_start_from_hf_weights(hf_folders: dict[str, Any], run: dict[str, Any],
                               mesh: str) -> None:
    from safetensors.torch import load_file

    root = Path(hf_folders["root"])
    world, hsdp = WORLDS[mesh]
    reports = run[mesh]
    assert len(reports) == world
    shards = world // 2 if hsdp else world
    for name in VARIANTS:
        per_rank = [r[name] for r in reports]
        assert all(not r["problems"] for r in per_rank), {name: [r["problems"] for r in per_rank]}
        got = {}
        for f in Path(per_rank[0]["consolidated"]).glob("*.safetensors"):
            got.update(load_file(str(f)))
        with _one_thread():
            ref = _reference(str(root / name), world)
        assert got, per_rank[0]["consolidated"]
        differ = [n for n, p in ref.items() if n not in got or not torch.equal(got[n], p)]
        assert not differ, f"{name}: {differ} differ from the plain PyTorch fine-tune"
        tensor_bytes, meta = _data_bytes(root / name)
        if name.startswith("tied"):  # transformers saves the tied head once
            assert "lm_head.weight" not in json.loads(
                (root / name / "model.safetensors.index.json").read_text())["weight_map"]
        data = {(r["replica"], r["shard"]): r["bytes"] - meta for r in per_rank}
        for replica in range(world // shards):  # every tensor byte once per replica
            assert sum(data[(replica, s)] for s in range(shards)) == tensor_bytes
        assert max(data.values()) <= tensor_bytes / shards * 1.5, data
    victim = hf_folders["victim"]
    for kind, needle in BROKEN.items():
        errors = [r["broken"][kind] for r in reports]
        assert len(set(errors)) == 1, errors  # the same error on every rank
        assert victim in errors[0] and needle in errors[0], errors[0]
        if kind != "missing":
            assert "model.norm.weight" in errors[0], errors[0]
    assert all(r["import"] == [] for r in reports), [r["import"] for r in reports]
    assert all(r["stages"] == [] for r in reports), [r["stages"] for r in reports]
