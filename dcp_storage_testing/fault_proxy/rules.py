"""Which requests the :class:`~dcp_storage_testing.fault_proxy.FaultProxy` faults, how, and what it counted."""

from __future__ import annotations

import re
import threading
import urllib.parse
from dataclasses import dataclass, field
from typing import Literal

__all__ = [
    "ALL_FAULT_MODES",
    "FAULT_MODES",
    "PERMANENT_MODES",
    "BODY_FAULT_MODES",
    "CONDITION_FAULT_MODES",
    "CONDITION_HEADERS",
    "CORRUPT_BODY_MODES",
    "RANGE_FAULT_MODES",
    "STALL_MODES",
    "ByteRange",
    "FaultCounters",
    "FaultMode",
    "FaultRule",
    "RuleBook",
    "faulted_range",
    "parse_range",
]

FaultMode = Literal[
    "slowdown_503",
    "error_500",
    "reset",
    "truncate",
    "slow",
    "ignore_range",
    "shift_range",
    "short_range",
    "forbidden_403",
    "stall_body",
    "trickle_body",
    "encoded_range",
    "long_range",
    "ignore_conditions",
    "flip_body",
]
# Faults of the transport: every request can meet them, and a retry of the same request may succeed.
FAULT_MODES: tuple[FaultMode, ...] = ("slowdown_503", "error_500", "reset", "truncate", "slow")
# Well-formed answers with other bytes than a ranged GET asked for; only requests with a range meet them.
RANGE_FAULT_MODES: tuple[FaultMode, ...] = ("ignore_range", "shift_range", "short_range")
# Answers to ranged GETs whose headers name the range asked for while the body is not those bytes as stored
# (the body is rewritten, the request forwarded unchanged); only requests with a range meet them.
BODY_FAULT_MODES: tuple[FaultMode, ...] = ("encoded_range", "long_range")
# The worst of them: a 206 whose headers are all right (status, Content-Range, Content-Length) and whose body
# has one bit flipped. No transport check can see it; only a checksum of the bytes can.
CORRUPT_BODY_MODES: tuple[FaultMode, ...] = ("flip_body",)
# Refusals no retry can get past (a 403 for credentials without the permission); every request can meet them.
PERMANENT_MODES: tuple[FaultMode, ...] = ("forbidden_403",)
# A server that sends its headers and part of a body, then nothing more on a connection it keeps open, or
# the rest one byte every ``delay`` seconds (``trickle_body``): no socket timeout ever fires, and only a
# deadline on the request ends it.
STALL_MODES: tuple[FaultMode, ...] = ("stall_body", "trickle_body")
# A server that ignores conditional-write headers (If-None-Match, If-Match): the proxy drops them, so a
# create-if-absent PUT over an existing object succeeds, as on S3-compatible stores without the feature.
CONDITION_FAULT_MODES: tuple[FaultMode, ...] = ("ignore_conditions",)
CONDITION_HEADERS = ("If-None-Match", "If-Match")
ALL_FAULT_MODES: tuple[FaultMode, ...] = (
    FAULT_MODES
    + RANGE_FAULT_MODES
    + PERMANENT_MODES
    + STALL_MODES
    + BODY_FAULT_MODES
    + CONDITION_FAULT_MODES
    + CORRUPT_BODY_MODES
)

# A request's ``Range: bytes=FIRST-LAST`` (LAST inclusive; ``None`` for ``bytes=FIRST-``).
ByteRange = tuple[int, int | None]
_RANGE = re.compile(r"\s*bytes\s*=\s*(\d+)\s*-\s*(\d*)\s*")


def parse_range(value: str | None) -> ByteRange | None:
    """``(first, last)`` of a single-range ``Range`` or ``x-ms-range`` value; ``None`` for none, suffix, multiple."""
    match = _RANGE.fullmatch(value) if value is not None else None
    if match is None:
        return None
    return int(match.group(1)), int(match.group(2)) if match.group(2) else None


def faulted_range(mode: FaultMode, first: int, last: int | None) -> str | None:
    """The range header the proxy sends upstream instead (``None``: none at all) in a range mode.

    ``ignore_range`` drops it, so the store answers ``200`` with the whole object. ``shift_range`` asks for
    as many bytes one byte further down (up, for a range starting at 0): the store's ``206`` names the other
    range honestly. ``short_range`` asks for the first half: a complete, well-formed ``206`` that is short.
    """
    if mode == "ignore_range":
        return None
    if mode == "shift_range":
        step = -1 if first > 0 else 1
        return f"bytes={first + step}-{'' if last is None else last + step}"
    if last is None:
        return f"bytes={first}-{first}"
    return f"bytes={first}-{first + (last - first + 1) // 2 - 1}"


def _range_eligible(mode: FaultMode, byte_range: ByteRange | None) -> bool:
    """Whether a request with ``byte_range`` can be faulted in ``mode`` (other modes: any request)."""
    if mode not in RANGE_FAULT_MODES and mode not in BODY_FAULT_MODES + CORRUPT_BODY_MODES:
        return True
    if byte_range is None:
        return False
    first, last = byte_range
    return mode != "short_range" or last is None or last > first  # a 1-byte range has no shorter half


