"""The Azure Blob transport (adlfs): ranged downloads whose every answer is checked against the range asked for.

Ranged Azure Blob downloads (adlfs) with every answer checked against the range its request asked for.

adlfs's ``cat_file(path, start, end)`` calls the Azure SDK's ``download_blob(offset, length)``, which
takes the object's size from the first answer's ``Content-Range`` but never checks that the answer starts
where it asked: a ``206`` naming other bytes of the right length is returned as the range, and a ``200``
(``Range`` ignored) fails with a ``ValueError`` outside any retry. :func:`azure_read_range` makes the same
download on adlfs's client, with adlfs's timeouts and concurrency, and hands the SDK a
``raw_response_hook`` that checks every successful answer of the download (the SDK may split a range
into several requests) against the ``x-ms-range`` of its own request (:mod:`.range_check`), before the
SDK reads its body. A ``200`` is refused even for a whole object (the SDK needs ``Content-Range`` to know
the object's size); like any mismatch it is retried, in whole-blob reads (:func:`azure_read`) too, where the
SDK would raise a ``ValueError``. Missing blobs raise ``FileNotFoundError``, as in adlfs.

The Azure Blob transport (adlfs): reads whose every answer is checked against the range it asked for.

adlfs's reads go through the Azure SDK, which hides the status and ``Content-Range`` of the answers; the
reads here make the same download on adlfs's client with a check of each answer (:mod:`.azure_io`), and
refuse a ``200`` to a ranged request. Everything else is adlfs's: queries, a create-if-absent upload with
``If-None-Match: *``, and writes of staged blocks committed as one block list at close (never committed
on error: uncommitted blocks are invisible, and the service drops them). The URL scheme the user wrote
(``az``, ``abfs`` or ``abfss``) is the one errors name.
"""

from __future__ import annotations

import errno
import functools
import os
import posixpath
from collections.abc import Callable
from typing import Any

from dcp_storage.errors import FileTooLargeError
from dcp_storage.transports.fsspec_transport import FsspecTransport, builtin_backend
from dcp_storage.transports.guards import (
    ListingBound,
    VersionConditionFailed,
    check_range_answer,
    describe_answer,
    is_encoded,
    range_mismatch,
)
from dcp_storage.transports.retry import bounded_sync

__all__ = ["AzureTransport", "azure_list_names", "azure_read", "azure_read_range", "check_each_answer", "is_azure"]


_HOOKS = ("service_client", "split_path", "_strip_protocol", "loop")
_RANGE_HEADERS = ("x-ms-range", "Range")


def is_azure(fs: Any) -> bool:
    """Whether ``fs`` is adlfs's ``AzureBlobFileSystem`` (az://, abfs://) with the hooks used here."""
    return type(fs).__name__ == "AzureBlobFileSystem" and all(hasattr(fs, name) for name in _HOOKS)


def _asked(headers: Any) -> tuple[int, int] | None:
    """``[start, end)`` of a request's ``x-ms-range: bytes=FIRST-LAST`` (``None`` if it has none)."""
    for name in _RANGE_HEADERS:
        value = headers.get(name)
        if value and value.startswith("bytes="):
            first, sep, last = value[len("bytes=") :].partition("-")
            if sep and first.isdigit() and last.isdigit():
                return int(first), int(last) + 1
    return None


def check_each_answer(pipeline_response: Any, whole: bool = False) -> None:
    """``raw_response_hook``: a successful answer to a ranged request holds exactly the range it asked for.

    Error statuses are left to the SDK (404 becomes ``ResourceNotFoundError``, 5xx are retried or raised).
    A ``200`` is refused (the SDK cannot read one). In a ``whole`` download the SDK's first range runs past
    the end of a small blob and is answered shorter, so only the status is checked there.
    """
    response = pipeline_response.http_response
    if not 200 <= response.status_code < 300:
        return
    asked = _asked(pipeline_response.http_request.headers)
    if asked is None:
        return
    length = response.headers.get("Content-Length")
    size = int(length) if length else None
    encoding = response.headers.get("Content-Encoding")
    if is_encoded(encoding):  # the SDK hands on the encoded bytes as the blob's
        raise range_mismatch(*asked, describe_answer(response.status_code, None, size, encoding))
    if response.status_code == 200:  # the SDK takes the object's size from Content-Range: it cannot use a 200
        got = f"{describe_answer(200, None, size)}; the Azure SDK reads only 206 answers to its ranged requests"
        raise range_mismatch(*asked, got)
    if not whole:
        check_range_answer(*asked, response.status_code, response.headers.get("Content-Range"), size, encoding)


