"""DeepSpeed checkpoint files: finding them, reading them safely, staging their numbers, and the
pure math of where each parameter's elements lie in DeepSpeed's partitions.

DeepSpeed's checkpoint files are pickles. They are read only through
``torch.load(weights_only=True)`` with the few non-torch globals they hold allowed, each mapped
to an inert stand-in defined here (DeepSpeed itself is never imported): a loss scaler, the ZeRO
stage enum and the fragment addresses of its slice mappings. Any other global is refused with
one error naming the class and the file; a truncated or damaged file is one error naming the
file. Torch is imported lazily, inside the functions.

:func:`segments_12` and :func:`segments_3` (no I/O) map every parameter's elements to positions in
the ranks' saved partitions, for ZeRO-1/2 and ZeRO-3 (see :mod:`shardckpt.interop.deepspeed.import_`), and
check that the partitions add up to the parameters.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from bisect import bisect_right
from typing import Any
from collections.abc import Sequence

from shardckpt.errors import ConfigError, IntegrityError
from shardckpt.format.layout import prod
from shardckpt.interop.foreign import check_link, escaped, shown, source_root
from shardckpt.interop.pt_archive import check_tensors, load_mapped, local_copy, read_storages
from shardckpt.interop.pt_zip import read_layout
from shardckpt.storage import NotFoundError, Storage


class DeepSpeedObject:
    """Inert stand-in for a DeepSpeed object in a checkpoint: keeps its pickled state as data."""

    def __init__(self, *args: Any) -> None:
        self.args = args
        self.state: Any = None

    def __setstate__(self, state: Any) -> None:
        self.state = state


class StageError(ValueError):
    """A ZeRO stage that is not 0, 1, 2 or 3 (raised while a file is unpickled)."""


def zero_stage(value: Any) -> int:
    """Stand-in for DeepSpeed's ``ZeroStageEnum``: the stage as an int (0 to 3, else refused)."""
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= 3:
        raise StageError(f"holds ZeRO stage {shown(value if isinstance(value, str) else repr(value), 40)}; "
                         "a stage is 0, 1, 2 or 3")
    return int(value)


#: Every non-torch global a DeepSpeed ZeRO checkpoint may name, and what stands in for it.
ALLOWED_GLOBALS: tuple[tuple[Any, str], ...] = (
    (DeepSpeedObject, "deepspeed.runtime.fp16.loss_scaler.LossScaler"),
    (DeepSpeedObject, "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"),
    (zero_stage, "deepspeed.runtime.zero.config.ZeroStageEnum"),
    (DeepSpeedObject, "deepspeed.utils.tensor_fragment.fragment_address"),
)

_OPTIM = re.compile(r"(bf16_|fp16_)?zero_pp_rank_([0-9]+)_mp_rank_00_optim_states\.pt")
_MODEL3 = re.compile(r"zero_pp_rank_([0-9]+)_mp_rank_00_model_states\.pt")
MODEL_FILE = "mp_rank_00_model_states.pt"
_UNSUPPORTED = re.compile(r"Unsupported global: GLOBAL ([\w.]+)")


def _allowed() -> list[Any]:
    # Each stand-in needs its own class object per name for torch's registry, which is keyed
    # by the callable: a subclass per name keeps the mapping one-to-one.
    out = []
    for obj, name in ALLOWED_GLOBALS:
        if obj is DeepSpeedObject:
            obj = type(name.rsplit(".", 1)[1], (DeepSpeedObject,), {"__module__": __name__})
        out.append((obj, name))
    return out


def _reason(e: BaseException) -> str:
    """The whole reason torch gives, on one line (the advice torch adds to a weights-only failure,
    about loading without it, is left out: that is never done here)."""
    text = str(e).strip()
    marker = "WeightsUnpickler error:"
    if marker in text:
        text = text[text.index(marker) + len(marker):].strip()
    return escaped(text) if text else type(e).__name__


