"""Open once, pass down: a plain offline command reads each source manifest once and opens one
storage handle per location (the command line's run-directory check included);
``Checkpointer.load`` opens one reader per rank.

Counted from outside the code under test: every ``Storage`` constructed and every read of a
``manifest.json`` through it, every ``CheckpointReader`` constructed.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from pathlib import Path
from typing import Any, Iterator

import pytest

from shardckpt.checkpoint.reader import CheckpointReader
from shardckpt.format.manifest import MANIFEST_NAME
from shardckpt.storage import Storage
from shardckpt.tools.synth import synthesize
from testing.cli import cli


class Counts:
    """Storage handles by URL, manifest reads by checkpoint URL, readers by checkpoint URL."""

    def __init__(self) -> None:
        self.storages: Counter[str] = Counter()
        self.manifest_reads: Counter[str] = Counter()
        self.readers: Counter[str] = Counter()


@pytest.fixture
def counts(monkeypatch: pytest.MonkeyPatch) -> Counts:
    c = Counts()
    init = Storage.__init__

    def counted_init(self: Storage, url: str, *args: Any, **kwargs: Any) -> None:
        init(self, url, *args, **kwargs)
        c.storages[self.url] += 1

    monkeypatch.setattr(Storage, "__init__", counted_init)
    for name in ("read", "read_prefix", "read_limited"):
        real = getattr(Storage, name)

        def reading(self: Storage, rel: str, *args: Any, _real: Any = real, **kwargs: Any) -> Any:
            if rel == MANIFEST_NAME:
                c.manifest_reads[self.url] += 1
            return _real(self, rel, *args, **kwargs)

        monkeypatch.setattr(Storage, name, reading)
    reader_init = CheckpointReader.__init__

    def counted_reader(self: CheckpointReader, *args: Any, **kwargs: Any) -> None:
        reader_init(self, *args, **kwargs)
        c.readers[self.url] += 1

    monkeypatch.setattr(CheckpointReader, "__init__", counted_reader)
    return c


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    root = tmp_path_factory.mktemp("once")
    a, b = str(root / "a"), str(root / "b")
    synthesize(a, 20_000, ranks=4, units=2, seed=0)
    synthesize(b, 20_000, ranks=2, units=2, seed=1)
    return a, b


def _run(*args: str) -> None:
    r = cli(*args)
    assert r.exit_code in (0, 1), r.output  # diff exits 1 when the checkpoints differ


@contextlib.contextmanager
def _entry(counts: Counts) -> Iterator[Counts]:
    """Counts of the library call alone (what the command calls once its arguments are read)."""
    for c in (counts.storages, counts.manifest_reads, counts.readers):
        c.clear()
    yield counts


def _no_progress(total: int) -> Any:
    return contextlib.nullcontext(lambda n: None)


def test_reshard_reads_the_source_manifest_once(counts: Counts, ckpts: tuple[str, str],
                                                tmp_path: Path) -> None:
    from shardckpt.tools.jobs import run_reshard

    src, _ = ckpts
    dst = str(tmp_path / "dst")
    with _entry(counts):
        run_reshard(src, dst, 3, None, 1, 1, False, None, 1 << 20, None, _no_progress)
    assert counts.manifest_reads[src] == 1
    assert counts.readers == Counter({src: 1})
    assert counts.storages[src] == 1 and counts.storages[dst] == 1
    with _entry(counts):
        _run("reshard", src, str(tmp_path / "cli"), "--to", "3")
    assert counts.manifest_reads[src] == 1 and counts.readers == Counter({src: 1})
    assert counts.storages[str(tmp_path / "cli")] == 1


def test_reshard_with_workers_hands_them_the_parsed_manifest(counts: Counts,
                                                             ckpts: tuple[str, str],
                                                             tmp_path: Path) -> None:
    """The worker processes open storage again (another process) but read no manifest: the
    parent's is passed to them. Counted here: the parent's reads."""
    from shardckpt.tools.reshard import reshard

    src, _ = ckpts
    with _entry(counts):
        r = reshard(src, str(tmp_path / "w"), 3, workers=2)
    assert counts.manifest_reads[src] == 1 and counts.readers == Counter({src: 1})
    assert r.bytes_read > 0


def test_consolidate_reads_the_source_manifest_once(counts: Counts, ckpts: tuple[str, str],
                                                    tmp_path: Path) -> None:
    from shardckpt.tools.jobs import run_consolidate

    src, _ = ckpts
    dst = str(tmp_path / "hf")
    with _entry(counts):
        run_consolidate(src, dst, "bf16", 1 << 30, "model", "model.", False, False, None, None,
                        1 << 20, None, _no_progress)
    assert counts.manifest_reads[src] == 1
    assert counts.readers == Counter({src: 1})
    assert counts.storages[src] == 1 and counts.storages[dst] == 1
    with _entry(counts):
        _run("consolidate", src, str(tmp_path / "cli"))
    assert counts.manifest_reads[src] == 1 and counts.readers == Counter({src: 1})
    assert counts.storages[str(tmp_path / "cli")] == 1


def test_diff_reads_each_manifest_once(counts: Counts, ckpts: tuple[str, str]) -> None:
    from shardckpt.tools.jobs import run_diff

    a, b = ckpts
    for call in (lambda: run_diff(a, b, None, 1 << 20, None, _no_progress),
                 lambda: _run("diff", a, b)):
        with _entry(counts):
            call()
        assert counts.manifest_reads == Counter({a: 1, b: 1})
        assert counts.readers == Counter({a: 1, b: 1})
        assert counts.storages == Counter({a: 1, b: 1})


def test_verify_reads_the_manifest_once(counts: Counts, ckpts: tuple[str, str]) -> None:
    from shardckpt.tools.jobs import run_verify

    a, _ = ckpts
    with _entry(counts):
        assert run_verify(a, None, 2, None, _no_progress).ok
    assert counts.manifest_reads == Counter({a: 1})
    assert counts.storages == Counter({a: 1})
    with _entry(counts):
        _run("verify", a)
    assert counts.manifest_reads == Counter({a: 1})


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A run directory whose ``latest`` names its one checkpoint."""
    run = tmp_path_factory.mktemp("once-run") / "run"
    synthesize(str(run / "step-00000007"), 20_000, ranks=2, units=2, seed=2, step=7)
    (run / "latest").write_text("step-00000007\n")
    return str(run)


