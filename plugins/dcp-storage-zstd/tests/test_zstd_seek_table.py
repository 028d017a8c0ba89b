"""The stored format: zstd seekable frames + seek table, as written by ``ZstdSeekable.transform_to``."""

from __future__ import annotations

import dataclasses
import io
import struct

import pytest
import zstandard
from dcp_storage.plugin_api import NeedMoreTail, SeekableTransform

from dcp_storage_zstd import SeekTableError, ZstdSeekable
from dcp_storage_zstd.seek_table import encode_seek_table, parse_seek_table


class _Sink(io.RawIOBase):
    """A file the transform writes into; records whether the chain closed it."""

    def __init__(self) -> None:
        super().__init__()
        self.buf = io.BytesIO()
        self.was_closed = False

    def writable(self) -> bool:
        return True

    def write(self, b: object) -> int:
        return self.buf.write(b)  # type: ignore[arg-type]

    def close(self) -> None:
        self.was_closed = True
        super().close()


def encode(data: bytes, writes: list[int] | None = None, **kwargs: object) -> bytes:
    """``data`` through ``ZstdSeekable(**kwargs).transform_to``, written in pieces of the given sizes."""
    sink = _Sink()
    out = ZstdSeekable(**kwargs).transform_to(sink)  # type: ignore[arg-type]
    pos = 0
    for n in writes or [len(data)]:
        out.write(data[pos : pos + n])
        pos += n
    out.write(data[pos:])
    out.close()
    assert sink.was_closed
    return sink.buf.getvalue()


def sample(n: int, seed: int = 0) -> bytes:
    """Half-compressible bytes: a repeating pattern with noise."""
    import random

    rng = random.Random(seed)
    return bytes((i % 7) * 3 if i % 3 else rng.randrange(256) for i in range(n))


