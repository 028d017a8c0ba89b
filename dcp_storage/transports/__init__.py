"""Transports move bytes (and only bytes) between storage and memory."""

from .counters import TransportCounters
from .fsspec_transport import FsspecTransport, TransportConfig
from .ranges import RangeRequest
from .retry import RetryPolicy, is_transient

__all__ = ["FsspecTransport", "TransportConfig", "TransportCounters", "RangeRequest", "RetryPolicy", "is_transient"]
