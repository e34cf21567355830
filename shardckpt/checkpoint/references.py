"""Files a manifest names, its own and those it references in sibling checkpoints (format 1.3).

A checkpoint of a run may name, instead of writing it again, the ``frozen`` file of an earlier
checkpoint of the same run directory: ``../step-00000100/<save-id>/frozen-00000-of-00004.safetensors``
(the parser admits exactly that form, :data:`~shardckpt.format.manifest.REFERENCE`).
:class:`RunFiles` is the read side: a :class:`~shardckpt.storage.checked.Files` view of one
checkpoint in which a referenced path is read from the run directory (the checkpoint's parent),
never by handing ``..`` to the storage (an object store has no ``..``). On a local disk a
referenced file is read only if, every link followed, it still lies inside the run directory.

The retention side (what must be kept because a kept manifest references it) is
:func:`referenced_steps`: references never chain (a writer copies an earlier reference rather
than pointing at a checkpoint that itself references), so the step directories one manifest
names are all that its bytes need.
"""

from __future__ import annotations

import logging
import re
import threading

from shardckpt.errors import IncompleteCheckpointError, ManifestError
from shardckpt.format.manifest import FROZEN_ROLE, FileEntry, Manifest, frozen_part, reference_of
from shardckpt.storage import Storage, crc32c, read_checked, check_inside

log = logging.getLogger(__name__)

#: A reference as it appears in a manifest's bytes (a damaged or newer manifest, scanned by
#: retention rather than parsed, so that a checkpoint it may need is kept all the same).
_REFERENCE_BYTES = re.compile(rb'"\.\./(step-[0-9]{8,20})/')


def parent_of(storage: Storage) -> Storage | None:
    """The directory that holds the checkpoint at ``storage`` (its run directory), on the same
    backend; None where the checkpoint is a root."""
    root, url = storage.root.rstrip("/"), storage.url.rstrip("/")
    if "/" not in root:
        return None
    up_root = root.rsplit("/", 1)[0] or "/"
    # a local path relative to the working directory has no "/" of its own: name the parent
    # by the root path the backend serves
    up_url = url.rsplit("/", 1)[0] if "/" in url else up_root
    if not up_url or up_url.endswith(":/"):
        up_url += "/"
    return Storage(up_url, storage.storage_options, backend=(storage.backend, up_root))


class RunFiles:
    """A checkpoint's files as its manifest names them: paths below the checkpoint are read
    from ``storage``; a reference (``../step-XXXXXXXX/...``) from the run directory, after its
    form is checked (again: a manifest built in memory was not parsed) and, on a local disk, that
    no link takes it out of the run directory. Offers what the checked read path needs
    (:class:`~shardckpt.storage.checked.Files`) plus ``size`` and ``read_checked``."""

    def __init__(self, storage: Storage) -> None:
        self.storage = storage
        self.backend = storage.backend
        self._run: Storage | None = None
        self._inside: set[str] = set()
        self._lock = threading.Lock()

    @property
    def url(self) -> str:
        return self.storage.url

    def run(self) -> Storage:
        """The run directory (the checkpoint's parent)."""
        if self._run is None:
            run = parent_of(self.storage)
            if run is None:
                raise IncompleteCheckpointError(
                    f"{self.storage.url}: the manifest references files of sibling checkpoints, "
                    "but this checkpoint lies in no run directory")
            self._run = run
        return self._run

    def locate(self, rel: str) -> tuple[Storage, str]:
        """The storage and the path below it that hold ``rel`` (a path a manifest names)."""
        if not rel.startswith("../"):
            return self.storage, rel
        if reference_of(rel) is None:
            raise ManifestError(f"{self.storage.url}: {rel!r} is not a reference to a frozen file "
                                "of a sibling checkpoint; refused")
        run, below = self.run(), rel[3:]
        with self._lock:
            known = below in self._inside
        if not known:
            check_inside(run, below)  # a link out of the run directory is refused
            with self._lock:
                self._inside.add(below)
        return run, below

    def check_inside(self, rel: str) -> None:
        """Refuse ``rel`` if a symbolic link takes it out of where it belongs: the checkpoint's
        directory for its own files, the run directory for a reference (local disks only)."""
        storage, below = self.locate(rel)
        if storage is self.storage:
            check_inside(storage, below)

    def url_of(self, rel: str) -> str:
        if not rel.startswith("../"):
            return self.storage.url_of(rel)
        run = parent_of(self.storage)
        return run.url_of(rel[3:]) if run is not None else self.storage.url_of(rel)

    def full(self, rel: str) -> str:
        storage, below = self.locate(rel)
        return storage.full(below)

    def read(self, rel: str, start: int | None = None, end: int | None = None) -> bytes:
        storage, below = self.locate(rel)
        return storage.read(below, start, end)

    def size(self, rel: str) -> int:
        storage, below = self.locate(rel)
        return storage.size(below)

    def read_checked(self, entry: FileEntry, chunk_size: int, start: int, end: int,
                     prefix: str = "") -> memoryview:
        return read_checked(self, entry, chunk_size, start, end, prefix)

    def missing_note(self, entry: FileEntry) -> str:
        """What to say after "missing" for ``entry``: for a reference, that the checkpoint that
        held it is gone."""
        ref = reference_of(entry.path) if entry.is_reference else None
        if ref is None:
            return ""
        return (f" (this checkpoint references it: the checkpoint {self.url_of('../' + ref[0])}, "
                "which holds it, was removed or moved; this checkpoint cannot be read without it)")


