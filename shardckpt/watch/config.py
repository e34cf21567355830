"""A checkpoint pipeline, read from TOML: the run prefix to watch and the ordered steps to run.

::

    name = "llama-7b"                     # records live under <state>/.watch/<name>/
    watch = "s3://ckpt/llama-7b"          # a run directory of step-XXXXXXXX checkpoints
    state = "s3://ckpt/llama-7b-derived"  # where progress records go (default: watch)
    interval_s = 30                       # polling interval
    concurrency = 1                       # checkpoints processed at once by one watcher
    retries = 2                           # retries per step after its first attempt
    backoff_s = 5.0                       # first retry delay; doubles per retry (capped at 300 s)
    lease_ttl_s = 120                     # a step lease's life, renewed every third of it
    trust = ["keys/ckpt.pub"]             # only checkpoints these Ed25519 keys signed (optional)
    signing_key = "keys/ckpt"             # reshard steps sign what they write (optional)

    [storage_options]                     # fsspec options for every location (optional)

    [[steps]]
    kind = "verify"
    [[steps]]
    kind = "consolidate"
    dst = "s3://ckpt/hf/{name}"           # {name}: step-00000100, {step}: 100 ({step:06d} too)
    dtype = "bfloat16"
    keep_buffers = false                  # true: also write the persistent buffers
    [[steps]]
    kind = "reshard"
    dst = "s3://ckpt/ws8/{name}"
    to = 8
    from = 64                             # optional guard: the source's world size
    processes = 4                         # run as a torchrun job of 4 processes (default 1)
    [[steps]]
    kind = "retain"
    keep = 3                              # the newest 3 checkpoints (up to the one processed)
    keep_optimizer_last = 1               # optional: the newest 1 whole, older kept ones thinned
    keep_every = 1000                     # optional: steps that are multiples of 1000 kept (weights)

``processes`` (verify, reshard and consolidate only) runs the step as ``torchrun
--nproc_per_node <processes> -m shardckpt <kind> ...`` from the watcher
(:mod:`shardckpt.watch.job`); 1 runs it in the watcher's own process.

Local paths that are not absolute are relative to the TOML file's directory. Every problem is
one :class:`~shardckpt.errors.ConfigError` naming the file and the key. Pure apart from reading
the file.
"""

from __future__ import annotations

import os
import re
import string
import sys
from dataclasses import dataclass, field
from typing import Any
from collections.abc import Mapping

from shardckpt.checkpoint.trust import signing_key, trusted_keys
from shardckpt.errors import ConfigError
from shardckpt.format.dtypes import OUTPUT_ALIASES

if sys.version_info >= (3, 11):
    import tomllib
else:  # the same module, from PyPI
    import tomli as tomllib

KINDS = ("verify", "reshard", "consolidate", "copy", "retain")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,99}\Z")
_TOP = {"name", "watch", "state", "interval_s", "concurrency", "retries", "backoff_s",
        "lease_ttl_s", "storage_options", "steps", "trust", "signing_key"}
_STEP_KEYS = {
    "verify": {"kind", "processes"},
    "reshard": {"kind", "dst", "to", "from", "replicate", "processes"},
    "consolidate": {"kind", "dst", "dtype", "copy_from", "max_shard_size", "keep_buffers",
                    "processes"},
    "copy": {"kind", "dst"},
    "retain": {"kind", "keep", "keep_optimizer_last", "keep_every"},
}
_DTYPES = tuple(OUTPUT_ALIASES)
#: The kinds that can run as a torchrun job (``processes``): the offline tools that have a job form.
JOB_KINDS = ("verify", "reshard", "consolidate")


@dataclass(frozen=True, slots=True)
class StepSpec:
    """One step of a pipeline; ``dst`` is a template with ``{step}`` and ``{name}``."""

    index: int
    kind: str
    dst: str | None = None
    to: int | None = None
    replicate: int = 1
    dtype: str = "bfloat16"
    copy_from: str | None = None
    max_shard_size: int | None = None
    keep: int | None = None
    processes: int = 1              # > 1: run as a torchrun job of that many processes
    from_: int | None = None        # reshard: the source's world size it must have (a guard)
    keep_buffers: bool = False      # consolidate: also write the persistent buffers
    keep_optimizer_last: int | None = None  # retain: the newest N kept whole, older ones thinned
    keep_every: int | None = None   # retain: every checkpoint whose step is a multiple is kept

    @property
    def key(self) -> str:
        """The step's name in records: ``<index>-<kind>`` (index from 1, in pipeline order)."""
        return f"{self.index}-{self.kind}"

    def dst_for(self, step: int, name: str) -> str | None:
        return None if self.dst is None else self.dst.format(step=step, name=name)


