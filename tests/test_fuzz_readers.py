"""Seeded, structure-aware fuzzing of every reader of untrusted input (``testing/fuzz.py``).

Each target starts from a valid input (a manifest, DCP's ``.metadata``, a safetensors header,
DeepSpeed's ``torch.save`` files), mutates it with a fixed seed, and feeds every case to the
reader: it must return or raise one :class:`~shardckpt.errors.ShardckptError`, never another
exception, and never hang. A failure names the target, the seed and the case's index, which
reproduce it: ``mutations(doc, seed, n)`` yields the same cases every run.

Parser-level cases run in bulk; a few tens go through the offline commands in this process
(``verify``, ``inspect``, ``reshard``, ``consolidate``, ``import dcp``, ``import deepspeed``):
exit 0, or non-zero with one ``error:`` line; no traceback; nothing written outside the
destination; and no ``manifest.json`` (or consolidated index) in the destination unless the
command succeeded.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import random
import shutil
import struct
import types
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

from shardckpt.errors import ShardckptError
from shardckpt.format.integrity import CHECKSUM_FIELD, crc32c
from shardckpt.format.manifest import MANIFEST_NAME
from shardckpt.format.manifest_parse import parse
from shardckpt.format.safetensors_header import header_length, parse_header
from testing.ckpts import make_ckpt, manifest_doc_of_tiny
from testing.cli import cli
from testing.fuzz import Deep, dumps, expect_clean, hang_guard, mutate_bytes, mutations

#: The one seed of this file; a target's cases are ``mutations(base, SEED + k, n)``.
SEED = 20250611
DEEPSPEED = Path(__file__).parent / "fixtures" / "deepspeed"


def check_all(cases: Iterator[tuple[int, Any]], run: Callable[[Any], Any], target: str,
              seed: int) -> tuple[int, int]:
    """Run every case through ``run`` under :func:`expect_clean`; (cases, refusals)."""
    n = refused = 0
    for i, case in cases:
        n += 1
        if expect_clean(lambda: run(case), f"{target}: seed {seed}, case {i}") is not None:
            refused += 1
    return n, refused


def byte_cases(data: bytes, seed: int, n: int) -> Iterator[tuple[int, bytes]]:
    rng = random.Random(seed)
    for i in range(n):
        yield i, mutate_bytes(data, rng)


# ------------------------------------------------------------------------------ manifests


def sealed(case: Any) -> bytes:
    """``case`` as manifest bytes with its checksum recomputed (as a writer seals one), so that
    a mutation reaches the checks behind the checksum; a case that is not an object as is."""
    if not isinstance(case, dict):
        return dumps(case).encode("utf-8", "surrogatepass")
    body = {k: v for k, v in case.items() if k != CHECKSUM_FIELD}
    raw = dumps(body).encode("utf-8", "surrogatepass")
    head = raw[:raw.rindex(b"}")].rstrip()
    covered = head + (b"\n " if head.endswith(b"{") else b",\n ")
    return covered + b'"%s": "%08x"\n}' % (CHECKSUM_FIELD.encode(), crc32c(covered))


def raw_text(case: Any) -> bytes:
    return dumps(case).encode("utf-8", "surrogatepass")


@pytest.fixture(scope="module")
def dcp_import(source: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The stock DCP checkpoint imported (a 1.2 manifest with a chunked section)."""
    from shardckpt.interop.dcp.import_ import import_dcp

    dst = tmp_path_factory.mktemp("fuzz-dcp") / "imported"
    import_dcp(str(source), str(dst))
    return dst


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A committed 2-rank flat-group checkpoint, never written to (cases copy it)."""
    path, _ = make_ckpt(tmp_path_factory.mktemp("fuzz-tiny"))
    return Path(path)


MANIFEST_TARGETS = {
    # name: (base document, encoding, seed offset, cases)
    "flat": ("tiny", raw_text, 1, 500),
    "flat-sealed": ("tiny", sealed, 2, 700),
    "flat-on-disk-sealed": ("disk", sealed, 3, 300),
    "chunked": ("chunked", raw_text, 4, 300),
    "chunked-sealed": ("chunked", sealed, 5, 500),
}


@pytest.mark.parametrize("target", sorted(MANIFEST_TARGETS))
def test_manifest_parser(target: str, tiny: Path, dcp_import: Path) -> None:
    base, encode, k, n = MANIFEST_TARGETS[target]
    doc = {"tiny": manifest_doc_of_tiny,
           "disk": lambda: json.loads((tiny / MANIFEST_NAME).read_bytes()),
           "chunked": lambda: json.loads((dcp_import / MANIFEST_NAME).read_bytes())}[base]()
    parse(sealed(doc))  # the start is valid: the mutations are what is refused
    total, refused = check_all(mutations(doc, SEED + k, n), lambda c: parse(encode(c)),
                               f"manifest {target}", SEED + k)
    assert total == n and refused > n // 2, (total, refused)


def test_manifest_bytes(tiny: Path) -> None:
    data = (tiny / MANIFEST_NAME).read_bytes()
    total, refused = check_all(byte_cases(data, SEED + 6, 400), parse, "manifest bytes", SEED + 6)
    assert refused > 300


# ------------------------------------------------------------------------------ safetensors


def shard_file(ckpt: Path) -> Path:
    return next(ckpt.rglob("shard-00000-of-*.safetensors"))


def header_parts(path: Path) -> tuple[dict[str, Any], int]:
    """A real shard's header document and its data section's size."""
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8:8 + n]), len(data) - 8 - n


def read_stheader(raw: bytes, file_size: int) -> None:
    """What every reader does with a safetensors file's first bytes: the length, then the JSON."""
    n = header_length(raw[:8], file_size, "t.safetensors")
    parse_header(raw[8:8 + n], file_size, "t.safetensors")


