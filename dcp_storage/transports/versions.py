"""Pinning every object of a load to the version its first read saw, so a load never mixes two versions.

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
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

from dcp_storage.errors import ObjectChangedError

__all__ = ["PinnedReads", "VersionConditionFailed", "VersionPins", "begin_load"]

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
