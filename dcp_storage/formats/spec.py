"""What a format plugin provides: a sniffer and reader/writer factories.

The built-in formats define their own half here in ``formats/<name>/spec.py`` (name, version, sniffer);
their readers and writers live a layer above (``dcp_storage.storage``), which binds them into the specs the
entry points register (:mod:`dcp_storage.storage.builtin_formats`), so no format imports the storage layer.

A format registers a :class:`FormatSpec` under the ``dcp_storage.formats`` entry-point group.
:func:`dcp_storage.open_reader` builds one :class:`Probe` of the URL (a directory listing, or the first
bytes of a file) and asks every format's ``sniff``; the best score wins.
"""

from __future__ import annotations

import dataclasses
import posixpath
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..errors import CheckpointNotFoundError
from ..transports import Transport
from ..transports.buckets import missing_bucket
from ..transports.factory import open_transport

__all__ = ["FormatSpec", "Probe", "trust_byte_items"]

HEAD_BYTES = 64


@dataclass(frozen=True)
class Probe:
    """What format detection may look at, fetched once: cheap for a bucket prefix or a big file."""

    url: str
    transport: Transport
    path: str
    is_dir: bool
    names: tuple[str, ...] = ()  # entries of the directory (names, not paths)
    head: bytes = b""  # first bytes of the file (empty for a directory)
    size: int = 0

    @classmethod
    def of(cls, url: str, storage_options: dict[str, Any] | None = None) -> Probe:
        transport, path = open_transport(url, storage_options)
        return cls.at(transport, path, url)

    @classmethod
    def at(cls, transport: Transport, path: str, url: str | None = None) -> Probe:
        """Probe ``path`` on an open transport (a reader's own, on its error path)."""
        url = transport.url(path) if url is None else url
        names = transport.listdir(path)
        if names:
            return cls(url, transport, path, True, tuple(names))
        if not transport.exists(path):
            raise missing_bucket(transport, path) or CheckpointNotFoundError(
                f"{transport.url(path)}: no such file or directory"
            )
        size = transport.size(path)
        head = bytes(transport.read_range(path, 0, min(size, HEAD_BYTES))) if size else b""
        return cls(url, transport, path, False, (), head, size)

    @property
    def basename(self) -> str:
        return posixpath.basename(self.path.rstrip("/"))

    def head_of(self, name: str, nbytes: int = HEAD_BYTES) -> bytes:
        """The first ``nbytes`` of ``name`` inside the probed directory."""
        path = self.transport.join(self.path, name)
        size = self.transport.size(path)
        return bytes(self.transport.read_range(path, 0, min(size, nbytes))) if size else b""


@dataclass(frozen=True)
class FormatSpec:
    """A checkpoint format: ``name/version`` descriptor, detection, and reader/writer factories.

    ``sniff(probe)`` returns a score (higher is more specific) when the probe looks like this format, or
    ``None``. ``open_reader(url, storage_options=..., **options)`` returns a DCP ``StorageReader``;
    ``open_writer`` a ``StorageWriter`` (``None`` for read-only formats). A spec registered without a reader
    (a format's own half, before its reader is bound) is detected but cannot be opened. ``reader`` names the reader class
    to suggest to a user who pointed another format's reader at such a checkpoint
    (``"dcp_storage.SafetensorsReader(url)"``); empty: ``open_reader(url, format=name)`` is suggested.
    """

    name: str
    version: str
    sniff: Callable[[Probe], int | None]
    open_reader: Callable[..., Any] | None = None
    open_writer: Callable[..., Any] | None = None
    description: str = ""
    reader: str = ""

    @property
    def descriptor(self) -> str:
        return f"{self.name}/{self.version}"


def trust_byte_items(options: dict[str, Any], config_class: type) -> None:
    """A reader factory's ``trust=True`` (what ``convert(trust=True)`` passes), for readers whose non-tensor
    items are vetted by a loader config: ``options["loader_config"]`` with ``trust_byte_items=True``."""
    if options.pop("trust", False):
        config = options.get("loader_config") or config_class()
        options["loader_config"] = dataclasses.replace(config, trust_byte_items=True)
