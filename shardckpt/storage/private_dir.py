"""A local directory that only this user reads and writes: the node-local checkpoint tier.

A tier lives in a place other users can write to as well (``/dev/shm``, a shared scratch
disk), and a job resumes from what it finds there. So, as ssh's ``StrictModes`` does for
``~/.ssh``:

* the directory is created ``0700``; one that exists already must belong to this user and be
  writable by nobody else, and so must every directory above it, unless it belongs to root or is
  sticky (``/dev/shm``, ``/tmp``): one that fails is refused with :class:`PrivateDirError` naming
  it, its owner and its mode (someone who can rename a directory above the tier can swap the tier
  for their own);
* below it, directories are created ``0700`` and files ``0600``, each path walked component by
  component from the directory with ``O_NOFOLLOW`` (as :mod:`.confined` deletes), so a planted
  ``step-N`` link is refused with :class:`~shardckpt.errors.LinkRefusedError`, never written
  through.

:func:`private_storage` gives a :class:`~shardckpt.storage.Storage` whose writes do all that.
"""

from __future__ import annotations

import errno
import os
import stat
import uuid
from collections.abc import Callable
from typing import Any

from shardckpt.errors import ConfigError, LinkRefusedError
from shardckpt.storage import confined
from shardckpt.storage.core import Storage
from shardckpt.storage.local import LocalBackend, local_path
from shardckpt.storage.retry import map_error, mapped_errors
from shardckpt.storage.writer import LocalSink, Sink

FILE_MODE = 0o600
DIR_MODE = 0o700
_DIR_FLAGS = (os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_NOFOLLOW", 0)
              | getattr(os, "O_CLOEXEC", 0))
_FILE_FLAGS = (os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0)
               | getattr(os, "O_CLOEXEC", 0))


class PrivateDirError(ConfigError):
    """A private directory (or one above it) that another user owns or may write."""


def _who(uid: int) -> str:
    try:
        import pwd

        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except (ImportError, KeyError):
        return f"uid {uid}"


def check_private(path: str, what: str) -> None:
    """Raise :class:`PrivateDirError` unless the directory ``path`` and every directory above
    it are safe to keep this user's checkpoints in (see the module doc)."""
    me = os.geteuid()
    st = os.stat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise PrivateDirError(f"{what} {path}: not a directory")
    if st.st_uid != me:
        raise PrivateDirError(f"{what} {path} belongs to {_who(st.st_uid)}, not to this user "
                              f"({_who(me)}); refusing to keep checkpoints there or resume from it "
                              "(choose a path of your own)")
    if st.st_mode & 0o022:
        raise PrivateDirError(f"{what} {path} is writable by others (mode {stat.S_IMODE(st.st_mode):04o}); "
                              f"refusing to keep checkpoints there or resume from it (chmod 700 {path})")
    up = os.path.realpath(path)
    while up != "/":
        up = os.path.dirname(up)
        st = os.stat(up)
        if st.st_uid not in (me, 0):
            raise PrivateDirError(f"{what} {path}: {up} above it belongs to {_who(st.st_uid)}, who "
                                  "could replace the directory; refusing it (choose a path of "
                                  "your own)")
        if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
            raise PrivateDirError(f"{what} {path}: {up} above it is writable by others and not "
                                  f"sticky (mode {stat.S_IMODE(st.st_mode):04o}), so anyone could "
                                  "replace the directory; refusing it")


def make_private(url: str, what: str) -> str:
    """Create the local directory ``url`` (``0700``; its missing parents too) unless it exists,
    then :func:`check_private` it. Returns its path."""
    path = local_path(url)
    if path is None:
        raise ConfigError(f"{what} {url}: not a local directory")
    try:
        os.makedirs(path, mode=DIR_MODE, exist_ok=True)
    except OSError as e:
        raise map_error(e, "create", url) from e
    check_private(path, what)
    return path


def _open_dir(root: str, parts: list[str], root_url: str, create: bool) -> int:
    """An open descriptor of directory ``root/parts...``, each component opened with
    ``O_NOFOLLOW`` below the resolved ``root`` and created ``0700`` where missing."""
    fd = os.open(os.path.realpath(root), _DIR_FLAGS & ~getattr(os, "O_NOFOLLOW", 0))
    try:
        for i, p in enumerate(parts):
            if create:
                try:
                    os.mkdir(p, DIR_MODE, dir_fd=fd)
                except FileExistsError:
                    pass
            try:
                sub = os.open(p, _DIR_FLAGS, dir_fd=fd)
            except OSError as e:
                if e.errno in (errno.ELOOP, errno.ENOTDIR) and stat.S_ISLNK(
                        os.stat(p, dir_fd=fd, follow_symlinks=False).st_mode):
                    raise _link(root_url, parts[:i + 1]) from None
                raise
            os.close(fd)
            fd = sub
    except BaseException:
        os.close(fd)
        raise
    return fd


def _link(root_url: str, parts: list[str]) -> LinkRefusedError:
    url = f"{root_url}/{'/'.join(parts)}"
    return LinkRefusedError(f"{url}: a symbolic link in a private directory; shardckpt never "
                            "writes through one (remove it if it should not be there)", url, url, "?")


def _split(root: str, path: str, root_url: str) -> tuple[list[str], str]:
    rel = os.path.relpath(path, root)
    parts = confined.parts_of(rel.replace(os.sep, "/"), root_url)
    return parts[:-1], parts[-1]


