"""Bodies of the :data:`~.rules.BODY_FAULT_MODES`: a ``206`` head kept, its body replaced."""

from __future__ import annotations

import struct
import zlib

from dcp_storage_testing.fault_proxy.rules import FaultMode
from dcp_storage_testing.fault_proxy.wire import Head

__all__ = ["LONG_PAD", "rewritten"]

LONG_PAD = 16  # zero bytes ``long_range`` puts before the range's bytes
_GZIP_FIXED = 10 + 1 + 8  # header, the comment's terminating NUL, trailer (CRC32, ISIZE)


def _gzip(payload: bytes, total: int | None) -> bytes:
    """A gzip member of ``payload``; with ``total``, padded with a comment (FCOMMENT) to exactly that length
    if it fits (else unpadded)."""
    deflate = zlib.compressobj(9, zlib.DEFLATED, -zlib.MAX_WBITS)
    data = deflate.compress(payload) + deflate.flush()
    trailer = struct.pack("<II", zlib.crc32(payload), len(payload) & 0xFFFFFFFF)
    pad = 0 if total is None else total - _GZIP_FIXED - len(data)
    if pad < 0:
        pad = 0
    header = b"\x1f\x8b\x08\x10\x00\x00\x00\x00\x00\xff"  # deflate, FCOMMENT, no mtime, unknown OS
    return header + b"x" * pad + b"\x00" + data + trailer


def rewritten(mode: FaultMode, response: Head, body: bytes) -> tuple[Head, bytes]:
    """The head and body a ``206`` answer with ``body`` becomes in ``mode``."""
    head = response.with_header("Transfer-Encoding", None)
    if mode == "encoded_range":
        encoded = _gzip(bytes(len(body)), len(body))
        head = head.with_header("Content-Encoding", "gzip").with_header("Content-Length", str(len(encoded)))
        return head, encoded
    if mode == "long_range":
        longer = bytes(LONG_PAD) + body
        chunked = b"%x\r\n%s\r\n0\r\n\r\n" % (len(longer), longer)
        return head.with_header("Content-Length", None).with_header("Transfer-Encoding", "chunked"), chunked
    if mode == "flip_body":  # same length, same headers: one bit of the middle byte flipped
        flipped = bytearray(body)
        if flipped:
            flipped[len(flipped) // 2] ^= 0x01
        return head.with_header("Content-Length", str(len(flipped))), bytes(flipped)
    raise ValueError(f"not a body fault mode: {mode!r}")
