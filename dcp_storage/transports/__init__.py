"""Transports move bytes (and only bytes) between storage and memory."""

from ..redaction import install_log_redaction
from .config import TransportConfig
from .counters import TransportCounters
from .fsspec_transport import FsspecTransport
from .protocol import AtomicWriter, LocalFileAccess, Transport
from .ranges import RangeRequest
from .retry import RetryPolicy, is_transient

install_log_redaction()  # botocore logs signed requests (tokens, key ids) at DEBUG: mask them

__all__ = [
    "AtomicWriter",
    "FsspecTransport",
    "LocalFileAccess",
    "RangeRequest",
    "RetryPolicy",
    "Transport",
    "TransportConfig",
    "TransportCounters",
    "is_transient",
]
