"""``import dcp`` / ``export dcp`` beyond the chunks (single process): frozen parameters and SGD
momentum in ``--ranks``, an export in bounded chunks over several files, payloads read without
torch where they are plain tensors."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from shardckpt.checkpoint.reader import CheckpointReader
from shardckpt.cli.main import app
from shardckpt.format.manifest import MANIFEST_NAME
from shardckpt.interop.dcp.export import export_dcp
from shardckpt.interop.dcp.import_ import import_dcp

from testing.ckpts import flat_state
from testing.dcp_states import assert_same, dcp_load, dcp_save, metadata

torch = pytest.importorskip("torch")
dcp = pytest.importorskip("torch.distributed.checkpoint")

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def test_export_streams_bounded_chunks_into_several_files(tiny_ckpt: tuple[str, Any],
                                                           source: Path, tmp_path: Path) -> None:
    """A box over the block budget is written as several DCP chunks (rows; a row over the budget
    split along the next dim), payload files roll over; stock DCP reads it all bit for bit."""
    import io as io_

    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    url, m = tiny_ckpt
    budget = 64  # the embedding is 8 KiB, a (8, 24) fp32 row 96 bytes
    out = export_dcp(url, str(tmp_path / "out"), block_bytes=budget, file_bytes=16 << 10)
    assert len(out["files"]) > 2
    full = export_dcp(url, str(tmp_path / "whole"))
    assert full["files"] == ["__0_0.distcp"]
    md = metadata(tmp_path / "out")
    empty = io_.BytesIO()
    torch.save(torch.zeros(1), empty)
    overhead = len(empty.getvalue()) + 64  # torch.save's archive around the elements
    for key, t in md.state_dict_metadata.items():
        if hasattr(t, "chunks"):
            for c in t.chunks:
                n = int(torch.Size(c.sizes).numel()) * t.properties.dtype.itemsize
                assert n <= budget, (key, c)
                assert md.storage_data[dcp.metadata.MetadataIndex(key, c.offsets)].length \
                    <= budget + overhead
    embed = md.state_dict_metadata["model.model.embed_tokens.weight"]
    assert len(embed.chunks) == 256 * 8 * 4 // budget
    for name in ("out", "whole"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp_to_torch_save(str(tmp_path / name), str(tmp_path / f"{name}.pt"))
    small = torch.load(str(tmp_path / "out.pt"), weights_only=True)
    assert_same(small, torch.load(str(tmp_path / "whole.pt"), weights_only=True))
    comp = m.components["model"]
    for p in comp.layout.params:
        assert torch.equal(small["model"][p.fqn], flat_state(url, p.fqn, "master")), p.fqn
    # chunked tensors: a source chunk over the budget is split the same way
    import_dcp(str(source), str(tmp_path / "ck"))
    export_dcp(str(tmp_path / "ck"), str(tmp_path / "ck-out"), block_bytes=8)
    assert_same(dcp_load(tmp_path / "ck-out"), dcp_load(source))


def test_import_ranks_frozen_parameters_listed_or_named(tmp_path: Path) -> None:
    """A ``requires_grad=False`` parameter has no Adam state: a param group lists it (optimizer
    over all parameters) or ``--frozen`` names it, and it is stored frozen in its own dtype;
    otherwise it is a buffer."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Linear(6, 3))
    m[0].requires_grad_(False)
    m.register_buffer("pos", torch.arange(3.0))
    for name, params in (("all", list(m.parameters())),
                         ("trained", [p for p in m.parameters() if p.requires_grad])):
        opt = torch.optim.AdamW(params, lr=1e-2)
        m(torch.ones(2, 4)).pow(2).sum().backward()
        opt.step()
        msd, osd = get_state_dict(m, opt)
        dcp_save({"model": msd, "optim": osd}, tmp_path / name)
    runs = {"all": [], "trained": [], "named": ["--frozen", r"0\..*"]}
    for run, extra in runs.items():
        src = tmp_path / ("trained" if run == "named" else run)
        r = CliRunner().invoke(app, ["import", "dcp", str(src), str(tmp_path / f"flat-{run}"),
                                     "--ranks", "2", *extra])
        assert r.exit_code == 0, r.output
        comp = CheckpointReader(str(tmp_path / f"flat-{run}")).manifest.components["model"]
        frozen = {f for g in comp.layout.groups if not g.requires_grad for f in g.params}
        bufs = {b.fqn for b in comp.buffers}
        if run == "trained":
            assert frozen == set() and bufs == {"pos", "0.weight", "0.bias"}
            continue
        assert frozen == {"0.weight", "0.bias"} and bufs == {"pos"}, (run, frozen, bufs)
        assert [k for k, _ in comp.states[comp.layout.param("0.weight").group]] == ["master"]
        for fqn in ("0.weight", "0.bias"):
            assert torch.equal(flat_state(str(tmp_path / f"flat-{run}"), fqn, "master"),
                               m.state_dict()[fqn])
    from shardckpt.errors import ConfigError
    from shardckpt.interop.dcp.to_flat import import_dcp_flat

    with pytest.raises(ConfigError, match=rf"^{tmp_path / 'trained'}: .*'nothing' matches no "
                                          r"model tensor.*1\.weight has optimizer state"):
        import_dcp_flat(str(tmp_path / "trained"), str(tmp_path / "bad"), 2,
                        frozen=["nothing", r"1\.weight"])
    assert not (tmp_path / "bad" / MANIFEST_NAME).exists()


