"""``shardckpt import deepspeed``: DeepSpeed ZeRO-1/2/3 checkpoints (fp32 and bf16 training, 2 and 3
ranks, written by DeepSpeed itself: ``tests/fixtures/deepspeed``) become shardckpt checkpoints whose
weights equal DeepSpeed's own consolidation and whose Adam moments equal the state DeepSpeed held,
bit for bit, at any world size; bad input is one clear error and nothing is committed."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file
from typer.testing import CliRunner

from shardckpt.checkpoint.reader import CheckpointReader

from shardckpt.checkpoint.verify import verify
from shardckpt.cli.main import app
from shardckpt.tools.consolidate import consolidate
from shardckpt.interop.deepspeed.files import segments_12
from shardckpt.interop.deepspeed.import_ import import_deepspeed
from shardckpt.errors import IntegrityError
from shardckpt.tools.diff import diff
from shardckpt.format.manifest import MANIFEST_NAME
from shardckpt.tools.reshard import reshard

torch = pytest.importorskip("torch")

FIXTURES = Path(__file__).parent / "fixtures" / "deepspeed"
NAMES = sorted(p.name for p in FIXTURES.iterdir() if p.is_dir())
TAG = "global_step3"
TIED = ("lm_head.weight", "model.embed_tokens.weight")
FROZEN = "model.layers.1.post_attention_layernorm.weight"


def full_state(ckpt: str, kind: str) -> dict[str, np.ndarray]:
    """Every parameter's ``kind`` state, assembled shard by shard from the checkpoint."""
    r = CheckpointReader(ckpt)
    comp = r.manifest.components["model"]
    lay = comp.layout
    out = {}
    for g in lay.groups:
        if kind not in dict(comp.states[g.name]):
            continue
        flat = np.concatenate([np.frombuffer(r.read_state(s, g.name, kind), np.float32)
                               for s in range(lay.shard_degree)])
        for p in lay.group_params(g):
            out[p.fqn] = flat[p.offset:p.offset + p.numel].reshape(p.shape)
    return out


def bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, np.float32).view(np.uint32)


@pytest.fixture(scope="module")
def imported(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, int], str]:
    root = tmp_path_factory.mktemp("ds")
    out = {}
    for name in NAMES:
        for ranks in (1, 4):
            dst = str(root / f"{name}-to-{ranks}")
            import_deepspeed(str(FIXTURES / name), dst, ranks)
            out[(name, ranks)] = dst
    return out


def test_fixtures_cover_the_matrix() -> None:
    have = set(NAMES)
    for stage in (1, 2, 3):
        for prec in ("fp32", "bf16"):
            assert f"zero{stage}-{prec}-2" in have


@pytest.mark.parametrize("ranks", [1, 4])
@pytest.mark.parametrize("name", NAMES)
def test_weights_equal_deepspeed_consolidation(imported: dict, name: str, ranks: int) -> None:
    ref = load_file(str(FIXTURES / name / "reference_fp32.safetensors"))
    dst = imported[(name, ranks)]
    got = full_state(dst, "master")
    m = CheckpointReader(dst).manifest
    comp = m.components["model"]
    for fqn, want in ref.items():
        if fqn in {b.fqn for b in comp.buffers}:
            _, raw = CheckpointReader(dst).read_buffer(fqn)
            assert bytes(raw) == want.tobytes(), fqn
            continue
        canon = comp.aliases.get(fqn, fqn)
        assert np.array_equal(bits(got[canon]), bits(want.astype(np.float32))), fqn
    optimized = {f for g in m.optimizer.param_groups for f in g["params"]}
    assert FROZEN in got and FROZEN not in optimized
    if "zero3" not in name:  # ZeRO-3 does not record tied parameters
        assert comp.aliases.get(TIED[0]) == TIED[1]


@pytest.mark.parametrize("name", NAMES)
def test_moments_equal_what_deepspeed_held(imported: dict, name: str) -> None:
    ref = load_file(str(FIXTURES / name / "reference_optim.safetensors"))
    dst = imported[(name, 4)]
    for kind in ("exp_avg", "exp_avg_sq"):
        got = full_state(dst, kind)
        want = {k[:-len(kind) - 1]: v for k, v in ref.items() if k.endswith("." + kind)}
        assert set(got) == set(want)
        for fqn, v in want.items():
            assert np.array_equal(bits(got[fqn]), bits(v)), (kind, fqn)


