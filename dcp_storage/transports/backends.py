"""Which built-in transport class serves a filesystem: the registry of fsspec backends.

Each backend module (:mod:`.local_transport`, :mod:`.s3_transport`, ...) registers its class with
:func:`builtin_backend`; importing :mod:`dcp_storage.transports` loads them all. A class serves the
filesystems its ``serves(fs)`` accepts; a filesystem no backend serves gets
:class:`~.fsspec_transport.FsspecTransport`, the common base, which works through plain fsspec calls.
"""

from __future__ import annotations

import functools
from typing import Any, TypeVar

__all__ = ["backend_for", "builtin_backend", "class_to_build", "restore"]

# Classes are typed ``type`` here: this module imports nothing of the base (which imports it).
_BACKENDS: list[type] = []
_T = TypeVar("_T", bound=type)


def builtin_backend(cls: _T) -> _T:
    """Register ``cls`` as the transport of the filesystems its ``serves(fs)`` accepts."""
    _BACKENDS.append(cls)
    return cls


def backend_for(fs: Any) -> Any:
    """The registered class serving ``fs``; ``None`` if none does (the base class serves it)."""
    return next((cls for cls in _BACKENDS if cls.serves(fs)), None)


def class_to_build(cls: type, fs: Any, base: type) -> type:
    """The class ``cls(fs, ...)`` builds: the backend serving ``fs`` for ``base`` itself; a backend class (or a
    subclass of one) as named; any other subclass of ``base`` combined with the backend (its methods first)."""
    backend = backend_for(fs) or base
    if cls is base:
        return backend
    if issubclass(cls, (backend, *_BACKENDS)):
        return cls
    return _combined(cls, backend)


@functools.cache
def _combined(declared: type, backend: type) -> type:
    """``declared`` on ``backend``; pickled as ``declared`` (see ``FsspecTransport.__reduce__``)."""
    namespace = {"__module__": declared.__module__, "__qualname__": declared.__qualname__, "_declared": declared}
    return type(declared.__name__, (declared, backend), namespace)


def restore(cls: type, state: dict[str, Any]) -> Any:
    """Unpickle a transport of class ``cls`` (its ``__reduce__``): built for ``state["fs"]``, then its state."""
    transport = cls.__new__(cls, state["fs"])  # type: ignore[call-arg]
    transport.__setstate__(state)
    return transport
