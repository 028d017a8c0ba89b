"""``DcpStorage``: torch_checkpointing's ``Storage`` ABC over dcp-storage's transports.

Every call resolves its path under the config's ``root_url`` (:mod:`.paths`) and asks a transport opened
by dcp-storage's factory (:func:`~dcp_storage.plugin_api.open_transport`): so any URL dcp-storage opens
works, with its retries, concurrent ranged reads, bounded in-flight bytes, atomic writes and credential
errors (``StorageAccessError``, ``BucketNotFoundError``, ...: all ``OSError`` subclasses too, as the ABC's
callers expect). Reads and writes are in :mod:`.streams`, the ``rename`` table in :mod:`.rename`.

Which thread calls what: torch_checkpointing writes files from a thread pool in its checkpoint process
(``stream_write``/``write``, ``mkdir``), rank 0 then commits with one ``rename`` of the staged directory;
loads read from several threads (``stream_read``, ``read``, ``exists``, ``getsize``). Every method is
thread-safe; transports are opened on first use in the process that uses them, and dropped when the
storage is pickled.
"""

from __future__ import annotations

import io
import os
import shutil
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dcp_storage.plugin_api import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    RangeRequest,
    Transport,
    open_transport,
)
from torch_checkpointing.storage.base_storage import ReadArgs, Storage
from typing_extensions import Buffer

from dcp_storage_torch_checkpointing import _unstable
from dcp_storage_torch_checkpointing.paths import as_url, resolve
from dcp_storage_torch_checkpointing.rename import rename_local, rename_remote
from dcp_storage_torch_checkpointing.streams import AtomicWriteStream, MemoryReader, RangeReader

if TYPE_CHECKING:
    from dcp_storage_torch_checkpointing.config import DcpStorageConfig

__all__ = ["DcpStorage"]


def _scheme(url: str) -> str:
    return url.split("://", 1)[0].lower()


