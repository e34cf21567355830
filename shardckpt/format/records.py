"""Typed records of the manifest's free-form parts that shardckpt itself relies on.

``extras``, ``per_rank_state`` and the optimizer's param groups are JSON objects that readers
(resume, consolidate, inspect, diff, the importers) look into by key. Each has one record here,
the one place that knows its keys' names and types (docs/FORMAT.md section 3.9 lists them):

* :class:`RunExtras`: ``extras`` (step, samples seen, seed, application state, Hugging Face
  config; where an import came from is the importer's own :class:`Origin` record, which it
  registers with its importer, so that this layer names no foreign format);
* :class:`PerRankState`: ``per_rank_state`` (the world that wrote the rank files, a reshard's
  drop);
* :class:`ParamGroupRecord`: one of ``optimizer.param_groups`` (``params``, ``hparams``, ``step``).

Codec: ``from_doc(doc, where, source)`` checks every key it knows and raises one
:class:`~shardckpt.errors.ManifestError` naming ``source`` and each offending key (with a
caller's :class:`~shardckpt.format.parse_context.ParseContext`, one
:class:`~shardckpt.format.parse_context.Problem` instead); ``to_doc()`` gives back the object it
was read from, key for key and in the same order, so that a rewrite keeps the bytes. Keys a record
does not know (user metadata) pass through untouched. ``null`` for an optional key reads as
absent. A record built by a writer (not read) writes its keys in declaration order, those that
are ``None`` left out unless the format writes them always. Pure; no I/O.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol, TypeVar
from collections.abc import Callable, Mapping, Sequence

from shardckpt.errors import ManifestError
from shardckpt.format.integrity import MAX_FREE, MAX_NAME
from shardckpt.format.parse_context import ParseContext, Problem

R = TypeVar("R")
Check = Callable[[ParseContext, Any, str], Any]
#: Range of a seed: what ``torch.manual_seed`` takes (signed or unsigned 64-bit).
SEED_RANGE = (-(1 << 63), (1 << 64) - 1)
_MANIFEST = "manifest.json"


# ------------------------------------------------------------------------------- value checks


def json_value(ctx: ParseContext, v: Any, where: str) -> Any:
    """``v`` if it is JSON that can be written back: objects with string keys, lists (tuples),
    strings and keys of at most :data:`MAX_FREE` characters, finite numbers, booleans, null."""
    stack = [(v, where)]
    while stack:
        x, w = stack.pop()
        if isinstance(x, str):
            if len(x) > MAX_FREE:
                raise ctx.fail(w, f"a string of {len(x)} characters; at most {MAX_FREE} are allowed here")
        elif isinstance(x, float):
            if not math.isfinite(x):
                raise ctx.fail(w, f"{x} is not a finite number")
        elif isinstance(x, dict):
            for k, y in x.items():
                if not isinstance(k, str):
                    raise ctx.fail(w, f"a key of type {type(k).__name__}; JSON keys are strings")
                if len(k) > MAX_FREE:
                    raise ctx.fail(w, f"a key of {len(k)} characters; at most {MAX_FREE} are allowed here")
                stack.append((y, f"{w}.{k[:64]}"))
        elif isinstance(x, (list, tuple)):
            stack.extend((y, f"{w}[{i}]") for i, y in enumerate(x))
        elif not (x is None or isinstance(x, (bool, int))):
            raise ctx.fail(w, f"a value of type {type(x).__name__} is not JSON")
    return v


def json_object(ctx: ParseContext, v: Any, where: str) -> dict[str, Any]:
    return dict(json_value(ctx, ctx.obj(v, where), where))


def count(ctx: ParseContext, v: Any, where: str) -> int:
    return ctx.int_(v, where)


def seed_int(ctx: ParseContext, v: Any, where: str) -> int:
    return ctx.int_(v, where, *SEED_RANGE)


def text(ctx: ParseContext, v: Any, where: str) -> str:
    return ctx.str_(v, where, MAX_FREE)


def flag(ctx: ParseContext, v: Any, where: str) -> bool:
    return ctx.bool_(v, where)


def fqns(ctx: ParseContext, v: Any, where: str) -> tuple[str, ...]:
    return tuple(ctx.str_(p, f"{where}[{i}]", MAX_NAME) for i, p in enumerate(ctx.lst(v, where)))


def texts(ctx: ParseContext, v: Any, where: str) -> tuple[str, ...]:
    return tuple(text(ctx, p, f"{where}[{i}]") for i, p in enumerate(ctx.lst(v, where)))


class _Faults(Problem):
    """Every fault of one record, as one problem of the caller's document."""

    def __init__(self, source: str, problems: list[str]) -> None:
        ManifestError.__init__(self, f"{source}: " + "; ".join(problems))
        self.problem = "; ".join(problems)