@pytest.mark.parametrize("command", ["reshard", "consolidate", "verify", "inspect", "diff"])
@pytest.mark.parametrize("through_run_dir", [False, True], ids=["checkpoint", "run-dir"])
def test_a_command_opens_each_location_once(counts: Counts, ckpts: tuple[str, str], run_dir: str,
                                            tmp_path: Path, command: str,
                                            through_run_dir: bool) -> None:
    """One ``Storage`` per location a command names, counted at the command line: the
    run-directory check opens the source, and the command reads through that handle. A run
    directory is one location and the checkpoint its ``latest`` names another."""
    if through_run_dir and command == "diff":
        pytest.skip("diff compares the checkpoints it is given (no run directories)")
    a, b = ckpts
    src = run_dir if through_run_dir else a
    ckpt = f"{run_dir}/step-00000007" if through_run_dir else a  # the checkpoint src names
    dst = str(tmp_path / "out")
    args, read = {"reshard": (["reshard", src, dst, "--to", "3"], [ckpt]),
                  "consolidate": (["consolidate", src, dst], [ckpt]),
                  "verify": (["verify", src], [ckpt]), "inspect": (["inspect", src], [ckpt]),
                  "diff": (["diff", src, b], [ckpt, b])}[command]
    opened = {src, *read} | ({dst} if command in ("reshard", "consolidate") else set())
    with _entry(counts):
        _run(*args)
    assert counts.storages == Counter(opened)
    assert counts.manifest_reads == Counter(read)


@pytest.mark.usefixtures("one_thread")
def test_checkpointer_load_opens_one_reader(counts: Counts, tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    from shardckpt.runtime import ZeroEngine
    from shardckpt.runtime.mesh import ProcessMesh
    from shardckpt.runtime.models.llama import LLAMA_POLICY, LlamaConfig, LlamaForCausalLM
    from shardckpt.training.checkpointer import Checkpointer

    cfg = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1)
    torch.manual_seed(0)
    engine = ZeroEngine(LlamaForCausalLM(cfg), policy=LLAMA_POLICY,
                        process_mesh=ProcessMesh.single())
    ckpt = Checkpointer(str(tmp_path / "run"), engine)
    ckpt.save(1)
    url = ckpt.manager.url_for(1)
    with _entry(counts):
        ckpt.load(url)
    assert counts.readers == Counter({url: 1})
    assert counts.manifest_reads == Counter({url: 1})


@pytest.mark.usefixtures("one_thread")
def test_checkpointer_load_of_chunked_tensors_opens_one_reader(counts: Counts,
                                                               tmp_path: Path) -> None:
    """A checkpoint of chunked tensors (what a module and its optimizer saved through DCP) loads
    through ``load_chunked``, which reads through the reader the load opened; nothing opens the
    checkpoint again (per-rank state included)."""
    torch = pytest.importorskip("torch")
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch import nn
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from shardckpt.interop.dcp.storage import ShardckptWriter
    from shardckpt.runtime import ShardedAdamW, ZeroEngine
    from shardckpt.training.checkpointer import Checkpointer

    def net(seed: int) -> nn.Module:
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 3))

    m = net(0)
    opt = torch.optim.AdamW(m.parameters(), lr=0.1)
    m(torch.ones(2, 4)).pow(2).sum().backward()
    opt.step()
    msd, osd = get_state_dict(m, opt)
    url = str(tmp_path / "ck")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": msd, "optim": osd}, storage_writer=ShardckptWriter(url))
    engine = ZeroEngine(net(1), policy=(nn.Linear,))
    ShardedAdamW(engine, [p for _, p in engine.named_parameters()], lr=1.0)
    with _entry(counts):
        res = Checkpointer(str(tmp_path / "run"), engine).load(url)
    assert res.manifest.chunked is not None  # the chunked path was taken
    assert counts.readers == Counter({url: 1})
    assert counts.manifest_reads == Counter({url: 1})
    full = engine.full_state_dict()
    assert all(torch.equal(full[k], v) for k, v in m.state_dict().items())
    engine.close()