class DcpStorage(Storage):
    """A torch_checkpointing ``Storage`` on any URL dcp-storage opens. Build it from a ``DcpStorageConfig``."""

    def __init__(self, config: DcpStorageConfig) -> None:
        self._config = config
        self._lock = threading.Lock()
        self._transports: dict[str, Transport] = {}
        self._root_transport: Transport | None = None
        self._root = ""

    # ------------------------------------------------------------------------------------- transports
    def __getstate__(self) -> dict[str, Any]:
        return {"_config": self._config}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["_config"])  # type: ignore[misc]

    def _root_of(self) -> Transport:
        with self._lock:
            if self._root_transport is None:
                cfg = self._config
                transport, root = open_transport(cfg.root_url, cfg.storage_options, cfg.transport_config)
                self._root = os.path.abspath(root) if transport.is_local else cfg.root_url.rstrip("/")
                self._root_transport = transport
            return self._root_transport

    @property
    def is_local(self) -> bool:
        """Whether the root is a local directory (renames are then ``os.rename``, atomic)."""
        return self._root_of().is_local

    def locate(self, path: str | os.PathLike[str]) -> tuple[Transport, str]:
        """The transport for ``path`` and the path of ``path`` on it."""
        root_transport = self._root_of()
        where = resolve(self._root, path, local_root=root_transport.is_local)
        url = as_url(where)
        if url is None or self._serves(root_transport, url):
            return root_transport, root_transport.strip_url(where)
        scheme = _scheme(url)
        with self._lock:
            transport = self._transports.get(scheme)
            if transport is None:  # a full URL on another store: that store's transport, default options
                transport, _ = open_transport(url, None, self._config.transport_config)
                self._transports[scheme] = transport
        return transport, transport.strip_url(url)

    def _serves(self, root_transport: Transport, url: str) -> bool:
        if root_transport.is_local:
            return _scheme(url) in ("file", "local")
        root_url = as_url(self._root)
        return root_url is not None and _scheme(root_url) == _scheme(url)

    def close(self) -> None:
        """Release the transports' threads and clients (the storage opens them again if used after)."""
        with self._lock:
            transports = [*self._transports.values(), *([self._root_transport] if self._root_transport else [])]
            self._transports, self._root_transport = {}, None
        for transport in transports:
            transport.close()

    # ------------------------------------------------------------------------------------- reading
    def stream_read(self, path: Path, read_args: ReadArgs | None = None) -> io.RawIOBase:
        """A reader with ``readinto``: the whole file read first (``pre_read_full_file``, the default; one
        set of concurrent ranged reads), or ranged reads into the caller's buffers as it reads."""
        transport, where = self.locate(path)
        size = transport.size(where)
        known = read_args.known_size_bytes if read_args is not None else None
        if known is not None and known != size:
            raise CorruptCheckpointError(
                f"{transport.url(where)}: {size} bytes stored but {known} expected (the file changed or was "
                "cut short since its size was recorded)"
            )
        if read_args is not None and not read_args.pre_read_full_file:
            return RangeReader(transport, where, size)
        data = bytearray(size)
        if size:
            transport.read_ranges([RangeRequest(where, 0, size, into=memoryview(data))])
        return MemoryReader(data)

    def read(self, path: Path, read_args: ReadArgs | None = None) -> bytes:
        with self.stream_read(path, read_args) as stream:
            return stream.readall()

    # ------------------------------------------------------------------------------------- writing
    def stream_write(self, path: Path) -> io.IOBase:
        """An atomic writer: its bytes appear at ``path`` when it closes, never after an exception."""
        transport, where = self.locate(path)
        return AtomicWriteStream(transport, where)

    def write(self, path: Path, data: Buffer) -> None:
        transport, where = self.locate(path)
        view = memoryview(data).cast("B")
        if view.nbytes <= transport.config.part_size:
            transport.write_file(where, view)  # one request
            return
        with transport.open_atomic(where) as out:  # a multipart upload on object stores
            out.write(view)

    # ------------------------------------------------------------------------------------- tree
    def delete(self, path: Path) -> None:
        transport, where = self.locate(path)
        transport.remove(where)

    def mkdir(self, path: Path, recursive: bool = True) -> None:
        """A directory (object stores have none: a no-op there, as their directories are key prefixes)."""
        transport, where = self.locate(path)
        if transport.is_local and not recursive:
            os.mkdir(where)
        else:
            transport.makedirs(where)

    def rmdir(self, path: Path) -> None:
        """The directory and everything under it (nothing if there is none)."""
        transport, where = self.locate(path)
        if transport.is_local:
            if os.path.isdir(where):
                shutil.rmtree(where)
            return
        transport.remove_tree(where)

    def rename(
        self, src_path: Path, dst_path: Path, is_directory: bool = False, background_cleanup: bool = False
    ) -> None:
        """The ABC's commit primitive, its table exactly (see :mod:`.rename`): local disks ``os.rename``
        (atomic); object stores a server-side copy of each object (the commit marker last), then the
        source deleted (in a background thread with ``background_cleanup``)."""
        src_transport, src = self.locate(src_path)
        dst_transport, dst = self.locate(dst_path)
        if src_transport.is_local and dst_transport.is_local:
            rename_local(src, dst)
        else:
            rename_remote(src_transport, src, dst_transport, dst, background_cleanup=background_cleanup)

    def ls(self, path: Path) -> list[str]:
        """Names directly under ``path``; ``CheckpointNotFoundError`` (a ``FileNotFoundError``) if nothing is."""
        transport, where = self.locate(path)
        names = transport.listdir(where)
        if not names and not self._exists(transport, where):
            raise CheckpointNotFoundError(f"{transport.url(where)}: no such directory")
        return names

    def exists(self, path: Path) -> bool:
        transport, where = self.locate(path)
        return self._exists(transport, where)

    @staticmethod
    def _exists(transport: Transport, where: str) -> bool:
        if transport.is_local:
            return os.path.exists(where)
        return _unstable.kind(transport, where) is not None

    def getsize(self, path: Path) -> int:
        transport, where = self.locate(path)
        return transport.size(where)

    def isdir(self, path: Path) -> bool:
        transport, where = self.locate(path)
        if transport.is_local:
            return os.path.isdir(where)
        return _unstable.kind(transport, where) == "dir"

    def remap_path(self, path: Path) -> str:
        """The URL ``path`` resolves to (a local path for a local root)."""
        transport, where = self.locate(path)
        return transport.url(where)
