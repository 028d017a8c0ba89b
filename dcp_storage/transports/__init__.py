"""Transports move bytes (and only bytes) between storage and memory.

The built-in ones, one module per store, all on fsspec: :class:`LocalTransport`, :class:`S3Transport`,
:class:`GcsTransport`, :class:`AzureTransport`, :class:`HttpTransport`, and :class:`FsspecTransport` (their
common base) for any other fsspec filesystem. Importing this package registers them all, so the factory
(:func:`~.factory.open_transport`) and ``FsspecTransport(fs)`` always see every backend.
"""

from ..redaction import install_log_redaction
from .azure_transport import AzureTransport
from .client_identity import client_identity
from .config import TransportConfig
from .counters import TransportCounters
from .fsspec_transport import FsspecTransport
from .gcs_transport import GcsTransport
from .http_transport import HttpTransport
from .local_runs import RunsRead
from .local_transport import LocalTransport
from .protocol import AtomicWriter, LocalFileAccess, LocalRunReads, MultipartUploads, Transport
from .ranges import RangeRequest
from .retry import RetryPolicy, is_transient
from .s3_transport import S3Transport

install_log_redaction()  # botocore logs signed requests (tokens, key ids) at DEBUG: mask them

__all__ = [
    "client_identity",
    "AtomicWriter",
    "AzureTransport",
    "FsspecTransport",
    "GcsTransport",
    "HttpTransport",
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
