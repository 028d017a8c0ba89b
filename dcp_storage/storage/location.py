"""What every reader and writer of a URL shares: binding the URL to a transport, and reporting on it.

A class using :class:`BoundLocation` sets ``storage_options``, ``transport_config`` and ``_given_transport``
in its constructor, then calls :meth:`~BoundLocation._open` with the URL (again from ``reset`` when DCP
passes a new ``checkpoint_id``).

Pickling (``dcp.async_save(..., async_checkpointer_type=AsyncCheckpointerType.PROCESS)`` sends the writer
to a checkpoint process by pickle): what lives only in this process (the transport with its thread pool,
locks, clients and sessions; anything a class lists in ``_process_local``) is left out, and the transport
is opened again, through the factory, from the URL, ``storage_options`` and ``transport_config`` on first
use in the receiving process. ``storage_options`` (credentials included) travel inside the pickle, which
torch sends through a pipe, never through a file. A transport given to the constructor is pickled itself
(the core's and the obstore plugin's leave their pools and clients behind, as here).
"""

from __future__ import annotations

import os
from typing import Any

from dcp_storage.transports import TransportConfig
from dcp_storage.transports.factory import bind_transport

__all__ = ["BoundLocation"]


class BoundLocation:
    """``path`` (the URL as given), ``transport`` and ``root`` (the path on it), ``checkpoint_id``, ``counters``."""

    storage_options: dict[str, Any]
    transport_config: TransportConfig | None
    _given_transport: Any
    # Attributes never pickled (see the module docstring); classes add theirs, and every class's list counts.
    _process_local: tuple[str, ...] = ("transport", "root")

    def _open(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        self.transport, self.root = bind_transport(
            self.path, self.storage_options, self.transport_config, self._given_transport
        )

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        for cls in type(self).__mro__:
            for name in cls.__dict__.get("_process_local", ()):
                state.pop(name, None)
        return state

    def __getattr__(self, name: str) -> Any:
        # Reached only for attributes not set: after unpickling, the transport is opened on first use.
        if name in ("transport", "root") and "path" in self.__dict__:
            self._open(self.path)
            return self.__dict__[name]
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @property
    def checkpoint_id(self) -> str:
        return self.path

    @property
    def counters(self) -> dict[str, int]:
        """Requests, bytes and retries so far (see :class:`~dcp_storage.transports.TransportCounters`)."""
        return self.transport.counters.snapshot()
