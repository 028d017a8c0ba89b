"""An ``.npz`` archive read through a dcp-storage transport: members, ``.npy`` headers, byte ranges.

``numpy.savez`` writes a zip whose members are ``<key>.npy`` files, stored uncompressed: each member is a
short ``.npy`` header (dtype, shape, order) followed by the array's raw elements. So the whole format is a
scan (:func:`scan_npz`): the zip's end records and central directory (dcp-storage's zip index, which also
refuses archives whose entries overlap or whose local headers disagree with the directory), then every
member's local header and ``.npy`` header, in two batches of small ranged reads; no array byte is read.
The scan's :class:`~dcp_storage.plugin_api.RawTensor` rows are all :class:`~dcp_storage.plugin_api.RawTensorReader`
needs to load any slice of any array with ranged reads of exactly its bytes, under any read strategy.

Refused, with an error naming the file and the member: compressed members (``numpy.savez_compressed``:
no byte range of a deflate stream holds a slice), object arrays (they need pickle, which could run code),
dtypes torch lacks, and members whose header promises other than the bytes they hold.
"""

from __future__ import annotations

import ast
import math
import sys
from dataclasses import dataclass

import numpy as np
import torch

from dcp_storage.plugin_api import (
    CorruptCheckpointError,
    DcpStorageError,
    NotAZipError,
    RangeRequest,
    RawTensor,
    Transport,
    UnsafeCheckpointError,
    ZipIndex,
    data_starts,
    read_zip_index,
)

__all__ = ["NpzArchive", "NpzMember", "scan_npz", "torch_dtype"]

_STORED = 0  # zip compression method: none
_MAGIC = b"\x93NUMPY"
_PREFIX = 12  # magic (6), version (2), header length (2 in format 1.0, 4 in 2.0 and 3.0)
_FIRST_READ = 256  # .npy header bytes fetched on the first try (numpy pads its headers to 64 or 128)
_MAX_HEADER = 10_000  # numpy's own bound on a .npy header (numpy.lib.format.read_array_header_1_0)


def torch_dtype(dtype: np.dtype, where: str) -> torch.dtype:
    """The torch dtype of a numpy dtype (either byte order); our error for one torch has no dtype for."""
    if dtype.hasobject:
        raise UnsafeCheckpointError(where, "an object array", "it needs pickle to load; .npz arrays are read without")
    try:
        return torch.from_numpy(np.empty(0, dtype.newbyteorder("="))).dtype
    except TypeError as exc:
        raise CorruptCheckpointError(f"{where}: numpy dtype {dtype} has no torch dtype") from exc


@dataclass(frozen=True)
class NpzMember:
    """One array: its key, numpy dtype, shape, order, and the byte offset of its data in the file."""

    key: str
    member: str
    dtype: np.dtype
    shape: tuple[int, ...]
    fortran_order: bool
    data_offset: int

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    def raw(self, where: str) -> RawTensor:
        """Where its elements lie, for :class:`~dcp_storage.plugin_api.RawTensorReader`."""
        order = {">": "big", "<": "little"}.get(self.dtype.byteorder, sys.byteorder)
        stride = None
        if self.fortran_order and len(self.shape) > 1:
            stride = tuple(math.prod(self.shape[:d]) for d in range(len(self.shape)))
        return RawTensor(self.key, self.data_offset, torch_dtype(self.dtype, where), self.shape, "", order, stride)


