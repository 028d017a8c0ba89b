"""``verify --deep`` of a DCP checkpoint without usable checksums: the zip CRC-32 of every record.

Each tensor record of a ``.distcp`` file is a ``torch.save`` zip, whose central directory records the CRC-32
of every entry. A checkpoint that torch's writer saved (no manifest), or whose manifest is stale, is still
checked bit for bit where it stores tensors: each record's zip index is read through a window onto its
byte range (:class:`_Window`), and every stored entry is hashed in pieces of bounded size, so memory stays
bounded whatever the record size. Records that are not zips (``BYTE_IO`` items, records written through
a stream extension) carry no CRC and are counted apart.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from dcp_storage.errors import DcpStorageError
from dcp_storage.formats.torch_save.zip_index import STORED, data_starts, read_zip_index
from dcp_storage.integrity.checksums import crc32
from dcp_storage.integrity.read_verify import key_name
from dcp_storage.transports import RangeRequest

__all__ = ["check_record_crcs"]

_PIECE = 8 * 1024 * 1024
_ZIP = b"PK\x03\x04"


class _Window:
    """The byte range ``[offset, offset + length)`` of one file, as the transport of a file of its own."""

    def __init__(self, transport: Any, path: str, offset: int, length: int) -> None:
        self._t, self._path, self._offset, self._length = transport, path, offset, length

    def url(self, _path: str) -> str:
        return f"{self._t.url(self._path)} [{self._offset}, {self._offset + self._length})"

    def size(self, _path: str) -> int:
        return self._length

    def read_range(self, _path: str, lo: int, hi: int) -> Any:
        return self._t.read_range(self._path, self._offset + lo, self._offset + min(hi, self._length))

    def read_ranges(self, reqs: list[RangeRequest]) -> list[Any]:
        return [self.read_range(r.path, r.start, r.end) for r in reqs]


def check_record_crcs(
    transport: Any, root: str, storage: dict[Any, Any], problems: list[str], seen: Callable[[str, int, int], bool]
) -> tuple[int, int]:
    """Check the CRC-32 of every zip entry of every record; ``(records checked, records without a CRC)``.

    A problem names the file, the record's byte range, the keys it holds and the entry; ``seen(url, lo,
    hi)`` tells a record already reported (the deep read of its tensor failed) from a new one.
    """
    keys: dict[tuple[str, int, int, tuple[str, ...]], list[str]] = {}
    for index, info in storage.items():
        transforms = tuple(getattr(info, "transform_descriptors", None) or ())
        keys.setdefault((info.relative_path, int(info.offset), int(info.length), transforms), []).append(
            key_name(index)
        )
    checked = skipped = 0
    for (name, offset, length, transforms), held in sorted(keys.items()):
        path = transport.join(root, name)
        url = transport.url(path)
        if transforms or length < 4 or bytes(transport.read_range(path, offset, offset + 4)) != _ZIP:
            skipped += 1
            continue
        window = _Window(transport, path, offset, length)
        try:
            index = read_zip_index(window, name)  # type: ignore[arg-type]
            entries = [n for n, e in index.entries.items() if e.method == STORED]
            starts = data_starts(window, index, entries)  # type: ignore[arg-type]
        except DcpStorageError as exc:
            if not seen(url, offset, offset + length):
                problems.append(f"{exc} (holding {', '.join(held[:5])})")
            continue
        checked += 1
        for entry_name in entries:
            entry, start, value = index.entries[entry_name], starts[entry_name], 0
            for lo in range(start, start + entry.compressed_size, _PIECE):
                value = crc32(window.read_range(name, lo, min(lo + _PIECE, start + entry.compressed_size)), value)
            if value != entry.crc32 and not seen(url, offset, offset + length):
                problems.append(
                    f"{url} [{offset}, {offset + length}) (holding {', '.join(held[:5])}): zip entry {entry_name!r} "
                    f"fails its CRC-32 (recorded {entry.crc32:08x}): the bytes changed after they were written; "
                    "restore the file from a good copy or re-save the checkpoint"
                )
    return checked, skipped