def test_safetensors_header_document(tiny: Path) -> None:
    doc, data_size = header_parts(shard_file(tiny))

    def run(case: Any) -> None:
        raw = dumps(case).encode("utf-8", "surrogatepass")
        read_stheader(struct.pack("<Q", len(raw)) + raw, 8 + len(raw) + data_size)

    run(doc)
    total, refused = check_all(mutations(doc, SEED + 10, 900), run, "safetensors header",
                               SEED + 10)
    assert refused > 600


def test_safetensors_header_bytes(tiny: Path) -> None:
    data = shard_file(tiny).read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    head = data[:8 + n]
    rng = random.Random(SEED + 11)

    def cases() -> Iterator[tuple[int, tuple[bytes, int]]]:
        for i in range(500):
            b = mutate_bytes(head, rng)
            if rng.random() < 0.3:  # the 8-byte length alone
                b = struct.pack("<Q", rng.choice((0, 1, 7, n - 1, n + 1, 2**32, 2**63, 2**64 - 1,
                                                  100_000_000, 100_000_001))) + head[8:]
            yield i, (b, rng.choice((len(data), len(b), 8 + n, 7, 0, 2**53)))

    check_all(cases(), lambda c: read_stheader(*c), "safetensors bytes", SEED + 11)


def test_hf_source_header(tiny: Path, tmp_path: Path) -> None:
    """The Hugging Face source's header read (length from storage, then the JSON)."""
    from shardckpt.interop.hf.source import read_header
    from shardckpt.storage import Storage

    path = shard_file(tiny)
    data = path.read_bytes()
    doc, data_size = header_parts(path)
    (n,) = struct.unpack("<Q", data[:8])
    storage = Storage(str(tmp_path))
    rng = random.Random(SEED + 12)
    target = tmp_path / "model.safetensors"

    def cases() -> Iterator[tuple[int, bytes]]:
        for i, case in mutations(doc, SEED + 12, 100):
            raw = dumps(case).encode("utf-8", "surrogatepass")
            yield i, struct.pack("<Q", len(raw)) + raw + data[8 + n:]
        for i in range(100, 200):
            yield i, mutate_bytes(data, rng)

    def run(b: bytes) -> None:
        target.write_bytes(b)
        read_header(storage, "model.safetensors")

    total, refused = check_all(cases(), run, "hf header", SEED + 12)
    assert total == 200 and refused > 100


