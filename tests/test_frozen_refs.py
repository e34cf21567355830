"""Frozen files referenced, not rewritten (format 1.3): a frozen base and a small trainable adapter
saved twice by the Checkpointer. The second checkpoint writes the adapter's bytes alone and names
the first checkpoint's frozen file; it loads bit for bit, verifies, reshards and consolidates;
retention and clean keep what it references; a missing or hostile reference is one clear error;
a frozen parameter that changed is written again."""

from __future__ import annotations

import copy
import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from shardckpt.checkpoint.reader import CheckpointReader
from shardckpt.checkpoint.run_dir import CheckpointManager
from shardckpt.checkpoint.verify import verify
from shardckpt.errors import ManifestError, ShardckptError
from shardckpt.format import manifest_parse
from shardckpt.format.chunked import FEATURE as CHUNKED_FEATURE
from shardckpt.format.integrity import seal
from shardckpt.format.manifest import MANIFEST_NAME
from shardckpt.format.manifest_parse import parse
from shardckpt.runtime import ShardedAdamW, ZeroEngine, decay_param_groups
from shardckpt.runtime.mesh import ProcessMesh
from shardckpt.tools.clean import clean
from shardckpt.tools.consolidate import consolidate
from shardckpt.tools.diff import diff
from shardckpt.tools.reshard import reshard
from shardckpt.training.checkpointer import Checkpointer
from shardckpt.storage import Storage, crc32c
from shardckpt.training.save_load import load
from shardckpt.watch.config import StepSpec
from shardckpt.watch.steps import StepContext, StepFailed, run_copy, run_retain
from testing.fuzz import dumps, expect_clean, mutations

pytestmark = pytest.mark.usefixtures("one_thread")

STEP1, STEP2, STEP3 = "step-00000001", "step-00000002", "step-00000003"
FUZZ_SEED = 20261203


class Tuned(nn.Module):
    """A frozen base (two 64x64 layers, ~97% of the state) and a small trainable adapter."""

    def __init__(self, d: int = 64) -> None:
        super().__init__()
        self.base = nn.Sequential(nn.Linear(d, d), nn.Linear(d, d))
        self.adapter = nn.Linear(d, 4, bias=False)
        self.base.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.adapter(self.base(x))


def build(pm: Any = None, seed: int = 0) -> tuple[ZeroEngine, ShardedAdamW]:
    torch.manual_seed(seed)
    engine = ZeroEngine(Tuned(), process_mesh=pm or ProcessMesh.single())
    return engine, ShardedAdamW(engine, decay_param_groups(engine, 0.0), lr=1e-2)


def train(engine: ZeroEngine, opt: ShardedAdamW, step: int, rank: int = 0) -> None:
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(100 * step + rank))
    engine(x).pow(2).sum().backward()
    opt.step()
    opt.zero_grad()


def snapshot(engine: ZeroEngine) -> dict[str, dict[str, bytes]]:
    return {g: {k: t.numpy().tobytes() for k, t in kinds.items()}
            for g, kinds in engine.local_shards().items()}


def files_under(path: Path) -> dict[str, int]:
    return {str(p.relative_to(path)): p.stat().st_size for p in path.rglob("*") if p.is_file()}


