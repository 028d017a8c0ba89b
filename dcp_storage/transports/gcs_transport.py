"""The GCS transport (gcsfs): JSON-API requests one attempt each, under our retries (see :mod:`.gcs_io`).

Ranged reads check the answer's status and ``Content-Range`` before reading the body. Writes are one
media upload at close, sent from memory or a local spill file and retried as a whole, and never sent on
error; create-if-absent is an upload with ``ifGenerationMatch=0``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from dcp_storage.transports.backends import builtin_backend
from dcp_storage.transports.fsspec_transport import FsspecTransport
from dcp_storage.transports.gcs_io import (
    GcsAtomicUpload,
    gcs_create,
    gcs_delete,
    gcs_exists,
    gcs_list_names,
    gcs_put,
    gcs_read,
    gcs_read_range,
    gcs_size,
    gcs_size_version,
    is_gcs,
)
from dcp_storage.transports.writers import CountingWriter

__all__ = ["GcsTransport"]


@builtin_backend
class GcsTransport(FsspecTransport):
    """Objects in Google Cloud Storage or fake-gcs-server (``gs://``, ``gcs://``)."""

    serves = staticmethod(is_gcs)  # the filesystems this class is the transport of

    def _exists(self, path: str) -> bool:
        return gcs_exists(self.fs, path)

    def _size(self, path: str) -> int:
        return gcs_size(self.fs, path)

    def _delete(self, path: str) -> None:
        gcs_delete(self.fs, path)

    def _list_names(self, path: str) -> list[str]:
        return gcs_list_names(self.fs, path)

    def _read_whole(self, path: str, max_bytes: int | None) -> bytes:
        return gcs_read(self.fs, path, max_bytes)

    def _size_version(self, path: str) -> tuple[int, str | None]:
        return gcs_size_version(self.fs, path)

    def _read_range(self, path: str, start: int, end: int) -> bytes:
        return gcs_read_range(self.fs, path, start, end)

    def _read_range_version(
        self, path: str, start: int, end: int, expected: str | None, saw: Callable[[str | None], None]
    ) -> bytes:
        """Reads the pinned generation (``generation=``), and reports the answer's (see :mod:`.versions`)."""
        return gcs_read_range(self.fs, path, start, end, expected, saw)

    def _put(self, path: str, data: bytes, nbytes: int) -> None:
        gcs_put(self.fs, path, data, nbytes)

    def _put_if_absent(self, path: str, data: bytes) -> None:
        gcs_create(self.fs, path, data)

    def _open_atomic(self, path: str) -> Iterator[CountingWriter]:
        """One media upload at close, retried as a whole (see :mod:`.gcs_io`); nothing sent on error."""
        upload = GcsAtomicUpload(self.fs, path, self.config.part_size, self._runner(path))
        writer = CountingWriter(upload, self.counters)  # type: ignore[arg-type]
        try:
            yield writer
            upload.commit()
        finally:
            upload.abandon()
            self.counters.add(requests=upload.requests)
