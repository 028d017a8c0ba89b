"""Checking that the answer to a ranged GET holds exactly the bytes asked for.

A server, or a cache or proxy in between, may ignore ``Range`` and answer ``200`` with the whole object,
answer ``206`` with another range than asked (its ``Content-Range`` says which), or a shorter one. Client
libraries hand any of these on as "the body", and a reader that copies the body into a tensor would load
wrong bytes without an error. So every ranged read checks the answer's status, ``Content-Range`` and
length against the request, before a byte of the body is used, with :func:`check_range_answer` (O(1) per
response). A mismatch raises :class:`RangeMismatchError`, which the retry layer
(:mod:`~dcp_storage.transports.retry`) retries like a body cut short; when the policy gives up, the
transport raises :class:`~dcp_storage.errors.TransportError` naming the URL, the range asked, the last
answer and the attempts. If the object itself is shorter than the range, that is a truncated file
(:class:`~dcp_storage.errors.CorruptCheckpointError`), not a mismatch, and is not retried.

A ``200`` is accepted only for a range that was the whole object: from byte 0, with a body exactly as long
as the range (so the object ends where the caller expected it to).

A ranged answer must be the stored bytes themselves: one with a ``Content-Encoding`` (other than
``identity``) is refused, whatever its ``Content-Range``. A compressing cache may gzip a ``206``; aiohttp
(HTTP, GCS) then decodes the body, so its length no longer says anything about what ``Content-Length``
and ``Content-Range`` described, and botocore and object_store hand on the encoded bytes as they are
(both took as many wrong bytes as the range asked for, without an error). Our HTTP and GCS range requests
ask for ``Accept-Encoding: identity``. A body longer than its range (chunked, no ``Content-Length``) is
refused as well, never cut to the range's length.

What each backend checks (a ranged read is always ``[start, end)`` with ``end`` known):

=================================  =========================================================================
s3:// (s3fs, our streaming GET)    status, ``Content-Range`` and ``Content-Length`` of botocore's response
                                   (``HTTPStatusCode``, ``ContentRange``, ``ContentLength``) before the body
                                   is read; then the bytes streamed (:mod:`.s3_stream`)
gs:// (gcsfs, one-attempt request) status, ``Content-Range`` and the body's length (:mod:`.gcs_io`)
http(s):// (fsspec HTTP)           status, ``Content-Range`` and the body's length, on fsspec's own aiohttp
                                   session (:mod:`.http_io`)
az:// (adlfs)                      status, ``Content-Range`` and ``Content-Length`` of every response of the
                                   download (the Azure SDK may split a range into several requests), each
                                   against the range its own request asked for (:mod:`.azure_io`); then the
                                   body's length. A ``200`` is refused even for a whole object: the SDK
                                   cannot read one
any other fsspec filesystem        the body's length only: the client hides the headers
obstore plugin                     object_store checks status ``206`` and ``Content-Range`` (a mismatch
                                   reaches us as its error and is retried like ours); then the bytes
                                   streamed. A ``200`` is read only as a whole-object answer (see the plugin)
=================================  =========================================================================

A length check alone cannot catch a ``206`` that names other bytes of the right length; where a client
hides the headers, only the length is checked (local files are read with ``preadv`` and need neither).
"""

from __future__ import annotations

import re
from typing import Any

from dcp_storage.errors import CorruptCheckpointError
from dcp_storage.transports.deadline import bounded_call

__all__ = [
    "IDENTITY",
    "RangeMismatchError",
    "check_range_answer",
    "describe_answer",
    "is_encoded",
    "range_mismatch",
    "raise_if_short",
    "read_range_body",
]

IDENTITY = {"Accept-Encoding": "identity"}  # request headers of a ranged GET: the stored bytes, not an encoding

_CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+|\*)")
_QUOTED_MAX = 80  # a Content-Range comes from the server: quoted with repr, and cut to this many characters


class RangeMismatchError(OSError):
    """The answer to a ranged read was not the range asked for (status, ``Content-Range`` or length).

    Internal signal for "retry this" (like :class:`~dcp_storage.transports.retry.TruncatedReadError`):
    the retry layer turns the last one into a :class:`~dcp_storage.errors.TransportError`.
    """