def referenced_steps(m: Manifest) -> set[str]:
    """The step directories (names) whose files ``m`` references."""
    out = set()
    for f in m.references():
        ref = reference_of(f.path)
        if ref is not None:
            out.add(ref[0])
    return out


def referenced_steps_in(data: bytes) -> set[str]:
    """The step directories a manifest's raw bytes seem to reference: for a manifest that does
    not parse, so that what it may need is kept all the same."""
    return {m.decode() for m in _REFERENCE_BYTES.findall(data)}


def reference_to(entry: FileEntry, step: str) -> str:
    """The path by which a checkpoint in a sibling directory references ``entry`` of the
    checkpoint in step directory ``step``: an entry that is itself a reference is copied
    (references never chain)."""
    return entry.path if entry.is_reference else f"../{step}/{entry.path}"


def frozen_stand_ins(m: Manifest, prev: Manifest, step: str) -> dict[str, str]:
    """For each ``frozen`` file of ``m`` (its own, not a reference) that the frozen file of
    ``prev`` (the checkpoint in sibling step directory ``step``) stands for, its path -> the
    reference to name instead. ``prev`` must have the same mesh, chunk size and frozen groups
    (names, units, dtypes, numel, padding, parameters, state kinds); each entry the same size,
    header size, CRC32C and chunk CRC32Cs. Pure: whether the file is still there is the caller's."""
    if (not (m.frozen and prev.frozen) or m.mesh != prev.mesh or m.chunk_size != prev.chunk_size
            or frozen_part(m.components) != frozen_part(prev.components)):
        return {}
    theirs = {f.index: f for f in prev.files if f.role == FROZEN_ROLE}
    out = {}
    for f in m.files:
        old = theirs.get(f.index)
        if (f.role == FROZEN_ROLE and not f.is_reference and old is not None
                and (f.size, f.header_size, f.crc32c, tuple(f.chunk_crc32c))
                == (old.size, old.header_size, old.crc32c, tuple(old.chunk_crc32c))):
            out[f.path] = reference_to(old, step)
    return out


def file_crc(header: bytes, pieces: list[memoryview]) -> tuple[int, int]:
    """(size, CRC32C) of a file of ``header`` then ``pieces``, without writing it."""
    crc, size = crc32c(header), len(header)
    for p in pieces:
        crc = crc32c(p, crc)
        size += len(p)
    return size, crc
