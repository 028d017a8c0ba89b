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

from ..errors import ObjectChangedError

__all__ = ["VersionConditionFailed", "VersionPins", "begin_load"]


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
