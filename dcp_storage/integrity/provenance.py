"""``name/version`` descriptors of what wrote a checkpoint, and the distribution that provides each one.

A reader that meets a descriptor it has no plugin for names the distribution to install, so the writer
records it: for an extension, the registry entry (``dcp_storage.extensions`` entry points) whose name is
the extension's ``registry_name()``, else the distribution that owns the extension's module (torch's own
extensions: ``torch``).
"""

from __future__ import annotations

import functools
from importlib import metadata as importlib_metadata
from typing import Any

from dcp_storage import registry
from dcp_storage._version import __version__
from dcp_storage.integrity.manifest import ExtensionInfo

__all__ = ["describe_extension", "distribution_of_module", "format_distribution", "writer_descriptor"]


def writer_descriptor() -> str:
    """``dcp-storage/<version>``: the writer recorded in every checkpoint we write."""
    return f"dcp-storage/{__version__}"


@functools.cache
def _packages_distributions() -> dict[str, list[str]]:
    return dict(importlib_metadata.packages_distributions())


def _version(distribution: str) -> str | None:
    try:
        return importlib_metadata.version(distribution)
    except importlib_metadata.PackageNotFoundError:
        return None


def distribution_of_module(module: str) -> str | None:
    """The installed distribution that provides top-level package of ``module`` (``None`` if unknown)."""
    top = module.partition(".")[0]
    dists = _packages_distributions().get(top)
    return dists[0] if dists else None


def _registry_distribution(registry_name: str, cls: type) -> str | None:
    target = f"{cls.__module__}:{cls.__qualname__}"
    for info in registry.list("extensions"):
        if info.name == registry_name or info.target == target or info.target is cls:
            return None if info.distribution.startswith("<") else info.distribution
    return None


def format_distribution(name: str) -> str | None:
    """The distribution that registers format ``name`` (``dcp-storage`` for the built-in ones)."""

    for info in registry.list("formats"):
        if info.name == name:
            return None if info.distribution.startswith("<") else info.distribution
    return None


def describe_extension(descriptor: str, extension: Any | None = None) -> ExtensionInfo:
    """An :class:`ExtensionInfo` for ``descriptor``, with distribution and version when they can be found."""
    name = descriptor.partition("/")[0].partition("@")[0]
    dist = None
    if extension is not None:
        cls = extension if isinstance(extension, type) else type(extension)
        dist = _registry_distribution(name, cls) or distribution_of_module(cls.__module__)
    else:
        dist = next(
            (
                i.distribution
                for i in registry.list("extensions")
                if i.name == name and not i.distribution.startswith("<")
            ),
            None,
        )
    return ExtensionInfo(descriptor, dist, _version(dist) if dist else None)