def manifest_doc(ckpt: Path) -> dict[str, Any]:
    return json.loads((ckpt / MANIFEST_NAME).read_text())


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Two async saves of the same frozen base (the adapter trained in between), keep_last=1."""
    root = tmp_path_factory.mktemp("frozen") / "run"
    engine, opt = build()
    ckpt = Checkpointer(str(root), engine, keep_last=1, async_save=True)
    train(engine, opt, 1)
    ckpt.save(1)
    train(engine, opt, 2)
    ckpt.save(2)
    ckpt.close()
    trained = sum(t.numel() * t.element_size() for g in engine.layout.groups if g.requires_grad
                  for t in engine.local_shards()[g.name].values())
    frozen = sum(t.numel() * t.element_size() for g in engine.layout.groups if not g.requires_grad
                 for t in engine.local_shards()[g.name].values())
    return {"root": root, "live": snapshot(engine), "trained_bytes": trained, "frozen_bytes": frozen,
            "kept": list(ckpt.manager.kept_referenced), "engine": engine}


def test_second_save_writes_only_the_adapter(run: dict[str, Any]) -> None:
    root = run["root"]
    m1 = CheckpointReader(str(root / STEP1)).manifest
    m2 = CheckpointReader(str(root / STEP2)).manifest
    assert m2.version == (1, 3) and m2.frozen
    ref = m2.frozen_file(0)
    assert ref.path == f"../{STEP1}/{m1.frozen_file(0).path}"
    assert (ref.size, ref.crc32c) == (m1.frozen_file(0).size, m1.frozen_file(0).crc32c)
    written = files_under(root / STEP2 / m2.save_id)
    assert not any("frozen" in name for name in written)
    shard, rank = m2.shard_file(0), m2.file(f"{m2.save_id}/rank-00000.safetensors")
    # the save directory holds the shard file (the adapter's master and AdamW state) and the
    # per-rank RNG file, nothing else
    assert sum(written.values()) == shard.size + rank.size
    assert shard.size - shard.data_start == run["trained_bytes"]
    assert run["frozen_bytes"] >= 9 * run["trained_bytes"]


def test_load_of_the_second_is_bit_exact(run: dict[str, Any]) -> None:
    engine, _ = build(seed=1)  # other initial values: all must come from the checkpoint
    assert snapshot(engine) != run["live"]
    res = load(engine, str(run["root"] / STEP2))
    assert snapshot(engine) == run["live"]
    assert res.bytes_read >= run["frozen_bytes"]


def test_verify_reshard_consolidate_diff(run: dict[str, Any], tmp_path: Path) -> None:
    src = str(run["root"] / STEP2)
    result = verify(src)
    assert result.ok, result.problems
    frozen_report = next(r for r in result.reports if r.path.startswith("../"))
    assert frozen_report.ok and frozen_report.size == CheckpointReader(src).manifest.frozen_file(0).size
    out = reshard(src, str(tmp_path / "rs"), 2)
    assert not out.manifest.frozen and not out.manifest.references()  # standalone, every byte
    assert verify(str(tmp_path / "rs")).ok
    assert diff(src, str(tmp_path / "rs")).equal
    cons = consolidate(src, str(tmp_path / "hf"), dtype="float32")
    from safetensors.numpy import load_file

    got = load_file(str(tmp_path / "hf" / cons.files[0][0]))
    engine = run["engine"]
    for fqn in ("base.0.weight", "base.1.bias", "adapter.weight"):
        spec = engine.layout.param(fqn)
        g = engine.layout.group(spec.group)
        master = engine.local_shards()[g.name]["master"][spec.offset:spec.offset + spec.numel]
        assert got[fqn].tobytes() == master.numpy().tobytes(), fqn


def test_exports_follow_the_reference(run: dict[str, Any], tmp_path: Path) -> None:
    """export dcp and export deepspeed read the referenced frozen file like every other reader
    (it lies in a sibling checkpoint of the run, not through a link out of the source)."""
    from shardckpt.interop.dcp.export import export_dcp
    from shardckpt.interop.deepspeed.export import export_deepspeed

    src = str(run["root"] / STEP2)
    export_dcp(src, str(tmp_path / "dcp"))
    export_deepspeed(src, str(tmp_path / "ds"), ranks=1)
    import torch.distributed.checkpoint as dcp

    md = dcp.FileSystemReader(str(tmp_path / "dcp")).read_metadata()
    assert any(k.endswith("base.0.weight") for k in md.state_dict_metadata)
    assert any(p.is_file() for p in (tmp_path / "ds").rglob("*_optim_states.pt"))


def test_retention_kept_the_referenced_checkpoint(run: dict[str, Any]) -> None:
    root = run["root"]
    assert (root / STEP1 / MANIFEST_NAME).exists()  # keep_last=1, yet step 2 needs it
    assert run["kept"] == [str(root / STEP1)]
    manager = CheckpointManager(str(root), keep_last=1)
    assert manager.apply_retention() == [] and manager.kept_referenced == [str(root / STEP1)]


def _watch_step(root: Path, kind: str, **kw: Any) -> StepContext:
    ckpt = root / STEP2
    return StepContext(StepSpec(1, kind, **kw), Storage(str(ckpt)),
                       CheckpointReader(str(ckpt)).manifest, STEP2, 2, Storage(str(root)), {},
                       lambda name: True)


def test_watch_retain_keeps_and_copy_refuses(run: dict[str, Any], tmp_path: Path) -> None:
    root = tmp_path / "run"
    shutil.copytree(run["root"], root)
    assert run_retain(_watch_step(root, "retain", keep=1)) == \
        {"removed": [], "bytes": 0, "referenced": [STEP1]}
    assert (root / STEP1 / MANIFEST_NAME).exists()
    with pytest.raises(StepFailed, match="references frozen files"):
        run_copy(_watch_step(root, "copy", dst=str(tmp_path / "copy")))
    assert not (tmp_path / "copy").exists() and not (tmp_path / STEP1).exists()


def test_clean_keeps_a_referenced_save_directory(run: dict[str, Any], tmp_path: Path) -> None:
    root = tmp_path / "run"
    shutil.copytree(run["root"], root)
    sid = CheckpointReader(str(root / STEP1)).manifest.save_id
    (root / STEP1 / MANIFEST_NAME).unlink()  # its own manifest gone: only the reference keeps it
    from testing.cli import cli, ok

    shown = json.loads(ok(cli("clean", str(root), "--min-age", "0", "--dry-run", "--json")).stdout)
    assert shown["kept_referenced"] == [f"{STEP1}/{sid}"] and shown["debris"] == []
    assert "a committed checkpoint references its frozen files" in ok(
        cli("clean", str(root), "--min-age", "0", "--dry-run")).stdout
    report = clean(str(root), min_age_s=0)
    assert report.kept_referenced == [f"{STEP1}/{sid}"] and report.debris == []
    assert verify(str(root / STEP2)).ok


def test_replacing_a_referenced_checkpoint_keeps_its_frozen_files(run: dict[str, Any],
                                                                   tmp_path: Path) -> None:
    root = tmp_path / "run"
    shutil.copytree(run["root"], root)
    old = CheckpointReader(str(root / STEP1)).manifest.save_id
    reshard(str(root / STEP2), str(root / STEP1), 1, overwrite=True)  # step 1 replaced in place
    assert CheckpointReader(str(root / STEP1)).manifest.save_id != old
    assert (root / STEP1 / old).is_dir()  # step 2 still references it
    assert verify(str(root / STEP2)).ok


def test_removed_referenced_checkpoint_fails_clearly(run: dict[str, Any], tmp_path: Path) -> None:
    root = tmp_path / "run"
    shutil.copytree(run["root"], root)
    missing = CheckpointReader(str(root / STEP2)).manifest.frozen_file(0).path[3:]
    shutil.rmtree(root / STEP1)
    result = verify(str(root / STEP2))
    assert not result.ok and len(result.problems) == 1
    assert f"{root}/{missing}: missing" in result.problems[0]
    assert "was removed or moved" in result.problems[0]
    assert CheckpointManager(str(root)).resume_point() is None  # nothing left that loads
    engine, _ = build(seed=1)
    with pytest.raises(ShardckptError, match=missing.split("/")[-1]):
        load(engine, str(root / STEP2))


def test_a_reference_whose_file_is_gone_is_not_copied(run: dict[str, Any], tmp_path: Path) -> None:
    root = tmp_path / "run"
    shutil.copytree(run["root"], root)
    shutil.rmtree(root / STEP1)  # step 2's reference now dangles; the next save must not copy it
    ckpt = Checkpointer(str(root), run["engine"], keep_last=None)
    ckpt.save(3)
    ckpt.close()
    m3 = CheckpointReader(str(root / STEP3)).manifest
    assert not m3.references() and verify(str(root / STEP3)).ok


def test_a_link_out_of_the_run_is_not_followed(run: dict[str, Any], tmp_path: Path) -> None:
    root = tmp_path / "run"
    shutil.copytree(run["root"], root)
    os.rename(root / STEP1, tmp_path / "elsewhere")
    os.symlink(tmp_path / "elsewhere", root / STEP1)
    result = verify(str(root / STEP2))
    assert not result.ok and "symbolic link" in result.problems[0]
    with pytest.raises(ShardckptError, match="symbolic link"):
        load(build(seed=1)[0], str(root / STEP2))


@pytest.mark.parametrize("path", [
    "../../etc/passwd",
    "../../etc/frozen-00000-of-00001.safetensors",
    "../step-00000001/../../x/frozen-00000-of-00001.safetensors",
    "../step-00000001/sid/shard-00000-of-00001.safetensors",
    "../step-00000001/../frozen-00000-of-00001.safetensors",
    "../step-1/sid/frozen-00000-of-00001.safetensors",
    "/etc/step-00000001/sid/frozen-00000-of-00001.safetensors",
])
def test_hostile_reference_is_refused(run: dict[str, Any], path: str) -> None:
    doc = manifest_doc(run["root"] / STEP2)
    doc.pop("manifest_crc32c")
    i = next(i for i, f in enumerate(doc["files"]) if f["role"] == "frozen")
    doc["files"][i]["path"] = path
    with pytest.raises(ManifestError, match=rf"evil/manifest.json: .*files\[{i}\]\.path"):
        parse(seal(doc), "evil/manifest.json")


def test_a_reference_only_for_frozen_entries(run: dict[str, Any]) -> None:
    doc = manifest_doc(run["root"] / STEP2)
    doc.pop("manifest_crc32c")
    doc["files"][0]["path"] = "../" + STEP1 + "/" + doc["files"][0]["path"]
    with pytest.raises(ManifestError, match=r"files\[0\]\.path: .* not a plain relative path"):
        parse(seal(doc))


def test_a_reader_without_the_feature_refuses_it(run: dict[str, Any], monkeypatch) -> None:
    data = (run["root"] / STEP2 / MANIFEST_NAME).read_bytes()
    monkeypatch.setattr(manifest_parse, "KNOWN_FEATURES", (CHUNKED_FEATURE,))  # as 1.2 reads
    with pytest.raises(ManifestError, match="needs 'frozen_files'.*upgrade shardckpt"):
        parse(data)


def test_a_changed_frozen_parameter_is_written_again(run: dict[str, Any], tmp_path: Path) -> None:
    root = tmp_path / "run"
    shutil.copytree(run["root"], root)
    engine, opt = build(seed=1)
    ckpt = Checkpointer(str(root), engine, keep_last=1)
    assert ckpt.resume() == 2
    frozen = next(g.name for g in engine.layout.groups if not g.requires_grad)
    with torch.no_grad():
        engine.local_shards()[frozen]["master"][5] += 1.0
    engine.refresh_params()
    ckpt.save(3)
    ckpt.close()
    m3 = CheckpointReader(str(root / STEP3)).manifest
    assert not m3.references()
    assert f"{m3.save_id}/frozen-00000-of-00001.safetensors" in files_under(root / STEP3)
    # nothing kept references steps 1 and 2 any more: retention removed both
    assert not (root / STEP1).exists() and not (root / STEP2).exists()
    fresh, _ = build(seed=2)
    load(fresh, str(root / STEP3))
    assert snapshot(fresh) == snapshot(engine)


def test_on_an_object_store_the_reference_is_read_from_the_run_directory() -> None:
    """memory:// has no "..": a reference is read through the run directory's own handle."""
    url = f"memory://frozen-refs-{os.getpid()}"
    engine, opt = build()
    ckpt = Checkpointer(url, engine, keep_last=1)
    for step in (1, 2):
        train(engine, opt, step)
        ckpt.save(step)
    ckpt.close()
    m = CheckpointReader(f"{url}/{STEP2}").manifest
    assert m.frozen_file(0).path.startswith(f"../{STEP1}/") and ckpt.manager.kept_referenced
    assert verify(f"{url}/{STEP2}").ok
    fresh, _ = build(seed=5)
    load(fresh, f"{url}/{STEP2}")
    assert snapshot(fresh) == snapshot(engine)
    Storage(url).rm("", recursive=True)


