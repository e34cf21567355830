"""Hugging Face and DeepSpeed inputs written by someone who is not trusted: symbolic links are
followed only inside the source's root (a Hugging Face cache snapshot's root is its repository
folder, so its blobs work), a DeepSpeed file's tensors can yield no more than the bytes the file
holds for them, a file is never read whole before it is checked, and every bad input is one error
line naming the input file (not the destination) with its whole reason."""

from __future__ import annotations

import json
import math
import os
import shutil
import struct
import zipfile
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
from safetensors.numpy import save_file

from shardckpt.errors import IntegrityError
from shardckpt.format.manifest import MANIFEST_NAME
from testing.ckpts import make_ckpt
from testing.cli import cli, ok, one_line_error

torch = pytest.importorskip("torch")

FIXTURES = Path(__file__).parent / "fixtures" / "deepspeed"
TAG = "global_step3"
RANK0 = f"{TAG}/zero_pp_rank_0_mp_rank_00_optim_states.pt"
SECRET = b"-----BEGIN OPENSSH PRIVATE KEY-----\nnot for anyone\n"


def nothing_written(dst: Path) -> None:
    assert not (dst / MANIFEST_NAME).exists()
    assert not dst.exists() or not [p for p in dst.rglob("*") if p.is_file()], list(dst.rglob("*"))


def secret(root: Path) -> Path:
    """A private key outside every source folder."""
    (root / "home" / ".ssh").mkdir(parents=True)
    key = root / "home" / ".ssh" / "id_ed25519"
    key.write_bytes(SECRET)
    return key


# ------------------------------------------------------------------ Hugging Face folders


