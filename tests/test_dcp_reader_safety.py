"""Loading a checkpoint through ``ShardckptReader`` never runs code a stored value names.

A checkpoint ``ShardckptWriter`` wrote holds each non-tensor value as ``torch.save`` bytes, and
DCP's default load planner decodes those with ``torch.load(weights_only=False)``. Here a value's
pickle calls ``os.system("touch <marker>")``: the checkpoint verifies (its manifest is plain JSON),
yet loading it must refuse that value by key, file and global, and the marker must not appear.
Values ``torch.load(weights_only=True)`` loads still round-trip; ``allow_pickle=True`` is the
opt-in for trusted checkpoints.

Names added by this change (``UnsafePickleError``, ``allow_pickle``, the planner) are looked up
inside the tests, so that on a reader without the check the tests fail on what they check.
"""

from __future__ import annotations

import collections
import io
import os
import pickle
import shlex
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from shardckpt import errors
from shardckpt.checkpoint.verify import verify
from shardckpt.interop.dcp.storage import ShardckptReader, ShardckptWriter

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


class RunsCommand:
    """A value whose pickle is ``os.system(cmd)``: unpickling it runs ``cmd``."""

    def __init__(self, cmd: str) -> None:
        self.cmd = cmd

    def __reduce__(self) -> Any:
        return (os.system, (self.cmd,))


@dataclass
class RunInfo:
    """A user class: loads with ``weights_only=True`` only once allow-listed."""

    step: int
    tag: str


def _weights() -> torch.Tensor:
    return torch.arange(6, dtype=torch.float32).reshape(2, 3)


def _hostile(tmp_path: Path, name: str = "ck") -> tuple[str, Path]:
    """A committed checkpoint of one tensor and one value that touches a marker when unpickled."""
    marker = tmp_path / f"{name}-ran"
    url = str(tmp_path / name)
    dcp.save({"w": _weights(), "extra": {"note": RunsCommand(f"touch {shlex.quote(str(marker))}")}},
             storage_writer=ShardckptWriter(url))
    return url, marker


def _target() -> dict[str, Any]:
    return {"w": torch.zeros(2, 3), "extra": {"note": None}}


def _benign() -> dict[str, Any]:
    return {"w": _weights(),
            "meta": {"epoch": 3, "name": "run-a", "lr": 0.25, "tags": ["x", "y"], "seen": {1, 2},
                     "none": None,  # a tuple is one value (DCP flattens mappings, not tuples):
                     "more": (collections.OrderedDict(b=2, a=1), collections.Counter("aab"),
                              b"raw", bytearray(b"ab"), complex(1, 2), torch.float16),
                     "pair": (torch.tensor([1.5, 2.5]), 7)}}


def _empty_like(sd: dict[str, Any]) -> dict[str, Any]:
    return {"w": torch.zeros(2, 3), "meta": {k: None for k in sd["meta"]}}


def _assert_benign_loaded(got: dict[str, Any]) -> None:
    want = _benign()
    assert torch.equal(got["w"], want["w"])
    pair = got["meta"].pop("pair")
    want_pair = want["meta"].pop("pair")
    assert torch.equal(pair[0], want_pair[0]) and pair[1] == want_pair[1]
    assert got["meta"] == want["meta"]


def _failures(e: CheckpointException) -> list[BaseException]:
    return [exc for exc, _ in e.failures.values()]


def test_default_planner_load_refuses_the_value_and_runs_nothing(tmp_path: Path) -> None:
    url, marker = _hostile(tmp_path)
    assert verify(url)  # the checkpoint is well formed: only the reader stands in the way
    target = _target()
    raised: BaseException | None = None
    try:
        dcp.load(target, storage_reader=ShardckptReader(url))
    except CheckpointException as e:
        raised = e
    assert not marker.exists(), "loading ran the command the stored value names"
    assert raised is not None
    (err,) = _failures(raised)
    assert isinstance(err, errors.UnsafePickleError) and isinstance(err, errors.ShardckptError)
    assert err.key == "extra.note" and err.refused == ("posix.system",)
    assert err.file.endswith("chunks-00000.safetensors")
    for part in ("extra.note", "posix.system", err.file, "allow_pickle=True"):
        assert part in str(err)
    assert torch.equal(target["w"], torch.zeros(2, 3))  # refused before anything was handed over


