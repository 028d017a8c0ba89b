"""``open_reader`` / ``open_writer``: pick the right reader or writer for a URL.

Formats come from the registry (``dcp_storage.formats`` entry points), so an installed plugin's format is
detected like the built-in ones.
"""

from __future__ import annotations

import os
from typing import Any

from dcp_storage import registry
from dcp_storage.errors import UnknownFormatError
from dcp_storage.formats.completeness import probe_or_refuse
from dcp_storage.formats.detection import best_formats, registered_formats, score_formats
from dcp_storage.formats.spec import FormatSpec, Probe
from dcp_storage.integrity.format_check import missing_format_plugin

__all__ = ["UnknownFormatError", "detect_format", "open_reader", "open_writer", "reader_of"]


def _describe(probe: Probe) -> str:
    if probe.is_dir:
        shown = ", ".join(probe.names[:8]) + (", ..." if len(probe.names) > 8 else "")
        return f"a directory holding [{shown}]"
    return f"a {probe.size}-byte file starting with {probe.head[:16]!r}"


def detect_format(url: str | os.PathLike[str], storage_options: dict[str, Any] | None = None) -> FormatSpec:
    """The format whose sniffer scores ``url`` highest; :class:`UnknownFormatError` if none or a tie."""
    probe = probe_or_refuse(os.fspath(url), storage_options)  # an interrupted save: IncompleteCheckpointError
    specs = registered_formats()
    missing = missing_format_plugin(probe, specs)  # the manifest names a format no plugin here provides
    if missing is not None:
        raise UnknownFormatError(missing)
    scores, failures = score_formats(probe, specs)
    broken = [f"{p.name} ({p.distribution}): {p.error}" for p in registry.list("formats") if p.status == "failed"]
    if not scores:
        tried = ", ".join(sorted(specs)) or "none"
        extra = ("; errors: " + "; ".join(failures)) if failures else ""
        extra += ("; plugins that failed to import: " + "; ".join(broken)) if broken else ""
        raise UnknownFormatError(
            f"{probe.transport.url(probe.path)}: unrecognised checkpoint ({_describe(probe)}); tried formats: "
            f"{tried}{extra}. Pass format=... to choose one."
        )
    winners = best_formats(scores)
    if len(winners) > 1:
        raise UnknownFormatError(
            f"{probe.transport.url(probe.path)}: ambiguous checkpoint ({_describe(probe)}): formats "
            f"{', '.join(winners)} all match; pass format=... to choose one"
        )
    return specs[winners[0]]


def open_reader(
    url: str | os.PathLike[str],
    format: str | None = None,
    storage_options: dict[str, Any] | None = None,
    **options: Any,
) -> Any:
    """A DCP ``StorageReader`` for ``url``: ``dcp.load(sd, storage_reader=open_reader(url))``.

    ``format`` names a registered format (``"dcp"``, ``"safetensors"``, ``"torch_save"``, or a plugin's);
    without it the format is detected.
    """
    _check_format_name("open_reader", format)
    spec = registry.get("formats", format) if format is not None else detect_format(url, storage_options)
    return reader_of(spec, url, storage_options, **options)


def _check_format_name(api: str, format: object) -> None:
    """``open_reader(url, opts)`` passes the options as ``format`` (the second argument): say so, instead of
    the registry's ``TypeError: unhashable type: 'dict'``."""
    if format is not None and not isinstance(format, str):
        raise TypeError(
            f"{api}: format must be a format name such as 'dcp' or 'safetensors', got a {type(format).__name__}; "
            f"pass storage options by name: {api}(url, storage_options=...)"
        )


def reader_of(
    spec: FormatSpec, url: str | os.PathLike[str], storage_options: dict[str, Any] | None = None, **options: Any
) -> Any:
    """``spec``'s reader for ``url``; :class:`UnknownFormatError` for a format registered without one."""
    if spec.open_reader is None:
        raise UnknownFormatError(
            f"format {spec.name!r} is registered without a reader; its plugin must pass open_reader"
        )
    return spec.open_reader(os.fspath(url), storage_options=storage_options, **options)


def open_writer(
    url: str | os.PathLike[str], format: str = "dcp", storage_options: dict[str, Any] | None = None, **options: Any
) -> Any:
    """A DCP ``StorageWriter`` for ``url`` in ``format`` (``"dcp"`` or ``"safetensors"``, or a plugin's)."""
    _check_format_name("open_writer", format)
    spec = registry.get("formats", format)
    if spec.open_writer is None:
        raise UnknownFormatError(
            f"format {format!r} is read-only; writable formats: "
            + ", ".join(n for n, s in registered_formats().items() if s.open_writer is not None)
        )
    return spec.open_writer(os.fspath(url), storage_options=storage_options, **options)
