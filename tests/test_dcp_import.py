"""``shardckpt import dcp`` / ``export dcp`` on checkpoints DCP's own ``FileSystemWriter`` wrote
(single process here; FSDP2 on several ranks is in integration/test_dcp_interop.py): what
``dcp.load`` gives from the source it gives from the import and from its export, bit for bit;
the metadata pickle is read only through the allow-list, payloads only through
``torch.load(weights_only=True)``; every hostile or damaged input is one clear error naming the
file, with nothing committed."""

from __future__ import annotations

import pickle
import shutil
import warnings
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from shardckpt.checkpoint.reader import CheckpointReader

from shardckpt.checkpoint.verify import verify
from shardckpt.cli.main import app
from shardckpt.interop.dcp.export import export_dcp
from shardckpt.interop.dcp.import_ import import_dcp
from shardckpt.errors import IntegrityError
from shardckpt.format.manifest import MANIFEST_NAME

from testing.ckpts import flat_state
from testing.dcp_states import assert_same, dcp_load, dcp_save, flat, metadata

torch = pytest.importorskip("torch")
dcp = pytest.importorskip("torch.distributed.checkpoint")

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.fixture
def src(source: Path, tmp_path: Path) -> Path:
    """A private copy of the source to damage."""
    return Path(shutil.copytree(source, tmp_path / "src"))


def test_import_keeps_chunks_and_loads_bit_for_bit(source: Path, tmp_path: Path) -> None:
    from shardckpt.interop.dcp.storage import ShardckptReader

    m = import_dcp(str(source), str(tmp_path / "ck"))
    assert m.version == (1, 2) and m.chunked is not None and verify(str(tmp_path / "ck"))
    assert m.chunked.tensors["model.0.weight"].dtype == "bfloat16"
    assert "lr_scheduler.lrs" in m.chunked.blobs and "train_state.step" in m.chunked.tensors
    want = dcp_load(source)
    assert_same(dcp_load(reader=ShardckptReader(str(tmp_path / "ck"))), want)
    assert flat(want)["train_state.step"] == 7 and flat(want)["lr_scheduler.last_epoch"] == 3


def test_export_reads_back_with_stock_dcp(source: Path, tmp_path: Path) -> None:
    import_dcp(str(source), str(tmp_path / "ck"))
    out = export_dcp(str(tmp_path / "ck"), str(tmp_path / "out"))
    assert out["files"] == ["__0_0.distcp"] and (tmp_path / "out" / ".metadata").exists()
    assert_same(dcp_load(tmp_path / "out"), dcp_load(source))
    # the exported metadata names only allow-listed globals, so it imports again
    import_dcp(str(tmp_path / "out"), str(tmp_path / "again"))
    assert_same(dcp_load(reader=__import__("shardckpt.interop.dcp.storage").interop.dcp.storage.ShardckptReader(
        str(tmp_path / "again"))), dcp_load(source))


def test_export_refuses_an_existing_dcp_checkpoint(source: Path, tmp_path: Path) -> None:
    from shardckpt.errors import ConfigError

    import_dcp(str(source), str(tmp_path / "ck"))
    with pytest.raises(ConfigError, match=r"\.metadata exists"):
        export_dcp(str(tmp_path / "ck"), str(source))