class NpzArchive:
    """The members of one ``.npz`` file; raises our errors (naming the URL and member) for what is wrong."""

    def __init__(self, transport: Transport, path: str) -> None:
        self.transport, self.path, self.url = transport, path, transport.url(path)
        try:
            self.index: ZipIndex = read_zip_index(transport, path)
        except NotAZipError as exc:
            raise CorruptCheckpointError(f"{self.url}: not an .npz archive (no zip end record; truncated?)") from exc

    @property
    def size(self) -> int:
        return self.index.file_size

    def names(self) -> list[str]:
        """Member names, in the order of the zip's central directory (``numpy.savez``'s argument order)."""
        return list(self.index.entries)

    def where(self, name: str) -> str:
        return f"{self.url} (member {name!r})"

    def members(self) -> list[NpzMember]:
        """Every member, or the first member's error."""
        parsed = self.parse()
        for found in parsed.values():
            if isinstance(found, DcpStorageError):
                raise found
        return list(parsed.values())  # type: ignore[arg-type]

    def parse(self) -> dict[str, NpzMember | DcpStorageError]:
        """Every member, or the error that member raised (``verify`` reports one problem per member)."""
        out: dict[str, NpzMember | DcpStorageError] = {}
        good = []
        for name, entry in self.index.entries.items():
            if not name.endswith(".npy"):
                out[name] = CorruptCheckpointError(
                    f"{self.where(name)}: not a .npy array; an .npz archive holds only those"
                )
            elif entry.method != _STORED:
                out[name] = DcpStorageError(
                    f"{self.where(name)}: the member is compressed (numpy.savez_compressed), so no byte range of "
                    "the file holds a slice of the array; save it with numpy.savez (uncompressed) to load it here"
                )
            else:
                good.append(name)
        starts = data_starts(self.transport, self.index, good)  # the local headers, in one batch
        for name, head in self._headers(good, starts).items():
            try:
                if isinstance(head, DcpStorageError):
                    raise head
                out[name] = self._member(name, starts[name], head)
            except DcpStorageError as exc:
                out[name] = exc
        return {name: out[name] for name in self.index.entries}

    def _headers(self, names: list[str], starts: dict[str, int]) -> dict[str, bytes | DcpStorageError]:
        """Each member's ``.npy`` header bytes (magic to the end of the header dict), in at most two batches."""
        sizes = {n: self.index.entries[n].size for n in names}
        first = [RangeRequest(self.path, starts[n], starts[n] + min(sizes[n], _FIRST_READ)) for n in names]
        heads = {n: bytes(b) for n, b in zip(names, self.transport.read_ranges(first))}  # type: ignore[arg-type]
        out: dict[str, bytes | DcpStorageError] = {}
        need: dict[str, int] = {}
        for n in names:
            try:
                need[n] = self._header_end(n, heads[n])
            except DcpStorageError as exc:
                out[n] = exc
        more = [n for n in need if need[n] > len(heads[n])]
        rest = [RangeRequest(self.path, starts[n] + len(heads[n]), starts[n] + need[n]) for n in more]
        for n, b in zip(more, self.transport.read_ranges(rest) if rest else []):
            heads[n] += bytes(b)  # type: ignore[arg-type]
        out.update({n: heads[n][: need[n]] for n in need})
        return out

    def _header_end(self, name: str, head: bytes) -> int:
        """Where the ``.npy`` header that ``head`` starts with ends (bounded by the member's size)."""
        where, size = self.where(name), self.index.entries[name].size
        if len(head) < _PREFIX or not head.startswith(_MAGIC):
            raise CorruptCheckpointError(f"{where}: not a .npy array (no .npy magic; {size} bytes)")
        major = head[6]
        if major not in (1, 2, 3):
            raise CorruptCheckpointError(f"{where}: .npy format version {major}.{head[7]} is not one numpy writes")
        width = 2 if major == 1 else 4
        end = 8 + width + int.from_bytes(head[8 : 8 + width], "little")
        if end - 8 - width > _MAX_HEADER or end > size:
            raise CorruptCheckpointError(
                f"{where}: its .npy header claims {end - 8 - width} bytes, but the member holds {size} "
                "(truncated or corrupt)"
            )
        return end

    def _member(self, name: str, start: int, head: bytes) -> NpzMember:
        where = self.where(name)
        width = 2 if head[6] == 1 else 4
        try:
            text = head[8 + width :].decode("latin1" if head[6] < 3 else "utf-8")
            header = ast.literal_eval(text)  # a dict of literals: numpy's own parser (safe_eval) does the same
            dtype = np.lib.format.descr_to_dtype(header["descr"])
            shape, fortran = tuple(header["shape"]), header["fortran_order"]
        except (ValueError, SyntaxError, TypeError, KeyError, UnicodeDecodeError, MemoryError, RecursionError) as exc:
            raise CorruptCheckpointError(f"{where}: unreadable .npy header: {exc}") from exc
        if not all(isinstance(n, int) and n >= 0 for n in shape) or not isinstance(fortran, bool):
            raise CorruptCheckpointError(f"{where}: unreadable .npy header: shape {shape!r}, order {fortran!r}")
        torch_dtype(dtype, where)  # refuses object arrays and dtypes torch lacks
        member = NpzMember(name[: -len(".npy")], name, dtype, shape, fortran, start + len(head))
        held = self.index.entries[name].size - len(head)
        if held != member.nbytes:
            raise CorruptCheckpointError(
                f"{where}: holds {held} data bytes, but its header says {member.nbytes} ({dtype}, shape "
                f"{list(shape)}): the member is truncated or its header is wrong"
            )
        return member

    def data_range(self, name: str) -> tuple[int, int]:
        """``[start, end)`` of a member's stored bytes (header and data), for the CRC check."""
        start = data_starts(self.transport, self.index, [name])[name]
        return start, start + self.index.entries[name].compressed_size


def scan_npz(transport: Transport, path: str) -> list[RawTensor]:
    """The format's scan: where every array of the ``.npz`` at ``path`` lies (its headers only are read)."""
    archive = NpzArchive(transport, path)
    return [m.raw(archive.where(m.member)) for m in archive.members()]