def hf_weights(folder: Path, config: str = '{"model_type": "llama"}') -> None:
    """A one-file Hugging Face model folder: two small tensors and ``config.json``."""
    folder.mkdir(parents=True, exist_ok=True)
    save_file({"model.embed_tokens.weight": np.ones((4, 4), np.float32),
               "model.norm.weight": np.ones(4, np.float32)}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(config)


def hf_header(folder: Path, header: dict[str, Any], data: bytes = b"\0" * 4) -> None:
    """A ``model.safetensors`` with the header ``header`` (written as JSON, non-ASCII escaped)."""
    folder.mkdir(parents=True, exist_ok=True)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    (folder / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw + data)


def cache_snapshot(root: Path, files: dict[str, bytes]) -> Path:
    """A Hugging Face cache repository: each file a link ``snapshots/<rev>/<name> ->
    ../../blobs/<sha>``, as ``huggingface_hub`` lays it out; returns the snapshot folder."""
    repo = root / "hub" / "models--org--tiny"
    snap = repo / "snapshots" / "0123456789abcdef0123456789abcdef01234567"
    (repo / "blobs").mkdir(parents=True)
    snap.mkdir(parents=True)
    for i, (name, data) in enumerate(files.items()):
        (repo / "blobs" / f"{i:040x}").write_bytes(data)
        (snap / name).symlink_to(f"../../blobs/{i:040x}")
    return snap


def test_copy_from_follows_links_only_inside_the_folder(tmp_path: Path) -> None:
    key = secret(tmp_path)
    ckpt, _ = make_ckpt(tmp_path)
    # a Hugging Face cache snapshot: every file is a link into the repository's blobs/
    snap = cache_snapshot(tmp_path, {"tokenizer.json": b'{"tok": 1}',
                                     "generation_config.json": b'{"gen": 1}'})
    out = tmp_path / "hf"
    ok(cli("consolidate", ckpt, str(out), "--copy-from", str(snap)))
    assert (out / "tokenizer.json").read_bytes() == b'{"tok": 1}'
    assert (out / "generation_config.json").read_bytes() == b'{"gen": 1}'
    # a link out of the snapshot's repository folder: refused, naming the link and its target
    (snap / "vocab.json").symlink_to(os.path.relpath(key, snap))
    bad = tmp_path / "hf2"
    line = one_line_error(cli("consolidate", ckpt, str(bad), "--copy-from", str(snap)),
                          str(snap / "vocab.json"), str(key), "outside")
    assert "PRIVATE" not in line
    nothing_written(bad)
    # a plain folder: its root is the folder itself, a link into a sibling is refused too
    plain = tmp_path / "upstream"
    plain.mkdir()
    (plain / "tokenizer_config.json").write_text("{}")
    (plain / "tokenizer.json").symlink_to(key)
    one_line_error(cli("consolidate", ckpt, str(tmp_path / "hf3"), "--copy-from", str(plain)),
                   str(plain / "tokenizer.json"), str(key))
    nothing_written(tmp_path / "hf3")
    assert SECRET not in b"".join(p.read_bytes() for p in tmp_path.rglob("*.json")
                                if p.is_file() and not p.is_symlink())


def test_import_hf_follows_links_only_inside_the_folder(tmp_path: Path) -> None:
    key = secret(tmp_path)
    plain = tmp_path / "plain"
    hf_weights(plain)
    snap = cache_snapshot(tmp_path, {"model.safetensors": (plain / "model.safetensors").read_bytes(),
                                     "config.json": b'{"model_type": "llama"}'})
    ok(cli("import", "hf", str(snap), str(tmp_path / "ok"), "--ranks", "1"))
    # config.json leading out of the cache repository
    (snap / "config.json").unlink()
    (snap / "config.json").symlink_to(key)
    one_line_error(cli("import", "hf", str(snap), str(tmp_path / "a"), "--ranks", "1"),
                   str(snap / "config.json"), str(key), "outside")
    nothing_written(tmp_path / "a")
    # weights leading out of a plain folder
    other = tmp_path / "elsewhere.safetensors"
    shutil.copy(plain / "model.safetensors", other)
    (plain / "model.safetensors").unlink()
    (plain / "model.safetensors").symlink_to(other)
    one_line_error(cli("import", "hf", str(plain), str(tmp_path / "b"), "--ranks", "1"),
                   str(plain / "model.safetensors"), str(other), "outside")
    nothing_written(tmp_path / "b")


@pytest.mark.parametrize("config", ['{"model_type": "llama", "x": NaN}',
                                    '{"model_type": "llama", "x": -Infinity}',
                                    '{"model_type": "llama", "x": 1e999}'])
def test_config_json_out_of_range_is_one_line(tmp_path: Path, config: str) -> None:
    src = tmp_path / "src"
    hf_weights(src, config)
    one_line_error(cli("import", "hf", str(src), str(tmp_path / "out"), "--ranks", "1"),
                   str(src / "config.json"), "not valid JSON")
    nothing_written(tmp_path / "out")
    # consolidate copying it from a model folder: refused before anything is written
    ckpt, _ = make_ckpt(tmp_path)
    one_line_error(cli("consolidate", ckpt, str(tmp_path / "hf"), "--copy-from", str(src)),
                   str(src / "config.json"), "not valid JSON")
    nothing_written(tmp_path / "hf")


@pytest.mark.parametrize("case,needles", [
    ("name-surrogate", ("'a\\udc80'", "lone UTF-16 surrogate")),
    ("name-long", ("5000 characters", "at most 4096")),
    ("shape-huge", ("1000000000000000000000000000000", "2**53")),
    ("config-surrogate", ("config.json", "'x\\udc80\\n' (a key)", "lone UTF-16 surrogate")),
])
def test_errors_name_the_input_file(tmp_path: Path, case: str, needles: tuple[str, ...]) -> None:
    src, dst = tmp_path / "src", tmp_path / "dst"
    one = {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}
    if case == "name-surrogate":
        hf_header(src, {"a\udc80": one})
    elif case == "name-long":
        hf_header(src, {"x" * 5000: one})
    elif case == "shape-huge":
        hf_header(src, {"w": {"dtype": "F32", "shape": [0, 10**30], "data_offsets": [0, 0]},
                        "v": one})
    else:
        hf_weights(src, json.dumps({"model_type": "llama", "x\udc80\n": 1}))
    bad = src / ("config.json" if case.startswith("config") else "model.safetensors")
    line = one_line_error(cli("import", "hf", str(src), str(dst), "--ranks", "1"), str(bad), *needles)
    assert MANIFEST_NAME not in line and str(dst) not in line
    nothing_written(dst)


# --------------------------------------------------------------------- DeepSpeed folders


def ds_copy(tmp_path: Path, name: str = "zero2-fp32-2") -> Path:
    dst = tmp_path / name
    shutil.copytree(FIXTURES / name, dst)
    return dst


def rewrite_rank0(src: Path, change: Callable[[dict[str, Any]], None]) -> None:
    """Load rank 0's optimizer file, ``change`` its ``optimizer_state_dict`` and save it back
    (without the DeepSpeed objects the import does not use, which plain torch cannot reload)."""
    from shardckpt.interop.deepspeed.files import load_pt
    from shardckpt.storage import Storage

    sd = load_pt(Storage(str(src)), RANK0)
    osd = sd["optimizer_state_dict"]
    osd.pop("loss_scaler")
    osd.pop("param_slice_mappings")
    change(osd)
    torch.save(sd, src / RANK0)


def refused(src: Path, dst: Path, *needles: str) -> str:
    from shardckpt.interop.deepspeed.import_ import import_deepspeed

    with pytest.raises(IntegrityError) as e:
        import_deepspeed(str(src), str(dst), 2)
    msg = str(e.value)
    assert "\n" not in msg, msg
    for n in needles:
        assert n in msg, (n, msg)
    nothing_written(dst)
    return msg


def test_a_view_that_repeats_elements_is_refused(tmp_path: Path) -> None:
    """A few kilobytes declaring 10**7 elements through stride 0 (and a view whose rows overlap)
    are refused before a value is read, naming the file and the key."""
    src = ds_copy(tmp_path)

    def expand(osd: dict[str, Any]) -> None:
        osd["single_partition_of_fp32_groups"][0] = torch.zeros(1).expand(10**7)

    rewrite_rank0(src, expand)
    assert (src / RANK0).stat().st_size < 64 << 10
    refused(src, tmp_path / "out", str(src / RANK0),
            "'optimizer_state_dict.single_partition_of_fp32_groups[0]'", "overlap", "strides [0]")

    def overlap(osd: dict[str, Any]) -> None:
        st = osd["base_optimizer_state"]["state"][0]
        st["exp_avg"] = torch.zeros(8191).as_strided((4096, 4096), (1, 1))

    src = ds_copy(tmp_path / "again")
    rewrite_rank0(src, overlap)
    refused(src, tmp_path / "out2", str(src / RANK0),
            "'optimizer_state_dict.base_optimizer_state.state.0.exp_avg'", "overlap")


class CountingReads:
    """Wraps the local backend's reads: counts the bytes asked for and refuses (before reading)
    any single request over ``limit`` bytes."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, limit: int) -> None:
        from shardckpt.storage.local import LocalBackend

        self.asked = 0
        real_read, real_prefix = LocalBackend.read, LocalBackend.read_prefix
        counter = self

        def read(self: Any, path: str, url: str, start: int | None = None,
                 end: int | None = None) -> bytes:
            n = (os.path.getsize(path) if end is None else end) - (start or 0)
            counter.take(n, url)
            return real_read(self, path, url, start, end)

        def read_prefix(self: Any, path: str, url: str, n: int) -> bytes:
            counter.take(min(n, os.path.getsize(path)), url)
            return real_prefix(self, path, url, n)

        self.limit = limit
        monkeypatch.setattr(LocalBackend, "read", read)
        monkeypatch.setattr(LocalBackend, "read_prefix", read_prefix)

    def take(self, n: int, url: str) -> None:
        assert n <= self.limit, f"{url}: a read of {n} bytes"
        self.asked += n


def test_a_sparse_tail_is_refused_before_the_file_is_read(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    src = ds_copy(tmp_path)
    with open(src / RANK0, "r+b") as f:  # a valid archive, then 3 GiB of holes (free on disk)
        f.truncate((src / RANK0).stat().st_size + (3 << 30))
    reads = CountingReads(monkeypatch, 1 << 20)
    refused(src, tmp_path / "out", str(src / RANK0), "no zip end record")
    assert reads.asked < 4 << 20


def test_a_record_declaring_more_than_the_file_holds(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A storage record whose central directory entry says 3 GiB in a 30 KB file."""
    src = ds_copy(tmp_path)
    raw = bytearray((src / RANK0).read_bytes())
    with zipfile.ZipFile(src / RANK0) as z:
        info = next(i for i in z.infolist() if i.filename.endswith("/data/1"))
    at = raw.find(b"PK\x01\x02")
    while raw[at + 46:at + 46 + len(info.filename)] != info.filename.encode():
        at = raw.find(b"PK\x01\x02", at + 4)
    struct.pack_into("<II", raw, at + 20, 3 << 30, 3 << 30)  # compressed and stored size
    (src / RANK0).write_bytes(bytes(raw))
    reads = CountingReads(monkeypatch, 1 << 20)
    refused(src, tmp_path / "out", str(src / RANK0), "data/1", "declares 3221225472 bytes")
    assert reads.asked < 4 << 20


def test_stage_enum_of_infinity_is_one_line(tmp_path: Path) -> None:
    src = ds_copy(tmp_path)
    z = zipfile.ZipFile(src / RANK0)
    members = [(i.filename, z.read(i)) for i in z.infolist()]
    z.close()
    with zipfile.ZipFile(src / RANK0, "w", zipfile.ZIP_STORED) as out:
        for name, data in members:
            if name.endswith("/data.pkl"):
                old = b"ZeroStageEnum\nqdK\x02"
                assert old in data
                data = data.replace(old, b"ZeroStageEnum\nqdG" + struct.pack(">d", math.inf))
            out.writestr(name, data)
    dst = tmp_path / "out"
    one_line_error(cli("import", "deepspeed", str(src), str(dst), "--ranks", "2"),
                   str(src / RANK0), "ZeRO stage", "inf")
    nothing_written(dst)


def test_a_tag_with_a_newline_is_shown_whole(tmp_path: Path) -> None:
    src = ds_copy(tmp_path)
    (src / "latest").write_text("global_step3\nthe rest of the reason")
    line = one_line_error(cli("import", "deepspeed", str(src), str(tmp_path / "out"), "--ranks", "2"),
                          str(src / "latest"), "'global_step3\\nthe rest of the reason'",
                          "not a folder name")
    assert line.rstrip().endswith("--tag to name the checkpoint folder")
    nothing_written(tmp_path / "out")


def test_deepspeed_files_follow_links_only_inside_the_folder(tmp_path: Path) -> None:
    src = ds_copy(tmp_path)
    outside = tmp_path / "elsewhere.pt"
    shutil.move(src / RANK0, outside)
    (src / RANK0).symlink_to(outside)
    one_line_error(cli("import", "deepspeed", str(src), str(tmp_path / "out"), "--ranks", "2"),
                   str(src / RANK0), str(outside), "outside")
    nothing_written(tmp_path / "out")
    # a link that stays inside the folder works
    inside = src / "kept.pt"
    shutil.move(outside, inside)
    (src / RANK0).unlink()
    (src / RANK0).symlink_to(os.path.relpath(inside, src / TAG))
    ok(cli("import", "deepspeed", str(src), str(tmp_path / "ok"), "--ranks", "2"))


# ------------------------------------------- the integrations' app state, written by a hostile author


def _dcp_save(path: Path, state: dict[str, Any], extras: dict[str, Any] | None = None) -> None:
    import torch.distributed.checkpoint as dcp

    from shardckpt.interop.dcp.storage import ShardckptWriter

    dcp.save(state, storage_writer=ShardckptWriter(str(path), extras=extras))


def _with_persistent_id() -> bytes:
    import io
    import pickle

    class P(pickle.Pickler):
        def persistent_id(self, obj: Any) -> Any:
            return "storage-0" if obj == "x" else None

    buf = io.BytesIO()
    P(buf).dump({"a": "x"})
    return buf.getvalue()


class _RunsCode:
    def __reduce__(self) -> Any:
        return (os.system, ("true",))


@pytest.mark.parametrize("payload, named", [
    (lambda: __import__("pickle").dumps(_RunsCode()), "posix.system"),
    (lambda: __import__("pickle").dumps(__import__("collections").OrderedDict(a=1)), "collections.OrderedDict"),
    (lambda: b"\x80\x04K\x01", "not a whole pickle"),
    (lambda: _with_persistent_id(), "persistent id"),
])
def test_bytes_a_consumer_unpickles_are_refused_unless_plain(tmp_path: Path, payload: Any, named: str) -> None:
    """A DCP value holding bytes that name a global (or are no whole pickle) is refused by
    PlainBytesLoadPlanner with one UnsafePickleError naming the value; nothing runs."""
    import torch.distributed.checkpoint as dcp

    from shardckpt.errors import UnsafePickleError
    from shardckpt.interop.dcp.plain_bytes import PlainBytesLoadPlanner
    from shardckpt.interop.dcp.storage import ShardckptReader
    from shardckpt.interop.plain_pickle import plain_pickle_problem

    data = payload()
    assert named in (plain_pickle_problem(data) or ""), plain_pickle_problem(data)
    _dcp_save(tmp_path / "ck", {"loader": {"dp_rank_0": data, "world_size": 1}})
    target = {"loader": {"dp_rank_0": b"", "world_size": 0}}
    planner = PlainBytesLoadPlanner("ck", "the loader", "trust it with allow_pickle")
    from torch.distributed.checkpoint.api import CheckpointException

    with pytest.raises(CheckpointException) as e:  # DCP's wrapping, one failure per rank
        dcp.load(target, storage_reader=ShardckptReader(str(tmp_path / "ck")), planner=planner)
    (refused, _), = e.value.failures.values()
    assert isinstance(refused, UnsafePickleError) and "'loader.dp_rank_0'" in str(refused)
    assert named in str(refused) and target["loader"]["dp_rank_0"] == b""


def test_plain_pickled_state_loads_through(tmp_path: Path) -> None:
    import pickle

    import torch.distributed.checkpoint as dcp

    from shardckpt.interop.dcp.plain_bytes import PlainBytesLoadPlanner
    from shardckpt.interop.dcp.storage import ShardckptReader

    state = {"_num_yielded": 3, "fetcher_state": {"ended": False}, "buf": [1, 2.5, None, (3, "x")],
             "seen": {1, 2}, "raw": b"\x00"}
    _dcp_save(tmp_path / "ck", {"loader": {"dp_rank_0": pickle.dumps(state), "world_size": 1}})
    target = {"loader": {"dp_rank_0": b"", "world_size": 0}}
    dcp.load(target, storage_reader=ShardckptReader(str(tmp_path / "ck")),
             planner=PlainBytesLoadPlanner("ck", "the loader", ""))
    assert pickle.loads(target["loader"]["dp_rank_0"]) == state and target["loader"]["world_size"] == 1


def _trainer_ckpt(root: Path, rng: bytes) -> Path:
    from shardckpt.format.records import RunExtras

    ck = root / "checkpoint-8"
    app = {"version": 1, "world_size": 1, "rng_bytes": [len(rng)], "model_only": True,
           "trainer_state": json.dumps({"global_step": 8, "best_model_checkpoint": None})}
    _dcp_save(ck, {"rng": {"rank-00000": torch.frombuffer(bytearray(rng), dtype=torch.uint8)}},
              RunExtras(step=8, app={"trainer": app}).to_doc())
    return ck


def _rewrite(ck: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    from shardckpt.format.integrity import seal

    doc = json.loads((ck / MANIFEST_NAME).read_text())
    edit(doc)
    (ck / MANIFEST_NAME).write_bytes(seal(doc))


def test_trainer_rng_length_comes_from_the_stored_tensor(tmp_path: Path) -> None:
    """rng_bytes that disagree with the stored tensor (3 GiB claimed), a tensor whose recorded
    shape runs past its file, and a file cut short: each one ManifestError naming what is
    wrong; the honest checkpoint gives the stored length."""
    from shardckpt.errors import ManifestError
    from shardckpt.integrations.trainer_checks import read_trainer_record, rng_lengths

    ck = _trainer_ckpt(tmp_path, b'{"python": 1}')
    app = read_trainer_record(str(ck))
    assert rng_lengths(str(ck), None, app["rng_bytes"]) == [13]
    with pytest.raises(ManifestError, match=r"rng_bytes\[0\] is 3221225472, but rng.rank-00000 .* holds 13 bytes"):
        rng_lengths(str(ck), None, [3 << 30])

    def grow(doc: dict[str, Any]) -> None:
        t = next(t for t in doc["chunked"]["tensors"] if t["fqn"] == "rng.rank-00000")
        t["shape"], t["chunks"][0]["sizes"] = [3 << 30], [3 << 30]
        t["chunks"][0]["end"] = t["chunks"][0]["begin"] + (3 << 30)
    honest = (ck / MANIFEST_NAME).read_bytes()
    _rewrite(ck, grow)
    with pytest.raises(ManifestError, match=r"chunks\[0\]: bytes \[0, 3221225472\) .* past its end"):
        rng_lengths(str(ck), None, [3 << 30])
    (ck / MANIFEST_NAME).write_bytes(honest)
    doc = json.loads(honest)
    shard = ck / next(t for t in doc["chunked"]["tensors"] if t["fqn"] == "rng.rank-00000")["chunks"][0]["file"]
    shard.write_bytes(shard.read_bytes()[:-8])
    with pytest.raises(ManifestError, match=rf"{shard.name}: \d+ bytes \(the manifest records \d+\)"):
        rng_lengths(str(ck), None, [13])


def test_trainer_state_never_hands_trainer_a_path(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """best_model_checkpoint is dropped from what Trainer reads: with a warning naming it when it
    is not a committed checkpoint of the run (outside, through .., a URL), quietly otherwise."""
    from shardckpt.errors import ManifestError
    from shardckpt.integrations.trainer_checks import restored_trainer_state
    from shardckpt.integrations.transformers import TrainerRun

    run = tmp_path / "run"
    make_ckpt(run, "checkpoint-4")
    (tmp_path / "outside").mkdir()
    trainer_run = TrainerRun(str(run))
    for best in (str(tmp_path / "outside"), f"{run}/../outside", "s3://bucket/other/checkpoint-4",
                 f"{run}/checkpoint-9", 7, ["x"]):
        caplog.clear()
        text = restored_trainer_state(json.dumps({"global_step": 4, "best_model_checkpoint": best}),
                                      trainer_run, "ck")
        assert json.loads(text) == {"global_step": 4, "best_model_checkpoint": None}
        assert "dropped" in caplog.text and repr(best) in caplog.text, best
    caplog.clear()
    text = restored_trainer_state(json.dumps({"best_model_checkpoint": f"{run}/checkpoint-4"}), trainer_run, "ck")
    assert json.loads(text)["best_model_checkpoint"] is None and "dropped" not in caplog.text
    for bad in ("[1]", "{", '"x"'):
        with pytest.raises(ManifestError, match="trainer_state"):
            restored_trainer_state(bad, trainer_run, "ck")
