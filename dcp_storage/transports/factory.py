"""Choosing a transport for a URL: the registry first, fsspec otherwise.

A transport plugin registers under the ``dcp_storage.transports`` entry-point group, either under a URL
scheme it serves (``myblob = "my_pkg:MyBlobTransport"`` makes ``myblob://...`` URLs use it) or under a name
users select with the ``transport`` storage option (``{"transport": "obstore", ...}``). A registered
transport is a class with ``from_url(url, storage_options, config) -> (transport, path)`` offering
:class:`~dcp_storage.transports.FsspecTransport`'s methods. Everything else goes through fsspec, which has
its own registry of schemes (``s3``, ``gs``, ``az``, ``memory``, ...).
"""

from __future__ import annotations

import os
from typing import Any

from .. import registry
from .fsspec_transport import FsspecTransport, TransportConfig

__all__ = ["TRANSPORT_OPTION", "bind_transport", "open_transport"]

TRANSPORT_OPTION = "transport"
BUILTIN = "fsspec"


def open_transport(
    url: str | os.PathLike[str],
    storage_options: dict[str, Any] | None = None,
    config: TransportConfig | None = None,
) -> tuple[Any, str]:
    """The transport for ``url`` and the path of ``url`` on it."""
    url = os.fspath(url)
    options = dict(storage_options or {})
    chosen = options.pop(TRANSPORT_OPTION, None)
    if chosen is None and "://" in url:
        scheme = url.split("://", 1)[0]
        if scheme != BUILTIN and any(p.name == scheme for p in registry.list("transports")):
            chosen = scheme
    if chosen is None or chosen == BUILTIN:
        return FsspecTransport.from_url(url, options, config)
    factory = registry.get("transports", chosen)
    return factory.from_url(url, options, config)


def bind_transport(
    url: str | os.PathLike[str],
    storage_options: dict[str, Any] | None,
    config: TransportConfig | None,
    given: Any = None,
) -> tuple[Any, str]:
    """What every reader and writer does on ``reset(checkpoint_id)``: reuse ``given`` or open one.

    A transport that is not built on an fsspec filesystem turns the URL into its own path with a
    ``strip_url(url)`` method; fsspec transports use their filesystem's ``_strip_protocol``.
    """
    if given is not None:
        strip = getattr(given, "strip_url", None)
        path = strip(os.fspath(url)) if callable(strip) else given.fs._strip_protocol(os.fspath(url))
        confinement = getattr(given, "confinement", None)
        if confinement is not None:  # a shared local transport: it may now read this checkpoint too
            confinement.add(path)
        return given, path
    return open_transport(url, storage_options, config)