@dataclass(frozen=True, slots=True)
class Pipeline:
    name: str
    watch: str
    state: str
    steps: tuple[StepSpec, ...]
    interval_s: float = 30.0
    concurrency: int = 1
    retries: int = 2
    backoff_s: float = 5.0
    lease_ttl_s: float = 120.0
    storage_options: Mapping[str, Any] = field(default_factory=dict)
    source: str = "<pipeline>"
    #: public key files: a checkpoint they did not sign is refused by every step (dead-lettered),
    #: and ``verify`` checks every file's signed digest
    trust: tuple[str, ...] = ()
    #: a private key file: reshard steps sign what they write
    signing_key: str | None = None


def load_pipeline(path: str) -> Pipeline:
    """Read and check the pipeline at ``path`` (a local TOML file)."""
    try:
        with open(path, "rb") as f:
            doc = tomllib.load(f)
    except FileNotFoundError as e:
        raise ConfigError(f"{path}: no such pipeline file") from e
    except OSError as e:
        raise ConfigError(f"{path}: cannot read the pipeline file: {e.strerror or e}") from e
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML: {e}") from e
    return parse_pipeline(doc, path, os.path.dirname(os.path.abspath(path)))


def parse_pipeline(doc: Mapping[str, Any], source: str = "<pipeline>", base: str = ".") -> Pipeline:
    """A :class:`Pipeline` from a parsed TOML document; local paths are relative to ``base``."""
    def bad(what: str) -> ConfigError:
        return ConfigError(f"{source}: {what}")

    unknown = sorted(set(doc) - _TOP)
    if unknown:
        raise bad(f"unknown key(s) {', '.join(unknown)}; expected some of {', '.join(sorted(_TOP))}")
    name = doc.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise bad(f"name {name!r}: expected a plain name (letters, digits, _ . -)")
    watch = _location(doc.get("watch"), "watch", base, bad)
    state = _location(doc.get("state", watch), "state", base, bad)
    opts = doc.get("storage_options", {})
    if not isinstance(opts, dict):
        raise bad("storage_options: expected a table")
    raw_steps = doc.get("steps")
    if not isinstance(raw_steps, list) or not raw_steps:
        raise bad("no [[steps]]: a pipeline needs at least one step")
    steps = tuple(_step(i + 1, s, base, bad) for i, s in enumerate(raw_steps))
    return Pipeline(
        name, watch, state, steps,
        interval_s=_number(doc, "interval_s", 30.0, bad, minimum=0.01),
        concurrency=int(_number(doc, "concurrency", 1, bad, minimum=1, integer=True)),
        retries=int(_number(doc, "retries", 2, bad, minimum=0, integer=True)),
        backoff_s=_number(doc, "backoff_s", 5.0, bad, minimum=0.0),
        lease_ttl_s=_number(doc, "lease_ttl_s", 120.0, bad, minimum=0.1),
        storage_options=opts, source=source, trust=_trust(doc.get("trust", []), base, bad),
        signing_key=_signing_key(doc.get("signing_key"), base, bad))


def _trust(value: Any, base: str, bad: Any) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(k, str) and k.strip() for k in value):
        raise bad("trust: expected a list of public key files")
    keys = tuple(k if os.path.isabs(k) else os.path.normpath(os.path.join(base, k)) for k in value)
    trusted_keys(keys or None)  # a key file that cannot be read or parsed: refused here, by name
    return keys


def _signing_key(value: Any, base: str, bad: Any) -> str | None:
    if value is None:
        return None
    path = _location(value, "signing_key", base, bad)
    signing_key(path)  # read and parsed now: a wrong path or key fails here, by name
    return path


def _location(value: Any, key: str, base: str, bad: Any) -> str:
    if not isinstance(value, str) or not value.strip():
        raise bad(f"{key}: expected a location (a directory or URL such as s3://bucket/run)")
    if "://" in value or os.path.isabs(value):
        return value.rstrip("/") or value
    return os.path.normpath(os.path.join(base, value))


