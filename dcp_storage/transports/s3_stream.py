"""Streaming S3 ranged GETs straight into destination buffers (s3fs + aiobotocore).

``s3fs.cat_file`` collects the response body into a fresh ``bytes`` (touching twice the data in new
pages) and the caller copies it again; on a 2-core machine that client CPU is most of the cost
(measured here: 0.3-0.4 GB/s with threads over ``cat_file`` vs 0.7-0.9 GB/s streaming, see
``benchmarks/NOTES-s3-throughput.md``). This module issues the same signed ``GetObject`` through s3fs's
own client (credentials, endpoint and s3fs's retries for the request itself all apply), then copies each
body chunk into the caller's buffers as it arrives. A body cut short resumes from the first missing byte.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fsspec.asyn import sync

__all__ = ["ScatterSink", "can_stream", "stream_range"]


def can_stream(fs: Any) -> bool:
    """Whether ``fs`` is an s3fs filesystem whose client we can stream from."""
    return type(fs).__name__ == "S3FileSystem" and hasattr(fs, "_call_s3") and hasattr(fs, "loop")


class ScatterSink:
    """Writes the bytes of one group range into its segments' buffers, skipping coalescing gaps.

    ``pieces`` are ``(start, end, view)`` relative to the range start, sorted and non-overlapping.
    """

    def __init__(self, pieces: list[tuple[int, int, memoryview]]) -> None:
        self._pieces = pieces
        self._next = 0

    def reset(self) -> None:
        self._next = 0

    def write(self, pos: int, chunk: memoryview) -> None:
        end = pos + len(chunk)
        i = self._next
        pieces = self._pieces
        while i < len(pieces) and pieces[i][1] <= pos:
            i += 1
        self._next = i
        while i < len(pieces) and pieces[i][0] < end:
            p_start, p_end, view = pieces[i]
            lo, hi = max(p_start, pos), min(p_end, end)
            view[lo - p_start : hi - p_start] = chunk[lo - pos : hi - pos]
            if p_end > end:
                break
            i += 1


async def _get_range(fs: Any, path: str, start: int, end: int, emit: Callable[[int, memoryview], None]) -> int:
    bucket, key, version = fs.split_path(path)
    kwargs: dict[str, Any] = {"Bucket": bucket, "Key": key, "Range": f"bytes={start}-{end - 1}"}
    if version:
        kwargs["VersionId"] = version
    response = await fs._call_s3("get_object", **kwargs)
    body = response["Body"]
    got = 0
    want = end - start
    try:
        content = getattr(getattr(body, "raw_stream", None), "content", None)
        if content is not None and hasattr(content, "readany"):
            while got < want:
                chunk = await content.readany()
                if not chunk:
                    break
                view = memoryview(chunk)[: want - got]
                emit(got, view)
                got += len(view)
        else:  # another HTTP backend: one read, still no second copy on our side
            data = await body.read()
            view = memoryview(data)[:want]
            emit(0, view)
            got = len(view)
    finally:
        body.close()
    return got


def stream_range(fs: Any, path: str, start: int, end: int, emit: Callable[[int, memoryview], None]) -> int:
    """GET bytes ``[start, end)`` of ``path``, calling ``emit(offset, chunk)`` per chunk; returns bytes got.

    Fewer than ``end - start`` bytes means the body was cut short; the caller decides whether to resume.
    """
    return int(sync(fs.loop, _get_range, fs, path, start, end, emit))