def test_export_of_flat_groups_is_what_get_state_dict_gives(tiny_ckpt: tuple[str, Any],
                                                            tmp_path: Path) -> None:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    url, m = tiny_ckpt
    comp = m.components["model"]
    export_dcp(url, str(tmp_path / "out"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp_to_torch_save(str(tmp_path / "out"), str(tmp_path / "all.pt"))
    sd = torch.load(str(tmp_path / "all.pt"), weights_only=True)
    assert set(sd) == {"model", "optim"}
    for p in comp.layout.params:
        assert torch.equal(sd["model"][p.fqn], flat_state(url, p.fqn, "master")), p.fqn
        for kind, _ in comp.states[p.group]:
            if kind != "master":
                assert torch.equal(sd["optim"]["state"][p.fqn][kind], flat_state(url, p.fqn, kind))
    for alias, canon in comp.aliases.items():
        assert torch.equal(sd["model"][alias], sd["model"][canon])
    assert {b.fqn for b in comp.buffers} <= set(sd["model"])
    assert m.optimizer is not None
    groups = sd["optim"]["param_groups"]
    assert [g["params"] for g in groups] == [g["params"] for g in m.optimizer.param_groups]
    assert [g["lr"] for g in groups] == [g["hparams"]["lr"] for g in m.optimizer.param_groups]


def write_metadata(path: Path, md: Any) -> None:
    (path / ".metadata").write_bytes(pickle.dumps(md))


def refused(src: Path, tmp_path: Path, *needles: str) -> str:
    dst = tmp_path / "dst"
    with pytest.raises(IntegrityError) as e:
        import_dcp(str(src), str(dst))
    for n in needles:
        assert n in str(e.value), (n, str(e.value))
    assert not (dst / MANIFEST_NAME).exists()
    assert not dst.exists() or not [p for p in dst.rglob("*") if p.is_file()]
    return str(e.value)


def test_metadata_naming_another_global_is_refused_without_running(src: Path, tmp_path: Path) -> None:
    md = metadata(src)
    marker = tmp_path / "ran"
    (src / ".metadata").write_bytes(f"cos\nsystem\n(S'touch {marker}'\ntR.".encode())
    refused(src, tmp_path, "os.system", str(src / ".metadata"))
    assert not marker.exists()
    # a metadata object that hides a global deeper down
    md.storage_meta.modules = [shutil.rmtree]
    write_metadata(src, md)
    refused(src, tmp_path, "shutil.rmtree", ".metadata")


@pytest.mark.parametrize("damage", ["truncated", "empty", "not a pickle", "not Metadata"])
def test_damaged_metadata_is_one_clear_error(src: Path, tmp_path: Path, damage: str) -> None:
    data = (src / ".metadata").read_bytes()
    new = {"truncated": data[: len(data) // 2], "empty": b"", "not a pickle": b"\x00garbage",
           "not Metadata": pickle.dumps({"a": 1})}[damage]
    (src / ".metadata").write_bytes(new)
    refused(src, tmp_path, ".metadata")


def test_missing_metadata_and_payload(src: Path, tmp_path: Path) -> None:
    (src / "__0_0.distcp").unlink()
    refused(src, tmp_path, "__0_0.distcp", "missing")
    (src / ".metadata").unlink()
    refused(src, tmp_path, ".metadata", "missing")


def test_truncated_payload_and_range_past_end(src: Path, tmp_path: Path) -> None:
    f = src / "__0_0.distcp"
    f.write_bytes(f.read_bytes()[:-100])
    refused(src, tmp_path, "__0_0.distcp", "past the file's end")


def test_damaged_payload_bytes_are_refused_and_nothing_committed(src: Path, tmp_path: Path) -> None:
    md = metadata(src)
    key = next(k for k in md.storage_data if k.fqn == "model.1.weight")
    info = md.storage_data[key]
    f = src / info.relative_path
    data = bytearray(f.read_bytes())
    data[info.offset: info.offset + 64] = b"\xff" * 64  # the zip header of this payload
    f.write_bytes(bytes(data))
    refused(src, tmp_path, "__0_0.distcp", "'model.1.weight'", "not a readable torch.save")


def test_payload_with_a_global_is_refused_by_weights_only(src: Path, tmp_path: Path) -> None:
    import io

    md = metadata(src)
    key = next(k for k in md.storage_data if k.fqn == "extra.scale")
    info = md.storage_data[key]
    buf = io.BytesIO()
    torch.save({"t": torch.zeros(2, 3), "f": shutil.rmtree}, buf)
    f = src / info.relative_path
    pos = f.stat().st_size
    f.write_bytes(f.read_bytes() + buf.getvalue())
    info.offset, info.length = pos, len(buf.getvalue())
    write_metadata(src, md)
    refused(src, tmp_path, "__0_0.distcp", "'extra.scale'", "not a readable torch.save")


def test_payload_of_another_shape_or_dtype_is_refused(src: Path, tmp_path: Path) -> None:
    md = metadata(src)
    a = next(k for k in md.storage_data if k.fqn == "extra.scale")
    b = next(k for k in md.storage_data if k.fqn == "model.0.weight")
    md.storage_data[a] = md.storage_data[b]  # a bf16 [5, 3] payload where fp32 [2, 3] belongs
    write_metadata(src, md)
    refused(src, tmp_path, "'extra.scale'", "bfloat16", "[2, 3]")


@pytest.mark.parametrize("how", ["gap", "overlap", "outside"])
def test_chunks_that_do_not_tile_are_refused(src: Path, tmp_path: Path, how: str) -> None:
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    md = metadata(src)
    tmd = md.state_dict_metadata["extra.scale"]
    c = tmd.chunks[0]
    if how == "gap":
        c.sizes = torch.Size([1, 3])
    elif how == "overlap":
        tmd.chunks.append(ChunkStorageMetadata(torch.Size([0, 1]), torch.Size([1, 1])))
    else:
        tmd.size = torch.Size([1, 3])
    write_metadata(src, md)
    refused(src, tmp_path, ".metadata", "'extra.scale'", "do not tile")


def test_payload_outside_the_folder_is_refused(src: Path, tmp_path: Path) -> None:
    md = metadata(src)
    for info in md.storage_data.values():
        info.relative_path = "../elsewhere.distcp"
    write_metadata(src, md)
    refused(src, tmp_path, "not a file beside it")


def test_cli_import_export_and_one_line_errors(source: Path, src: Path, tmp_path: Path) -> None:
    runner = CliRunner()
    r = runner.invoke(app, ["import", "dcp", str(source), str(tmp_path / "ck"), "--json"])
    assert r.exit_code == 0, r.output
    r = runner.invoke(app, ["export", "dcp", str(tmp_path / "ck"), str(tmp_path / "out")])
    assert r.exit_code == 0 and "exported" in r.output, r.output
    assert_same(dcp_load(tmp_path / "out"), dcp_load(source))
    (src / ".metadata").write_bytes(b"cos\nsystem\n(S'true'\ntR.")
    r = runner.invoke(app, ["import", "dcp", str(src), str(tmp_path / "bad")])
    lines = r.stderr.strip().splitlines()
    assert r.exit_code == 1 and len(lines) == 1 and "os.system" in lines[0], r.stderr
    assert not (tmp_path / "bad" / MANIFEST_NAME).exists()
    assert CheckpointReader(str(tmp_path / "ck")).manifest.chunked is not None


def test_import_ranks_writes_flat_groups_bit_for_bit(tmp_path: Path) -> None:
    """``--ranks``: a plain module's ``get_state_dict`` (tied weight, buffer, two param groups)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Embedding(7, 5), torch.nn.LayerNorm(5), torch.nn.Linear(5, 7))
    m[2].weight = m[0].weight  # tied
    m.register_buffer("pos", torch.arange(4.0))
    decay = [m[0].weight]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": [p for p in m.parameters() if p is not m[0].weight],
                              "weight_decay": 0.0}], lr=1e-2)
    for _ in range(2):
        m(torch.tensor([[1, 2, 3]])).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
    msd, osd = get_state_dict(m, opt)
    dcp_save({"model": msd, "optim": osd}, tmp_path / "src")
    r = CliRunner().invoke(app, ["import", "dcp", str(tmp_path / "src"), str(tmp_path / "flat"),
                                 "--ranks", "3", "--json"])
    assert r.exit_code == 0, r.output
    man = CheckpointReader(str(tmp_path / "flat")).manifest
    comp = man.components["model"]
    assert comp.aliases == {"2.weight": "0.weight"} and [b.fqn for b in comp.buffers] == ["pos"]
    assert man.optimizer is not None and man.optimizer.name == "adamw"
    assert [(g["hparams"]["weight_decay"], g["step"]) for g in man.optimizer.param_groups] == \
        [(0.1, 2), (0.0, 2)]
    for fqn, p in m.named_parameters():
        st = opt.state[p]
        for kind, want in (("master", p.detach()), ("exp_avg", st["exp_avg"]),
                           ("exp_avg_sq", st["exp_avg_sq"])):
            assert torch.equal(flat_state(str(tmp_path / "flat"), fqn, kind), want), (fqn, kind)


def test_import_ranks_refuses_state_it_cannot_map(source: Path, tmp_path: Path) -> None:
    """``opt.state_dict()`` keys state by integer ids, not FQNs: one clear error, nothing written."""
    from shardckpt.interop.dcp.to_flat import import_dcp_flat

    with pytest.raises(IntegrityError, match="get_state_dict|no optimizer state"):
        import_dcp_flat(str(source), str(tmp_path / "flat"), 2, optim_key="optimizer")
    assert not (tmp_path / "flat" / MANIFEST_NAME).exists()
    with pytest.raises(IntegrityError, match="no optimizer state under 'optim'"):
        import_dcp_flat(str(source), str(tmp_path / "flat"), 2, optim_key="optim")
    r = CliRunner().invoke(app, ["import", "dcp", str(source), str(tmp_path / "flat"),
                                 "--ranks", "2", "--model-key", "nothing"])
    lines = r.stderr.strip().splitlines()
    assert r.exit_code == 1 and len(lines) == 1 and "--model-key" in lines[0], r.stderr