def load_pt(storage: Storage, rel: str, root: str | None = None) -> dict[str, Any]:
    """The dict saved in ``rel``, tensors on the CPU, read so that memory follows what the file's
    tensors hold, not the file's size (:mod:`shardckpt.interop.pt_archive`): the zip structure
    is checked first, the pickle is loaded with its storages mapped, not read, every tensor is
    checked against its storage and the storages against the file, and only then are the
    storages read.

    ``root``: the folder the file must resolve inside (default: ``storage``'s,
    :func:`~shardckpt.interop.foreign.source_root`).
    Raises :class:`IntegrityError` naming the file for a missing, truncated or damaged file, an
    archive with bytes no tensor accounts for, a tensor that repeats or overlaps elements or
    reaches past its storage (named by its key), a global not on the allow-list (named), or
    anything but a dict at the top.
    """
    from shardckpt.storage import iter_file_chunks, LocalBackend

    url = storage.url_of(rel)
    real = check_link(storage, rel, root if root is not None else source_root(storage))
    try:
        size = storage.size(rel)
    except NotFoundError:
        raise IntegrityError(f"{url}: missing") from None
    layout = read_layout(lambda a, b: storage.read(rel, a, b), size, url)
    local = isinstance(storage.backend, LocalBackend)
    path = ((real or storage.full(rel)) if local
            else local_copy(iter_file_chunks(storage, rel, 8 << 20)))
    try:
        obj = _load(path, url)
        if not isinstance(obj, dict):
            raise IntegrityError(f"{url}: holds a {type(obj).__name__}, not a DeepSpeed state "
                                 "dict")
        read_storages(obj, check_tensors(obj, layout, url), path, url)
    finally:
        if not local:
            os.unlink(path)
    return obj


def _load(path: str, url: str) -> Any:
    """``torch.load`` of ``path`` through the allow-list, storages mapped; one error naming
    ``url`` for anything it refuses or fails on."""
    import pickle

    try:
        return load_mapped(path, url, _allowed())
    except StageError as e:
        raise IntegrityError(f"{url}: {e}") from None
    except pickle.UnpicklingError as e:
        m = _UNSUPPORTED.search(str(e))
        if m:
            raise IntegrityError(f"{url}: holds a {m.group(1)} object, which is not on the "
                                 "allow-list of what a DeepSpeed checkpoint may hold; refused "
                                 "without running it") from None
        raise IntegrityError(f"{url}: not a readable torch.save file (truncated or damaged): "
                             f"{_reason(e)}") from None
    except Exception as e:  # noqa: BLE001 - a foreign pickle: any failure is one clear error
        raise IntegrityError(f"{url}: not a readable torch.save file (truncated or damaged): "
                             f"{_reason(e)}") from None


class Segment(tuple):
    """Elements ``[start, end)`` of a parameter are at element ``pos`` of staged region ``src``."""

    __slots__ = ()

    def __new__(cls, start: int, end: int, src: str, pos: int) -> Segment:
        return tuple.__new__(cls, (start, end, src, pos))

    start = property(lambda s: s[0])
    end = property(lambda s: s[1])
    src = property(lambda s: s[2])
    pos = property(lambda s: s[3])


@dataclass
class Staged:
    """Raw fp32 regions in a local folder: name -> (path, elements); written once, then read in
    pieces through open handles (one per region, kept until :meth:`close`).

    ``limit`` (bytes, None: none) bounds what is staged and held from the source altogether: a
    source's tensors yield at most twice their bytes (bf16 widened to fp32), so a source whose
    names use one tensor many times is refused (:meth:`spend`) before it is written out."""

    folder: str
    regions: dict[str, tuple[str, int]] = field(default_factory=dict)
    handles: dict[str, Any] = field(default_factory=dict)
    limit: int | None = None
    spent: int = 0
    source: str = ""

    def spend(self, nbytes: int, url: str) -> None:
        """Count ``nbytes`` taken from file ``url``; refuse once the total passes ``limit``."""
        self.spent += nbytes
        if self.limit is not None and self.spent > self.limit:
            raise IntegrityError(f"{url}: its values would come to more than {self.limit} bytes "
                                 f"of fp32, over twice the {self.source or 'source'}'s files; "
                                 "refused (a tensor used under many names)")

    def put(self, name: str, parts: Any, url: str = "") -> None:
        """Write region ``name``: the tensors or fp32 arrays ``parts`` one after another, each
        widened to fp32 only as it is written (no joined copy)."""
        import numpy as np

        path = os.path.join(self.folder, f"{len(self.regions):06d}.f32")
        n = 0
        with open(path, "wb") as f:
            for part in parts:
                self.spend(4 * int(part.size if isinstance(part, np.ndarray) else part.numel()), url)
                a = part if isinstance(part, np.ndarray) else to_f32(part)
                a = np.ascontiguousarray(a, dtype=np.float32).reshape(-1)
                f.write(a.data.cast("B"))
                n += a.size
        self.regions[name] = (path, n)

    def read(self, name: str, pos: int, n: int) -> bytes:
        path, size = self.regions[name]
        if pos + n > size:
            raise IntegrityError(f"staged region {name}: elements [{pos}, {pos + n}) past {size}")
        f = self.handles.get(name)
        if f is None:
            f = self.handles[name] = open(path, "rb")
        f.seek(pos * 4)
        return f.read(n * 4)

    def close(self) -> None:
        for f in self.handles.values():
            f.close()
        self.handles.clear()


