"""Checks on what a store answers: ranges, versions pinned per load, bounded listings, no cross-origin redirects.

Pinning every object of a load to the version its first read saw, so a load never mixes two versions.

A checkpoint object is read in many ranged requests (a header, then slices, on several threads). If it is
replaced in between (a save with ``overwrite=True``, a sync job), the later requests return the new
object's bytes, and the load would silently assemble a tensor from two versions. So the transport keeps,
per load, the version of each object that its first read saw: the ``ETag`` (S3, HTTP, Azure) or the
``generation`` (GCS), taken from the answers it already gets (a ranged GET, ``HeadObject``, the GCS object
metadata), so pinning adds no request. Every later ranged read of that object sends the version as a
condition (S3 ``IfMatch``, HTTP ``If-Match``, Azure ``if_match``, GCS ``generation=``) and the version the
answer names is compared with the pin as well (this covers reads made concurrently before any pin, and
servers that ignore the condition). A mismatch, a ``412 Precondition Failed``, or a pinned GCS generation
that is gone raises :class:`~dcp_storage.errors.ObjectChangedError` naming the URL: never retried, since
retrying a range can only fetch the new version into a buffer half filled with the old one.

Where it sits: :meth:`FsspecTransport._pinned <dcp_storage.transports.FsspecTransport>` is the one place
every ranged read of the built-in backends passes through; backends only translate the wire (send the
condition, report the version seen, raise :class:`VersionConditionFailed` on a ``412``). The pins live as
long as one load: readers call ``begin_load()`` in ``reset`` (DCP calls it at the start of every load),
writes and deletes through the transport drop the pin of what they touch, and a whole-file read (which is
one consistent answer by itself) sets the pin anew rather than checking it, so a long-lived transport
that rereads a small file that legitimately changed between loads does not refuse it.

Bounds on a paged listing, so a store whose listing never ends cannot hold a load or a tool forever.

An S3 ``ListObjectsV2`` or ``ListMultipartUploads``, or a GCS object listing, goes on for as long as the
store hands out continuation tokens. A broken or hostile server that always answers "truncated, here is
the next token" would keep the caller listing, its memory growing with every page. So every paged listing
of the transports counts its pages and entries with a :class:`ListingBound` and stops with
:class:`~dcp_storage.errors.ListingTooLongError` naming the URL and the bound when it passes either, or at
once when the store hands back a token it gave before (a loop). The whole listing also runs under the
transport's :class:`~dcp_storage.transports.RetryPolicy` deadline (each page request is cancelled when it
passes, :mod:`.deadline`).

The bounds, read at each listing (so a process may change them before it lists):

* ``DCP_STORAGE_MAX_LIST_PAGES`` (default 1,000 pages): S3 and GCS answer up to 1,000 entries a page, so
  this is a million entries under one prefix, far more than a checkpoint directory or a run's steps hold;
* ``DCP_STORAGE_MAX_LIST_ENTRIES`` (default 1,000,000 entries kept): the memory bound when pages are large.

HTTP redirects to another origin are refused, so a checkpoint's credentials never leave for another host.

aiohttp (under fsspec's HTTP filesystem) follows redirects and, to another origin, drops only
``Authorization`` and cookies: an API-key header from ``storage_options`` (``headers={"X-Api-Key": ...}``)
goes along to whatever host the ``Location`` names, and that host's bytes are loaded as the checkpoint's.
So every HTTP session the transport uses gets a redirect hook (an aiohttp trace callback, run before the
redirect is followed) that compares the origins (scheme, host, port: another port is another origin):

* the same origin: followed as before (a server that moves files within itself keeps working);
* another origin: :class:`~dcp_storage.errors.CrossOriginRedirectError` naming both URLs (secrets masked),
  raised before any request goes there; not retried;
* another origin with the storage option ``cross_origin_redirects="follow-without-credentials"``: followed
  with only the request's own range and condition headers; every header from ``storage_options``
  (``Authorization``, ``X-Api-Key``, cookies, ...) is dropped first.

The hook is installed through fsspec's ``get_client`` option with a module-level function, so the
filesystem still pickles (a process-mode save or a rank process rebuilds it).

Checking that the answer to a ranged GET holds exactly the bytes asked for.

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

import functools
import re
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

from dcp_storage.errors import CorruptCheckpointError, CrossOriginRedirectError, ListingTooLongError, ObjectChangedError
from dcp_storage.runtime import count_setting
from dcp_storage.text import redact_urls
from dcp_storage.transports.retry import bounded_call

__all__ = [
    "check_object_checksum",
    "error_in_200",
    "IDENTITY",
    "ListingBound",
    "MAX_LIST_ENTRIES_ENV",
    "MAX_LIST_PAGES_ENV",
    "PinnedReads",
    "REDIRECT_OPTION",
    "RangeMismatchError",
    "VersionConditionFailed",
    "VersionPins",
    "begin_load",
    "check_range_answer",
    "describe_answer",
    "guarded_client",
    "http_redirect_options",
    "is_encoded",
    "raise_if_short",
    "range_mismatch",
    "read_range_body",
]


T = TypeVar("T")


class VersionConditionFailed(OSError):
    """Internal: the store refused a read conditioned on the pinned version (``412``, or GCS: the
    generation is gone). The transport turns it into :class:`~dcp_storage.errors.ObjectChangedError`."""


def begin_load(transport: object) -> None:
    """Start a new load on ``transport``: forget its pins (a transport without pins, e.g. a plugin's: nothing)."""
    begin = getattr(transport, "begin_load", None)
    if callable(begin):
        begin()


class VersionPins:
    """``path -> version`` seen first in this load; thread-safe by the atomicity of ``dict`` operations."""

    def __init__(self) -> None:
        self._seen: dict[str, str] = {}

    def expected(self, path: str) -> str | None:
        """The version pinned for ``path``, to send as the condition of the next read; ``None`` if none."""
        return self._seen.get(path)

    def saw(self, path: str, version: str | None, url: str) -> None:
        """Record the version an answer named; raise :class:`ObjectChangedError` if another one is pinned."""
        if not version:
            return  # the store names no version (a plain HTTP server, another fsspec filesystem)
        pinned = self._seen.setdefault(path, version)
        if pinned != version:
            self._seen.pop(path, None)  # the next load pins afresh
            raise ObjectChangedError(url, pinned, version)

    def repin(self, path: str, version: str | None) -> None:
        """Pin ``path`` to ``version`` (a whole-file read: one consistent answer by itself)."""
        if version:
            self._seen[path] = version
        else:
            self._seen.pop(path, None)

    def changed(self, path: str, url: str, seen: str | None = None) -> ObjectChangedError:
        """The error for a read the store refused under the pin (the pin is dropped)."""
        pinned = self._seen.pop(path, None)
        return ObjectChangedError(url, pinned or "?", seen)

    def forget(self, path: str | None = None) -> None:
        """Drop the pin of ``path`` (written or deleted through this transport), or every pin (a new load)."""
        if path is None:
            self._seen.clear()
        else:
            prefix = path.rstrip("/") + "/"
            for name in [p for p in self._seen if p == path or p.startswith(prefix)]:
                self._seen.pop(name, None)

    def __len__(self) -> int:
        return len(self._seen)


class PinnedReads:
    """The transport's side of pinning (mixed into :class:`~.fsspec_transport.FsspecTransport`): the one
    place reads meet their pins, and the per-backend hooks that report versions (defaults: none)."""

    versions: VersionPins

    if TYPE_CHECKING:  # provided by the transport

        def url(self, path: str) -> str: ...
        def _size(self, path: str) -> int: ...
        def _read_whole(self, path: str, max_bytes: int | None) -> bytes: ...
        def _read_range(self, path: str, start: int, end: int) -> bytes: ...

    def begin_load(self) -> None:
        """Forget the versions pinned so far: what a reader's ``reset`` calls at the start of each load."""
        self.versions.forget()

    def _pinned(self, path: str, read: Callable[[str | None, Callable[[str | None], None]], T]) -> T:
        """One read of ``path`` under its pinned version (:mod:`.versions`): the one place every ranged read of
        the built-in backends passes through. ``read(expected, saw)`` sends ``expected`` as the store's
        condition and calls ``saw(version)`` with the version the answer names as soon as its headers are in,
        before a byte of the body is used; another version than pinned, or a refused condition, raises
        :class:`~dcp_storage.errors.ObjectChangedError` (never retried)."""
        expected = self.versions.expected(path)
        url = self.url(path)
        try:
            return read(expected, lambda seen: self.versions.saw(path, seen, url))
        except VersionConditionFailed as exc:
            raise self.versions.changed(path, url) from exc

    def _size_version(self, path: str) -> tuple[int, str | None]:
        """The size and the version the answer named (``None`` where the store names none)."""
        return self._size(path), None

    def _read_whole_version(self, path: str, max_bytes: int | None) -> tuple[bytes, str | None]:
        """:meth:`_read_whole` and the version the answer named (``None`` where the store names none)."""
        return self._read_whole(path, max_bytes), None

    def _read_range_version(
        self, path: str, start: int, end: int, expected: str | None, saw: Callable[[str | None], None]
    ) -> bytes:
        """Bytes ``[start, end)`` read on condition of version ``expected`` (when not ``None``), calling
        ``saw(version)`` with the version the answer names before its body is used (see :meth:`_pinned`).
        Backends with versions override this; the default (any fsspec filesystem, or a subclass that
        overrides only ``_read_range``) names none."""
        return self._read_range(path, start, end)

    def _pinned_size(self, path: str) -> int:
        size, version = self._size_version(path)
        self.versions.saw(path, version, self.url(path))  # a size answer pins the version too, at no cost
        return size


MAX_LIST_PAGES_ENV = "DCP_STORAGE_MAX_LIST_PAGES"
MAX_LIST_ENTRIES_ENV = "DCP_STORAGE_MAX_LIST_ENTRIES"
DEFAULT_MAX_PAGES = 1_000
DEFAULT_MAX_ENTRIES = 1_000_000


class ListingBound:
    """Counts one listing's pages and entries; :meth:`page` raises once a bound is passed."""

    def __init__(self, url: str, what: str = "objects") -> None:
        self.url = url
        self.what = what
        self.max_pages = max(1, count_setting(MAX_LIST_PAGES_ENV, DEFAULT_MAX_PAGES, "pages"))
        self.max_entries = max(1, count_setting(MAX_LIST_ENTRIES_ENV, DEFAULT_MAX_ENTRIES, "entries"))
        self.pages = 0
        self.entries = 0
        self._tokens: set[str] = set()

    def page(self, entries: int, next_token: str | None) -> None:
        """Count a page of ``entries`` that the store says continues at ``next_token`` (``None``: the last)."""
        self.pages += 1
        self.entries += entries
        if self.entries > self.max_entries:
            raise self._error(f"more than {self.max_entries} entries", MAX_LIST_ENTRIES_ENV)
        if next_token is None:
            return
        if next_token in self._tokens:
            raise ListingTooLongError(
                f"{self.url}: the listing of {self.what} handed back a continuation token it gave before, after "
                f"{self.pages} pages: it would never end (a broken or hostile store?)"
            )
        self._tokens.add(next_token)
        if self.pages >= self.max_pages:
            raise self._error(f"{self.pages} pages and still not done", MAX_LIST_PAGES_ENV)

    def _error(self, passed: str, env: str) -> ListingTooLongError:
        limit = self.max_pages if env == MAX_LIST_PAGES_ENV else self.max_entries
        return ListingTooLongError(
            f"{self.url}: the listing of {self.what} passed its bound ({passed}; {env}={limit}); a store whose "
            f"listing does not end (broken or hostile?), or raise {env} for a prefix that really holds more"
        )


REDIRECT_OPTION = "cross_origin_redirects"  # storage option: "refuse" (the default) or FOLLOW
FOLLOW = "follow-without-credentials"
_CHOICES = ("refuse", FOLLOW)
# What a request of ours carries of its own; everything else came from storage_options and stays home.
_OWN_HEADERS = frozenset({"range", "accept-encoding", "if-match", "accept", "user-agent", "host"})


def http_redirect_options(url: str, options: dict[str, Any]) -> dict[str, Any]:
    """``options`` for fsspec's HTTP filesystem with the redirect hook; other schemes: the option removed."""
    options = dict(options)
    choice = options.pop(REDIRECT_OPTION, "refuse")
    if choice not in _CHOICES:
        raise ValueError(f"storage option {REDIRECT_OPTION}={choice!r}: expected one of {', '.join(_CHOICES)}")
    if url.split("://", 1)[0].lower() not in ("http", "https"):
        return options
    inner = options.get("get_client")
    options["get_client"] = functools.partial(guarded_client, inner=inner, follow=choice == FOLLOW)
    return options


async def guarded_client(
    inner: Callable[..., Awaitable[Any]] | None = None, follow: bool = False, **kwargs: Any
) -> Any:
    """fsspec's ``get_client``: ``inner(**kwargs)`` (or a plain ``aiohttp.ClientSession``) with the hook."""
    import aiohttp  # fsspec's HTTP filesystem needs it; imported only when an HTTP session is made

    trace = aiohttp.TraceConfig()
    trace.on_request_redirect.append(functools.partial(_on_redirect, follow=follow))
    kwargs["trace_configs"] = [*(kwargs.get("trace_configs") or []), trace]
    if inner is not None:
        return await inner(**kwargs)
    return aiohttp.ClientSession(**kwargs)


async def _on_redirect(_session: Any, _context: Any, params: Any, *, follow: bool) -> None:
    """Before aiohttp follows a redirect: same origin, go on; another origin, refuse (or strip, see module)."""
    from yarl import URL  # aiohttp's URL type

    here = URL(str(params.url))
    location = params.response.headers.get("Location") or params.response.headers.get("URI")
    if not location:
        return
    target = here.join(URL(location))
    if target.origin() == here.origin():
        return
    if follow:
        for name in [n for n in params.headers if n.lower() not in _OWN_HEADERS]:
            params.headers.popall(name, None)
        return
    raise CrossOriginRedirectError(
        f"{redact_urls(str(here))} redirected to another origin, {redact_urls(str(target))}: refused, so the "
        "checkpoint's credentials and headers are not sent there and its bytes are not loaded. Use the target URL "
        f"directly if you trust it, or pass storage option {REDIRECT_OPTION}={FOLLOW!r} to follow such redirects "
        "without any header from storage_options"
    )


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


def check_object_checksum(resp: Any, body: bytes) -> None:
    """Check a whole object's body against the ``x-amz-checksum-*`` its answer carries, as botocore does for the
    requests it sends with ``x-amz-checksum-mode`` (its default): the first algorithm in botocore's order that
    it can compute here and the answer names (a composite ``...-N`` multipart checksum is not checked)."""
    from botocore import httpchecksum
    from botocore.exceptions import FlexibleChecksumError

    usable = {"crc32": "Crc32Checksum", "sha1": "Sha1Checksum", "sha256": "Sha256Checksum", "sha512": "Sha512Checksum"}
    if getattr(httpchecksum, "HAS_CRT", False):
        usable.update(crc32c="CrtCrc32cChecksum", crc64nvme="CrtCrc64NvmeChecksum")
    for algorithm in ("crc64nvme", "crc32c", "crc32", "sha1", "sha256", "sha512"):
        expected = resp.getheader(f"x-amz-checksum-{algorithm}")
        cls = getattr(httpchecksum, usable.get(algorithm, ""), None)
        if expected is None or cls is None or "-" in expected:
            continue
        checksum = cls()
        checksum.update(body)
        if checksum.b64digest() != expected:
            raise FlexibleChecksumError(
                error_msg=f"Expected checksum {expected} did not match calculated checksum: {checksum.b64digest()}"
            )
        return


def error_in_200(body: bytes) -> bool:
    """Whether an S3 listing's 200 answer is an error (an ``<Error>`` document, or not XML: a body cut short), as
    botocore's ``before-parse`` handler for S3 judges it, which turns such an answer into a 500."""
    from xml.etree import ElementTree

    try:
        return bool(body) and ElementTree.fromstring(body).tag == "Error"
    except ElementTree.ParseError:
        return True
