"""The local-disk transport: positioned reads of regular files inside the checkpoint, atomic renames.

Reads open only regular files inside their checkpoint (``confinement``, :mod:`.local_open`) and fill the
caller's buffers with ``preadv`` (:mod:`.local_io`); a whole-file read is refused from the file's size
before any byte is read when it is over ``max_bytes``. Writes go to a temp file beside the target, are
``fsync``ed and renamed over it (the directory is synced too), so a file appears whole or not at all.
The strided-copy fast path (:mod:`.local_runs`) and the raw descriptors (:meth:`local_files`) are what
the core's local fast paths use.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import shutil
import stat
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from fsspec.implementations.local import LocalFileSystem

from dcp_storage.errors import CheckpointNotFoundError, CorruptCheckpointError, WrongPathTypeError
from dcp_storage.transports.fsspec_transport import FsspecTransport, builtin_backend
from dcp_storage.transports.local_io import (
    LocalFiles,
    fsync_dir,
    preadv_exact,
    read_whole,
    start_writeback,
    stat_regular,
)
from dcp_storage.transports.protocol import CountingWriter, MiB
from dcp_storage.transports.ranges import FetchGroup, LocalRuns, RangeRequest, RangeRun, Region, RunsRead, plan_fetches
from dcp_storage.transports.s3_stream import create_local

__all__ = ["LocalTransport", "directory_in_the_way"]

# Reads feeding checks (block digests, RangeRequest.on_piece) land in pieces of this size, each hashed by the
# thread that read it before it reads the next: xxh3_64 hashes a 256 KiB piece just read at ~40 GB/s here, a
# 1 MiB one at ~20 (the kernel's copy leaves half of it out of the 2 MiB L2), bytes of a large read at 13-16
# (its copy streams past the cache). Smaller pieces cost more in syscalls and page-cache lookups than they save.
HOT_PIECE_BYTES = 256 * 1024


class LocalWriter(CountingWriter):
    """A local temp file's writer that starts writeback of every ``WRITEBACK_BYTES`` written
    (:func:`~dcp_storage.transports.local_io.start_writeback`); the commit still ``fsync``s."""

    WRITEBACK_BYTES = 32 * MiB

    def __init__(self, raw: Any, counters: Any) -> None:
        super().__init__(raw, counters)
        self._synced = 0

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        step = self.WRITEBACK_BYTES
        for pos in range(0, max(view.nbytes, 1), step):  # a big tensor: writeback starts after each piece
            super().write(view[pos : pos + step])
            if self.written - self._synced >= step:
                self._raw.flush()
                start_writeback(self._raw.fileno(), self._synced, self.written - self._synced)
                self._synced = self.written
        return view.nbytes


@builtin_backend
class LocalTransport(FsspecTransport):
    """Files on a local disk (``/path``, ``file://``, ``local://``)."""

    is_local = True

    @staticmethod
    def serves(fs: Any) -> bool:
        return isinstance(fs, LocalFileSystem)

    def url(self, path: str) -> str:
        return path

    def join(self, root: str, *names: str) -> str:
        return os.path.join(root, *names)

    def local_files(self) -> LocalFiles:
        """Descriptors of this checkpoint's local files (regular files inside it only); ``close`` them."""
        return LocalFiles(self.confinement)

    def read_runs(self, reads: Sequence[RunsRead]) -> None:
        """Equal-length byte runs straight into memory, one ``preadv`` each (see :mod:`.local_runs`)."""
        LocalRuns(self).read_runs(reads)

    def map_regions(self, regions: Sequence[Region]) -> Iterator[tuple[mmap.mmap, int]]:
        """Private read-only maps of each region in turn (see :mod:`.local_runs`)."""
        return LocalRuns(self).map_regions(regions)

    # ------------------------------------------------------------------------------------ queries
    def exists(self, path: str) -> bool:
        return os.path.exists(path)

    def size(self, path: str) -> int:
        """Size of the regular file at ``path`` inside the checkpoint: :class:`CheckpointNotFoundError` if
        there is none, :class:`~dcp_storage.errors.CorruptCheckpointError` if it is no regular file or lies
        outside the checkpoint."""
        try:
            return stat_regular(path, self.confinement).st_size
        except FileNotFoundError as exc:
            raise CheckpointNotFoundError(f"{self.url(path)}: no such file") from exc

    def listed_sizes(self, path: str) -> dict[str, int | None]:
        """Every entry of the directory ``path`` with the size of each regular file
        (:class:`~.protocol.ListedSizes`), from one listing of its opened descriptor: the directory is
        checked to lie inside the checkpoint once, and an entry that is a regular file and no symlink then
        lies inside it too (what :meth:`size` checks per file). Symlinks and anything else map to ``None``:
        :meth:`size` decides them. One ``lstat`` per entry, through the directory's descriptor."""
        try:
            if self.confinement is not None:
                self.confinement.check(path)
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        except (OSError, CorruptCheckpointError):  # missing, or not the checkpoint's: size() says why
            return {}
        try:
            if self.confinement is not None:  # a directory swapped for a link out since the check
                self.confinement.check_opened(path, fd)
            names = os.listdir(fd)
            sizes: list[int | None] = []
            add, lstat, is_regular = sizes.append, os.stat, stat.S_ISREG
            for name in names:  # lstat through the descriptor: no path walk, no link followed
                try:
                    st = lstat(name, dir_fd=fd, follow_symlinks=False)
                except FileNotFoundError:  # removed since the listing
                    add(None)
                    continue
                add(st.st_size if is_regular(st.st_mode) else None)
        except (OSError, CorruptCheckpointError):
            return {}
        finally:
            os.close(fd)
        return dict(zip(names, sizes))

    def makedirs(self, path: str) -> None:
        try:
            os.makedirs(path, exist_ok=True)
        except (FileExistsError, NotADirectoryError) as exc:  # a file where a directory must be, or above it
            raise WrongPathTypeError(
                f"{self.url(path)}: a file is in the way (at this path or above it) where the checkpoint's "
                "directory must be; a checkpoint is a directory: remove the file or save to another path"
            ) from exc

    def remove(self, path: str) -> None:
        try:
            os.remove(path)
        except FileNotFoundError:
            pass
        except IsADirectoryError as exc:
            raise directory_in_the_way(self.url(path)) from exc

    def remove_tree(self, path: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            shutil.rmtree(path)

    def listdir(self, path: str) -> list[str]:
        try:
            names = os.listdir(path)
        except (FileNotFoundError, NotADirectoryError):
            return []
        # Hide in-progress atomic writes (see _open_atomic).
        return sorted(n for n in names if not (n.startswith(".") and n.endswith(".tmp")))

    # ------------------------------------------------------------------------------------ reading
    def _read_whole(self, path: str, max_bytes: int | None) -> bytes:
        return read_whole(path, self.confinement, max_bytes)

    def read_ranges(self, requests: Sequence[RangeRequest]) -> list[memoryview | None]:
        """As :meth:`FsspecTransport.read_ranges`, each coalesced group one ``preadv`` (gaps into scratch)."""
        cfg = self.config
        groups = plan_fetches(requests, cfg.coalesce_gap, cfg.max_request_bytes)
        files = LocalFiles(self.confinement)
        try:

            def fetch(group: FetchGroup, views: list[memoryview]) -> None:
                self._fetch_group_local(files.fd(group.path), group, views)

            def read_pieces(
                path: str, offset: int, view: memoryview, step: int, on_piece: Callable[[int, memoryview], None]
            ) -> None:
                fd, preadv, calls, done = files.fd(path), os.preadv, 0, 0
                try:
                    for at in range(0, view.nbytes, step):
                        part = view[at : at + step]
                        got = preadv(fd, [part], offset + at)
                        calls += 1
                        if got != part.nbytes:  # short: the rest, or the truncated file named
                            calls += preadv_exact(fd, path, [part[got:]], offset + at + got)
                        done += part.nbytes
                        on_piece(offset + at, part)
                finally:
                    self.counters.add(requests=calls, bytes_read=done)

            run = RangeRun(
                requests, groups, fetch, self.executor(), cfg.max_inflight_bytes, HOT_PIECE_BYTES, read_pieces
            )
            return run.execute()
        finally:
            files.close()  # execute() returns only once no fetch runs any more

    def _fetch_group_local(self, fd: int, group: FetchGroup, views: list[memoryview]) -> None:
        buffers: list[memoryview] = []
        position = group.start
        for seg, view in zip(group.segments, views):
            if seg.start > position:
                buffers.append(memoryview(bytearray(seg.start - position)))
            buffers.append(view)
            position = seg.end
        calls = preadv_exact(fd, group.path, buffers, group.start)
        self.counters.add(requests=calls, bytes_read=group.length)

    # ------------------------------------------------------------------------------------ writing
    def write_file(self, path: str, data: bytes | bytearray | memoryview) -> None:
        """Atomically write a whole small file: temp file, ``fsync``, rename."""
        with self.open_atomic(path) as f:
            f.write(data)

    def create_new(self, path: str, data: bytes) -> bool:
        """``open(O_CREAT | O_EXCL)``, then the bytes (:func:`.exclusive.create_local`); one request."""
        self.counters.add(requests=1)
        return create_local(path, data)

    def _open_atomic(self, path: str) -> Iterator[CountingWriter]:
        """A temp file beside ``path``, ``fsync``, then ``os.replace`` (and the directory is synced)."""
        directory = os.path.dirname(path) or "."
        os.makedirs(directory, exist_ok=True)
        tmp = os.path.join(directory, f".{os.path.basename(path)}.{uuid.uuid4().hex}.tmp")
        raw = open(tmp, "wb")  # noqa: SIM115 - closed in both branches below
        writer = LocalWriter(raw, self.counters)
        try:
            yield writer
            raw.flush()
            os.fsync(raw.fileno())
            raw.close()
            try:
                os.replace(tmp, path)
            except IsADirectoryError as exc:
                raise directory_in_the_way(self.url(path)) from exc
            self.counters.add(requests=1)
            fsync_dir(directory)
        except BaseException:
            with contextlib.suppress(OSError):  # a full disk fails the close's flush too: remove the temp anyway
                raw.close()
            with contextlib.suppress(FileNotFoundError):
                os.remove(tmp)
            raise


def directory_in_the_way(url: str) -> WrongPathTypeError:
    """A directory where a save must write or remove a file: never removed on the user's behalf."""
    return WrongPathTypeError(
        f"{url}: a directory where a file of the checkpoint belongs; nothing of a save is a directory here: "
        "remove it yourself (a save never deletes directories) or save to another path"
    )