# ------------------------------------------------------------------------------ DCP .metadata


class _Global:
    """A global (``module.name``) written into a pickle as is, whatever it names."""

    def __init__(self, module: str, name: str) -> None:
        self.module, self.name = module, name

    def __call__(self) -> None:  # a pickled function must look callable
        raise AssertionError("never called")


class _Obj:
    """An instance of ``cls`` (a :class:`_Global`) with ``state``: pickled as ``cls.__new__``
    then ``__setstate__`` (``newobj``, as dataclasses are) or as ``cls(*args)`` then state."""

    def __init__(self, cls: _Global, state: Any, args: tuple = (), newobj: bool = True) -> None:
        self.cls, self.state, self.args, self.newobj = cls, state, args, newobj


class _Pickler(pickle._Pickler):  # type: ignore[name-defined]
    """The pure-Python pickler (its ``save`` can be extended) writing :class:`_Global`,
    :class:`_Obj` and :class:`~testing.fuzz.Deep` as their opcodes."""

    def save(self, obj: Any, save_persistent_id: bool = True) -> None:
        if isinstance(obj, _Global):
            name = f"{obj.module}\n{obj.name}\n".encode("utf-8", "surrogatepass")
            self.write(pickle.GLOBAL + name)
        elif isinstance(obj, Deep):  # nested lists without recursing: [[...[0]...]]
            self.write(pickle.EMPTY_LIST * obj.depth + pickle.BININT1 + b"\0"
                       + pickle.APPEND * obj.depth)
        elif isinstance(obj, _Obj):
            self.save(obj.cls)
            self.save(obj.args)
            self.write(pickle.NEWOBJ if obj.newobj else pickle.REDUCE)
            if obj.state is not None:
                self.save(obj.state)
                self.write(pickle.BUILD)
        else:
            super().save(obj, save_persistent_id)


def _hashable(k: Any) -> Any:
    return tuple(k) if isinstance(k, list) else k


def dcp_doc(v: Any) -> Any:
    """DCP metadata records as a document :func:`testing.fuzz.mutate` walks."""
    from shardckpt.interop.dcp import records as dcp_records

    names = {cls: key for key, cls in dcp_records.RECORDS.items() if isinstance(cls, type)}
    if isinstance(v, dcp_records.Record):
        mod, name = names[type(v)]
        return {"__global__": f"{mod}:{name}", **{k: dcp_doc(x) for k, x in vars(v).items()}}
    if isinstance(v, dict):
        if all(isinstance(k, str) for k in v):
            return {k: dcp_doc(x) for k, x in v.items()}
        return {"__items__": [[dcp_doc(k), dcp_doc(x)] for k, x in v.items()]}
    if isinstance(v, tuple):
        return {"__size__": [dcp_doc(x) for x in v]}
    if isinstance(v, list):
        return [dcp_doc(x) for x in v]
    if isinstance(v, str) and v.startswith("torch.") and v != "torch.strided":
        return {"__dtype__": v.removeprefix("torch.")}
    if isinstance(v, os.PathLike):
        return {"__path__": str(v)}
    return v


def dcp_obj(d: Any) -> Any:
    """A document back as objects :class:`_Pickler` writes as DCP's pickle does."""
    if isinstance(d, list):
        return [dcp_obj(x) for x in d]
    if not isinstance(d, dict):
        return d
    g = d.get("__global__")
    if isinstance(g, str) and ":" in g:
        return _Obj(_Global(*g.split(":", 1)),
                    {k: dcp_obj(x) for k, x in d.items() if k != "__global__"})
    if len(d) == 1:
        (k, x), = d.items()
        if k == "__items__" and isinstance(x, list) and all(isinstance(p, list) and len(p) == 2
                                                            for p in x):
            try:
                return {_hashable(dcp_obj(a)): dcp_obj(b) for a, b in x}
            except TypeError:  # an unhashable key: a list of pairs instead
                return [[dcp_obj(a), dcp_obj(b)] for a, b in x]
        if k == "__size__" and isinstance(x, list):
            return _Obj(_Global("torch", "Size"), None, (tuple(dcp_obj(e) for e in x),), False)
        if k == "__dtype__" and isinstance(x, str):
            return _Global("torch", x)
        if k == "__path__":
            return _Obj(_Global("pathlib", "PosixPath"), None, (dcp_obj(x),), False)
    return {k: dcp_obj(x) for k, x in d.items()}