# ------------------------------------------------------------------------------------ codec


class _Codec:
    """``from_doc`` / ``to_doc`` of a record from its ``KEYS`` table: key -> (check, required,
    written always). The record's fields are the keys' names, then ``other`` (keys it does not
    know, in their order) and ``keys`` (the object's key order, None when built by a writer)."""

    __slots__ = ()
    KEYS: ClassVar[dict[str, tuple[Check, bool, bool]]]
    # fields of every record (declared by each dataclass)
    other: Mapping[str, Any]
    keys: tuple[str, ...] | None

    @classmethod
    def decode(cls: type[R], ctx: ParseContext, doc: Any, where: str) -> R:
        """The record; each fault is noted in ``ctx`` (its field left at the default)."""
        d = ctx.obj(doc, where)
        values: dict[str, Any] = {}
        defaults = cls.__dataclass_fields__  # type: ignore[attr-defined]
        for key, (check, required, _) in cls.KEYS.items():  # type: ignore[attr-defined]
            if key not in d:
                if required:
                    ctx.note(where, f"missing field {key!r}")
                continue
            if d[key] is None and defaults[key].default is None:
                continue  # null reads as absent
            got = ctx.attempt(check, ctx, d[key], f"{where}.{key}")
            if got is not None:
                values[key] = got
        other = {k: v for k, v in d.items() if k not in cls.KEYS}  # type: ignore[attr-defined]
        ctx.attempt(json_value, ctx, other, where)
        if any(k not in values for k, (_, required, _) in cls.KEYS.items() if required):  # type: ignore[attr-defined]
            return None  # type: ignore[return-value]  # a fault was noted: never returned
        return cls(**values, other=other, keys=tuple(d))  # type: ignore[call-arg]

    @classmethod
    def from_doc(cls: type[R], doc: Any, where: str, source: str = _MANIFEST,
                 ctx: ParseContext | None = None) -> R:
        """The record of JSON object ``doc`` found at ``where`` of ``source``, every known key
        checked: one :class:`ManifestError` names ``source`` and every fault (with ``ctx``, the
        caller's document, one :class:`Problem` to record)."""
        sub = ParseContext(ctx.source if ctx is not None else source)
        try:
            rec = cls.decode(sub, doc, where)  # type: ignore[attr-defined]
        except Problem as p:
            sub.add(p)
        if sub.problems:
            if ctx is None:
                sub.finish()
            raise _Faults(sub.source, sub.problems)
        return rec

    def to_doc(self) -> dict[str, Any]:
        """The JSON object: the one read, key for key and in order, or a writer's in
        declaration order."""
        known = type(self).KEYS
        other = self.other
        order = self.keys
        if order is None:
            order = tuple([k for k, (_, _, always) in known.items()
                     if always or getattr(self, k) is not None] + list(other))
        out: dict[str, Any] = {}
        for k in order:
            out[k] = _encode(getattr(self, k)) if k in known else other[k]
        return out


def _encode(v: Any) -> Any:
    if isinstance(v, _Codec):
        return v.to_doc()
    if isinstance(v, tuple):
        return list(v)
    if isinstance(v, dict):
        return dict(v)
    return v


# ------------------------------------------------------------------------------------ records


class Origin(_Codec):
    """Where an imported checkpoint came from, as its importer records it: a record of its own
    under ``extras[KEY]``. The format layer knows no origin: each importer names its record
    (:attr:`shardckpt.interop.importer.Importer.origin`), and a reader asks :meth:`RunExtras.origin`
    for it, which checks it then."""

    __slots__ = ()
    #: the key of ``extras`` the record lies under
    KEY: ClassVar[str]

    def entry(self) -> dict[str, Any]:
        """``{KEY: the record's object}``: the record's place in ``extras`` (``other`` of a
        :class:`RunExtras` a writer builds)."""
        return {self.KEY: self.to_doc()}


OriginT = TypeVar("OriginT", bound=Origin)


