"""Ranged GETs over fsspec's HTTP filesystem with the answer checked before its body is read.

``HTTPFileSystem.cat_file(url, start, end)`` returns the body of whatever came back: a server that ignores
``Range`` sends ``200`` and the whole object, one that answers another range sends those bytes, and the
caller cannot tell. :func:`http_read_range` makes the same request on fsspec's own aiohttp session, with its
client options (``headers``, auth, ...) and its error mapping (404 is ``FileNotFoundError``, other errors
aiohttp's ``ClientResponseError`` with the status), and checks status, ``Content-Range`` and length before
reading the body (:mod:`.range_check`). Retries stay with the transport's retry layer.
"""

from __future__ import annotations

from typing import Any

from fsspec.asyn import sync

from .range_check import read_range_body

__all__ = ["http_read_range", "is_http"]

_HOOKS = ("set_session", "encode_url", "kwargs", "loop", "_raise_not_found_for_status")


def is_http(fs: Any) -> bool:
    """Whether ``fs`` is fsspec's ``HTTPFileSystem`` (http:// and https://) with the hooks used here."""
    return type(fs).__name__ == "HTTPFileSystem" and all(hasattr(fs, name) for name in _HOOKS)


async def _get_range(fs: Any, url: str, start: int, end: int) -> bytes:
    options = dict(fs.kwargs)
    headers = dict(options.pop("headers", None) or {})
    headers["Range"] = f"bytes={start}-{end - 1}"
    session = await fs.set_session()
    async with session.get(fs.encode_url(url), headers=headers, **options) as response:
        fs._raise_not_found_for_status(response, url)
        return await read_range_body(response, start, end)


def http_read_range(fs: Any, url: str, start: int, end: int) -> bytes:
    """Bytes ``[start, end)`` of ``url``: exactly those, or :class:`~.range_check.RangeMismatchError`."""
    return bytes(sync(fs.loop, _get_range, fs, url, start, end))
