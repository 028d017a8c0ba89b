"""``ZstdSeekable``: a torch stream extension writing seekable (framed) zstandard.

Each item's bytes are cut into a small first frame of ``head_bytes`` (the ``torch.save`` record's header
lives there, so a reader parses it without decoding a whole frame), then frames of ``frame_bytes``
uncompressed bytes (the last one shorter), each compressed on its own (with its content size and checksum), and followed by a seek table
(:mod:`.seek_table`). The whole stream is valid zstd, so ``transform_from`` (torch's readers, and ours for
items read whole) simply decodes it; dcp-storage's reader also uses the
:class:`~dcp_storage.formats.dcp_native.records.SeekableTransform` methods to fetch and decode only the
frames covering the slice a rank needs.
"""

from __future__ import annotations

import io
import threading
from typing import IO, Any

import zstandard
from dcp_storage.plugin_api import Frame, FrameIndex, StreamTransformExtension

from dcp_storage_zstd.seek_table import (
    MAX_FRAME_BYTES,
    SeekTableError,
    ZstdFrame,
    encode_seek_table,
    parse_seek_table,
    table_bytes,
)

__all__ = ["DESCRIPTOR_VERSION", "REGISTRY_NAME", "ZstdSeekable"]

REGISTRY_NAME = "stream.zstd_seekable"
DESCRIPTOR_VERSION = "1"
DEFAULT_FRAME_BYTES = 1 << 20
DEFAULT_LEVEL = 3
DEFAULT_HEAD_BYTES = 4096
_STORED_BYTES_PER_ENTRY = 256 * 1024  # tail probe sizing, see tail_probe_bytes


