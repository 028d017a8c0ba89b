"""The reads each fsspec filesystem gets for buffered fetches: checked ones where the headers are reachable.

s3fs reads are streamed and checked in :mod:`.s3_stream`. For the rest, ``fs.cat_file(path, start, end)``
returns only the body, so gcsfs, fsspec's HTTP filesystem and adlfs get their own request that checks the
answer's status and ``Content-Range`` (:mod:`.range_check`). Any other filesystem keeps ``cat_file``, and
the caller checks the body's length, which is all that can be checked there. Whole-file reads
(:func:`whole_file_reader`) are made with one attempt on gcsfs and with a 200 refused on adlfs (whose SDK
ranges even a whole read, and raises a ``ValueError`` for a 200).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from ..errors import FileTooLargeError
from .azure_io import azure_read, azure_read_range, is_azure
from .gcs_io import gcs_read, gcs_read_range, is_gcs
from .http_io import http_read, http_read_range, is_http

__all__ = ["RangeReader", "buffered_range_reader", "whole_file_reader"]

# ``read(path, start, end) -> bytes``: bytes ``[start, end)`` of ``path`` (the caller checks the length).
RangeReader = Callable[[str, int, int], bytes]


def _cat_file(fs: Any, path: str, start: int, end: int) -> bytes:
    return fs.cat_file(path, start=start, end=end)


def buffered_range_reader(fs: Any) -> RangeReader:
    """The ranged read for ``fs`` (O(1): a few type checks, no I/O)."""
    for matches, read in ((is_gcs, gcs_read_range), (is_http, http_read_range), (is_azure, azure_read_range)):
        if matches(fs):
            return functools.partial(read, fs)
    return functools.partial(_cat_file, fs)


def _cat_whole(fs: Any, path: str, max_bytes: int | None = None) -> bytes:
    """Any other filesystem: the size first when bounded (nothing is read of a larger file), then no more
    than that size plus one byte, so a file that grew meanwhile is not read whole either."""
    if max_bytes is None:
        return fs.cat_file(path)  # type: ignore[no-any-return]
    size = fs.size(path)
    if size is None:  # a store that does not say (an HTTP server without Content-Length): a bounded range
        return fs.cat_file(path, start=0, end=max_bytes + 1)  # type: ignore[no-any-return]
    if int(size) > max_bytes:
        raise FileTooLargeError(fs.unstrip_protocol(path), int(size), max_bytes)
    # Up to the limit, not the size seen: a size from a cached listing may be stale, and a file that grew
    # must come back whole (or past the limit, and refused), never cut to its old size.
    return fs.cat_file(path, start=0, end=max_bytes + 1)  # type: ignore[no-any-return]


def whole_file_reader(fs: Any) -> Callable[..., bytes]:
    """``read(path, max_bytes=None) -> bytes`` of a whole (small) file on ``fs``, s3fs aside (see
    :mod:`.s3_stream`; HTTP is streamed, see :mod:`.http_io`). With ``max_bytes`` it raises
    :class:`~dcp_storage.errors.FileTooLargeError` for a file the store says is larger, and otherwise returns
    at most ``max_bytes + 1`` bytes, having allocated no more than that (the caller refuses a result that long)."""
    for matches, read in ((is_gcs, gcs_read), (is_azure, azure_read), (is_http, http_read)):
        if matches(fs):
            return functools.partial(read, fs)
    return functools.partial(_cat_whole, fs)
