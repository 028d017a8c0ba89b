"""Which store client a transport talks through, for caches of what a store was seen to do.

A fact learnt about a store (for example, that it honours ``If-None-Match``, see
:mod:`dcp_storage.storage.takeover`) holds for every transport sharing one client. Only this layer knows
where a transport keeps its client; callers above get an opaque, weakly referenceable key.
"""

from __future__ import annotations

from typing import Any

__all__ = ["client_identity"]


def client_identity(transport: Any) -> Any:
    """The client object behind ``transport`` (an fsspec filesystem for fsspec-based transports), else the
    transport itself: two transports with one key talk to one store through one client."""
    return getattr(transport, "fs", None) or transport