@dataclass(frozen=True, slots=True)
class RunExtras(_Codec):
    """``extras``: global training state and provenance. Every key is optional; ``other`` holds
    the caller's own metadata, which shardckpt never interprets."""

    step: int | None = None                  # the training step saved
    samples_seen: int | None = None
    source: str | None = None                # importers: where the weights came from
    hf_config: Mapping[str, Any] | None = None  # a Hugging Face config.json
    hf_prefix: str | None = None             # chunked tensors: the model's names start with it
    seed: int | None = None                  # Checkpointer: base of the re-seed after a world change
    app: Mapping[str, Any] | None = None     # Checkpointer: app_state name -> its state_dict()
    run: str | None = None                   # Checkpointer with a local tier: the run's identity
    other: Mapping[str, Any] = field(default_factory=dict, repr=False)
    keys: tuple[str, ...] | None = field(default=None, compare=False, repr=False)

    KEYS: ClassVar[dict[str, tuple[Check, bool, bool]]] = {
        "step": (count, False, False), "samples_seen": (count, False, False),
        "source": (text, False, False), "hf_config": (json_object, False, False),
        "hf_prefix": (text, False, False),
        "seed": (seed_int, False, False), "app": (json_object, False, False),
        "run": (text, False, False)}

    def origin(self, record: type[OriginT], source: str = _MANIFEST) -> OriginT | None:
        """The importer's record ``record`` (an :class:`Origin`) under ``extras[record.KEY]``,
        checked (a fault names ``source``); None where absent or null."""
        doc = self.other.get(record.KEY)
        return None if doc is None else record.from_doc(doc, f"extras.{record.KEY}", source)


@dataclass(frozen=True, slots=True)
class PerRankState(_Codec):
    """``per_rank_state``: what the ``rank`` files are. Their state is restorable only on the
    world that wrote them, and only when no reshard dropped them."""

    world_size: int | None = None            # the world that wrote the rank files
    dropped_from_world_size: int | None = None  # reshard: the world whose rank files it dropped
    note: str | None = None
    files: bool | None = None                # each rank wrote a rank file
    other: Mapping[str, Any] = field(default_factory=dict, repr=False)
    keys: tuple[str, ...] | None = field(default=None, compare=False, repr=False)

    KEYS: ClassVar[dict[str, tuple[Check, bool, bool]]] = {
        "world_size": (count, False, True), "dropped_from_world_size": (count, False, True),
        "note": (text, False, False), "files": (flag, False, False)}

    def restorable_on(self, world_size: int) -> bool:
        """Whether the rank files hold the state of each rank of a job of ``world_size``."""
        return self.world_size == world_size and not self.dropped_from_world_size


@dataclass(frozen=True, slots=True)
class ParamGroupRecord(_Codec):
    """One of ``optimizer.param_groups``: its parameters' FQNs, hyper-parameters and step."""

    params: tuple[str, ...] = ()
    hparams: Mapping[str, Any] = field(default_factory=dict)
    step: int = 0
    other: Mapping[str, Any] = field(default_factory=dict, repr=False)
    keys: tuple[str, ...] | None = field(default=None, compare=False, repr=False)

    KEYS: ClassVar[dict[str, tuple[Check, bool, bool]]] = {
        "params": (fqns, True, True), "hparams": (json_object, False, True),
        "step": (count, False, True)}


# ------------------------------------------------------------------------------------ readers


class _Recorded(Protocol):
    """What the readers below take of a :class:`~shardckpt.format.manifest.Manifest` (which
    imports this module, so it is not named here)."""

    @property
    def extras(self) -> Mapping[str, Any]: ...

    @property
    def run_extras(self) -> RunExtras: ...

    @property
    def per_rank_state(self) -> Mapping[str, Any]: ...


class _Groups(Protocol):
    """What :func:`param_groups` takes of a :class:`~shardckpt.format.manifest.OptimizerInfo`."""

    @property
    def param_groups(self) -> Sequence[Mapping[str, Any]]: ...


def run_extras(m: _Recorded, source: str = _MANIFEST) -> RunExtras:
    """``m``'s extras as the typed record, parsed once (:attr:`Manifest.run_extras`; a manifest
    that was read had it checked then). ``source`` names the manifest should one a writer built
    hold a fault."""
    try:
        return m.run_extras
    except ManifestError:
        return RunExtras.from_doc(dict(m.extras), "extras", source)


def per_rank_state(m: _Recorded, source: str = _MANIFEST) -> PerRankState:
    """``m``'s per-rank state record, checked."""
    return PerRankState.from_doc(dict(m.per_rank_state), "per_rank_state", source)


def param_groups(info: _Groups | None, source: str = _MANIFEST) -> tuple[ParamGroupRecord, ...]:
    """The param groups of ``info`` (none without an optimizer), each checked."""
    if info is None:
        return ()
    return tuple(ParamGroupRecord.from_doc(pg, f"optimizer.param_groups[{i}]", source)
                 for i, pg in enumerate(info.param_groups))