def to_f32(t: Any) -> Any:
    """A tensor as a flat float32 numpy array (bf16 and fp16 widen exactly)."""
    import torch

    return t.detach().to(torch.float32).reshape(-1).contiguous().numpy()


def shape_of(s: Any) -> tuple[int, ...]:
    return tuple(int(d) for d in s)


def folder_name(tag: str) -> bool:
    """Whether ``tag`` is a plain folder name (no path, nothing unprintable)."""
    return (bool(tag) and tag not in (".", "..") and "/" not in tag and "\\" not in tag
            and tag.isprintable())


def tag_folder_source(storage: Storage, tag: str | None) -> tuple[Storage, str | None]:
    """(checkpoint folder, tag) for ``storage`` given as the source: a *tag folder* (the folder
    that holds the rank files, ``.../global_step100``: a common habit) stands for its parent and
    its own name as the tag, where no tag was named and it has no ``latest`` of its own. Anything
    else comes back as it is. The parent becomes the folder links must stay inside."""
    if tag is not None or storage.exists("latest"):
        return storage, tag
    if not any(_OPTIM.fullmatch(n) for n in storage.ls("")):
        return storage, tag
    parent, name = storage.url.rstrip("/").rsplit("/", 1) if "/" in storage.url.rstrip("/") \
        else ("", storage.url)
    if not parent or not folder_name(name):
        return storage, tag
    return Storage(parent, storage.storage_options), name


def find_files(storage: Storage, tag: str | None) -> tuple[str, list[str], list[str]]:
    """(tag, optim files by rank, model files) of the checkpoint at ``storage``; one error naming
    the missing file or the world sizes that disagree."""
    root = source_root(storage)
    if tag is None:
        try:
            check_link(storage, "latest", root)
            tag = storage.read_limited("latest", 4096).decode("utf-8", "replace").strip()
        except NotFoundError:
            raise IntegrityError(f"{storage.url_of('latest')}: missing; pass --tag to name the "
                                 "checkpoint folder") from None
        if not folder_name(tag):
            raise IntegrityError(f"{storage.url_of('latest')}: names the tag {shown(tag)}, which "
                                 "is not a folder name; pass --tag to name the checkpoint folder")
    if not folder_name(tag):
        raise ConfigError(f"{storage.url}: tag {shown(tag)} is not a folder name")
    check_link(storage, tag, root)
    names = storage.ls(tag)
    if not names:
        raise IntegrityError(f"{storage.url_of(tag)}: no such checkpoint folder (or it is empty)")
    optim: dict[int, str] = {}
    prefixes = set()
    for n in names:
        m = _OPTIM.fullmatch(n)
        if m:
            prefixes.add(m.group(1) or "")
            optim[int(m.group(2))] = f"{tag}/{n}"
    if not optim:
        raise IntegrityError(f"{storage.url_of(tag)}: no zero_pp_rank_*_mp_rank_00_optim_states.pt "
                             "files; not a DeepSpeed ZeRO checkpoint")
    if len(prefixes) > 1:
        raise IntegrityError(f"{storage.url_of(tag)}: optimizer files of two precisions "
                             f"({', '.join(sorted(p or 'fp32' for p in prefixes))}); keep one set")
    world = max(optim) + 1
    missing = [r for r in range(world) if r not in optim]
    if missing:
        prefix = prefixes.pop()
        name = f"{tag}/{prefix}zero_pp_rank_{missing[0]}_mp_rank_00_optim_states.pt"
        raise IntegrityError(f"{storage.url_of(name)}: "
                             f"missing (ranks {missing} of {world} have no optimizer file)")
    model3 = {int(m.group(1)): f"{tag}/{n}" for n in names if (m := _MODEL3.fullmatch(n))}
    if f"{tag}/{MODEL_FILE}" in {f"{tag}/{n}" for n in names} and not model3:
        models = [f"{tag}/{MODEL_FILE}"]
    else:
        models = [model3.get(r, f"{tag}/zero_pp_rank_{r}_mp_rank_00_model_states.pt")
                  for r in range(world)]
    return tag, [optim[r] for r in range(world)], models


