"""Who holds a save's lock, and whether that holder is provably gone.

A lock (:mod:`.claim`) is a small JSON object naming its holder. Besides the fields shown in messages
(``save_id``, ``writer``, ``host``, ``pid``, ``since``) it records what a later save needs to judge it:

* ``claim``: a random id, unique to this claim (a renewal rewrites the bytes, the id stays);
* ``boot``, ``pidns``, ``started``: the host's boot id, the holder's PID namespace and the process start
  time (``/proc/<pid>/stat`` field 22, clock ticks since boot), so that on the same host a pid that is gone
  or was reused by another process is told from a live holder;
* ``lease_s`` and ``renewed``: the holder promises to rewrite the lock at least every ``lease_s / 3``
  seconds while its save runs (:mod:`.lease`); a lock not renewed for ``lease_s`` seconds is stale, wherever
  its holder runs. This compares the holder's clock with the reader's: hosts must agree on the time to well
  within the lease (NTP does).

:func:`stale_reason` says why a lock is stale, or ``None``: a lock whose fields are missing, malformed or
from an older version is never judged stale (only ``overwrite=True`` replaces it).
"""

from __future__ import annotations

import json
import math
import os
import socket
import time
from collections.abc import Callable
from typing import Any

from dcp_storage.formats.limits import count_setting

__all__ = ["DEFAULT_LEASE_S", "LEASE_ENV", "claim_id_of", "holder_fields", "lease_seconds", "parse", "stale_reason"]

LEASE_ENV = "DCP_STORAGE_LOCK_LEASE_S"
DEFAULT_LEASE_S = 90
_MAX_LEASE_S = 7 * 86400  # a holder claiming more is not believed (its lock is never judged by its lease)


def lease_seconds() -> int:
    """The lease a new lock promises: ``DCP_STORAGE_LOCK_LEASE_S`` (whole seconds, at least 1), default 90."""
    lease = count_setting(LEASE_ENV, DEFAULT_LEASE_S, "seconds")
    if not 1 <= lease <= _MAX_LEASE_S:
        raise ValueError(f"{LEASE_ENV}={lease} must be between 1 and {_MAX_LEASE_S} seconds")
    return lease


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            return f.read(4096)
    except OSError:
        return None


def _boot_id() -> str | None:
    raw = _read("/proc/sys/kernel/random/boot_id")
    return raw.strip() or None if raw else None


def _pid_namespace() -> str | None:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def _process_start(pid: int) -> tuple[int, str] | None:
    """``(start time in clock ticks since boot, state letter)`` of ``pid`` from ``/proc``; ``None`` if absent.

    The command name (field 2) may hold spaces and parentheses: fields are counted after its last ``)``.
    """
    raw = _read(f"/proc/{pid}/stat")
    if not raw or ")" not in raw:
        return None
    rest = raw.rsplit(")", 1)[1].split()
    try:
        return int(rest[19]), rest[0]  # field 22 (starttime) and field 3 (state)
    except (IndexError, ValueError):
        return None


_SELF: dict[int, dict[str, Any]] = {}  # by pid: a forked child computes its own


def _this_process() -> dict[str, Any]:
    pid = os.getpid()
    found = _SELF.get(pid)
    if found is None:
        start = _process_start(pid)
        found = {
            "host": socket.gethostname(),
            "boot": _boot_id(),
            "pidns": _pid_namespace(),
            "pid": pid,
            "started": start[0] if start else None,
        }
        _SELF[pid] = found
    return found


def holder_fields(save_id: str, claim_id: str, writer: str, since: str, lease_s: int) -> dict[str, Any]:
    """The fields of a new lock held by this process (module docstring)."""
    return {
        "save_id": save_id,
        "claim": claim_id,
        "writer": writer,
        "since": since,
        **_this_process(),
        "lease_s": lease_s,
        "renewed": round(time.time(), 3),
    }


def parse(raw: bytes | None) -> dict[str, Any] | None:
    """A lock's fields, or ``None`` for anything that is not a JSON object."""
    if not raw:
        return None
    try:
        fields = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    return fields if isinstance(fields, dict) else None


def claim_id_of(raw: bytes | None) -> str | None:
    fields = parse(raw)
    claim = fields.get("claim") if fields else None
    return claim if isinstance(claim, str) and claim else None


def _whole(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def _same_host(fields: dict[str, Any], me: dict[str, Any]) -> bool | None:
    """Whether the holder ran on this host in this PID namespace since its last boot: ``True``; on this host
    before a reboot: ``False`` with a reason given by the caller; ``None``: another host, or unknown."""
    if fields.get("host") != me["host"] or me["boot"] is None or fields.get("boot") is None:
        return None
    if fields.get("boot") != me["boot"]:
        return False
    return fields.get("pidns") == me["pidns"] if me["pidns"] is not None else None


def _dead_on_this_host(fields: dict[str, Any], me: dict[str, Any], is_active: Callable[[str], bool]) -> str | None:
    pid, started = _whole(fields.get("pid")), _whole(fields.get("started"))
    if pid is None or pid <= 0 or started is None:
        return None
    if pid == me["pid"] and started == me["started"]:
        claim = fields.get("claim")
        if isinstance(claim, str) and not is_active(claim):
            return f"its save in this process (pid {pid}) has ended"
        return None
    found = _process_start(pid)
    if found is None:
        return f"its process (pid {pid}) is gone"
    if found[1] in ("Z", "X"):
        return f"its process (pid {pid}) has exited"
    if found[0] != started:
        return f"its process (pid {pid}) is gone; the pid now belongs to another process"
    return None


def stale_reason(
    fields: dict[str, Any] | None, is_active: Callable[[str], bool], now: float | None = None
) -> str | None:
    """Why the lock with ``fields`` no longer protects a running save, or ``None`` (live, or unknown).

    ``is_active(claim_id)``: whether a claim of this process is still held by a running save.
    """
    if fields is None:
        return None
    me = _this_process()
    same = _same_host(fields, me)
    if same is False:
        return f"its host {me['host']} has restarted since"
    if same:
        dead = _dead_on_this_host(fields, me, is_active)
        if dead is not None:
            return dead
    lease, renewed = _number(fields.get("lease_s")), _number(fields.get("renewed"))
    if lease is None or renewed is None or not 0 < lease <= _MAX_LEASE_S:
        return None
    age = (time.time() if now is None else now) - renewed
    if age > lease:
        return f"it was last renewed {age:.0f} s ago, past its {lease:g} s lease"
    return None
