"""Which requests the :class:`~dcp_storage.testing.fault_proxy.FaultProxy` faults, how, and what it counted."""

from __future__ import annotations

import re
import threading
import urllib.parse
from dataclasses import dataclass, field
from typing import Literal

__all__ = ["FAULT_MODES", "FaultCounters", "FaultMode", "FaultRule", "RuleBook"]

FaultMode = Literal["slowdown_503", "error_500", "reset", "truncate", "slow"]
FAULT_MODES: tuple[FaultMode, ...] = ("slowdown_503", "error_500", "reset", "truncate", "slow")


@dataclass(frozen=True)
class FaultRule:
    """Which requests to fault and how.

    A request *matches* when every given filter matches: ``method`` (case-insensitive, exact),
    ``path`` and ``query`` (regular expressions searched in the URL-decoded path and in the raw query
    string). Every ``every``-th matching request (the ``every``-th, ``2*every``-th, ...) is faulted in
    ``mode``; ``every=1`` faults all of them. ``limit`` stops the rule after that many faults.
    ``delay`` is the hold-back of ``slow``.
    """

    mode: FaultMode
    every: int = 1
    method: str | None = None
    path: str | None = None
    query: str | None = None
    delay: float = 1.0
    limit: int | None = None

    def __post_init__(self) -> None:
        if self.mode not in FAULT_MODES:
            raise ValueError(f"FaultRule.mode must be one of {FAULT_MODES}, got {self.mode!r}")
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

    def matches(self, method: str, path: str, query: str) -> bool:
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
    and bodies).
    """

    requests: int = 0
    faults: dict[str, int] = field(default_factory=lambda: dict.fromkeys(FAULT_MODES, 0))
    faulted: tuple[tuple[str, str, str], ...] = ()
    bytes_to_upstream: int = 0
    bytes_to_client: int = 0

    @property
    def total_faults(self) -> int:
        return sum(self.faults.values())


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
        self.faults = dict.fromkeys(FAULT_MODES, 0)
        self.faulted: list[tuple[str, str, str]] = []
        self.up = 0
        self.down = 0

    def decide(self, method: str, target: str) -> FaultRule | None:
        split = urllib.parse.urlsplit(target)
        path = urllib.parse.unquote(split.path)
        with self.lock:
            self.requests += 1
            for i, rule in enumerate(self.rules):
                if not rule.matches(method, path, split.query):
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