def test_plain_payloads_import_without_torch_load_strided_ones_through_it(
        source: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A payload holding a plain contiguous tensor is copied as bytes (torch.load is not called);
    a strided one (a transposed tensor DCP saves as it is) goes through torch.load."""
    import io as io_

    from shardckpt.interop.dcp import payload as dcp_payload
    from shardckpt.interop.dcp.storage import ShardckptReader

    monkeypatch.setattr(torch, "load", lambda *a, **k: pytest.fail("torch.load called"))
    import_dcp(str(source), str(tmp_path / "ck"))
    monkeypatch.undo()
    assert_same(dcp_load(reader=ShardckptReader(str(tmp_path / "ck"))), dcp_load(source))
    t = torch.arange(12.0).reshape(3, 4).t()
    dcp_save({"t": t}, tmp_path / "strided")
    import_dcp(str(tmp_path / "strided"), str(tmp_path / "ck2"))
    sd = {"t": torch.zeros(4, 3)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(sd, storage_reader=ShardckptReader(str(tmp_path / "ck2")))
    assert torch.equal(sd["t"], t)
    buf = io_.BytesIO()
    torch.save(t, buf)
    assert dcp_payload.plain_bytes(buf.getvalue(), "float32", (4, 3)) is None
    buf = io_.BytesIO()
    torch.save(t.contiguous(), buf)
    assert bytes(dcp_payload.plain_bytes(buf.getvalue(), "float32", (4, 3))) == \
        t.contiguous().numpy().tobytes()
    assert dcp_payload.plain_bytes(buf.getvalue(), "float32", (3, 4)) is None


def test_import_ranks_and_runtime_load_of_sgd_momentum(tmp_path: Path) -> None:
    """SGD with momentum: ``momentum_buffer`` and SGD's hyper-parameters, imported for 2 ranks and
    loaded (imported, and as chunks) into ``ZeroEngine``; its next step is torch's, bit for bit."""
    from torch import nn
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from shardckpt.interop.dcp.storage import ShardckptWriter
    from shardckpt.runtime import ShardedSGD, ZeroEngine
    from shardckpt.training.save_load import load, save

    def net(seed: int) -> nn.Module:
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 3))

    def step(model: Any, opt: Any, i: int) -> None:
        model(torch.full((2, 4), float(i))).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()

    m = net(0)
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01, foreach=False)
    for i in range(2):
        step(m, opt, i)
    msd, osd = get_state_dict(m, opt)
    dcp_save({"model": msd, "optim": osd}, tmp_path / "src")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": msd, "optim": osd}, storage_writer=ShardckptWriter(str(tmp_path / "ck")))
    r = CliRunner().invoke(app, ["import", "dcp", str(tmp_path / "src"), str(tmp_path / "flat"),
                                 "--ranks", "2"])
    assert r.exit_code == 0, r.output
    man = CheckpointReader(str(tmp_path / "flat")).manifest
    assert man.optimizer is not None and man.optimizer.name == "sgd"
    assert man.optimizer.param_groups[0]["hparams"] == {
        "lr": 0.1, "momentum": 0.9, "dampening": 0, "weight_decay": 0.01, "nesterov": False,
        "maximize": False}
    saved = {fqn: opt.state[p]["momentum_buffer"].clone() for fqn, p in m.named_parameters()}
    for fqn, want in saved.items():
        assert torch.equal(flat_state(str(tmp_path / "flat"), fqn, "momentum_buffer"), want)
    step(m, opt, 2)
    for src in ("flat", "ck"):
        engine = ZeroEngine(net(1), policy=(nn.Linear,))
        sgd = ShardedSGD(engine, lr=1.0, momentum=0.5)
        load(engine, str(tmp_path / src))
        save(engine, str(tmp_path / f"{src}-again"))
        for fqn, want in saved.items():
            got = flat_state(str(tmp_path / f"{src}-again"), fqn, "momentum_buffer")
            assert torch.equal(got, want), (src, fqn)
        step(engine, sgd, 2)
        full = engine.full_state_dict()
        assert all(torch.equal(full[k], v) for k, v in m.state_dict().items()), src
