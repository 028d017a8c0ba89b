"""Ranged GETs over fsspec's HTTP filesystem with the answer checked before its body is read.

``HTTPFileSystem.cat_file(url, start, end)`` returns the body of whatever came back: a server that ignores
``Range`` sends ``200`` and the whole object, one that answers another range sends those bytes, and the
caller cannot tell. :func:`http_read_range` makes the same request on fsspec's own aiohttp session, with its
client options (``headers``, auth, ...) and its error mapping (404 is ``FileNotFoundError``, other errors
aiohttp's ``ClientResponseError`` with the status), and checks status, ``Content-Range`` and length before
reading the body (:mod:`.range_check`). Retries stay with the transport's retry layer.

For the same reason a whole (small) file read with a limit (:func:`http_read`) is one streamed ``GET``
that stops after ``limit + 1`` bytes: ``cat_file`` reads whole whatever body comes back, so a server that
gives no size, or ignores ``Range`` and sends ``200`` with a huge body, would otherwise be held whole.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from dcp_storage.transports.deadline import bounded_sync
from dcp_storage.transports.range_check import IDENTITY, read_range_body
from dcp_storage.transports.versions import VersionConditionFailed

__all__ = ["http_read", "http_read_range", "is_http", "read_prefix"]

_PIECE = 1024 * 1024  # read size of a bounded whole-file read
_HOOKS = ("set_session", "encode_url", "kwargs", "loop", "_raise_not_found_for_status")


def is_http(fs: Any) -> bool:
    """Whether ``fs`` is fsspec's ``HTTPFileSystem`` (http:// and https://) with the hooks used here."""
    return type(fs).__name__ == "HTTPFileSystem" and all(hasattr(fs, name) for name in _HOOKS)


def answer_version(headers: Any) -> str | None:
    """The version an HTTP answer names: its ``ETag`` (strong or weak, as sent); ``None`` without one."""
    etag = headers.get("ETag")
    return str(etag) if etag else None


async def _get_range(
    fs: Any, url: str, start: int, end: int, etag: str | None, saw: Callable[[str | None], None] | None
) -> bytes:
    options = dict(fs.kwargs)
    headers = dict(options.pop("headers", None) or {})
    headers["Range"] = f"bytes={start}-{end - 1}"
    headers.update(IDENTITY)
    if etag and not etag.startswith("W/"):  # If-Match compares strongly: a weak ETag never matches
        headers["If-Match"] = etag
    session = await fs.set_session()
    async with session.get(fs.encode_url(url), headers=headers, **options) as response:
        if etag and response.status == 412:
            raise VersionConditionFailed(f"{url}: ETag {etag} no longer matches")
        fs._raise_not_found_for_status(response, url)
        if saw is not None:
            saw(answer_version(response.headers))  # compared as well: a server may ignore If-Match
        return await read_range_body(response, start, end)


def http_read_range(
    fs: Any,
    url: str,
    start: int,
    end: int,
    etag: str | None = None,
    saw: Callable[[str | None], None] | None = None,
) -> bytes:
    """Bytes ``[start, end)`` of ``url``: exactly those, or :class:`~.range_check.RangeMismatchError`.

    With ``etag``, on condition ``If-Match`` (a ``412`` raises :class:`~.versions.VersionConditionFailed`);
    ``saw`` gets the answer's ETag before its body is read.
    """
    return bytes(bounded_sync(fs.loop, _get_range, fs, url, start, end, etag, saw))


async def read_prefix(stream: Any, limit: int) -> bytearray:
    """The first ``limit`` bytes of an aiohttp body ``stream`` (all of it when shorter); the rest is not read."""
    out = bytearray()
    while len(out) < limit:
        piece = await stream.read(min(_PIECE, limit - len(out)))
        if not piece:
            break
        out += piece
    return out


async def _get_prefix(fs: Any, url: str, limit: int) -> bytearray:
    session = await fs.set_session()
    async with session.get(fs.encode_url(url), **fs.kwargs) as response:
        fs._raise_not_found_for_status(response, url)
        return await read_prefix(response.content, limit)


def http_read(fs: Any, url: str, max_bytes: int | None = None) -> bytes:
    """The whole body at ``url``; with ``max_bytes``, at most ``max_bytes + 1`` bytes of it (the caller
    refuses a result that long), streamed, whatever size the server claims or withholds."""
    if max_bytes is None:
        return fs.cat_file(url)  # type: ignore[no-any-return]
    return bytes(bounded_sync(fs.loop, _get_prefix, fs, url, max_bytes + 1))
