"""HTTP/1.1 on the wire, as the proxy needs it: message heads, bodies relayed as raw bytes, resets."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

__all__ = ["CHUNK", "MAX_HEAD", "Head", "read_head", "relay_body", "reset", "response_has_body"]

CHUNK = 64 * 1024
MAX_HEAD = 64 * 1024


@dataclass
class Head:
    """A parsed HTTP/1.x message head; ``raw`` is the exact bytes received (forwarded as they are)."""

    raw: bytes
    start_line: str
    headers: list[tuple[str, str]]

    def get(self, name: str) -> str | None:
        name = name.lower()
        for key, value in self.headers:
            if key.lower() == name:
                return value
        return None

    def with_header(self, name: str, value: str | None) -> Head:
        """This head with header ``name`` set to ``value`` in place (appended if absent; removed if ``None``)."""
        lower = name.lower()
        headers = [(k, v) for k, v in self.headers if k.lower() != lower or value is not None]
        if value is not None:
            headers = [(k, value if k.lower() == lower else v) for k, v in headers]
            if self.get(name) is None:
                headers.append((name, value))
        lines = [self.start_line, *(f"{k}: {v}" for k, v in headers)]
        return Head(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1"), self.start_line, headers)

    def has_token(self, name: str, token: str) -> bool:
        value = self.get(name)
        return value is not None and token in (t.strip().lower() for t in value.split(","))


async def read_head(reader: asyncio.StreamReader) -> Head | None:
    """The next message head, or ``None`` on a clean end of stream before any byte."""
    try:
        raw = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError as exc:
        if not exc.partial:
            return None
        raise
    except asyncio.LimitOverrunError as exc:
        raise ValueError(f"message head larger than {MAX_HEAD} bytes") from exc
    lines = raw[:-4].decode("latin-1").split("\r\n")
    headers = []
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if not sep:
            raise ValueError(f"malformed header line {line!r}")
        headers.append((name.strip(), value.strip()))
    return Head(raw, lines[0], headers)


async def relay_body(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter | None,
    head: Head,
    *,
    until_eof: bool,
    count: Callable[[int], None] | None = None,
    pace: Callable[[int], Awaitable[None]] | None = None,
) -> int:
    """Copy one message body (``Content-Length``, chunked, or to EOF) as raw bytes; ``writer=None`` drops it.

    ``count(n)`` is called before each piece is written, so counters never lag what the peer has seen;
    ``pace(n)`` is awaited after each piece (a :class:`~.link.Pacer` holding the body to a bandwidth).
    """

    async def put(data: bytes) -> None:
        if count is not None:
            count(len(data))
        if writer is not None:
            writer.write(data)
            await writer.drain()
        if pace is not None:
            await pace(len(data))

    moved = 0
    if head.has_token("transfer-encoding", "chunked"):
        while True:
            size_line = await reader.readuntil(b"\r\n")
            size = int(size_line.split(b";", 1)[0].strip(), 16)
            await put(size_line)
            moved += len(size_line)
            if size == 0:
                while True:  # trailers, then the empty line
                    line = await reader.readuntil(b"\r\n")
                    await put(line)
                    moved += len(line)
                    if line == b"\r\n":
                        return moved
            left = size + 2  # the chunk and its CRLF
            while left:
                data = await reader.readexactly(min(CHUNK, left))
                await put(data)
                moved += len(data)
                left -= len(data)
    length = head.get("content-length")
    if length is not None:
        left = int(length)
        while left:
            data = await reader.read(min(CHUNK, left))
            if not data:
                raise asyncio.IncompleteReadError(b"", left)
            await put(data)
            moved += len(data)
            left -= len(data)
        return moved
    if until_eof:
        while data := await reader.read(CHUNK):
            await put(data)
            moved += len(data)
    return moved


def reset(writer: asyncio.StreamWriter) -> None:
    """Close with a TCP RST instead of a FIN: ``SO_LINGER`` on with a zero timeout, then close."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


def response_has_body(method: str, status: int) -> bool:
    return method != "HEAD" and not (100 <= status < 200 or status in (204, 304))