# ------------------------------------------------------------------------------ two ranks


def _two_ranks(rank: int, world: int, root: str) -> dict[str, Any]:
    engine, opt = build(ProcessMesh.from_process_group(), seed=0)
    ckpt = Checkpointer(root, engine, keep_last=1)
    for step in (1, 2):
        train(engine, opt, step, rank)
        ckpt.save(step)
    ckpt.close()
    fresh, _ = build(ProcessMesh.from_process_group(), seed=3)
    load(fresh, f"{root}/{STEP2}")
    return {"same": snapshot(fresh) == snapshot(engine)}


def test_two_ranks_reference_each_frozen_shard(tmp_path: Path) -> None:
    from testing.ranks import run_distributed

    root = tmp_path / "run"
    values = run_distributed(_two_ranks, 2, args=(str(root),), timeout_s=120)
    assert values == [{"same": True}, {"same": True}]
    m1 = CheckpointReader(str(root / STEP1)).manifest
    m2 = CheckpointReader(str(root / STEP2)).manifest
    assert [f.path for f in m2.files if f.role == "frozen"] == \
        [f"../{STEP1}/{m1.frozen_file(r).path}" for r in range(2)]
    assert not any("frozen" in n for n in files_under(root / STEP2))
    assert verify(str(root / STEP2)).ok and (root / STEP1 / MANIFEST_NAME).exists()


