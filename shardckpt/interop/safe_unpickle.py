"""The check a DCP value (a ``torch.save`` blob) passes before :class:`ShardckptReader` hands it
to DCP's load planner, whose ``load_bytes`` decodes it.

DCP's ``DefaultLoadPlanner.load_bytes`` decodes a value by calling ``torch.load`` with
``weights_only=False``: a pickle that names ``os.system`` runs it. :func:`check_value` admits a
value only if ``torch.load(..., weights_only=True)`` would load it, in two steps:

1. **Names.** Every pickle in the blob (``data.pkl`` of a ``torch.save`` archive; each pickle of
   the legacy format) is read by :class:`_GlobalScan`, a ``pickle.Unpickler`` whose
   ``find_class`` looks each global up in the set ``torch.load(weights_only=True)`` allows
   (torch's own list, plus the user's ``torch.serialization.add_safe_globals`` /
   ``safe_globals``; never ``os``, ``posix``, ``nt``, ``sys``) and returns an inert stand-in for
   it either way: nothing is imported, called or built, and every global named is seen. Any name
   outside the set is refused by name, before torch is asked to decode anything. A TorchScript
   archive (which ``torch.load`` hands to ``torch.jit.load``) is refused here too.
2. **Decode.** ``torch.load(..., weights_only=True, map_location="cpu")``, torch's restricted
   unpickler, which also limits what the admitted globals may do (which objects may take state,
   which opcodes are read). Whatever it refuses is refused.

Only a value that passes both goes on, as the same bytes. Each value is decoded twice (here and
by the planner); the values DCP stores this way are small (step counters, hyper-parameters,
RNG and data-loader state).
"""

from __future__ import annotations

import io
import logging
import pickle
import warnings
import zipfile
from typing import Any

from shardckpt.errors import UnsafePickleError

log = logging.getLogger(__name__)

__all__ = ["check_value", "refused_globals"]

#: Modules torch.load(weights_only=True) never admits, even when a user allow-lists them.
_BLOCKED_MODULES = frozenset({"sys", "os", "posix", "nt"})
#: The legacy (non-zip) ``torch.save`` format is five pickles, then raw storage bytes.
_LEGACY_PICKLES = 5


class _Inert:
    """What the scan returns for every global: accepts any construction, state or items and
    does nothing with them."""

    def __new__(cls, *args: Any, **kwargs: Any) -> _Inert:
        return object.__new__(cls)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __call__(self, *args: Any, **kwargs: Any) -> _Inert:
        return _Inert()

    def __setstate__(self, state: Any) -> None:
        pass

    def __setitem__(self, key: Any, value: Any) -> None:
        pass

    def append(self, item: Any) -> None:
        pass

    def extend(self, items: Any) -> None:
        pass


def _allowed_names() -> set[str] | None:
    """The globals torch.load(weights_only=True) admits now, as ``module.name``; None if this
    torch does not say (the decode step then decides alone)."""
    try:
        from torch import _weights_only_unpickler as wo
    except ImportError:
        return None
    try:
        return set(wo._get_allowed_globals()) | set(wo._get_user_allowed_globals())
    except (AttributeError, TypeError, ValueError):
        return None


def _mapped(module: str, name: str) -> tuple[str, str]:
    """Python 2 names as torch's weights-only unpickler reads them (``__builtin__.set``)."""
    try:
        from torch._utils import IMPORT_MAPPING, NAME_MAPPING
    except ImportError:
        return module, name
    if (module, name) in NAME_MAPPING:
        return NAME_MAPPING[(module, name)]
    return IMPORT_MAPPING.get(module, module), name


