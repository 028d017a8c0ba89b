"""The Azure Blob transport (adlfs): reads whose every answer is checked against the range it asked for.

adlfs's reads go through the Azure SDK, which hides the status and ``Content-Range`` of the answers; the
reads here make the same download on adlfs's client with a check of each answer (:mod:`.azure_io`), and
refuse a ``200`` to a ranged request. Everything else is adlfs's: queries, a create-if-absent upload with
``If-None-Match: *``, and writes of staged blocks committed as one block list at close (never committed
on error: uncommitted blocks are invisible, and the service drops them). The URL scheme the user wrote
(``az``, ``abfs`` or ``abfss``) is the one errors name.
"""

from __future__ import annotations

from collections.abc import Callable

from dcp_storage.transports.azure_io import azure_read, azure_read_range, is_azure
from dcp_storage.transports.backends import builtin_backend
from dcp_storage.transports.fsspec_transport import FsspecTransport

__all__ = ["AzureTransport"]


@builtin_backend
class AzureTransport(FsspecTransport):
    """Blobs in Azure Storage or azurite (``az://``, ``abfs://``, ``abfss://``)."""

    serves = staticmethod(is_azure)  # the filesystems this class is the transport of

    def _read_whole(self, path: str, max_bytes: int | None) -> bytes:
        return azure_read(self.fs, path, max_bytes)

    def _read_range(self, path: str, start: int, end: int) -> bytes:
        return azure_read_range(self.fs, path, start, end)

    def _read_range_version(
        self, path: str, start: int, end: int, expected: str | None, saw: Callable[[str | None], None]
    ) -> bytes:
        """On condition ``If-Match`` of the pinned ETag, and the blob's ETag compared (see :mod:`.versions`)."""
        return azure_read_range(self.fs, path, start, end, expected, saw)
