"""An ``.npz`` archive read through a dcp-storage transport: members, ``.npy`` headers, byte ranges.

``numpy.savez`` writes a zip whose members are ``<key>.npy`` files. The zip's central directory and each
member's ``.npy`` header say every array's key, dtype, shape and (for stored members) where its bytes
lie, so metadata costs a few small ranged reads. Arrays are decoded by ``numpy.load(allow_pickle=False)``:
an object array (which needs pickle, and so could run code) is refused, never loaded.
"""

from __future__ import annotations

import io
import math
import struct
import zipfile
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from dcp_storage.plugin_api import CorruptCheckpointError, Transport, UnsafeCheckpointError

__all__ = ["NpzArchive", "NpzMember", "TransportFile", "torch_dtype"]

_LOCAL_HEADER = 30  # fixed part of a zip local file header
_NPY_PREFIX = 12  # magic (6), version (2), header length (2 in format 1.0, 4 in 2.0 and 3.0)


class TransportFile(io.RawIOBase):
    """A read-only, seekable file over ``transport.read_range``: zipfile and numpy read only what they need."""

    def __init__(self, transport: Transport, path: str) -> None:
        super().__init__()
        self.transport, self.path = transport, path
        self.length = transport.size(path)
        self.pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.length}[whence]
        self.pos = max(0, base + offset)
        return self.pos

    def readinto(self, buffer: Any) -> int:
        n = max(0, min(len(buffer), self.length - self.pos))
        if n:
            memoryview(buffer).cast("B")[:n] = self.transport.read_range(self.path, self.pos, self.pos + n)
            self.pos += n
        return n


def torch_dtype(dtype: np.dtype, where: str) -> torch.dtype:
    """The torch dtype of a (native byte order) numpy dtype; our error for one torch has no dtype for."""
    if dtype.hasobject:
        raise UnsafeCheckpointError(where, "an object array", "it needs pickle to load; .npz arrays are read without")
    try:
        return torch.from_numpy(np.empty(0, dtype.newbyteorder("="))).dtype
    except TypeError as exc:
        raise CorruptCheckpointError(f"{where}: numpy dtype {dtype} has no torch dtype") from exc


@dataclass(frozen=True)
class NpzMember:
    """One array: its key, numpy dtype, shape, and the byte range of its data (``None``: compressed)."""

    key: str
    member: str
    dtype: np.dtype
    shape: tuple[int, ...]
    data_offset: int | None

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


class NpzArchive:
    """The members of one ``.npz`` file; raises our errors (naming the URL and member) for what is wrong."""

    def __init__(self, transport: Transport, path: str) -> None:
        self.transport, self.path, self.url = transport, path, transport.url(path)
        self.file = TransportFile(transport, path)
        try:
            self.zip = zipfile.ZipFile(self.file)
        except (zipfile.BadZipFile, OSError, ValueError) as exc:
            raise CorruptCheckpointError(f"{self.url}: not a readable .npz (zip) archive: {exc}") from exc

    @property
    def size(self) -> int:
        return self.file.length

    def members(self) -> list[NpzMember]:
        return [self.member(info) for info in self.zip.infolist()]

    def member(self, info: zipfile.ZipInfo) -> NpzMember:
        where = f"{self.url} (member {info.filename!r})"
        if not info.filename.endswith(".npy"):
            raise CorruptCheckpointError(f"{where}: not a .npy array; an .npz archive holds only those")
        data_offset = None
        try:
            if info.compress_type == zipfile.ZIP_STORED:  # the header alone, by ranges: no array byte is read
                start = self._member_start(info)
                stream: Any = io.BytesIO(self._read(start, start + min(info.file_size, _NPY_PREFIX)))
                version = np.lib.format.read_magic(stream)
                size_bytes = 2 if version == (1, 0) else 4
                header_len = int.from_bytes(stream.read(size_bytes), "little")
                stream = io.BytesIO(self._read(start, start + min(info.file_size, 8 + size_bytes + header_len)))
            else:  # compressed (numpy.savez_compressed): the header is the start of the inflated stream
                stream = self.zip.open(info)
            with stream:
                version = np.lib.format.read_magic(stream)
                read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
                shape, _fortran, dtype = read(stream)
                header_bytes = stream.tell()
        except (ValueError, zipfile.BadZipFile, OSError, EOFError) as exc:
            raise CorruptCheckpointError(f"{where}: unreadable .npy header: {exc}") from exc
        torch_dtype(dtype, where)  # refuses object arrays and dtypes torch lacks
        nbytes = math.prod(shape) * dtype.itemsize
        if info.compress_type == zipfile.ZIP_STORED:
            data_offset = start + header_bytes
            if info.file_size != header_bytes + nbytes:
                raise CorruptCheckpointError(
                    f"{where}: holds {info.file_size - header_bytes} data bytes, but its header says "
                    f"{nbytes} ({dtype}, shape {list(shape)})"
                )
        return NpzMember(info.filename[: -len(".npy")], info.filename, dtype, tuple(shape), data_offset)

    def _read(self, start: int, end: int) -> bytes:
        if end > self.size:
            raise CorruptCheckpointError(
                f"{self.url}: ends at byte {self.size}, before byte {end} its zip directory names"
            )
        return bytes(self.transport.read_range(self.path, start, end))

    def _member_start(self, info: zipfile.ZipInfo) -> int:
        """Where a member's bytes begin: after its local header, whose extra field may differ from the
        central directory's."""
        head = self._read(info.header_offset, info.header_offset + _LOCAL_HEADER)
        if not head.startswith(b"PK\x03\x04"):
            raise CorruptCheckpointError(f"{self.url}: no local header for member {info.filename!r}")
        name_len, extra_len = struct.unpack_from("<HH", head, 26)
        return info.header_offset + _LOCAL_HEADER + name_len + extra_len

    def load(self, key: str) -> torch.Tensor:
        """One array, decoded by ``numpy.load(allow_pickle=False)``, as a tensor in native byte order."""
        where = f"{self.url} (member {key + '.npy'!r})"
        try:
            self.file.seek(0)  # numpy reads the zip magic where the file stands
            with np.load(self.file, allow_pickle=False) as npz:
                array = npz[key]
        except (ValueError, zipfile.BadZipFile, OSError, EOFError, KeyError) as exc:
            raise CorruptCheckpointError(f"{where}: {type(exc).__name__}: {exc}") from exc
        torch_dtype(array.dtype, where)
        native = array.astype(array.dtype.newbyteorder("="), order="C", copy=False)  # keeps 0-d arrays 0-d
        return torch.from_numpy(native)

    def close(self) -> None:
        self.zip.close()
