"""Local-disk I/O: opening files inside the checkpoint only, and vectored positioned reads.

Opening checkpoint files on a local disk: regular files only, and only inside the checkpoint.

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
symlink swapped in after the check is refused. A directory on the path swapped for a symlink out of the
checkpoint in between (by whoever can rename entries inside it) would still be followed by ``open``; so the
opened descriptor's own path (``/proc/self/fd/N``, where the system has it) is checked against the
checkpoint again before a byte is read, and a descriptor that lies outside is closed and refused.

Vectored positioned reads on local files.

``os.preadv`` fills the caller's buffers (often destination tensor memory) straight from the page cache:
no intermediate ``bytes`` object, no extra copy. Gaps between coalesced ranges land in a scratch buffer.
:func:`pread_crc32` also reads straight into the destination, and CRC-32s each block as it lands in one
native loop (``_pread_crc32.c``): what a default-checked local load reads.

:func:`buffer_address` gives the writer's GIL-free copies (``ctypes.memmove``) a buffer's address.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import stat
import threading
from collections.abc import Callable
from typing import Any

from dcp_storage.errors import CheckpointNotFoundError, CorruptCheckpointError, FileTooLargeError, TransportError
from dcp_storage.runtime import fork_safe

__all__ = [
    "MEMMOVE_FROM",
    "Confinement",
    "LocalFiles",
    "buffer_address",
    "fsync_dir",
    "native_crc32_reads",
    "open_regular",
    "pread_crc32",
    "preadv_exact",
    "read_whole",
    "stat_regular",
]


# Hugging Face's hub cache keeps files in ``<repo>/blobs/`` and links them from ``<repo>/snapshots/<rev>/``
# (and its subfolders): a checkpoint opened inside a snapshot may follow links up to its repository directory.
_HUB_SNAPSHOTS = "snapshots"
_HUB_REPO_PREFIXES = ("models--", "datasets--", "spaces--")


class Confinement:
    """The directories local checkpoint files must resolve into: one per checkpoint a transport serves.

    A checkpoint is added as the user named it (:meth:`add`): a directory, or a file (a safetensors file,
    an index, a ``torch.save`` file), whose directory then bounds its siblings. A path is checked against
    the checkpoint it lies in by name (the longest added directory that is a prefix of it: one transport
    may serve several checkpoints), and must resolve inside that checkpoint's resolved directory. The
    checkpoint root may itself be a symlink: it is resolved once, when the first file in it is opened
    (a writer's root need not exist before). A path in no added checkpoint is refused.
    """

    def __init__(self, path: str | None = None) -> None:
        self._added: dict[str, tuple[str, str] | None] = {}  # as named -> (directory, resolved) once known
        if path is not None:
            self.add(path)

    def add(self, path: str) -> None:
        """Let files of the checkpoint at ``path`` be read."""
        self._added.setdefault(os.path.abspath(path), None)

    def _roots(self) -> list[tuple[str, str]]:
        out = []
        for named, known in list(self._added.items()):
            if known is None:
                directory = named if os.path.isdir(named) else os.path.dirname(named)
                known = (directory, _resolved_root(directory))
                if os.path.exists(named):  # a writer's root may appear later: decide once it exists
                    self._added[named] = known
            out.append(known)
        return out

    def check(self, path: str, where: str | None = None) -> str:
        """The resolved ``path``; :class:`CorruptCheckpointError` naming ``where`` (default ``path``) if it
        resolves outside its checkpoint."""
        root = self._root_of(path, where)
        real = os.path.realpath(path)
        if not _under(real, root):
            raise _outside(where or path, root)
        return real

    def _root_of(self, path: str, where: str | None) -> str:
        lexical = os.path.abspath(path)
        inside = [(d, r) for d, r in self._roots() if _under(lexical, d)]
        if not inside:
            raise CorruptCheckpointError(f"{where or path}: is in no checkpoint this transport was opened for")
        return max(inside, key=lambda dr: len(dr[0]))[1]

    def check_opened(self, path: str, fd: int, where: str | None = None) -> None:
        """:class:`CorruptCheckpointError` if the file ``fd`` (opened for ``path``) lies outside its checkpoint:
        a directory on the path was swapped for a link out after :meth:`check`. Where the system does not
        name a descriptor's path (no ``/proc/self/fd``), :meth:`check` alone stands."""
        try:
            opened = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            return
        opened = opened.removesuffix(" (deleted)")  # unlinked since: its name at the time is what counts
        root = self._root_of(path, where)
        if not _under(opened, root):
            raise _outside(where or path, root)


def _outside(where: str, root: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"{where}: resolves outside the checkpoint directory {root} (a symlink, or a symlinked directory, leading "
        "out of it); refusing to read it. Copy the file into the checkpoint instead of linking it"
    )


def _under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def _resolved_root(directory: str) -> str:
    """The resolved ``directory``; inside a hub snapshot (``<repo>/snapshots/<rev>/``, or a subfolder of
    one such as diffusers' ``unet/``), its repository ``<repo>``, whose ``blobs/`` the snapshot links into."""
    root = os.path.realpath(directory)
    here = root
    while True:
        parent = os.path.dirname(here)
        if parent == here:
            return root
        if os.path.basename(parent) == _HUB_SNAPSHOTS and os.path.basename(os.path.dirname(parent)).startswith(
            _HUB_REPO_PREFIXES
        ):
            return os.path.dirname(parent)
        here = parent


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


_REOPENS = 3  # a file replaced between stat and open (an atomic rename: a commit) is opened afresh this often


def open_regular(path: str, confinement: Confinement | None = None, where: str | None = None) -> int:
    """A read-only descriptor of ``path``: a regular file (inside ``confinement`` when given), never
    anything that could block or never end. The caller closes it; errors name ``where``.

    A file replaced between the checks and ``open`` (a save committing its ``.metadata`` by rename) is
    checked and opened again, so the reader gets the old or the new file whole; one that keeps changing
    is refused."""
    where = where or path
    for _ in range(_REOPENS - 1):
        fd = _open_checked(path, confinement, where)
        if fd is not None:
            return fd
    fd = _open_checked(path, confinement, where)
    if fd is None:
        raise CorruptCheckpointError(f"{where}: was replaced while being opened, again and again; refusing to read it")
    return fd


def _open_checked(path: str, confinement: Confinement | None, where: str) -> int | None:
    """One try of :func:`open_regular`: the descriptor, or ``None`` if the file was replaced meanwhile."""
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
        if confinement is not None:
            confinement.check_opened(path, fd, where)
        if (st.st_dev, st.st_ino) != (before.st_dev, before.st_ino):
            os.close(fd)
            return None
    except BaseException:
        os.close(fd)
        raise
    return fd


_IOV_MAX = min(getattr(os, "IOV_MAX", 1024) if hasattr(os, "IOV_MAX") else 1024, 1024)


def _advance(buffers: list[memoryview], nbytes: int) -> list[memoryview]:
    """Drop the first ``nbytes`` bytes from a list of buffers."""
    out: list[memoryview] = []
    for buf in buffers:
        if nbytes >= buf.nbytes:
            nbytes -= buf.nbytes
            continue
        out.append(buf[nbytes:] if nbytes else buf)
        nbytes = 0
    return out


def preadv_exact(fd: int, path: str, buffers: list[memoryview], offset: int) -> int:
    """Fill ``buffers`` in order from ``offset``; returns the number of ``preadv`` calls made.

    Raises :class:`CorruptCheckpointError` naming the file if it ends early (a truncated file).
    """
    calls = 0
    pending = [b for b in buffers if b.nbytes]
    position = offset
    while pending:
        batch = pending[:_IOV_MAX]
        want = sum(b.nbytes for b in batch)
        got = os.preadv(fd, batch, position)
        calls += 1
        if got == 0:
            size = os.fstat(fd).st_size
            raise CorruptCheckpointError(
                f"{path}: file ends at byte {size} but bytes up to {position + want} were expected (truncated file?)"
            )
        position += got
        pending = _advance(batch, got) + pending[len(batch) :]
    return calls


# A piece of a hashed read: hashed right after ``pread`` put it in the destination, while in the core's L2. With
# 2 threads over 256 MiB warm: +11.5% against one plain read at 32 KiB, +7.0% at 128 KiB, +9.9% at 512 KiB.
CRC32_PIECE_BYTES = 128 * 1024

_native_crc32: Any = None  # the _pread_crc32 module once its CRC-32 function is set and checked; False: none


def native_crc32_reads() -> bool:
    """Whether :func:`pread_crc32` runs here: the C extension is built and ISA-L's CRC-32 found and checked."""
    global _native_crc32
    if _native_crc32 is None:
        _native_crc32 = _load_native_crc32() or False
    return _native_crc32 is not False


def _load_native_crc32() -> Any:
    try:
        from isal import isal_zlib  # noqa: PLC0415 - only a hashed local read needs it

        import dcp_storage.transports._pread_crc32 as _pread_crc32  # noqa: PLC0415 - optional C extension
    except ImportError:
        return None
    try:  # the isal extension is loaded already: this finds it, and in it the function isal_zlib.crc32 calls
        function = ctypes.CDLL(isal_zlib.__file__).crc32_gzip_refl
    except (OSError, AttributeError):
        return None
    _pread_crc32.set_crc32(ctypes.cast(function, ctypes.c_void_p).value)
    sample = bytes(range(256)) * 64
    if any(_pread_crc32.crc32(sample, v) != isal_zlib.crc32(sample, v) for v in (0, 0x12345678)):
        return None  # not the function we expect: keep hashing through isal_zlib
    return _pread_crc32


def pread_crc32(fd: int, path: str, view: memoryview, offset: int, first: int, block: int) -> tuple[int, list[int]]:
    """Fill ``view`` from ``offset`` of ``fd`` and return (``pread`` calls, zip CRC-32 of each block).

    Blocks: the first ``first`` bytes, then every ``block`` bytes, the last ending with ``view``. One native
    loop reads and hashes piece by piece (:data:`CRC32_PIECE_BYTES`) with the GIL released. Raises
    :class:`CorruptCheckpointError` naming ``path`` if the file ends early, like :func:`preadv_exact`. Only
    where :func:`native_crc32_reads`.
    """
    got, calls, crcs = _native_crc32.pread_crc32(fd, view, offset, CRC32_PIECE_BYTES, first, block)
    if got < view.nbytes:  # the end of the file came first: named here, unless it grew meanwhile
        calls += preadv_exact(fd, path, [view[got:]], offset + got)
        crcs, at, end = [], 0, min(first, view.nbytes)
        while at < view.nbytes:  # the bytes are all there now: hash them here (a rare path)
            crcs.append(_native_crc32.crc32(view[at:end]))
            at, end = end, min(end + block, view.nbytes)
    return calls, crcs


class LocalFiles:
    """Read-only descriptors of local files, opened on first use and shared by threads; ``close`` them all.

    Only regular files inside ``confinement`` (when given) are opened (see :mod:`.local_open`).
    """

    def __init__(self, confinement: Confinement | None = None) -> None:
        self._fds: dict[str, int] = {}
        self._lock = fork_safe(threading.Lock())
        self._confinement = confinement

    def fd(self, path: str, where: str | None = None) -> int:
        """The descriptor of ``path``; errors (``CheckpointNotFoundError`` for a missing file) name ``where``."""
        with self._lock:
            fd = self._fds.get(path)
            if fd is None:
                fd = self._fds[path] = open_regular(path, self._confinement, where)
            return fd

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


_GROWTH_PIECE = 1024 * 1024  # what a file that grows while read_whole reads it is read on in


def read_whole(path: str, confinement: Confinement | None, max_bytes: int | None) -> bytes:
    """A whole regular file (inside ``confinement``); one larger than ``max_bytes`` is refused before any of
    it is read, from its size, and a file that grows while it is read stops counting at ``max_bytes + 1``."""
    fd = open_regular(path, confinement)
    try:
        size = os.fstat(fd).st_size
        if max_bytes is not None and size > max_bytes:
            raise FileTooLargeError(path, size, max_bytes)
        with open(fd, "rb", closefd=False) as f:  # noqa: PTH123 - a descriptor, not a path
            if max_bytes is None:
                return f.read()
            # read(n) allocates n bytes up front: ask for the size seen (+1 to notice growth), never the limit,
            # which would reserve the whole limit (1 GiB for a .metadata) for every small file read
            data = f.read(size + 1)
            if len(data) <= size:
                return data
            parts, total = [data], len(data)  # it grew while being read: count on up to max_bytes + 1
            while total <= max_bytes:
                piece = f.read(min(_GROWTH_PIECE, max_bytes + 1 - total))
                if not piece:
                    break
                parts.append(piece)
                total += len(piece)
            return b"".join(parts)
    finally:
        os.close(fd)


_SYNC_FILE_RANGE_WRITE = 2  # <linux/fs.h>: start writeback of dirty pages in the range, do not wait


def _sync_file_range() -> Callable[[int, int, int, int], int] | None:
    """libc's ``sync_file_range`` (Linux), which the ``os`` module lacks; ``None`` elsewhere."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        fn = libc.sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn  # type: ignore[no-any-return]


_SYNC_RANGE = _sync_file_range()


def start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Ask the kernel to start writing ``[offset, offset + nbytes)`` of ``fd`` to disk now, without waiting.

    A save writes gigabytes and then ``fsync``s; left alone, the kernel starts writeback only once dirty
    pages pass ``dirty_background_ratio``, so the disk idles while the writer serialises and the final
    ``fsync`` waits for nearly everything. Started range by range, the disk works while the writer does,
    and the ``fsync`` (still made: durability is unchanged) has little left. A no-op where unsupported.
    """
    if _SYNC_RANGE is not None:
        _SYNC_RANGE(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE)


def fsync_dir(directory: str) -> None:
    """Persist a rename: fsync the directory entry (POSIX only; a no-op where unsupported)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# Writes of at least this many bytes are copied into the stage by ``ctypes.memmove``, which releases the GIL;
# a slice assignment holds it for the whole copy (0.9 ms per 8 MiB), and a disk thread whose ``pwrite`` has
# returned waits for it: measured here, an O_DIRECT writer beside a copying thread got 0.9 GB/s against 2.6.
MEMMOVE_FROM = 256 * 1024


class _PyBuffer(ctypes.Structure):
    _fields_ = [  # noqa: RUF012 - ctypes' declaration
        ("buf", ctypes.c_void_p),
        ("obj", ctypes.py_object),
        ("len", ctypes.c_ssize_t),
        ("itemsize", ctypes.c_ssize_t),
        ("readonly", ctypes.c_int),
        ("ndim", ctypes.c_int),
        ("format", ctypes.c_char_p),
        ("shape", ctypes.c_void_p),
        ("strides", ctypes.c_void_p),
        ("suboffsets", ctypes.c_void_p),
        ("internal", ctypes.c_void_p),
    ]


def buffer_address(view: memoryview) -> int | None:
    """The address of a contiguous buffer's first byte, read-only ones included (``None`` if it has none).

    ``ctypes.c_char.from_buffer`` takes writable buffers only, and torch's zip writer hands its bytes over as
    read-only memoryviews. The caller keeps ``view`` alive while the address is used.
    """
    if not view.contiguous:
        return None
    info = _PyBuffer()
    try:  # a failure sets a Python error, which ctypes raises
        if ctypes.pythonapi.PyObject_GetBuffer(ctypes.py_object(view), ctypes.byref(info), 0) != 0:
            return None
    except (BufferError, TypeError, ValueError):
        return None
    try:
        return info.buf  # type: ignore[no-any-return]
    finally:
        ctypes.pythonapi.PyBuffer_Release(ctypes.byref(info))