def open_private(root: str, path: str, root_url: str) -> int:
    """``path`` (below ``root``) opened for writing, created ``0600``, truncated; its directories
    created ``0700``; no link followed on the way or at the end."""
    dirs, name = _split(root, path, root_url)
    fd = _open_dir(root, dirs, root_url, create=True)
    try:
        return _open_file(fd, name, _FILE_FLAGS, root_url, dirs)
    finally:
        os.close(fd)


def _open_file(fd: int, name: str, flags: int, root_url: str, dirs: list[str]) -> int:
    """File ``name`` of the open directory ``fd`` (``root/dirs``) opened with ``flags`` (which
    hold ``O_NOFOLLOW``; a new file is ``0600``): a link there is refused."""
    try:
        return os.open(name, flags, FILE_MODE, dir_fd=fd)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise _link(root_url, [*dirs, name]) from None
        raise


def take_private(root: str, spare: str, path: str, root_url: str) -> int | None:
    """Rename ``spare`` to ``path`` (both below ``root``, directories walked as
    :func:`open_private` walks them) and open it for writing, not truncated; None where the spare
    is gone. A link at ``path`` after the rename (the spare was one) is refused."""
    dirs, name = _split(root, path, root_url)
    sdirs, sname = _split(root, spare, root_url)
    try:
        sfd = _open_dir(root, sdirs, root_url, create=False)
    except FileNotFoundError:
        return None
    try:
        fd = _open_dir(root, dirs, root_url, create=True)
        try:
            try:
                os.rename(sname, name, src_dir_fd=sfd, dst_dir_fd=fd)
            except FileNotFoundError:
                return None
            return _open_file(fd, name, _FILE_FLAGS & ~(os.O_CREAT | os.O_TRUNC), root_url, dirs)
        finally:
            os.close(fd)
    finally:
        os.close(sfd)


class PrivateSink(LocalSink):
    """:class:`LocalSink` of a file created ``0600`` through :func:`open_private`."""

    def __init__(self, backend: PrivateBackend, path: str, url: str) -> None:  # noqa: D107
        self.path, self.url = path, url
        self._written = 0
        self._kicked = 0
        self.f = backend.call("open", url, lambda: os.fdopen(
            open_private(backend.private_root, path, backend.private_url), "wb"))


class PrivateBackend(LocalBackend):
    """The local backend of a private directory: its writes go through :func:`open_private`."""

    private_root = "/"
    private_url = ""

    def sink(self, path: str, url: str) -> Sink:
        return PrivateSink(self, path, url)

    def open_for_write(self, path: str, url: str, spare: str | None = None) -> int:
        """:func:`open_private`: ``0600``, no link followed, directories ``0700``; ``spare``
        (below the same root) renamed to ``path`` first where it is there (:func:`take_private`)."""
        if spare is not None:
            fd = take_private(self.private_root, spare, path, self.private_url)
            if fd is not None:
                return fd
        return open_private(self.private_root, path, self.private_url)

    def _write(self, path: str, url: str, data: bytes, install: Callable[[int, str, str], None]) -> None:
        dirs, name = _split(self.private_root, path, self.private_url)
        tmp = f"{name}.tmp-{uuid.uuid4().hex[:12]}"
        with mapped_errors("write", url):
            with os.fdopen(open_private(self.private_root, os.path.join(os.path.dirname(path), tmp),
                                        self.private_url), "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            fd = _open_dir(self.private_root, dirs, self.private_url, create=False)
            try:
                install(fd, tmp, name)
            finally:
                try:
                    os.unlink(tmp, dir_fd=fd)
                except FileNotFoundError:
                    pass
                os.close(fd)
            self.fsync_dir(os.path.dirname(path))

    def create_only(self, path: str, url: str, data: bytes) -> None:
        from shardckpt.storage.backends import conflict_error

        def link(fd: int, tmp: str, name: str) -> None:
            try:
                os.link(tmp, name, src_dir_fd=fd, dst_dir_fd=fd, follow_symlinks=False)
            except FileExistsError as e:
                raise conflict_error(url) from e
        self._write(path, url, data, link)

    def put(self, path: str, url: str, data: bytes) -> None:
        self._write(path, url, data, lambda fd, tmp, name: os.replace(tmp, name, src_dir_fd=fd,
                                                                        dst_dir_fd=fd))

    def install(self, staged: str, path: str, url: str) -> None:
        dirs, name = _split(self.private_root, path, self.private_url)
        sdirs, sname = _split(self.private_root, staged, self.private_url)

        def rename() -> None:
            fd = _open_dir(self.private_root, dirs, self.private_url, create=False)
            try:
                sfd = _open_dir(self.private_root, sdirs, self.private_url, create=False)
                try:
                    os.replace(sname, name, src_dir_fd=sfd, dst_dir_fd=fd)
                finally:
                    os.close(sfd)
            finally:
                os.close(fd)
        self.call("rename", url, rename)


def private_storage(url: str, what: str = "local tier directory") -> Storage:
    """A :class:`Storage` of the local directory ``url``, created and checked by
    :func:`make_private`, whose writes create ``0600`` files and ``0700`` directories and never
    follow a link (see the module doc)."""
    path = make_private(url, what)
    s = Storage(url)
    backend: Any = PrivateBackend(None, s.backend.retry, s.backend.tuning)
    backend.private_root, backend.private_url = path, s.url
    return Storage(url, backend=(backend, s.root))
