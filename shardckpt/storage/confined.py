"""Deleting on a local disk without leaving the directory the deletion was asked for.

Whoever can write inside a checkpoint or run directory can plant symbolic links there: a save
directory that points at someone else's files, a ``step-*`` directory that is a link to another
tree. A destructive operation (``clean``, retention, ``--overwrite``) takes the directory it was
given (its *prefix*, named by the operator and so trusted, links in it resolved) and never follows
a link found below it:

* the path to remove is walked component by component from the resolved prefix, each directory
  opened relative to the one before with ``O_NOFOLLOW``, so no component can be swapped for a
  link between a check and the removal;
* a link met on the way, or a link that is itself the thing to remove, is refused with
  :class:`~shardckpt.errors.LinkRefusedError` naming the link and its target; nothing is removed
  (the operation's caller decides whether to report it and go on);
* a directory is removed by walking it with ``os.scandir`` on file descriptors: an entry that is a
  link is unlinked (it lies inside the tree being removed; where it points is never touched).

Object stores have no links: their backends remove as usual. (Readers of untrusted input follow a
link that stays inside their root, :mod:`.links`; a removal follows none.)
"""

from __future__ import annotations

import errno
import os
import shutil
import stat

from shardckpt.errors import LinkRefusedError, StorageError

_DIR_FLAGS = (os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_NOFOLLOW", 0)
              | getattr(os, "O_CLOEXEC", 0))
#: Whether this platform can walk a path relative to open directories (POSIX).
_AT_CALLS = (os.open in os.supports_dir_fd and os.unlink in os.supports_dir_fd
             and os.rmdir in os.supports_dir_fd and os.stat in os.supports_dir_fd
             and os.scandir in os.supports_fd and hasattr(os, "O_NOFOLLOW"))


def parts_of(rel: str, url: str) -> list[str]:
    """The components of ``rel``, a path strictly below the prefix: not empty, no ``.``, ``..`` or
    empty component, no absolute path."""
    parts = rel.split("/")
    if not rel or rel.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise StorageError(f"{url}: {rel!r} is not a path inside the directory; nothing removed", url)
    return parts


def _target(path: str) -> str:
    """Where the link ``path`` points, resolved (as far as it resolves)."""
    try:
        return os.path.realpath(path)
    except OSError:  # a loop on some platforms
        try:
            return os.readlink(path)
        except OSError:
            return "?"


def _refuse(root_url: str, parts: list[str], at: int, link_path: str) -> LinkRefusedError:
    link_url = f"{root_url}/{'/'.join(parts[:at + 1])}"
    what = f"{root_url}/{'/'.join(parts)}"
    target = _target(link_path)
    where = "is" if at == len(parts) - 1 else f"lies under {link_url}, which is"
    return LinkRefusedError(
        f"{what}: not removed: it {where} a symbolic link to {target}; shardckpt never deletes "
        "through a link or removes one (remove the link yourself if it should go)",
        what, link_url, target)


def first_link(root: str, rel: str, root_url: str) -> tuple[str, str] | None:
    """(url of the link, its target) for the first symbolic link among the components of ``rel``
    below ``root``, ``rel`` itself included; None if there is none (or ``rel`` is not there)."""
    parts = parts_of(rel, root_url)
    path = os.path.realpath(root)
    for i, p in enumerate(parts):
        path = os.path.join(path, p)
        try:
            st = os.lstat(path)
        except OSError:
            return None
        if stat.S_ISLNK(st.st_mode):
            return f"{root_url}/{'/'.join(parts[:i + 1])}", _target(path)
        if not stat.S_ISDIR(st.st_mode):
            return None
    return None