def test_dcp_checkpointer_raises_rather_than_skip_to_an_older_step(tmp_path: Path) -> None:
    from shardckpt.interop.dcp.checkpointer import DcpCheckpointer

    run = tmp_path / "run"
    marker = tmp_path / "ran"
    ckpt = DcpCheckpointer(str(run))
    ckpt.save(1, {"w": _weights(), "extra": {"note": "fine"}})
    hostile = RunsCommand(f"touch {shlex.quote(str(marker))}")
    ckpt.save(2, {"w": _weights(), "extra": {"note": hostile}})
    target = _target()
    raised: BaseException | None = None
    try:
        DcpCheckpointer(str(run)).load_latest(target)
    except Exception as e:  # noqa: BLE001 - checked below, after the marker
        raised = e
    assert not marker.exists(), "loading ran the command the stored value names"
    assert isinstance(raised, errors.UnsafePickleError), raised
    assert raised.key == "extra.note" and raised.refused == ("posix.system",)
    assert ckpt.manager.url_for(2) in str(raised) and "posix.system" in str(raised)
    assert target["extra"]["note"] is None  # not quietly resumed from step 1 either


def test_benign_values_round_trip_with_the_default_planner(tmp_path: Path) -> None:
    url = str(tmp_path / "ck")
    dcp.save(_benign(), storage_writer=ShardckptWriter(url))
    got = _empty_like(_benign())
    dcp.load(got, storage_reader=ShardckptReader(url))
    _assert_benign_loaded(got)


def test_benign_values_round_trip_through_dcp_checkpointer(tmp_path: Path) -> None:
    from shardckpt.interop.dcp.checkpointer import DcpCheckpointer

    ckpt = DcpCheckpointer(str(tmp_path / "run"))
    ckpt.save(4, _benign())
    got = _empty_like(_benign())
    assert DcpCheckpointer(str(tmp_path / "run")).load_latest(got) == 4
    _assert_benign_loaded(got)


def test_user_class_loads_once_allow_listed_as_with_torch_load(tmp_path: Path) -> None:
    url = str(tmp_path / "ck")
    dcp.save({"w": _weights(), "info": RunInfo(7, "a")}, storage_writer=ShardckptWriter(url))
    name = f"{RunInfo.__module__}.RunInfo"
    with pytest.raises(CheckpointException) as ei:
        dcp.load({"w": torch.zeros(2, 3), "info": None}, storage_reader=ShardckptReader(url))
    (err,) = _failures(ei.value)
    assert isinstance(err, errors.UnsafePickleError)
    assert err.key == "info" and err.refused == (name,)
    got: dict[str, Any] = {"w": torch.zeros(2, 3), "info": None}
    with torch.serialization.safe_globals([RunInfo]):
        dcp.load(got, storage_reader=ShardckptReader(url))
    assert got["info"] == RunInfo(7, "a")


def test_allow_pickle_loads_what_weights_only_refuses(tmp_path: Path) -> None:
    url = str(tmp_path / "ck")
    dcp.save({"w": _weights(), "info": RunInfo(7, "a")}, storage_writer=ShardckptWriter(url))
    got: dict[str, Any] = {"w": torch.zeros(2, 3), "info": None}
    dcp.load(got, storage_reader=ShardckptReader(url, allow_pickle=True))
    assert got["info"] == RunInfo(7, "a") and torch.equal(got["w"], _weights())

    url = str(tmp_path / "benign")
    dcp.save(_benign(), storage_writer=ShardckptWriter(url))
    got = _empty_like(_benign())
    dcp.load(got, storage_reader=ShardckptReader(url, allow_pickle=True))
    _assert_benign_loaded(got)


def test_allow_pickle_is_what_it_says(tmp_path: Path) -> None:
    """The opt-in hands the value over unchecked, and DCP's default planner runs it (here: a
    marker file in the test's own folder). This also shows the hostile value is a real one."""
    url, marker = _hostile(tmp_path)
    dcp.load(_target(), storage_reader=ShardckptReader(url, allow_pickle=True))
    assert marker.exists()


def test_weights_only_planner_refuses_even_an_unchecked_value(tmp_path: Path) -> None:
    """Defence in depth: ``WeightsOnlyLoadPlanner`` decodes with weights_only=True itself."""
    from shardckpt.interop.dcp.storage import WeightsOnlyLoadPlanner

    url, marker = _hostile(tmp_path)
    with pytest.raises(CheckpointException, match="posix.system"):
        dcp.load(_target(), storage_reader=ShardckptReader(url, allow_pickle=True),
                 planner=WeightsOnlyLoadPlanner())
    assert not marker.exists()
    got = _empty_like(_benign())
    url = str(tmp_path / "benign")
    dcp.save(_benign(), storage_writer=ShardckptWriter(url))
    dcp.load(got, storage_reader=ShardckptReader(url), planner=WeightsOnlyLoadPlanner())
    _assert_benign_loaded(got)


