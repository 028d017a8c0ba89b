"""Opening checkpoint files on a local disk: regular files only, and only inside the checkpoint.

A local checkpoint is a directory anyone may have prepared, so a name in it may be anything the file system
allows:

* a FIFO, socket or device (``.metadata`` as a FIFO blocks ``open`` until a writer comes; as a symlink to
  ``/dev/zero`` it never ends). Such entries are refused from ``stat`` alone, never opened; the descriptor
  is then opened with ``O_NONBLOCK`` and checked again with ``fstat`` (something swapped in between is
  refused too).
* a symlink, or a symlinked directory, that leads out of the checkpoint (``__0_0.distcp -> /etc/passwd``).
  Its bytes would reach error messages and ``verify`` reports, and a manifest's checksums could be used
  to test guesses against it. Every path is resolved (``realpath``) and must stay under the checkpoint's
  :class:`Confinement`; symlinks that stay inside are fine.

The containment check resolves the path and then opens the resolved path with ``O_NOFOLLOW``, so a final
symlink swapped in after the check is refused. A directory above it swapped by a concurrent writer in the
meantime is not caught: whoever can rename directories inside the checkpoint while it loads could as well
have changed the bytes.
"""

from __future__ import annotations

import os
import stat

from ..errors import CheckpointNotFoundError, CorruptCheckpointError, TransportError

__all__ = ["Confinement", "open_regular", "stat_regular"]

# Hugging Face's hub cache keeps files in ``<repo>/blobs/`` and links them from ``<repo>/snapshots/<rev>/``:
# a checkpoint opened inside a snapshot may follow links up to its repository directory.
_HUB_SNAPSHOTS = "snapshots"
_HUB_REPO_PREFIXES = ("models--", "datasets--", "spaces--")


class Confinement:
    """The directory a local checkpoint's files must resolve into, worked out once, on first use.

    ``path`` is the checkpoint as the user named it: a directory, or a file (a safetensors file, an index,
    a ``torch.save`` file), whose directory then bounds its siblings. The checkpoint root itself may be a
    symlink: it is resolved once, when the first file is opened (a writer's root need not exist earlier).
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self._root: str | None = None

    @property
    def root(self) -> str:
        if self._root is None:
            real = os.path.realpath(self.path)
            root = real if os.path.isdir(real) else os.path.dirname(real)
            parent = os.path.dirname(root)
            if os.path.basename(parent) == _HUB_SNAPSHOTS and os.path.basename(
                os.path.dirname(parent)
            ).startswith(_HUB_REPO_PREFIXES):
                root = os.path.dirname(parent)
            self._root = root
        return self._root

    def check(self, path: str, where: str | None = None) -> str:
        """The resolved ``path``; :class:`CorruptCheckpointError` naming ``where`` (default ``path``) if it
        resolves outside."""
        real = os.path.realpath(path)
        root = self.root
        if real != root and not real.startswith(root.rstrip(os.sep) + os.sep):
            raise CorruptCheckpointError(
                f"{where or path}: resolves outside the checkpoint directory {root} (a symlink, or a symlinked directory, "
                "leading out of it); refusing to read it. Copy the file into the checkpoint instead of linking it"
            )
        return real


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO (named pipe)"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
    ):
        if test(mode):
            return name
    return "not a regular file"


def _refuse(path: str, mode: int) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"{path}: is {_kind(mode)}, not a regular file; a checkpoint holds only regular files, refusing to open it"
    )


def _os_error(path: str, exc: OSError) -> Exception:
    if isinstance(exc, FileNotFoundError):
        return CheckpointNotFoundError(f"{path}: no such file")
    if isinstance(exc, NotADirectoryError):
        return CheckpointNotFoundError(f"{path}: no such file (a directory on its path is a file)")
    return TransportError(f"{path}: cannot open for reading ({exc.strerror or type(exc).__name__})")


def stat_regular(path: str, confinement: Confinement | None = None, where: str | None = None) -> os.stat_result:
    """``stat`` of ``path``, which must be a regular file (inside ``confinement`` when given); errors name
    ``where`` (default: ``path``)."""
    where = where or path
    target = confinement.check(path, where) if confinement is not None else path
    try:
        st = os.stat(target)
    except OSError as exc:
        raise _os_error(where, exc) from None
    if not stat.S_ISREG(st.st_mode):
        raise _refuse(where, st.st_mode)
    return st


def open_regular(path: str, confinement: Confinement | None = None, where: str | None = None) -> int:
    """A read-only descriptor of ``path``: a regular file (inside ``confinement`` when given), never
    anything that could block or never end. The caller closes it; errors name ``where``."""
    where = where or path
    before = stat_regular(path, confinement, where)
    target = confinement.check(path, where) if confinement is not None else path
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    if confinement is not None:
        flags |= getattr(os, "O_NOFOLLOW", 0)  # ``target`` is resolved: a symlink there now was swapped in
    try:
        fd = os.open(target, flags)
    except OSError as exc:
        raise _os_error(where, exc) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _refuse(where, st.st_mode)
        if (st.st_dev, st.st_ino) != (before.st_dev, before.st_ino):
            raise CorruptCheckpointError(f"{where}: was replaced while being opened; refusing to read it")
    except BaseException:
        os.close(fd)
        raise
    return fd