class _GlobalScan(pickle.Unpickler):
    """Reads one pickle and records each global it names that the allow-list does not hold.
    ``find_class`` returns :class:`_Inert` for every name (allowed or not): no module is
    imported and nothing the pickle names is called."""

    def __init__(self, file: Any, allowed: set[str], refused: list[str]) -> None:
        super().__init__(file, fix_imports=False, encoding="latin1")
        self.allowed, self.refused = allowed, refused

    def find_class(self, module: str, name: str) -> Any:
        module, name = _mapped(str(module), str(name))
        full = f"{module}.{name}"
        if (module in _BLOCKED_MODULES or full not in self.allowed) and full not in self.refused:
            self.refused.append(full)
        return _Inert

    def persistent_load(self, pid: Any) -> Any:
        return _Inert()


def _pickles(data: bytes) -> list[tuple[io.BytesIO, int]] | None:
    """The pickle streams ``torch.load`` unpickles from ``data``, each with how many pickles to
    read from it; None for a TorchScript archive."""
    try:
        zf = zipfile.ZipFile(io.BytesIO(data))
    except zipfile.BadZipFile:
        return [(io.BytesIO(data), _LEGACY_PICKLES)]
    with zf:
        names = zf.namelist()
        if any(n.rsplit("/", 1)[-1] == "constants.pkl" for n in names):
            return None
        return [(io.BytesIO(zf.read(n)), 1) for n in names if n.rsplit("/", 1)[-1] == "data.pkl"]


def refused_globals(data: bytes) -> list[str] | None:
    """The globals ``data`` (a ``torch.save`` blob) names that ``torch.load(weights_only=True)``
    does not admit, in order of first use; ``["torch.jit.load"]`` for a TorchScript archive;
    None when the blob cannot be read this way (the decode step decides)."""
    allowed = _allowed_names()
    if allowed is None:
        return None
    try:
        streams = _pickles(data)
    except Exception:  # noqa: BLE001 - a damaged archive: torch.load decides
        return None
    if streams is None:
        return ["torch.jit.load"]
    refused: list[str] = []
    for stream, count in streams:
        for _ in range(count):
            if stream.tell() >= len(stream.getbuffer()):
                break
            try:
                _GlobalScan(stream, allowed, refused).load()
            except Exception:  # noqa: BLE001 - not a pickle past here (legacy raw bytes)
                break
    return refused


def _reason(e: BaseException) -> str:
    """The line of torch's weights-only error that says what was refused."""
    text = str(e)
    marker = "WeightsUnpickler error:"
    if marker in text:
        text = text.split(marker, 1)[1]
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[0] if lines else type(e).__name__


def check_value(data: bytes, key: str, file: str, url: str = "") -> None:
    """Raise :class:`~shardckpt.errors.UnsafePickleError` naming ``key`` and ``file`` unless
    ``torch.load(data, weights_only=True)`` would load ``data`` (module docstring)."""
    where = f"{url}: " if url else ""
    hint = ("It was refused without being loaded. If the checkpoint comes from a source you "
            "trust, allow the classes it uses with torch.serialization.add_safe_globals, or "
            "load it with allow_pickle=True, which runs whatever code its values name.")
    refused = refused_globals(data)
    if refused == ["torch.jit.load"]:
        raise UnsafePickleError(
            f"{where}value {key!r} (in {file}) is a TorchScript archive, which torch.load hands "
            f"to torch.jit.load and torch.load(weights_only=True) refuses. {hint}",
            key=key, file=file, refused=tuple(refused))
    if refused:
        names = ", ".join(refused)
        raise UnsafePickleError(
            f"{where}value {key!r} (in {file}) names the global{'s' if len(refused) > 1 else ''} "
            f"{names}, which torch.load(weights_only=True) does not allow. {hint}",
            key=key, file=file, refused=tuple(refused))
    import torch

    try:
        with warnings.catch_warnings():  # torch warns of pickle protocols other than 2
            warnings.simplefilter("ignore")
            torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - whatever the restricted decode refuses is refused
        reason = _reason(e)
        raise UnsafePickleError(
            f"{where}value {key!r} (in {file}) is not one torch.load(weights_only=True) loads "
            f"({type(e).__name__}: {reason}). {hint}", key=key, file=file) from None
