"""Transports move bytes (and only bytes) between storage and memory; :func:`open_transport` picks one for a URL.

The built-in ones, one module per store, all on fsspec: :class:`LocalTransport`, :class:`S3Transport`,
:class:`GcsTransport`, :class:`AzureTransport`, :class:`HttpTransport`, and :class:`FsspecTransport` (their
common base) for any other fsspec filesystem. Importing this package registers them all, so
:func:`open_transport` and ``FsspecTransport(fs)`` always see every backend.

Choosing a transport for a URL: the registry first, fsspec otherwise. A transport plugin registers under the ``dcp_storage.transports`` entry-point group, either under a URL
scheme it serves (``myblob = "my_pkg:MyBlobTransport"`` makes ``myblob://...`` URLs use it) or under a name
users select with the ``transport`` storage option (``{"transport": "obstore", ...}``). A registered
transport is a class with ``from_url(url, storage_options, config) -> (transport, path)`` whose instances
keep the :class:`~dcp_storage.transports.protocol.Transport` protocol. Everything else gets a built-in
transport: fsspec resolves the URL's scheme to its filesystem (its own registry of schemes: ``s3``, ``gs``,
``az``, ``memory``, ...; chained URLs included), and the transport class serving that filesystem is chosen
(:func:`~.fsspec_transport.transport_class_for`): :class:`~.local_transport.LocalTransport`,
:class:`~.s3_transport.S3Transport`, :class:`~.gcs_transport.GcsTransport`,
:class:`~.azure_transport.AzureTransport`, :class:`~.http_transport.HttpTransport`, or
:class:`~.fsspec_transport.FsspecTransport` for any other filesystem.

This is the only place a transport is built from a URL: everything else calls :func:`open_transport`
(or :func:`bind_transport`), so a transport plugin selected by ``storage_options`` serves every entry point.
"""

from __future__ import annotations

import os
from typing import Any

from dcp_storage import registry
from dcp_storage.errors import StorageOptionsError
from dcp_storage.text import install_log_redaction
from dcp_storage.transports.azure import AzureTransport
from dcp_storage.transports.fsspec_transport import FsspecTransport
from dcp_storage.transports.gcs import GcsTransport
from dcp_storage.transports.http_store import HttpTransport
from dcp_storage.transports.local import LocalTransport
from dcp_storage.transports.protocol import (
    AtomicWriter,
    ClientSetUp,
    ListedSizes,
    LocalFileAccess,
    LocalRunReads,
    MultipartUploads,
    Transport,
    TransportConfig,
    TransportCounters,
    client_identity,
)
from dcp_storage.transports.ranges import RangeRequest, RunsRead
from dcp_storage.transports.retry import RetryPolicy, is_transient
from dcp_storage.transports.s3 import S3Transport

install_log_redaction()  # botocore logs signed requests (tokens, key ids) at DEBUG: mask them

__all__ = [
    "READ_STRATEGY_OPTION",
    "TRANSPORT_OPTION",
    "bind_transport",
    "client_identity",
    "open_transport",
    "AtomicWriter",
    "AzureTransport",
    "ClientSetUp",
    "FsspecTransport",
    "GcsTransport",
    "HttpTransport",
    "ListedSizes",
    "LocalFileAccess",
    "LocalRunReads",
    "LocalTransport",
    "MultipartUploads",
    "RangeRequest",
    "RetryPolicy",
    "RunsRead",
    "S3Transport",
    "Transport",
    "TransportConfig",
    "TransportCounters",
    "is_transient",
]


TRANSPORT_OPTION = "transport"
# A reader's option (which ranks fetch shared bytes, see dcp_storage.strategies.read_strategy), never the
# filesystem's: dropped here so that any entry point given a reader's storage options can open a transport.
READ_STRATEGY_OPTION = "read_strategy"
BUILTIN = "fsspec"
# The built-in backends, registered with FsspecTransport when their modules load (named so that none is
# dropped as an unused import): the class serving a URL's filesystem is one of these, or FsspecTransport.
BUILTIN_BACKENDS = (LocalTransport, S3Transport, GcsTransport, AzureTransport, HttpTransport)


def open_transport(
    url: str | os.PathLike[str],
    storage_options: dict[str, Any] | None = None,
    config: TransportConfig | None = None,
) -> tuple[Transport, str]:
    """The transport for ``url`` and the path of ``url`` on it."""
    url = os.fspath(url)
    if url.startswith("file://") and not url.startswith("file:///"):
        url = _local_file_url(url)
    options = dict(storage_options or {})
    chosen = options.pop(TRANSPORT_OPTION, None)
    options.pop(READ_STRATEGY_OPTION, None)
    if chosen is None and "://" in url:
        scheme = url.split("://", 1)[0]
        if scheme != BUILTIN and any(p.name == scheme for p in registry.list("transports")):
            chosen = scheme
    if chosen is None or chosen == BUILTIN:
        return FsspecTransport.from_url(url, options, config)  # the backend serving the URL's filesystem
    factory = registry.get("transports", chosen)
    return factory.from_url(url, options, config)


def _local_file_url(url: str) -> str:
    """``file://localhost/path`` is ``file:///path`` (RFC 8089); fsspec reads any ``file://host/path`` as the
    relative path ``host/path`` under the working directory, so another host is refused."""
    host, _, rest = url[len("file://") :].partition("/")
    if host == "localhost":
        return "file:///" + rest
    raise StorageOptionsError(
        f"{url}: a file URL naming the host {host!r} (fsspec would write under ./{host}/ instead): give a local "
        "path, or file:///path"
    )


def bind_transport(
    url: str | os.PathLike[str],
    storage_options: dict[str, Any] | None,
    config: TransportConfig | None,
    given: Transport | None = None,
) -> tuple[Transport, str]:
    """What every reader and writer does on ``reset(checkpoint_id)``: reuse ``given`` or open one.

    A given transport turns the URL into its own path (:meth:`~.protocol.Transport.strip_url`).
    """
    if given is not None:
        path = given.strip_url(os.fspath(url))
        confinement = getattr(given, "confinement", None)
        if confinement is not None:  # a shared local transport: it may now read this checkpoint too
            confinement.add(path)
        return given, path
    return open_transport(url, storage_options, config)