def remove_inside(root: str, rel: str, root_url: str, recursive: bool = False) -> bool:
    """Remove ``rel`` below the local directory ``root`` without following any link (see the
    module doc); True if something was removed, False if nothing was there. Raises
    :class:`LinkRefusedError` for a link at or on the way to ``rel``; OSErrors pass to the caller
    (the backend maps them)."""
    parts = parts_of(rel, root_url)
    real = os.path.realpath(root)
    if not _AT_CALLS:
        return _remove_by_path(real, parts, root_url, recursive)
    try:
        fd = os.open(real, _DIR_FLAGS & ~getattr(os, "O_NOFOLLOW", 0))
    except (FileNotFoundError, NotADirectoryError):
        return False
    try:
        for i, p in enumerate(parts[:-1]):
            try:
                sub = os.open(p, _DIR_FLAGS, dir_fd=fd)
            except FileNotFoundError:
                return False
            except OSError as e:
                if e.errno not in (errno.ELOOP, errno.ENOTDIR):
                    raise
                if stat.S_ISLNK(os.stat(p, dir_fd=fd, follow_symlinks=False).st_mode):
                    raise _refuse(root_url, parts, i, os.path.join(real, *parts[:i + 1])) from None
                return False  # a file where a directory was expected: nothing below it to remove
            os.close(fd)
            fd = sub
        name = parts[-1]
        try:
            mode = os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode
        except FileNotFoundError:
            return False
        if stat.S_ISLNK(mode):
            raise _refuse(root_url, parts, len(parts) - 1, os.path.join(real, *parts))
        if not stat.S_ISDIR(mode):
            os.unlink(name, dir_fd=fd)
        elif recursive:
            _remove_tree_at(fd, name)
        else:
            os.rmdir(name, dir_fd=fd)
        return True
    finally:
        os.close(fd)


def _remove_tree_at(parent: int, name: str) -> None:
    """Remove directory ``name`` of the open directory ``parent`` and everything below it,
    iteratively (no recursion limit to meet), links unlinked and never followed."""
    try:
        top = os.open(name, _DIR_FLAGS, dir_fd=parent)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR):  # replaced meanwhile by a link or a file
            os.unlink(name, dir_fd=parent)
            return
        raise
    stack = [(parent, top, name)]  # (its parent's fd, its fd, its name); only own fds are closed
    try:
        while stack:
            up, fd, here = stack[-1]
            below = None
            with os.scandir(fd) as entries:
                for entry in entries:
                    if entry.is_dir(follow_symlinks=False):
                        below = entry.name
                        break
                    try:
                        os.unlink(entry.name, dir_fd=fd)
                    except FileNotFoundError:
                        pass
                    except IsADirectoryError:  # became a directory meanwhile: rescan
                        below = entry.name
                        break
            if below is None:
                stack.pop()
                os.close(fd)
                try:
                    os.rmdir(here, dir_fd=up)
                except FileNotFoundError:
                    pass
                continue
            try:
                stack.append((fd, os.open(below, _DIR_FLAGS, dir_fd=fd), below))
            except FileNotFoundError:
                continue
            except OSError as e:
                if e.errno not in (errno.ELOOP, errno.ENOTDIR):
                    raise
                os.unlink(below, dir_fd=fd)  # a link (or file) now: unlinked, never followed
    finally:
        for _, fd, _ in stack:
            os.close(fd)


def _remove_by_path(real: str, parts: list[str], root_url: str, recursive: bool) -> bool:
    """Where directories cannot be opened relative to each other: check each component with
    ``lstat``, then remove (``shutil.rmtree`` refuses a link at the top and unlinks those below)."""
    path = real
    for i, p in enumerate(parts):
        path = os.path.join(path, p)
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return False
        if stat.S_ISLNK(st.st_mode):
            raise _refuse(root_url, parts, i, path)
        if i < len(parts) - 1 and not stat.S_ISDIR(st.st_mode):
            return False
    if not stat.S_ISDIR(st.st_mode):
        os.unlink(path)
    elif recursive:
        shutil.rmtree(path)
    else:
        os.rmdir(path)
    return True
