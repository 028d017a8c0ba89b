"""What every reader and writer of a URL shares: binding the URL to a transport, and reporting on it.

A class using :class:`BoundLocation` sets ``storage_options``, ``transport_config`` and ``_given_transport``
in its constructor, then calls :meth:`~BoundLocation._open` with the URL (again from ``reset`` when DCP
passes a new ``checkpoint_id``).
"""

from __future__ import annotations

import os
from typing import Any

from ..transports import TransportConfig
from ..transports.factory import bind_transport

__all__ = ["BoundLocation"]


class BoundLocation:
    """``path`` (the URL as given), ``transport`` and ``root`` (the path on it), ``checkpoint_id``, ``counters``."""

    storage_options: dict[str, Any]
    transport_config: TransportConfig | None
    _given_transport: Any

    def _open(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        self.transport, self.root = bind_transport(
            self.path, self.storage_options, self.transport_config, self._given_transport
        )

    @property
    def checkpoint_id(self) -> str:
        return self.path

    @property
    def counters(self) -> dict[str, int]:
        """Requests, bytes and retries so far (see :class:`~dcp_storage.transports.TransportCounters`)."""
        return self.transport.counters.snapshot()
