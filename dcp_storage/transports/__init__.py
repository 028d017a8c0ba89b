"""Transports move bytes (and only bytes) between storage and memory.

The built-in ones, one module per store, all on fsspec: :class:`LocalTransport`, :class:`S3Transport`,
:class:`GcsTransport`, :class:`AzureTransport`, :class:`HttpTransport`, and :class:`FsspecTransport` (their
common base) for any other fsspec filesystem. Importing this package registers them all, so the factory
(:func:`~.factory.open_transport`) and ``FsspecTransport(fs)`` always see every backend.
"""

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
    "client_identity",
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