@dataclass(frozen=True)
class FaultRule:
    """Which requests to fault and how.

    A request *matches* when every given filter matches: ``method`` (case-insensitive, exact),
    ``path`` and ``query`` (regular expressions searched in the URL-decoded path and in the raw query
    string). Every ``every``-th matching request (the ``every``-th, ``2*every``-th, ...) is faulted in
    ``mode``; ``every=1`` faults all of them. ``limit`` stops the rule after that many faults.
    ``delay`` is the hold-back of ``slow`` and the silence of ``stall_body``. A rule in one of the :data:`RANGE_FAULT_MODES`
    or :data:`BODY_FAULT_MODES` matches only requests with a single-range ``Range`` or ``x-ms-range`` header (and, for ``short_range``, a range of 2
    bytes or more).
    """

    mode: FaultMode
    every: int = 1
    method: str | None = None
    path: str | None = None
    query: str | None = None
    delay: float = 1.0
    limit: int | None = None

    def __post_init__(self) -> None:
        if self.mode not in ALL_FAULT_MODES:
            raise ValueError(f"FaultRule.mode must be one of {ALL_FAULT_MODES}, got {self.mode!r}")
        if self.every < 1:
            raise ValueError(f"FaultRule.every must be >= 1, got {self.every}")
        if self.delay < 0:
            raise ValueError(f"FaultRule.delay must be >= 0, got {self.delay}")
        if self.limit is not None and self.limit < 0:
            raise ValueError(f"FaultRule.limit must be >= 0 or None, got {self.limit}")
        for name in ("path", "query"):
            pattern = getattr(self, name)
            if pattern is not None:
                re.compile(pattern)  # fail here, not inside the proxy thread

    def matches(self, method: str, path: str, query: str, byte_range: ByteRange | None = None) -> bool:
        if not _range_eligible(self.mode, byte_range):
            return False
        if self.method is not None and method.upper() != self.method.upper():
            return False
        if self.path is not None and re.search(self.path, path) is None:
            return False
        return self.query is None or re.search(self.query, query) is not None


@dataclass(frozen=True)
class FaultCounters:
    """A snapshot of what the proxy has done since it started (or since :meth:`FaultProxy.reset_counters`).

    ``faults`` has every mode as a key. ``faulted`` lists ``(method, path, mode)`` of each fault, oldest
    first (the last 10,000). ``bytes_to_upstream`` / ``bytes_to_client`` count forwarded bytes (heads
    and bodies). ``by_path`` maps ``(method, URL-decoded path)`` to ``[requests, body bytes to the client]``:
    what the server was asked for, object by object (how many times a metadata file was fetched, how many
    bytes of a data file were served), whatever the client's own counters say. ``log`` lists
    ``(method, path, first byte of the range or None)`` of every request, oldest first (the last 100,000).
    """

    requests: int = 0
    faults: dict[str, int] = field(default_factory=lambda: dict.fromkeys(ALL_FAULT_MODES, 0))
    faulted: tuple[tuple[str, str, str], ...] = ()
    bytes_to_upstream: int = 0
    bytes_to_client: int = 0
    by_path: dict[tuple[str, str], list[int]] = field(default_factory=dict)
    log: tuple[tuple[str, str, int | None], ...] = ()

    @property
    def total_faults(self) -> int:
        return sum(self.faults.values())

    def requests_to(self, path_suffix: str, method: str = "GET") -> int:
        """Requests of ``method`` for objects whose path ends with ``path_suffix``."""
        return sum(n for (m, p), (n, _b) in self.by_path.items() if m == method and p.endswith(path_suffix))

    def body_bytes(self, method: str = "GET") -> int:
        """Body bytes the server sent back for requests of ``method``, every object together."""
        return sum(b for (m, _p), (_n, b) in self.by_path.items() if m == method)


class RuleBook:
    """Rules and counters, shared between the proxy thread and callers; every access holds the lock."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.rules: list[FaultRule] = []
        self.seen: list[int] = []
        self.fired: list[int] = []
        self.reset_counters()

    def reset_counters(self) -> None:
        self.requests = 0
        self.faults = dict.fromkeys(ALL_FAULT_MODES, 0)
        self.faulted: list[tuple[str, str, str]] = []
        self.up = 0
        self.down = 0
        self.by_path: dict[tuple[str, str], list[int]] = {}
        self.log: list[tuple[str, str, int | None]] = []

    def count_body(self, key: tuple[str, str], nbytes: int) -> None:
        """Body bytes sent to the client for a request of ``key`` (method, path); the caller holds no lock."""
        with self.lock:
            self.by_path.setdefault(key, [0, 0])[1] += nbytes

    @staticmethod
    def key_of(method: str, target: str) -> tuple[str, str]:
        return method, urllib.parse.unquote(urllib.parse.urlsplit(target).path)

    def decide(self, method: str, target: str, byte_range: ByteRange | None = None) -> FaultRule | None:
        split = urllib.parse.urlsplit(target)
        path = urllib.parse.unquote(split.path)
        with self.lock:
            self.requests += 1
            self.by_path.setdefault((method, path), [0, 0])[0] += 1
            self.log.append((method, path, None if byte_range is None else byte_range[0]))
            if len(self.log) > 120_000:
                del self.log[:-100_000]
            for i, rule in enumerate(self.rules):
                if not rule.matches(method, path, split.query, byte_range):
                    continue
                self.seen[i] += 1
                if self.seen[i] % rule.every or (rule.limit is not None and self.fired[i] >= rule.limit):
                    continue
                self.fired[i] += 1
                self.faults[rule.mode] += 1
                self.faulted.append((method, path, rule.mode))
                del self.faulted[:-10_000]
                return rule
            return None