@pytest.mark.parametrize("name", NAMES)
def test_optimizer_step_and_hyperparameters(imported: dict, name: str) -> None:
    doc = json.loads((FIXTURES / name / "reference.json").read_text())
    m = CheckpointReader(imported[(name, 1)]).manifest
    assert m.optimizer.name == "adamw"
    assert m.extras["step"] == doc["steps"]
    assert [g["step"] for g in m.optimizer.param_groups] == [doc["steps"]] * 2
    for g, want in zip(m.optimizer.param_groups, doc["hparams"]):
        assert g["hparams"]["lr"] == want["lr"]
        assert g["hparams"]["weight_decay"] == want["weight_decay"]
        assert g["hparams"]["betas"] == list(want["betas"])


def test_tools_work_on_the_import(imported: dict, tmp_path: Path) -> None:
    src = imported[("zero2-bf16-2", 4)]
    assert verify(src).ok
    d = diff(imported[("zero2-bf16-2", 1)], src)
    assert d.equal and d.identical == d.compared > 0
    out = str(tmp_path / "r3")
    reshard(src, out, 3)
    for kind in ("master", "exp_avg_sq"):
        a, b = full_state(src, kind), full_state(out, kind)
        assert all(np.array_equal(bits(a[k]), bits(b[k])) for k in a)
    consolidate(out, str(tmp_path / "hf"), dtype="float32")
    ref = load_file(str(FIXTURES / "zero2-bf16-2" / "reference_fp32.safetensors"))
    hf = {}
    for f in (tmp_path / "hf").glob("*.safetensors"):
        hf.update(load_file(str(f)))
    assert np.array_equal(bits(hf["model.norm.weight"]), bits(ref["model.norm.weight"]))


def test_fsspec_source_and_hsdp_target(imported: dict) -> None:
    """From and to ``memory://`` (any fsspec URL), onto an HSDP mesh: the same tensors."""
    import fsspec

    fs = fsspec.filesystem("memory")
    name = "zero3-bf16-3"
    for f in (FIXTURES / name).rglob("*"):
        if f.is_file():
            fs.pipe(f"/ds-src/{f.relative_to(FIXTURES / name)}", f.read_bytes())
    try:
        m = import_deepspeed("memory://ds-src", "memory://ds-out", 4, replicate=2)
        assert m.mesh.replicate_degree == 2 and m.mesh.shard_degree == 2
        d = diff(imported[(name, 1)], "memory://ds-out")
        assert d.equal and d.identical == d.compared > 0
    finally:
        for path in ("/ds-src", "/ds-out"):
            if fs.exists(path):
                fs.rm(path, recursive=True)


@pytest.mark.parametrize("name", ["zero1-bf16-3", "zero3-fp32-3"])
def test_one_rank_file_at_a_time(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                 name: str) -> None:
    """Each DeepSpeed file's tensors are released before the next file is read."""
    import gc
    import weakref

    import shardckpt.interop.deepspeed.rank_files as di

    real, held, alive_at_load = di.load_pt, [], []

    def largest(obj: object) -> object:
        found = [obj] if isinstance(obj, torch.Tensor) else []
        children = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, list) else ()
        found += [largest(c) for c in children]
        found = [t for t in found if isinstance(t, torch.Tensor)]
        return max(found, key=lambda t: t.numel(), default=None)

    def tracked(storage: object, rel: str) -> dict:
        gc.collect()
        alive_at_load.append(sum(1 for r in held if r() is not None))
        sd = real(storage, rel)
        held.append(weakref.ref(largest(sd)))
        return sd

    monkeypatch.setattr(di, "load_pt", tracked)
    import_deepspeed(str(FIXTURES / name), str(tmp_path / "out"), 2)
    assert len(held) == (4 if "zero1" in name else 6)
    assert alive_at_load == [0] * len(held)