# The check on its own: bytes crafted by hand, each refused by name or by torch's decode.


def _saved(value: Any, **kwargs: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(value, buf, **kwargs)
    return buf.getvalue()


def _with_data_pkl(raw: bytes) -> bytes:
    """A ``torch.save`` archive whose ``data.pkl`` is ``raw``."""
    src = zipfile.ZipFile(io.BytesIO(_saved(1)))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as z:
        for n in src.namelist():
            z.writestr(n, raw if n.endswith("/data.pkl") else src.read(n))
    return out.getvalue()


@pytest.mark.parametrize("value", [3, "x", 1.5, None, b"raw", {"a": [1, (2, "b")]}, {1, 2},
                                   collections.OrderedDict(a=1), collections.Counter("aab"),
                                   torch.ones(3), {"t": torch.arange(4)}, torch.float16,
                                   torch.nn.Parameter(torch.ones(2)), complex(1, 2)])
def test_check_admits_what_weights_only_loads(value: Any) -> None:
    from shardckpt.interop.safe_unpickle import check_value

    check_value(_saved(value), "k", "f")
    check_value(_saved(value, _use_new_zipfile_serialization=False), "k", "f")


@pytest.mark.parametrize("data, refused", [
    (_saved(RunsCommand("true")), ("posix.system",)),
    (_saved(RunsCommand("true"), _use_new_zipfile_serialization=False), ("posix.system",)),
    (pickle.dumps(RunsCommand("true"), protocol=4), ("posix.system",)),  # STACK_GLOBAL
    (pickle.dumps(RunsCommand("true"), protocol=0), ("posix.system",)),
    (_saved([RunsCommand("true"), eval]), ("posix.system", "builtins.eval")),
    (_saved(io.BytesIO(b"x")), ("_io.BytesIO",)),
], ids=["torch.save", "legacy", "protocol-4", "protocol-0", "two", "bytesio"])
def test_check_names_each_refused_global(data: bytes, refused: tuple[str, ...]) -> None:
    from shardckpt.interop.safe_unpickle import check_value

    with pytest.raises(errors.UnsafePickleError) as ei:
        check_value(data, "opt.extra", "s/chunks-00003.safetensors", "file:///ck")
    assert ei.value.refused == refused
    assert ei.value.key == "opt.extra" and ei.value.file == "s/chunks-00003.safetensors"
    assert all(r in str(ei.value) for r in refused)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # torch.jit.script / save
def test_check_defers_to_torch_for_what_names_alone_do_not_show() -> None:
    """Allowed names used in a way torch's weights-only unpickler refuses (setting an attribute
    on the class ``torch.Tensor``), a pickle protocol it does not read, a TorchScript archive."""
    from shardckpt.interop.safe_unpickle import check_value

    build_on_class = (b"\x80\x02ctorch\nTensor\nq\x00"  # torch.Tensor, then BUILD (None, {foo: 1})
                      b"N}q\x01X\x03\x00\x00\x00fooq\x02K\x01s\x86q\x03b.")
    with pytest.raises(errors.UnsafePickleError, match="Can only build"):
        check_value(_with_data_pkl(build_on_class), "k", "f")
    assert not hasattr(torch.Tensor, "foo")
    with pytest.raises(errors.UnsafePickleError, match="Unsupported operand"):
        check_value(pickle.dumps(collections.OrderedDict(a=1), protocol=4), "k", "f")
    script = io.BytesIO()
    torch.jit.save(torch.jit.script(torch.nn.Linear(2, 2)), script)
    with pytest.raises(errors.UnsafePickleError, match="TorchScript"):
        check_value(script.getvalue(), "k", "f")


def test_error_keeps_its_fields_across_processes() -> None:
    """DCP gathers each rank's exception to every rank by pickling it."""
    e = errors.UnsafePickleError("m", key="k", file="f", refused=("posix.system",))
    back = pickle.loads(pickle.dumps(e))
    assert type(back) is errors.UnsafePickleError
    assert (back.key, back.file, back.refused, str(back)) == ("k", "f", ("posix.system",), "m")