def dcp_small_doc(md: Any) -> dict[str, Any]:
    """The document of metadata ``md`` cut to a few tensors and values (and their storage
    records and planner data): the cases stay small, and every kind of node is still there."""
    doc = dcp_doc(md)
    sd = doc["state_dict_metadata"]
    tensors = [k for k, v in sd.items() if "chunks" in v][:5]
    keep = set(tensors + [k for k, v in sd.items() if "chunks" not in v][:3])
    doc["state_dict_metadata"] = {k: v for k, v in sd.items() if k in keep}
    doc["storage_data"]["__items__"] = [p for p in doc["storage_data"]["__items__"]
                                        if p[0]["fqn"] in keep]
    doc["planner_data"] = {k: v for k, v in doc["planner_data"].items() if k in keep}
    return doc


def dcp_pickle(doc: Any) -> bytes:
    buf = io.BytesIO()
    _Pickler(buf, protocol=2).dump(dcp_obj(doc))
    return buf.getvalue()


@pytest.fixture(scope="module")
def dcp_copy(source: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A private copy of the stock DCP checkpoint whose ``.metadata`` the cases replace."""
    dst = tmp_path_factory.mktemp("fuzz-dcp-src") / "src"
    shutil.copytree(source, dst)
    return dst


def test_dcp_metadata_structure(dcp_copy: Path) -> None:
    from shardckpt.interop.dcp.source import read_dcp, read_dcp_metadata
    from shardckpt.storage import Storage

    storage = Storage(str(dcp_copy))
    original = (dcp_copy / ".metadata").read_bytes()
    doc = dcp_small_doc(read_dcp_metadata(storage, records=True))

    def run(case: Any) -> None:
        (dcp_copy / ".metadata").write_bytes(dcp_pickle(case))
        read_dcp(storage)

    try:
        run(doc)  # the document round-trips: what the cases change is what is refused
        assert len(read_dcp(storage).tensors) == 5
        total, refused = check_all(mutations(doc, SEED + 20, 800), run, "dcp metadata",
                                   SEED + 20)
    finally:
        (dcp_copy / ".metadata").write_bytes(original)
    assert refused > 400


@pytest.mark.parametrize("records", [True, False], ids=["records", "torch"])
def test_dcp_metadata_bytes(dcp_copy: Path, records: bool) -> None:
    """Damaged ``.metadata`` bytes: through the allow-listing unpickler, one ShardckptError."""
    from shardckpt.interop.dcp.source import read_dcp, read_dcp_metadata
    from shardckpt.storage import Storage

    storage = Storage(str(dcp_copy))
    original = (dcp_copy / ".metadata").read_bytes()
    read = read_dcp if records else read_dcp_metadata
    seed = SEED + (21 if records else 22)

    def run(b: bytes) -> None:
        (dcp_copy / ".metadata").write_bytes(b)
        read(storage)

    try:
        check_all(byte_cases(original, seed, 500 if records else 150), run, "dcp bytes", seed)
    finally:
        (dcp_copy / ".metadata").write_bytes(original)


# ------------------------------------------------------------------------------ DeepSpeed


class _StandIn:
    """A DeepSpeed object of a committed fixture, as :func:`ds_doc` loads it: its global's name,
    the arguments it was made with (None: made with ``__new__``) and its state."""

    module = name = ""
    args: tuple | None = None
    state: Any = None

    def __init__(self, *args: Any) -> None:
        self.args = args

    def __setstate__(self, state: Any) -> None:
        self.state = state


def _standin_pickle_module() -> types.ModuleType:
    """A ``pickle_module`` for ``torch.load`` whose unpickler maps DeepSpeed's globals to
    :class:`_StandIn` classes (the fixtures are committed files, read without DeepSpeed)."""

    class Unpickler(pickle.Unpickler):
        def find_class(self, module: str, name: str) -> Any:
            if module.startswith("deepspeed."):
                return type(name, (_StandIn,), {"module": module, "name": name})
            return super().find_class(module, name)

    m = types.ModuleType("fuzz_unpickle")
    m.Unpickler = Unpickler  # type: ignore[attr-defined]
    m.load = pickle.load  # type: ignore[attr-defined]
    return m


def ds_doc(path: Path) -> Any:
    """A DeepSpeed fixture file as a document: dicts and lists to mutate, tensors and sizes as
    leaves, DeepSpeed's objects as :class:`_Obj` naming DeepSpeed's globals."""
    import torch

    def conv(v: Any) -> Any:
        if isinstance(v, _StandIn):
            return _Obj(_Global(v.module, v.name), conv(v.state),
                        tuple(conv(a) for a in v.args or ()), v.args is None)
        if isinstance(v, dict):
            return {k: conv(x) for k, x in v.items()}
        if isinstance(v, list):
            return [conv(x) for x in v]
        return v

    return conv(torch.load(path, weights_only=False, pickle_module=_standin_pickle_module()))


def ds_save(case: Any, path: Path) -> None:
    import torch

    module = types.ModuleType("fuzz_pickle")
    module.Pickler = _Pickler  # type: ignore[attr-defined]
    torch.save(case, path, pickle_module=module)


DS_NAMES = ("zero2-fp32-2", "zero3-bf16-2", "zero1-bf16-2")


def ds_files(name: str) -> list[Path]:
    return sorted((DEEPSPEED / name / "global_step3").iterdir())


def test_deepspeed_bytes(tmp_path: Path) -> None:
    from shardckpt.interop.deepspeed.files import load_pt
    from shardckpt.storage import Storage

    storage = Storage(str(tmp_path))
    for k, name in enumerate(DS_NAMES):
        for j, f in enumerate(ds_files(name)[:2]):
            seed = SEED + 30 + 10 * k + j

            def run(b: bytes) -> None:
                (tmp_path / f.name).write_bytes(b)
                load_pt(storage, f.name)

            check_all(byte_cases(f.read_bytes(), seed, 60), run,
                      f"deepspeed bytes {name}/{f.name}", seed)


def test_deepspeed_structure(tmp_path: Path) -> None:
    """Mutated DeepSpeed states (one file of a checkpoint at a time), saved with ``torch.save``
    and read by the importer's reader, which stages their numbers."""
    from shardckpt.interop.deepspeed.files import Staged
    from shardckpt.interop.deepspeed.import_ import read_deepspeed

    staging = tmp_path / "staged"
    staging.mkdir()
    total = 0
    for k, name in enumerate(DS_NAMES):
        src = tmp_path / name
        shutil.copytree(DEEPSPEED / name, src)
        files = ds_files(name)
        for j, f in enumerate(files):
            doc = ds_doc(f)
            seed = SEED + 60 + 10 * k + j

            def run(case: Any) -> None:
                ds_save(case, src / "global_step3" / f.name)
                staged = Staged(str(staging))
                try:
                    read_deepspeed(str(src), staged)
                finally:
                    staged.close()
                    for p in staging.iterdir():
                        p.unlink()

            ds_save(doc, src / "global_step3" / f.name)  # saved back as is: still imports
            run(doc)
            n, _ = check_all(mutations(doc, seed, 20), run, f"deepspeed {name}/{f.name}", seed)
            total += n
            shutil.copy(f, src / "global_step3" / f.name)
    assert total == 20 * sum(len(ds_files(n)) for n in DS_NAMES)


# ------------------------------------------------------------------------------ the commands


def snapshot(root: Path, skip: Path) -> dict[str, tuple[int, int]]:
    """Every file and folder under ``root`` but ``skip``: path -> (size, mtime)."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        here = Path(dirpath)
        dirnames[:] = [d for d in dirnames if here / d != skip]
        for name in dirnames + filenames:
            p = here / name
            st = p.lstat()
            out[str(p.relative_to(root))] = (st.st_size if p.is_file() else 0, st.st_mtime_ns)
    return out


def run_command(args: list[str], root: Path, dst: Path | None, what: str,
                committed: str = MANIFEST_NAME) -> int:
    """``shardckpt ARGS`` in this process under the hang guard; checks the outcome's form, that
    nothing under ``root`` but ``dst`` changed, and that ``dst`` holds ``committed`` only after
    a success."""
    before = snapshot(root, dst or root / "\0")
    with hang_guard(120, what):
        r = cli(*args)
    out = r.stdout + r.stderr
    assert "Traceback" not in out, (what, out[-2000:])
    assert r.exception is None or isinstance(r.exception, SystemExit), (what, repr(r.exception))
    if r.exit_code != 0:
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), (what, r.exit_code, r.stderr)
    assert snapshot(root, dst or root / "\0") == before, f"{what}: wrote outside its destination"
    if dst is not None and r.exit_code != 0:
        assert not (dst / committed).exists(), f"{what}: failed but left {committed} in {dst}"
    return r.exit_code


def accepted_and_refused(doc: Any, seed: int, n: int, want: int) -> list[tuple[int, bytes]]:
    """Up to ``want`` sealed cases the parser accepts and ``want`` it refuses, in seed order."""
    ok: list[tuple[int, bytes]] = []
    bad: list[tuple[int, bytes]] = []
    for i, case in mutations(doc, seed, n):
        data = sealed(case)
        try:
            parse(data)
            (ok if len(ok) < want else []).append((i, data))
        except ShardckptError:
            (bad if len(bad) < want else []).append((i, data))
        if len(ok) == len(bad) == want:
            break
    return ok + bad


@pytest.mark.parametrize("base", ["flat", "chunked"])
def test_commands_on_fuzzed_manifests(base: str, tiny: Path, dcp_import: Path,
                                      tmp_path: Path) -> None:
    ckpt = tiny if base == "flat" else dcp_import
    doc = json.loads((ckpt / MANIFEST_NAME).read_bytes())
    seed = SEED + (90 if base == "flat" else 93)
    want = 8 if base == "flat" else 4
    cases = accepted_and_refused(doc, seed, 400, want)
    assert len(cases) == 2 * want
    codes = []
    for i, data in cases:
        root = tmp_path / f"case-{i}"
        src = root / "src"
        shutil.copytree(ckpt, src)
        (src / MANIFEST_NAME).write_bytes(data)
        what = f"manifest seed {seed}, case {i}"
        codes.append(run_command(["verify", str(src)], root, None, f"verify: {what}"))
        run_command(["inspect", str(src), "--json"], root, None, f"inspect: {what}")
        dst = root / "resharded"
        run_command(["reshard", str(src), str(dst), "--to", "1"], root, dst, f"reshard: {what}")
        dst = root / "hf"
        run_command(["consolidate", str(src), str(dst)], root, dst, f"consolidate: {what}",
                    "model.safetensors.index.json")
        shutil.rmtree(root)
    assert any(codes)


def test_import_dcp_fuzzed(source: Path, tmp_path: Path) -> None:
    from shardckpt.interop.dcp.source import read_dcp_metadata
    from shardckpt.storage import Storage

    original = (source / ".metadata").read_bytes()
    doc = dcp_small_doc(read_dcp_metadata(Storage(str(source)), records=True))
    seed = SEED + 91
    rng = random.Random(seed)
    cases = [(i, dcp_pickle(c)) for i, c in mutations(doc, seed, 12)]
    cases += [(i, mutate_bytes(original, rng)) for i in range(12, 18)]
    for i, data in cases:
        root = tmp_path / f"case-{i}"
        shutil.copytree(source, root / "src")
        (root / "src" / ".metadata").write_bytes(data)
        dst = root / "dst"
        run_command(["import", "dcp", str(root / "src"), str(dst)], root, dst,
                    f"import dcp: seed {seed}, case {i}")
        shutil.rmtree(root)


def test_import_deepspeed_fuzzed(tmp_path: Path) -> None:
    seed = SEED + 92
    rng = random.Random(seed)
    for i in range(12):
        name = DS_NAMES[i % len(DS_NAMES)]
        root = tmp_path / f"case-{i}"
        src = root / "src"
        shutil.copytree(DEEPSPEED / name, src)
        f = rng.choice(ds_files(name))
        if i % 2:
            (src / "global_step3" / f.name).write_bytes(mutate_bytes(f.read_bytes(), rng))
        else:
            _, case = next(mutations(ds_doc(f), seed + i, 1))
            ds_save(case, src / "global_step3" / f.name)
        dst = root / "dst"
        run_command(["import", "deepspeed", str(src), str(dst), "--ranks", "2"], root, dst,
                    f"import deepspeed: seed {seed}, case {i} ({name}/{f.name})")
        shutil.rmtree(root)


# ------------------------------------------------ the integrations' app state (Lightning, Trainer, torchtitan)


TOPK = "ModelCheckpoint{'monitor': 'step', 'mode': 'max'}"


def lightning_state(run: str) -> dict[str, Any]:
    return {"epoch": 1, "global_step": 8, "hyper_parameters": {"betas": {"$tuple": [0.9, 0.95]}},
            "callbacks": {TOPK: {
                "monitor": "step", "best_model_score": 8.0, "best_model_path": f"{run}/a.ckpt",
                "current_score": 8.0, "dirpath": run, "kth_value": 4.0,
                "best_k_models": {f"{run}/a.ckpt": 8.0, f"{run}/b.ckpt": 4.0},
                "kth_best_model_path": f"{run}/b.ckpt", "last_model_path": f"{run}/a.ckpt"}}}


def test_lightning_state_fuzzed(tiny: Path, tmp_path: Path) -> None:
    """Lightning's state as a manifest carries it (``extras.app.lightning``), mutated: reading
    it is a value or one ShardckptError, and of the ModelCheckpoint paths it names, whatever is
    not a committed checkpoint of the callback's directory is dropped and never deleted."""
    from types import SimpleNamespace

    from shardckpt.checkpoint.reader import read_manifest
    from shardckpt.integrations.lightning_state import join_state, lightning_doc
    from shardckpt.integrations.lightning_paths import PATH_FIELDS, confine_restored, remove_checkpoint
    from shardckpt.storage import Storage

    run = tmp_path / "run"
    for name in ("a.ckpt", "b.ckpt"):
        shutil.copytree(tiny, run / name)
    (tmp_path / "victim").mkdir()
    (tmp_path / "victim" / "keep").write_text("x")
    cb = SimpleNamespace(state_key=TOPK, dirpath=str(run), mode="max")
    base = json.loads((tiny / MANIFEST_NAME).read_text())
    ck = tmp_path / "ck"
    shutil.copytree(tiny, ck)
    seed = SEED + 95
    hostile = [str(tmp_path / "victim"), f"{run}/../victim", "memory://elsewhere/victim", f"{run}/a.ckpt/.."]

    def read(case: Any) -> None:
        doc = {**base, "extras": {**base.get("extras", {}), "app": {"lightning": {"version": 1, "state": case}}}}
        (ck / MANIFEST_NAME).write_bytes(sealed(doc))
        state = join_state(lightning_doc(read_manifest(Storage(str(ck))), str(ck)), {}, str(ck))
        if not isinstance(state, dict):
            return
        for p in confine_restored(state, [cb], None, str(ck)):
            assert remove_checkpoint(p, within=[str(run)]) is False, p
        kept = state.get("callbacks", {}).get(TOPK) if isinstance(state.get("callbacks"), dict) else None
        if isinstance(kept, dict):
            for fld in PATH_FIELDS:
                assert kept.get(fld) in (None, "", f"{run}/a.ckpt", f"{run}/b.ckpt"), (fld, kept.get(fld))

    cases = list(mutations(lightning_state(str(run)), seed, 150))
    rng = random.Random(seed)
    for i in range(150, 190):  # the attack itself: hostile paths where Lightning keeps paths
        doc = lightning_state(str(run))
        entry = doc["callbacks"][TOPK]
        entry[rng.choice(PATH_FIELDS)] = rng.choice(hostile)
        entry["best_k_models"][rng.choice(hostile)] = rng.choice([1.0, 9.0, "x", None])
        cases.append((i, doc))
    total, refused = check_all(iter(cases), read, "lightning state", seed)
    assert total == 190 and refused < total
    assert (tmp_path / "victim" / "keep").exists()
    assert sorted(os.listdir(run)) == ["a.ckpt", "b.ckpt"]


def test_trainer_record_fuzzed(tiny: Path, tmp_path: Path) -> None:
    """``extras.app.trainer`` and the trainer state inside it, mutated: the record's checks and
    the state Trainer would read give a value or one ShardckptError; that state never names a
    best checkpoint."""
    from shardckpt.integrations.trainer_checks import read_trainer_record, restored_trainer_state, rng_lengths
    from shardckpt.integrations.transformers import TrainerRun

    base = json.loads((tiny / MANIFEST_NAME).read_text())
    run = tmp_path / "run"
    shutil.copytree(tiny, run / "checkpoint-8")
    ck = run / "checkpoint-8"
    trainer_run = TrainerRun(str(run))
    state = {"global_step": 8, "best_model_checkpoint": str(ck), "log_history": [{"loss": 1.5}],
             "stateful_callbacks": {"TrainerControl": {"args": {}}}}
    record = {"version": 1, "world_size": 1, "rng_bytes": [13], "model_only": False,
              "trainer_state": json.dumps(state), "lr_scheduler": {"last_epoch": 8}, "scaler": None}
    seed = SEED + 96

    def read(case: Any) -> None:
        doc = {**base, "extras": {**base.get("extras", {}), "app": {"trainer": case}}}
        (ck / MANIFEST_NAME).write_bytes(sealed(doc))
        app = read_trainer_record(str(ck))
        text = restored_trainer_state(app["trainer_state"], trainer_run, str(ck))
        assert json.loads(text).get("best_model_checkpoint") is None
        rng_lengths(str(ck), None, app["rng_bytes"])  # not a DCP checkpoint: refused, named

    cases = list(mutations(record, seed, 120))
    cases += [(120 + i, {**record, "trainer_state": dumps(c)}) for i, c in mutations(state, seed + 1, 80)]
    total, refused = check_all(iter(cases), read, "trainer record", seed)
    assert total == 200 and refused == total  # tiny holds no RNG tensor: every case ends refused


def test_pickled_loader_state_fuzzed() -> None:
    """torchtitan's data-loader bytes, mutated (structure and bytes): the plain-data check
    returns, never raises, and whatever it admits unpickles without looking a global up."""
    import pickle

    from shardckpt.interop.plain_pickle import plain_pickle_problem

    class NoGlobals(pickle.Unpickler):
        def find_class(self, module: str, name: str) -> Any:
            raise AssertionError(f"admitted bytes name {module}.{name}")

    state = {"_num_yielded": 3, "_sampler_iter_yielded": 3, "fetcher_state": {"fetcher_ended": False},
             "dataset_state": {"sample_idx": 6, "token_buffer": [1, 2, 3]}, "_iterator_finished": False}
    seed = SEED + 97
    rng = random.Random(seed)
    cases = [pickle.dumps(c, protocol=rng.choice([0, 2, 4, 5])) for _, c in mutations(state, seed, 150)
             if not isinstance(c, Deep)]
    raw = pickle.dumps(state)
    cases += [mutate_bytes(raw, rng) for _ in range(300)]
    admitted = 0
    for i, data in enumerate(cases):
        problem = expect_clean(lambda d=data: plain_pickle_problem(d), f"loader bytes: seed {seed}, case {i}")
        assert problem is None
        if plain_pickle_problem(data) is None:
            admitted += 1
            NoGlobals(io.BytesIO(data)).load()
    assert 0 < admitted < len(cases)