@pytest.mark.parametrize("world", [1, 2, 3, 5])
def test_zero12_segments_with_alignment_paddings(world: int) -> None:
    """DeepSpeed's ZeRO-1/2 layout with per-parameter alignment padding (``parameter_alignment``),
    built here as DeepSpeed builds it: every parameter's elements are found where they are."""
    from types import SimpleNamespace

    rng = np.random.default_rng(world)
    groups = [{"a": (3, 5), "b": (7,), "c": (2, 2, 3)}, {"d": (1,), "e": (9,)}]
    pads = [[1, 5, 0], [3, 0]]
    flats, values = [], {}
    for g, pad in zip(groups, pads):
        parts = []
        for (fqn, shape), p in zip(g.items(), pad):
            values[fqn] = rng.standard_normal(int(np.prod(shape))).astype(np.float32)
            parts += [values[fqn], np.zeros(p, np.float32)]
        flat = np.concatenate(parts)
        align = 2 * world
        flats.append(np.concatenate([flat, np.zeros(-len(flat) % align, np.float32)]))
    used = [sum(int(np.prod(s)) + p for s, p in zip(g.values(), pad))
            for g, pad in zip(groups, pads)]
    saved = []  # per rank: each group's partition without the group's tail padding
    for r in range(world):
        parts = []
        for flat, n in zip(flats, used):
            size = len(flat) // world
            parts.append(flat[r * size:min((r + 1) * size, max(n, r * size))])
        saved.append(parts)
    ranks = [SimpleNamespace(lengths=[len(p) for p in parts], paddings=pads) for parts in saved]
    segs = segments_12("ckpt", groups, ranks, world)
    region = {str(r): np.concatenate(parts) for r, parts in enumerate(saved)}
    for fqn, want in values.items():
        got = np.concatenate([region[s.src][s.pos:s.pos + s.end - s.start] for s in segs[fqn]])
        assert np.array_equal(got, want), fqn


# ------------------------------------------------------------------------------ bad input


def copy(name: str, tmp_path: Path) -> Path:
    dst = tmp_path / name
    shutil.copytree(FIXTURES / name, dst)
    return dst


def refused(src: Path, tmp_path: Path, match: str) -> None:
    dst = tmp_path / "out"
    with pytest.raises(IntegrityError, match=match):
        import_deepspeed(str(src), str(dst), 2)
    assert not (dst / MANIFEST_NAME).exists()
    assert not dst.exists() or not any(dst.iterdir())


def test_missing_rank_file(tmp_path: Path) -> None:
    src = copy("zero2-fp32-3", tmp_path)
    (src / TAG / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    refused(src, tmp_path, r"zero_pp_rank_1_mp_rank_00_optim_states\.pt: missing")


def test_files_from_different_world_sizes(tmp_path: Path) -> None:
    src = copy("zero2-fp32-2", tmp_path)
    shutil.copy(FIXTURES / "zero2-fp32-3" / TAG / "zero_pp_rank_2_mp_rank_00_optim_states.pt",
                src / TAG)
    refused(src, tmp_path, r"different saves")


def test_truncated_file(tmp_path: Path) -> None:
    src = copy("zero1-bf16-2", tmp_path)
    f = src / TAG / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    refused(src, tmp_path, r"bf16_zero_pp_rank_1_mp_rank_00_optim_states\.pt: not a readable")


def test_sizes_that_do_not_add_up(tmp_path: Path) -> None:
    from shardckpt.interop.deepspeed.files import load_pt
    from shardckpt.storage import Storage

    src = copy("zero2-fp32-2", tmp_path)
    sd = load_pt(Storage(str(src / TAG)), "mp_rank_00_model_states.pt")
    sd["param_shapes"][0]["model.layers.1.mlp.down_proj.weight"] = torch.Size([16, 64])
    torch.save(sd, src / TAG / "mp_rank_00_model_states.pt")
    refused(src, tmp_path, r"do not add up")


def test_global_not_on_the_allow_list(tmp_path: Path) -> None:
    import datetime

    src = copy("zero3-fp32-2", tmp_path)
    torch.save({"optimizer_state_dict": {"zero_stage": 3, "surprise": datetime.date(2020, 1, 1)}},
               src / TAG / "zero_pp_rank_1_mp_rank_00_optim_states.pt")
    refused(src, tmp_path, r"zero_pp_rank_1_mp_rank_00_optim_states\.pt: holds a datetime\.date "
                           r"object, which is not on the allow-list")


def test_cli(tmp_path: Path) -> None:
    runner = CliRunner()
    dst = tmp_path / "cli"
    r = runner.invoke(app, ["import", "deepspeed", str(FIXTURES / "zero3-bf16-2"), str(dst),
                            "--ranks", "3", "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert (doc["zero_stage"], doc["source_world_size"], doc["ranks"]) == (3, 2, 3)
    src = copy("zero1-fp32-2", tmp_path)
    (src / TAG / "zero_pp_rank_0_mp_rank_00_optim_states.pt").unlink()
    r = runner.invoke(app, ["import", "deepspeed", str(src), str(tmp_path / "bad"), "--ranks", "2"])
    assert r.exit_code != 0
    assert len(r.stderr.strip().splitlines()) == 1 and "zero_pp_rank_0" in r.stderr