# ------------------------------------------------------------------------------------ fuzz


def _sealed(doc: dict[str, Any]) -> bytes:
    """``doc`` as manifest bytes with its checksum recomputed, hostile values kept."""
    raw = dumps({k: v for k, v in doc.items() if k != "manifest_crc32c"}).encode("utf-8", "surrogatepass")
    covered = raw[:raw.rindex(b"}")].rstrip() + b",\n "
    return covered + b'"manifest_crc32c": "%08x"\n}' % crc32c(covered)


def test_fuzzed_frozen_entries_are_refused_or_read(run: dict[str, Any]) -> None:
    """Mutations of the reference entry: each is refused with one ShardckptError or reads the
    right bytes; none escapes as another exception or reads outside the run directory."""
    ckpt = run["root"] / STEP2
    doc = manifest_doc(ckpt)
    i = next(i for i, f in enumerate(doc["files"]) if f["role"] == "frozen")
    refused = 0
    for k, case in mutations(doc["files"][i], FUZZ_SEED, 300):
        d = copy.deepcopy(doc)
        d["files"][i] = case

        def attempt(d: dict[str, Any] = d) -> None:
            m = parse(_sealed(d), str(ckpt / MANIFEST_NAME))
            reader = CheckpointReader(str(ckpt), manifest=m)
            for g in m.components["model"].layout.groups:
                assert bytes(reader.read_state(0, g.name, "master")) == run["live"][g.name]["master"]

        refused += expect_clean(attempt, f"frozen entry, seed {FUZZ_SEED}, case {k}") is not None
    assert refused > 250, refused