def range_mismatch(start: int, end: int, got: str) -> RangeMismatchError:
    """The error for an answer to ``[start, end)`` described by ``got`` (see :func:`describe_answer`)."""
    return RangeMismatchError(f"asked for bytes [{start}, {end}), got {got}")


def describe_answer(
    status: int | None, content_range: str | None, length: int | None, content_encoding: str | None = None
) -> str:
    """``status 206, Content-Range 'bytes 1-10/99', 10 bytes``: what came back, for error messages."""
    parts = [f"status {status}" if status is not None else "no status"]
    if content_range is not None:
        parts.append(f"Content-Range {content_range[:_QUOTED_MAX]!r}")
    elif status == 200:
        parts.append("no Content-Range (Range ignored?)")
    if is_encoded(content_encoding):
        parts.append(f"Content-Encoding {content_encoding[:_QUOTED_MAX]!r} (not the stored bytes)")  # type: ignore[index]
    parts.append(f"{length} bytes" if length is not None else "length unknown")
    return ", ".join(parts)


def is_encoded(content_encoding: str | None) -> bool:
    """Whether a ``Content-Encoding`` header says the body is not the stored bytes as they are."""
    return content_encoding is not None and content_encoding.strip().lower() not in ("", "identity")


def check_range_answer(
    start: int,
    end: int,
    status: int | None,
    content_range: str | None,
    length: int | None,
    content_encoding: str | None = None,
) -> None:
    """Raise :class:`RangeMismatchError` unless an answer to ``Range: bytes=start-(end-1)`` holds those bytes.

    ``length`` is the body's length as far as known before it is used (``Content-Length``, or the length of
    a body already read); ``None`` if unknown, and then the caller checks the bytes it got.
    ``content_encoding`` is the answer's ``Content-Encoding``: any but ``identity`` is refused.
    """
    want = end - start
    if is_encoded(content_encoding):
        raise range_mismatch(start, end, describe_answer(status, content_range, length, content_encoding))
    if status == 206:
        match = _CONTENT_RANGE.fullmatch(content_range.strip()) if content_range is not None else None
        if (
            match is not None
            and int(match.group(1)) == start
            and int(match.group(2)) == end - 1
            and (match.group(3) == "*" or int(match.group(3)) >= end)
            and (length is None or length == want)
        ):
            return
    elif status == 200 and start == 0 and length == want:
        return  # the range was the whole object
    raise range_mismatch(start, end, describe_answer(status, content_range, length))


async def read_range_body(response: Any, start: int, end: int) -> bytes:
    """Check an aiohttp response to ``Range: bytes=start-(end-1)``, then read exactly its ``end - start`` bytes.

    The check comes before the body is read, so a ``200`` with a whole large object costs no memory. A
    body cut short raises as aiohttp does (a transient error); one longer than its checked range raises
    :class:`RangeMismatchError`.
    """
    status, length, content_range = response.status, response.content_length, response.headers.get("Content-Range")
    check_range_answer(start, end, status, content_range, length, response.headers.get("Content-Encoding"))
    if length is not None:  # checked to be end - start: aiohttp reads no more, and raises if cut short
        return bytes(await response.read())
    body = await response.content.readexactly(end - start)  # no Content-Length (chunked): count, then
    if await response.content.read(1):  # nothing may follow
        raise range_mismatch(start, end, f"a longer body ({describe_answer(status, content_range, None)})")
    return body


def raise_if_short(fs: Any, path: str, url: str, end: int, cause: BaseException | None = None) -> None:
    """Raise :class:`~dcp_storage.errors.CorruptCheckpointError` if the object at ``path`` of ``fs`` is shorter
    than ``end`` bytes (a truncated file, not a transient mismatch); nothing if its size cannot be learnt."""
    try:
        fs.invalidate_cache(path)
        size = bounded_call(fs, "size", path)
    except Exception:  # noqa: BLE001 - size unknown: the caller's own error stands
        return
    if size is not None and size < end:
        raise CorruptCheckpointError(
            f"{url}: object ends at byte {size} but bytes up to {end} were expected (truncated file?)"
        ) from cause
