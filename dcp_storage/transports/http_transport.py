"""The HTTP transport (fsspec's HTTP filesystem): read-only checkpoints served over ``http(s)://``.

fsspec's ranged read returns only the body; the one here checks the answer's status and
``Content-Range`` against the range asked for (:mod:`.http_io`, :mod:`.range_check`), so a server that
ignores ``Range`` and sends the whole file is caught, not sliced wrongly. A whole-file read with a limit
is streamed and stops after ``limit + 1`` bytes, so a server that gives no size is never held whole.
Ranged reads are pinned to the ETag the load saw first (``If-Match``, :mod:`.versions`), and a redirect to
another origin is refused before any credential goes there (:mod:`.http_redirects`).
"""

from __future__ import annotations

from collections.abc import Callable

from dcp_storage.errors import CrossOriginRedirectError
from dcp_storage.transports.backends import builtin_backend
from dcp_storage.transports.deadline import bounded_call
from dcp_storage.transports.fsspec_transport import FsspecTransport
from dcp_storage.transports.http_io import answer_version, http_read, http_read_range, is_http

__all__ = ["HttpTransport"]


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