def _number(doc: Mapping[str, Any], key: str, default: float, bad: Any, minimum: float,
            integer: bool = False) -> float:
    value = doc.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or \
            (integer and not isinstance(value, int)) or value < minimum:
        kind = "an integer" if integer else "a number"
        raise bad(f"{key} = {value!r}: expected {kind} >= {minimum:g}")
    return value


def _template(value: Any, where: str, base: str, bad: Any) -> str:
    if not isinstance(value, str) or not value.strip():
        raise bad(f"{where}: dst: expected a location template such as s3://bucket/out/{{name}}")
    fields = set()
    try:
        for _, fname, _, _ in string.Formatter().parse(value):
            if fname is not None:
                fields.add(fname)
        value.format(step=1, name="step-00000001")
    except (ValueError, KeyError, IndexError) as e:
        raise bad(f"{where}: dst {value!r}: not a valid template ({e}); use {{step}} or {{name}}") from e
    if not fields & {"step", "name"} or fields - {"step", "name"}:
        raise bad(f"{where}: dst {value!r} must name the checkpoint with {{step}} or {{name}} "
                  "(and nothing else), so that each checkpoint gets its own output")
    return _location(value, f"{where}: dst", base, bad)


def _step(index: int, raw: Any, base: str, bad: Any) -> StepSpec:
    if not isinstance(raw, dict):
        raise bad(f"steps[{index}]: expected a table")
    kind = raw.get("kind")
    where = f"steps[{index}] ({kind})"
    if kind not in KINDS:
        raise bad(f"steps[{index}]: kind {kind!r}: expected one of {', '.join(KINDS)}")
    if "processes" in raw and kind not in JOB_KINDS:
        raise bad(f"{where}: processes: a {kind} step runs in the watcher's own process; only "
                  f"{', '.join(JOB_KINDS)} steps run as a torchrun job")
    unknown = sorted(set(raw) - _STEP_KEYS[kind])
    if unknown:
        raise bad(f"{where}: unknown key(s) {', '.join(unknown)}; a {kind} step takes "
                  f"{', '.join(sorted(_STEP_KEYS[kind]))}")
    dst = _template(raw.get("dst"), where, base, bad) if "dst" in _STEP_KEYS[kind] else None
    procs = int(_number(raw, "processes", 1, lambda w: bad(f"{where}: {w}"), 1, integer=True))
    if kind == "reshard":
        to = int(_number(raw, "to", 0, lambda w: bad(f"{where}: {w}"), 1, integer=True))
        rep = int(_number(raw, "replicate", 1, lambda w: bad(f"{where}: {w}"), 1, integer=True))
        if to % rep:
            raise bad(f"{where}: to = {to} is not divisible by replicate = {rep}")
        src_n = None if "from" not in raw else \
            int(_number(raw, "from", 0, lambda w: bad(f"{where}: {w}"), 1, integer=True))
        return StepSpec(index, kind, dst, to=to, replicate=rep, processes=procs, from_=src_n)
    if kind == "consolidate":
        dtype = raw.get("dtype", "bfloat16")
        if dtype not in _DTYPES:
            raise bad(f"{where}: dtype {dtype!r}: expected one of {', '.join(_DTYPES)}")
        cf = raw.get("copy_from")
        copy_from = None if cf is None else _location(cf, f"{where}: copy_from", base, bad)
        mss = raw.get("max_shard_size")
        if mss is not None:
            mss = int(_number(raw, "max_shard_size", 0, lambda w: bad(f"{where}: {w}"), 1, integer=True))
        keep = raw.get("keep_buffers", False)
        if not isinstance(keep, bool):
            raise bad(f"{where}: keep_buffers = {keep!r}: expected true or false")
        return StepSpec(index, kind, dst, dtype=dtype, copy_from=copy_from, max_shard_size=mss,
                        processes=procs, keep_buffers=keep)
    if kind == "retain":
        keep = int(_number(raw, "keep", 0, lambda w: bad(f"{where}: {w}"), 1, integer=True))
        opt, every = (None if raw.get(k) is None else
                      int(_number(raw, k, 0, lambda w: bad(f"{where}: {w}"), 1, integer=True))
                      for k in ("keep_optimizer_last", "keep_every"))
        if opt is not None and opt > keep:
            raise bad(f"{where}: keep_optimizer_last = {opt} is more than keep = {keep}: a "
                      "checkpoint keeps its optimizer state only while it is kept")
        return StepSpec(index, kind, keep=keep, keep_optimizer_last=opt, keep_every=every)
    return StepSpec(index, kind, dst, processes=procs)
