"""The HTTP transport: read-only checkpoints over ``http(s)://``, ranged GETs checked before their body is read.

Ranged GETs over fsspec's HTTP filesystem with the answer checked before its body is read.

``HTTPFileSystem.cat_file(url, start, end)`` returns the body of whatever came back: a server that ignores
``Range`` sends ``200`` and the whole object, one that answers another range sends those bytes, and the
caller cannot tell. :func:`http_read_range` makes the same request on fsspec's own aiohttp session, with its
client options (``headers``, auth, ...) and its error mapping (404 is ``FileNotFoundError``, other errors
aiohttp's ``ClientResponseError`` with the status), and checks status, ``Content-Range`` and length before
reading the body (:mod:`.range_check`). Retries stay with the transport's retry layer.

For the same reason a whole (small) file read with a limit (:func:`http_read`) is one streamed ``GET``
that stops after ``limit + 1`` bytes: ``cat_file`` reads whole whatever body comes back, so a server that
gives no size, or ignores ``Range`` and sends ``200`` with a huge body, would otherwise be held whole.

The HTTP transport (fsspec's HTTP filesystem): read-only checkpoints served over ``http(s)://``.

fsspec's ranged read returns only the body; the one here checks the answer's status and
``Content-Range`` against the range asked for (:mod:`.http_io`, :mod:`.range_check`), so a server that
ignores ``Range`` and sends the whole file is caught, not sliced wrongly. A whole-file read with a limit
is streamed and stops after ``limit + 1`` bytes, so a server that gives no size is never held whole.
Ranged reads are pinned to the ETag the load saw first (``If-Match``, :mod:`.versions`), and a redirect to
another origin is refused before any credential goes there (:mod:`.http_redirects`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from dcp_storage.errors import CrossOriginRedirectError
from dcp_storage.transports.fsspec_transport import FsspecTransport, builtin_backend
from dcp_storage.transports.guards import IDENTITY, VersionConditionFailed, read_range_body
from dcp_storage.transports.retry import bounded_call, bounded_sync

__all__ = ["HttpTransport", "http_read", "http_read_range", "is_http", "read_prefix"]


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


@builtin_backend
class HttpTransport(FsspecTransport):
    """Files served over HTTP(S) (``http://``, ``https://``)."""

    serves = staticmethod(is_http)  # the filesystems this class is the transport of

    def _read_whole(self, path: str, max_bytes: int | None) -> bytes:
        """One streamed ``GET`` stopped after ``max_bytes + 1`` bytes, whatever size the server claims or withholds."""
        return http_read(self.fs, path, max_bytes)

    def _read_range(self, path: str, start: int, end: int) -> bytes:
        return http_read_range(self.fs, path, start, end)

    def _read_range_version(
        self, path: str, start: int, end: int, expected: str | None, saw: Callable[[str | None], None]
    ) -> bytes:
        """On condition ``If-Match`` of the pinned ETag, and the answer's ETag compared (see :mod:`.versions`)."""
        return http_read_range(self.fs, path, start, end, expected, saw)

    def _size_version(self, path: str) -> tuple[int, str | None]:
        """fsspec's ``info`` (one ``HEAD``, or a ``GET`` it stops early) keeps the answer's ETag."""
        try:
            info = bounded_call(self.fs, "info", path)
        except FileNotFoundError as exc:  # fsspec's info turns every failure into "not found": say ours
            if isinstance(exc.__cause__, CrossOriginRedirectError):
                raise exc.__cause__ from None
            raise
        return int(info.get("size")), answer_version(info)  # no size: TypeError, as fsspec's size() gives
