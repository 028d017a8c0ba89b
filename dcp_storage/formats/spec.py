"""What a format plugin provides: a sniffer, reader/writer factories, and the hooks the tools call.

The built-in formats define their own half here in ``formats/<name>/spec.py`` (name, version, sniffer);
their readers and writers live a layer above (``dcp_storage.storage``), which binds them into the specs the
entry points register (:mod:`dcp_storage.storage.builtin_formats`), so no format imports the storage layer.

A format registers a :class:`FormatSpec` under the ``dcp_storage.formats`` entry-point group.
:func:`dcp_storage.open_reader` builds one :class:`Probe` of the URL (a directory listing, or the first
bytes of a file) and asks every format's ``sniff``; the best score wins.

Everything a tool knows about a format comes through its spec: ``inspect`` calls ``describe``, ``verify``
calls ``check`` and ``deep_check``, ``convert`` writes through ``convert_target``. So a format lives in
one place (``formats/<name>/``, or a plugin's package), and a plugin's format gets the same tools as the
built-in ones. Each hook is optional; without it the tool falls back to what any format's reader gives
(its ``Metadata``, and every tensor read back).
"""

from __future__ import annotations

import dataclasses
import posixpath
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from dcp_storage.errors import CheckpointNotFoundError
from dcp_storage.transports import Transport
from dcp_storage.transports.buckets import missing_bucket
from dcp_storage.transports.factory import open_transport

if TYPE_CHECKING:
    from dcp_storage.formats.convert_target import ConvertTarget
    from dcp_storage.formats.reports import CheckpointInfo, VerifyReport

__all__ = ["CheckHook", "DescribeHook", "FormatSpec", "Probe", "trust_byte_items"]

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


class DescribeHook(Protocol):
    def __call__(self, url: str, spec: FormatSpec, storage_options: dict[str, Any] | None) -> CheckpointInfo:
        """What the checkpoint at ``url`` holds and where (files, tensors, chunks with their byte ranges),
        from metadata and headers only: no tensor data is read. Raises our errors for what it cannot read."""
        ...


class CheckHook(Protocol):
    def __call__(self, report: VerifyReport, url: str, storage_options: dict[str, Any] | None) -> None:
        """Add every problem found to ``report.problems`` (each naming the file, the key and the reason),
        and what was checked to ``report.notes``/``report.checked``; never raises for a damaged checkpoint."""
        ...


@dataclass(frozen=True)
class FormatSpec:
    """A checkpoint format: ``name/version`` descriptor, detection, reader/writer factories and tool hooks.

    ``sniff(probe)`` returns a score (higher is more specific) when the probe looks like this format, or
    ``None``. ``open_reader(url, storage_options=..., **options)`` returns a DCP ``StorageReader``;
    ``open_writer`` a ``StorageWriter`` (``None`` for read-only formats). A spec registered without a reader
    (a format's own half, before its reader is bound) is detected but cannot be opened. ``reader`` names the reader class
    to suggest to a user who pointed another format's reader at such a checkpoint
    (``"dcp_storage.SafetensorsReader(url)"``); empty: ``open_reader(url, format=name)`` is suggested.

    The tools' hooks (all optional; the fallback in brackets):

    * ``describe`` - ``inspect``'s summary, with file names and byte ranges [the reader's ``Metadata``:
      tensors and shapes, no files];
    * ``check`` - ``verify``'s structural checks: metadata, headers, sizes, coverage, without reading tensor
      data [the reader's ``Metadata`` must load];
    * ``deep_check`` - ``verify --deep``'s byte checks that only the format knows (recorded checksums,
      CRCs), run after the shallow checks passed and every tensor was read back through the reader [none:
      the read-back is all];
    * ``convert_target`` - the streaming writer that makes the format a ``convert --to`` target [not a
      target];
    * ``suffixes`` - file-name endings that imply the format: ``convert`` infers ``--to`` from the output's
      name, ``verify`` checks a file detection refused as the format its name says.
    """

    name: str
    version: str
    sniff: Callable[[Probe], int | None]
    open_reader: Callable[..., Any] | None = None
    open_writer: Callable[..., Any] | None = None
    description: str = ""
    reader: str = ""
    describe: DescribeHook | None = None
    check: CheckHook | None = None
    deep_check: CheckHook | None = None
    convert_target: ConvertTarget | None = None
    suffixes: tuple[str, ...] = ()

    @property
    def descriptor(self) -> str:
        return f"{self.name}/{self.version}"


def trust_byte_items(options: dict[str, Any], config_class: type) -> None:
    """A reader factory's ``trust=True`` (what ``convert(trust=True)`` passes), for readers whose non-tensor
    items are vetted by a loader config: ``options["loader_config"]`` with ``trust_byte_items=True``."""
    if options.pop("trust", False):
        config = options.get("loader_config") or config_class()
        options["loader_config"] = dataclasses.replace(config, trust_byte_items=True)
