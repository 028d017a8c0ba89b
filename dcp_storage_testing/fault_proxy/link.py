"""A store's network link as the proxy can model it: a bandwidth cap per connection and a first-byte latency.

Why: an emulator on one machine (moto, s3rver) serves a single connection about as fast as many, so a
writer that keeps several requests in flight looks no faster than one that sends them one after another.
A real object store is the other way round: one connection tops out at tens to a hundred-odd MB/s and
each request waits tens of milliseconds for its first byte, while the store as a whole scales with the
requests in flight (S3's guidance is one concurrent request per ~85-90 MB/s wanted). Capping each
connection's body bytes per second and delaying each response reproduces that shape in front of any
emulator, as long as the cap times the connections in flight stays below what the emulator can serve.

:class:`LinkModel` is the configuration; :class:`Pacer` paces one message body. The clock and the sleep
are injectable, so the pacing arithmetic is tested without wall-clock timings.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

__all__ = ["LinkModel", "Pacer"]


@dataclass(frozen=True)
class LinkModel:
    """Per connection: at most ``bytes_per_s`` of body bytes each way, and ``first_byte_s`` before each response.

    ``bytes_per_s=None`` leaves bandwidth uncapped (only the latency applies).
    """

    bytes_per_s: float | None = None
    first_byte_s: float = 0.0
    clock: Callable[[], float] = field(default=time.monotonic, repr=False, compare=False)
    sleep: Callable[[float], Awaitable[None]] = field(default=asyncio.sleep, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.bytes_per_s is not None and not self.bytes_per_s > 0:
            raise ValueError(f"LinkModel bytes_per_s must be > 0 (or None for no cap), got {self.bytes_per_s!r}")
        if not self.first_byte_s >= 0:
            raise ValueError(f"LinkModel first_byte_s must be >= 0, got {self.first_byte_s!r}")

    @classmethod
    def parse(cls, text: str) -> LinkModel:
        """``"MBPS"`` or ``"MBPS,LATENCY_MS"`` (MB = 1e6 bytes; MBPS 0 means uncapped), as a command line gives it."""
        rate, _, latency = text.partition(",")
        try:
            mbps = float(rate)
            ms = float(latency) if latency else 0.0
        except ValueError:
            raise ValueError(f"a link is MBPS or MBPS,LATENCY_MS (for example 25,30), got {text!r}") from None
        return cls(bytes_per_s=mbps * 1e6 if mbps else None, first_byte_s=ms / 1e3)

    def pacer(self) -> Pacer | None:
        """A pacer for one body, or ``None`` when bandwidth is uncapped."""
        return None if self.bytes_per_s is None else Pacer(self.bytes_per_s, self.clock, self.sleep)

    async def first_byte(self) -> None:
        """Wait the first-byte latency (before a response's head goes out)."""
        if self.first_byte_s:
            await self.sleep(self.first_byte_s)

    def describe(self) -> str:
        rate = "uncapped" if self.bytes_per_s is None else f"{self.bytes_per_s / 1e6:g} MB/s per connection"
        return f"{rate}, {self.first_byte_s * 1e3:g} ms to first byte"


class Pacer:
    """Holds one body's bytes to ``bytes_per_s``: after each piece, sleep until the piece is due.

    Due time is measured from the first piece, so a body that the peer delivers slower than the cap is
    never delayed further, and the average over the body never exceeds the cap.
    """

    def __init__(
        self, bytes_per_s: float, clock: Callable[[], float], sleep: Callable[[float], Awaitable[None]]
    ) -> None:
        self._rate = bytes_per_s
        self._clock = clock
        self._sleep = sleep
        self._start: float | None = None
        self._moved = 0

    async def __call__(self, n: int) -> None:
        now = self._clock()
        if self._start is None:
            self._start = now
        self._moved += n
        due = self._start + self._moved / self._rate
        if due > now:
            await self._sleep(due - now)