def check_world(storage: Storage, rel: str, found: Any, world: int) -> None:
    counts = set(found) if isinstance(found, (list, tuple)) else {found}
    if counts != {world}:
        raise IntegrityError(f"{storage.url_of(rel)}: written by a data-parallel world of "
                             f"{', '.join(str(c) for c in sorted(counts))}, but {world} rank "
                             "files are here; the files come from different saves")


def _cover(url: str, fqn: str, numel: int, segs: list[Segment]) -> None:
    pos = 0
    for s in segs:
        if s.start != pos:
            break
        pos = s.end
    if pos != numel:
        raise IntegrityError(f"{url}: the partitions do not add up to parameter {fqn!r} "
                             f"({pos} of {numel} elements covered)")


def segments_12(url: str, shapes: list[dict[str, tuple[int, ...]]], ranks: Sequence[Any],
                 world: int) -> dict[str, list[Segment]]:
    """ZeRO-1/2: each group is its ranks' partitions concatenated in rank order."""
    out: dict[str, list[Segment]] = {}
    paddings = ranks[0].paddings
    for j, group in enumerate(shapes):
        starts, bases = [0], []
        for r in ranks:
            if len(r.lengths) != len(shapes):
                raise IntegrityError(f"{url}: a rank file has {len(r.lengths)} param groups, "
                                     f"the model states {len(shapes)}")
            starts.append(starts[-1] + r.lengths[j])
            bases.append(sum(r.lengths[:j]))
        offset = 0
        for i, (fqn, shape) in enumerate(group.items()):
            n = prod(shape)
            segs = []
            r = max(0, bisect_right(starts, offset) - 1)
            while r < world and starts[r] < offset + n:
                a, b = max(offset, starts[r]), min(offset + n, starts[r + 1])
                if a < b:
                    segs.append(Segment(a - offset, b - offset, str(r), bases[r] + a - starts[r]))
                r += 1
            _cover(url, fqn, n, segs)
            out[fqn] = segs
            pads = paddings[j] if paddings and j < len(paddings) else ()
            offset += n + (int(pads[i]) if i < len(pads) else 0)
        align = 2 * world
        if -(-offset // align) != -(-starts[-1] // align):
            raise IntegrityError(f"{url}: the partitions of param group {j} hold {starts[-1]} "
                                 f"elements, its parameters {offset}; the sizes do not add up")
    return out


def segments_3(url: str, params: Sequence[tuple[str, tuple[int, ...]]], lengths: Sequence[int],
                world: int, src: str = "") -> dict[str, list[Segment]]:
    """ZeRO-3: rank r holds piece r (``ceil(numel / world)`` elements) of every parameter."""
    out: dict[str, list[Segment]] = {}
    off = 0
    for fqn, shape in params:
        n = prod(shape)
        pn = -(-n // world)
        out[fqn] = [Segment(r * pn, min(n, (r + 1) * pn), f"{r}{src}", off)
                    for r in range(world) if r * pn < n]
        off += pn
    bad = [f"rank {r}: {n}" for r, n in enumerate(lengths) if n != off]
    if bad:
        raise IntegrityError(f"{url}: the partitions do not add up to the parameters: each rank "
                             f"should hold {off} elements, but {'; '.join(bad)}")
    return out