class ZstdSeekable(StreamTransformExtension):
    """Seekable zstandard compression of DCP items (descriptor ``stream.zstd_seekable/1``).

    Args:
        level: zstd compression level (``zstandard`` accepts negative "fast" levels up to 22).
        head_bytes: uncompressed bytes of the first frame (0: no separate first frame). A ranged read decodes
            it to learn the tensor's dtype, shape and where its elements start; 4 KiB holds the header of a
            ``torch.save`` record of a plain tensor (about 0.7 KiB) and matches the reader's probe size.
        frame_bytes: uncompressed bytes per frame: the granularity of ranged reads (smaller frames: less
            read around a slice, slightly lower ratio and one more index entry per frame).
        checksums: write zstd content checksums (verified on decode) and record them in the seek table.

    Use ``FsspecWriter(url, extensions=[ZstdSeekable()])`` or torch's
    ``FileSystemWriter(path, _extensions=[ZstdSeekable()])``. Readers need no arguments: dcp-storage finds
    this class through the ``dcp_storage.extensions`` entry point; torch's ``FileSystemReader`` needs an
    ``ExtensionRegistry`` with ``register(ZstdSeekable)``.
    """

    def __init__(
        self,
        level: int = DEFAULT_LEVEL,
        frame_bytes: int = DEFAULT_FRAME_BYTES,
        head_bytes: int = DEFAULT_HEAD_BYTES,
        checksums: bool = True,
    ) -> None:
        super().__init__()
        if not 1 <= frame_bytes <= MAX_FRAME_BYTES:
            raise ValueError(f"frame_bytes must be in [1, {MAX_FRAME_BYTES}], got {frame_bytes}")
        if not 0 <= head_bytes <= MAX_FRAME_BYTES:
            raise ValueError(f"head_bytes must be in [0, {MAX_FRAME_BYTES}], got {head_bytes}")
        if not -(1 << 17) <= level <= zstandard.MAX_COMPRESSION_LEVEL:
            raise ValueError(f"level must be at most {zstandard.MAX_COMPRESSION_LEVEL}, got {level}")
        self.level = level
        self.frame_bytes = frame_bytes
        self.head_bytes = head_bytes
        self.checksums = checksums
        self._local = threading.local()

    def __repr__(self) -> str:
        return (
            f"ZstdSeekable(level={self.level}, frame_bytes={self.frame_bytes}, head_bytes={self.head_bytes}, "
            f"checksums={self.checksums})"
        )

    # ------------------------------------------------------------------------------- torch's Extension
    @staticmethod
    def registry_name() -> str:
        return REGISTRY_NAME

    @staticmethod
    def from_descriptor(version: str) -> ZstdSeekable:
        if version.partition(".")[0] != DESCRIPTOR_VERSION:
            raise ValueError(
                f"{REGISTRY_NAME} version {version!r} is newer than this dcp-storage-zstd reads "
                f"(version {DESCRIPTOR_VERSION}); upgrade dcp-storage-zstd"
            )
        return ZstdSeekable()

    def get_descriptor(self) -> str:
        return f"{REGISTRY_NAME}/{DESCRIPTOR_VERSION}"

    def transform_to(self, output: IO[bytes]) -> IO[bytes]:
        compressor = zstandard.ZstdCompressor(level=self.level, write_checksum=self.checksums, write_content_size=True)
        writer = _FramedWriter(output, compressor, self.frame_bytes, self.head_bytes, self.checksums)
        return writer  # type: ignore[return-value]

    def transform_from(self, input: IO[bytes]) -> IO[bytes]:
        data = memoryview(input.read()).cast("B")
        index = parse_seek_table(data, len(data))
        return _FramedReader(self, index, data)  # type: ignore[return-value]

    # --------------------------------------------------------------- dcp-storage's SeekableTransform
    def tail_probe_bytes(self, stored_length: int) -> int:
        # Room for one entry per 256 KiB stored (frames compress at most 4x here, or take a second round),
        # at least 256 entries: about 3 KiB, one read for items up to 64 MiB stored.
        return table_bytes(max(256, stored_length // _STORED_BYTES_PER_ENTRY), checksums=True)

    def read_frame_index(self, tail: memoryview, stored_length: int) -> FrameIndex:
        return parse_seek_table(tail, stored_length)

    def decode_frame(self, frame: Frame, data: memoryview, out: memoryview) -> None:
        if len(data) != frame.stored_length or len(out) != frame.raw_length:
            raise SeekTableError(
                f"frame {frame.index}: got {len(data)} stored bytes for {frame.stored_length} and room for "
                f"{len(out)} decoded bytes for {frame.raw_length}"
            )
        checksum = getattr(frame, "checksum", None)
        if checksum is not None and (len(data) < 4 or int.from_bytes(data[-4:], "little") != checksum):
            raise SeekTableError(f"frame {frame.index}: its content checksum does not match the seek table")
        reader = self._decompressor().stream_reader(data, read_across_frames=False)
        filled = 0
        while filled < len(out):
            got = reader.readinto(out[filled:])
            if not got:
                raise SeekTableError(f"frame {frame.index} decodes to {filled} bytes, the seek table says {len(out)}")
            filled += got
        if reader.read(1):  # also makes zstd consume (and verify) the frame's checksum
            raise SeekTableError(f"frame {frame.index} decodes to more than the {len(out)} bytes the seek table says")

    def _decompressor(self) -> zstandard.ZstdDecompressor:
        # One per thread: decode_frame runs in the transport's worker threads.
        dctx = getattr(self._local, "dctx", None)
        if dctx is None:
            dctx = self._local.dctx = zstandard.ZstdDecompressor()
        return dctx


class _FramedWriter(io.RawIOBase):
    """Buffers writes into frames (``head_bytes``, then ``frame_bytes`` each), compresses each, and appends the
    seek table on close."""

    def __init__(
        self, output: Any, compressor: zstandard.ZstdCompressor, frame_bytes: int, head_bytes: int, checksums: bool
    ) -> None:
        super().__init__()
        self.output = output
        self.compressor = compressor
        self.frame_bytes = frame_bytes
        self.head_bytes = head_bytes
        self.checksums = checksums
        self.pending = bytearray()
        self.entries: list[tuple[int, int, int | None]] = []

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        if self.closed:
            raise ValueError("write to a closed zstd-seekable stream")
        view = memoryview(b).cast("B")
        n = len(view)
        while len(view):
            size = self._next_frame_bytes()
            if self.pending or len(view) < size:
                take = min(len(view), size - len(self.pending))
                self.pending += view[:take]
                view = view[take:]
                if len(self.pending) == size:
                    self._emit(self.pending)
                    self.pending = bytearray()
            else:  # large writes (tensor storages) are compressed in place, without a copy
                self._emit(view[:size])
                view = view[size:]
        return n

    def _next_frame_bytes(self) -> int:
        return self.head_bytes if not self.entries and self.head_bytes else self.frame_bytes

    def _emit(self, raw: Any) -> None:
        frame = self.compressor.compress(raw)
        checksum = int.from_bytes(frame[-4:], "little") if self.checksums else None
        self.output.write(frame)
        self.entries.append((len(frame), len(raw), checksum))

    def close(self) -> None:
        if self.closed:
            return
        try:
            if self.pending:
                self._emit(self.pending)
                self.pending = bytearray()
            self.output.write(encode_seek_table(self.entries, self.checksums))
            self.output.flush()
            self.output.close()
        finally:
            super().close()


class _FramedReader(io.RawIOBase):
    """Decodes a whole seekable item frame by frame (``read()`` decodes straight into one buffer)."""

    def __init__(self, ext: ZstdSeekable, index: FrameIndex, data: memoryview) -> None:
        super().__init__()
        self.ext = ext
        self.index = index
        self.data = data
        self.pos = 0  # raw position
        self.current: tuple[ZstdFrame | Frame, bytearray] | None = None

    def readable(self) -> bool:
        return True

    def readall(self) -> bytes:
        out = bytearray(self.index.raw_size - self.pos)
        self.readinto(out)
        return out  # type: ignore[return-value]  # a bytearray, not a copy; callers use it as bytes

    def readinto(self, b: Any) -> int:
        view = memoryview(b).cast("B")
        written = 0
        while written < len(view) and self.pos < self.index.raw_size:
            (frame,) = self.index.covering(self.pos, self.pos + 1)
            inner = self.pos - frame.raw_start
            want = min(len(view) - written, frame.raw_end - self.pos)
            if inner == 0 and want == frame.raw_length:  # a whole frame fits: decode in place
                self._decode(frame, view[written : written + want])
            else:
                if self.current is None or self.current[0] is not frame:
                    buf = bytearray(frame.raw_length)
                    self._decode(frame, memoryview(buf))
                    self.current = (frame, buf)
                view[written : written + want] = self.current[1][inner : inner + want]
            written += want
            self.pos += want
        return written

    def _decode(self, frame: Frame, out: memoryview) -> None:
        self.ext.decode_frame(frame, self.data[frame.stored_start : frame.stored_end], out)