def test_watch_retain_keeps_a_referenced_derived_output(run: dict[str, Any], tmp_path: Path) -> None:
    """retain prunes what earlier steps derived from a checkpoint it removes, except a derived
    checkpoint that a kept one beside it references (here: a copy of the frozen run)."""
    from shardckpt.tools.synth import synthesize
    from shardckpt.watch.retain import retain

    root = tmp_path / "run"
    for step in (1, 2):  # the watched run: plain checkpoints
        synthesize(str(root / f"step-{step:08d}"), 3000, 1, step=step)
    derived = tmp_path / "derived"
    shutil.copytree(run["root"], derived)  # its step 2 references step 1's frozen files
    plain = tmp_path / "plain"
    for step in (1, 2):
        synthesize(str(plain / f"step-{step:08d}"), 3000, 1, step=step)
    steps = (StepSpec(1, "copy", str(derived / "{name}")), StepSpec(2, "copy", str(plain / "{name}")))
    facts = retain(Storage(str(root)), 2, 1, steps, {}, lambda name: True)
    assert facts["removed"] == [STEP1] and not (root / STEP1).exists()
    assert facts["derived"] == [str(plain / STEP1)] and not (plain / STEP1).exists()
    assert facts["referenced"] == [str(derived / STEP1)] and (derived / STEP1 / MANIFEST_NAME).exists()
    assert verify(str(derived / STEP2))