async def _download(
    fs: Any,
    path: str,
    start: int | None,
    end: int | None,
    etag: str | None = None,
    saw: Callable[[str | None], None] | None = None,
) -> tuple[bytes, int]:
    """The bytes, and the blob's whole size when they were served (from the answer's ``Content-Range``).

    With ``etag``, on condition ``If-Match`` (a ``412`` raises :class:`~.versions.VersionConditionFailed`);
    ``saw`` gets the blob's ETag before its body is read.
    """
    from azure.core import MatchConditions
    from azure.core.exceptions import ResourceModifiedError, ResourceNotFoundError  # adlfs depends on it

    whole = start is None or end is None
    condition: dict[str, Any] = {"etag": etag, "match_condition": MatchConditions.IfNotModified} if etag else {}
    container, blob, version_id = fs.split_path(fs._strip_protocol(path))
    async with fs.service_client.get_blob_client(container=container, blob=blob) as client:
        try:
            stream = await client.download_blob(
                offset=None if whole else start,
                length=None if whole else end - start,  # type: ignore[operator]
                version_id=version_id,
                max_concurrency=getattr(fs, "max_concurrency", None) or 1,
                raw_response_hook=functools.partial(check_each_answer, whole=whole),
                **condition,
                **getattr(fs, "_timeout_kwargs", {}),
            )
        except ResourceModifiedError as exc:
            raise VersionConditionFailed(f"{path}: ETag {etag} no longer matches") from exc
        except ResourceNotFoundError as exc:
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), path) from exc
        if saw is not None:
            saw(stream.properties.etag)
        return bytes(await stream.readall()), int(stream.properties.size)


async def _list_names(fs: Any, path: str, url: str) -> list[str]:
    from azure.core.exceptions import ResourceNotFoundError  # adlfs depends on it

    container, key, _version = fs.split_path(fs._strip_protocol(path))
    prefix = key.rstrip("/") + "/" if key else ""
    names: set[str] = set()
    bound = ListingBound(url)  # a listing that never ends is cut off (:mod:`.guards`)
    async with fs.service_client.get_container_client(container) as client:
        pages = client.walk_blobs(name_starts_with=prefix or None, delimiter="/").by_page()
        try:
            async for page in pages:
                count = 0
                async for item in page:
                    names.add(posixpath.basename(item.name[len(prefix) :].rstrip("/")))
                    count += 1
                bound.page(count, pages.continuation_token or None)
        except ResourceNotFoundError:  # no such container
            return []
    names.discard("")  # a zero-byte "directory marker" blob named like the prefix
    return sorted(names)


def azure_list_names(fs: Any, path: str, url: str | None = None) -> list[str]:
    """Names of the blobs and prefixes directly under ``path`` (sorted); empty if there are none.

    adlfs's ``ls`` walks every page the service hands out; this walks them one by one, counting pages,
    entries and tokens with :class:`~.guards.ListingBound`, so a listing that never ends is cut off by the
    same bound as on S3 and GCS, not only by the retry policy's deadline. ``url``: ``path`` as the user
    wrote it, for the error (``az://``; adlfs's own protocol is ``abfs://``)."""
    return bounded_sync(fs.loop, _list_names, fs, path, url or fs.unstrip_protocol(path))  # type: ignore[no-any-return]


def azure_read(fs: Any, path: str, max_bytes: int | None = None) -> bytes:
    """The whole blob at ``path`` (``.metadata``, an index file); a ``200`` the SDK cannot read is refused.

    With ``max_bytes``: the blob's size comes first, from its properties (not from a listing adlfs cached:
    the blob may have been rewritten since); a larger blob raises
    :class:`~dcp_storage.errors.FileTooLargeError` with none of it read. Then exactly that many bytes are
    read (an exact, checked range), so nothing unbounded is ever allocated; a blob rewritten in between
    (the answer names another size) raises a range mismatch, retried, never a prefix taken for the whole.
    """
    if max_bytes is None:
        return bounded_sync(fs.loop, _download, fs, path, None, None)[0]
    info = fs.info(path, refresh=True)
    if info.get("type") != "file" or info.get("size") is None:  # a prefix of other blobs: no blob by that name
        raise FileNotFoundError(errno.ENOENT, "no blob (a directory of other blobs)", path)
    size = int(info["size"])
    if size > max_bytes:
        raise FileTooLargeError(fs.unstrip_protocol(path), size, max_bytes)
    if size == 0:
        return b""
    data, now = bounded_sync(fs.loop, _download, fs, path, 0, size)
    if now != size:
        raise range_mismatch(0, size, f"bytes of a blob now {now} bytes long (rewritten while read)")
    return data


def azure_read_range(
    fs: Any,
    path: str,
    start: int,
    end: int,
    etag: str | None = None,
    saw: Callable[[str | None], None] | None = None,
) -> bytes:
    """Bytes ``[start, end)`` of the blob at ``path``; an answer with other bytes raises ``RangeMismatchError``.

    The caller checks the body's length. ``etag`` and ``saw``: the version pin (see :func:`_download`).
    """
    return bounded_sync(fs.loop, _download, fs, path, start, end, etag, saw)[0]


@builtin_backend
class AzureTransport(FsspecTransport):
    """Blobs in Azure Storage or azurite (``az://``, ``abfs://``, ``abfss://``)."""

    serves = staticmethod(is_azure)  # the filesystems this class is the transport of

    def _list_names(self, path: str) -> list[str]:
        return azure_list_names(self.fs, path, self.url(path))

    def _read_whole(self, path: str, max_bytes: int | None) -> bytes:
        return azure_read(self.fs, path, max_bytes)

    def _read_range(self, path: str, start: int, end: int) -> bytes:
        return azure_read_range(self.fs, path, start, end)

    def _read_range_version(
        self, path: str, start: int, end: int, expected: str | None, saw: Callable[[str | None], None]
    ) -> bytes:
        """On condition ``If-Match`` of the pinned ETag, and the blob's ETag compared (see :mod:`.versions`)."""
        return azure_read_range(self.fs, path, start, end, expected, saw)