@pytest.mark.parametrize("head", [4096, 0])
@pytest.mark.parametrize("writes", [None, [1, 2, 4093, 70000, 3], [4096, 65536, 65536]])
def test_fixed_frames_and_table(writes: list[int] | None, head: int) -> None:
    data = sample(300_000)
    stored = encode(data, writes, frame_bytes=65536, head_bytes=head)
    index = parse_seek_table(stored, len(stored))
    body = 300_000 - head
    assert [f.raw_length for f in index.frames] == [head] * bool(head) + [65536] * (body // 65536) + [body % 65536]
    assert index.raw_size == len(data)
    for frame in index.frames:  # every frame decodes alone to its slice of the input
        piece = zstandard.ZstdDecompressor().decompress(stored[frame.stored_start : frame.stored_end])
        assert piece == data[frame.raw_start : frame.raw_end]
        assert frame.checksum == int.from_bytes(stored[frame.stored_end - 4 : frame.stored_end], "little")


def test_any_zstd_decoder_reads_the_whole_stream() -> None:
    """The seek table is a skippable frame: plain zstd decodes the item as the concatenation of frames."""
    data = sample(200_000, seed=1)
    stored = encode(data, frame_bytes=50_000)
    reader = zstandard.ZstdDecompressor().stream_reader(stored, read_across_frames=True)
    assert reader.read() == data


def test_transform_from_round_trip_and_partial_reads() -> None:
    data = sample(123_457, seed=2)
    ext = ZstdSeekable(frame_bytes=10_000, level=1)
    stored = encode(data, frame_bytes=10_000, level=1)
    assert ext.transform_from(io.BytesIO(stored)).read() == data
    stream = ext.transform_from(io.BytesIO(stored))
    got = b"".join(iter(lambda: stream.read(7_777), b""))  # reads that straddle frame boundaries
    assert got == data


@pytest.mark.parametrize("checksums", [True, False])
def test_empty_item(checksums: bool) -> None:
    stored = encode(b"", checksums=checksums)
    index = parse_seek_table(stored, len(stored))
    assert len(index) == 0 and index.raw_size == 0
    assert ZstdSeekable().transform_from(io.BytesIO(stored)).read() == b""


def test_table_without_checksums() -> None:
    data = sample(40_000)
    stored = encode(data, frame_bytes=16384, checksums=False)
    index = parse_seek_table(stored, len(stored))
    assert stored[-5] == 0  # descriptor byte: no checksum flag
    assert all(f.checksum is None for f in index.frames)
    assert ZstdSeekable().transform_from(io.BytesIO(stored)).read() == data


def test_short_tail_asks_for_exactly_the_table() -> None:
    stored = encode(sample(100_000), frame_bytes=1000)
    index = parse_seek_table(stored, len(stored))
    with pytest.raises(NeedMoreTail) as info:
        parse_seek_table(stored[-100:], len(stored))
    assert info.value.needed == 8 + 12 * len(index) + 9
    again = parse_seek_table(stored[-info.value.needed :], len(stored))
    assert again.frames == index.frames


def test_protocol_and_tail_probe() -> None:
    ext = ZstdSeekable()
    assert isinstance(ext, SeekableTransform)
    assert 3000 < ext.tail_probe_bytes(10_000) < 4096
    assert ext.tail_probe_bytes(1 << 30) == 8 + 12 * 4096 + 9  # one entry per 256 KiB stored


@pytest.mark.parametrize(
    ("damage", "match"),
    [
        (lambda b: b[:-4] + b"\x00\x00\x00\x00", "seekable magic"),
        (lambda b: b[:-5] + b"\x04" + b[-4:], "reserved bits"),
        (lambda b: b[:-9] + struct.pack("<I", 1 << 20) + b[-5:], "longer than"),
        (lambda b: b"junk" + b, "but the item has"),
    ],
)
def test_damaged_tables_are_refused(damage: object, match: str) -> None:
    stored = damage(encode(sample(50_000), frame_bytes=8192))  # type: ignore[operator]
    with pytest.raises(SeekTableError, match=match):
        parse_seek_table(stored, len(stored))


def test_decode_frame_refuses_damage() -> None:
    data = sample(64 * 1024)
    ext = ZstdSeekable(frame_bytes=32 * 1024)
    stored = bytearray(encode(data, frame_bytes=32 * 1024))
    index = parse_seek_table(bytes(stored), len(stored))
    frame = index.frames[1]
    out = memoryview(bytearray(frame.raw_length))
    ext.decode_frame(frame, memoryview(stored)[frame.stored_start : frame.stored_end], out)
    assert bytes(out) == data[frame.raw_start : frame.raw_end]
    stored[frame.stored_start + frame.stored_length // 2] ^= 0xFF  # payload: zstd's checksum catches it
    with pytest.raises(zstandard.ZstdError):
        ext.decode_frame(frame, memoryview(stored)[frame.stored_start : frame.stored_end], out)
    other = dataclasses.replace(index.frames[0], checksum=index.frames[0].checksum ^ 1)  # type: ignore[operator]
    with pytest.raises(SeekTableError, match="checksum does not match"):  # the table disagrees with the frame
        ext.decode_frame(other, memoryview(stored)[other.stored_start : other.stored_end], out[: other.raw_length])


def test_seek_table_encoding_is_the_reference_layout() -> None:
    table = encode_seek_table([(10, 20, 0xDEADBEEF), (5, 7, 1)], checksums=True)
    assert table == (
        struct.pack("<II", 0x184D2A5E, 2 * 12 + 9)
        + struct.pack("<III", 10, 20, 0xDEADBEEF)
        + struct.pack("<III", 5, 7, 1)
        + struct.pack("<IBI", 2, 0x80, 0x8F92EAB1)
    )


def test_invalid_settings() -> None:
    with pytest.raises(ValueError, match="frame_bytes"):
        ZstdSeekable(frame_bytes=0)
    with pytest.raises(ValueError, match="level"):
        ZstdSeekable(level=99)
    with pytest.raises(ValueError, match="upgrade dcp-storage-zstd"):
        ZstdSeekable.from_descriptor("2")
    assert ZstdSeekable.from_descriptor("1").get_descriptor() == "stream.zstd_seekable/1"
