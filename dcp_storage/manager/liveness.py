"""Whether a live save holds a step folder, so that cleanup never deletes under a running save.

A save holds its folder through the lock of :mod:`dcp_storage.storage.claim` (``.dcp_storage.lock``,
from before its first byte until its commit). The lock names its holder (host, pid, start time). Here:

* no lock: nothing holds the folder;
* a lock the claim protocol wrote (it carries a lease): the protocol's own judgement
  (:func:`dcp_storage.storage.lock_holder.stale_reason`): stale when its process on this host is gone or
  was reused, when its save in this process has ended, or when it was not renewed within its lease;
* an older lock without a lease, of this host: held while its process lives (``os.kill(pid, 0)``), except
  by the processes the caller names as its own finished saves (a save of this process that failed keeps
  its lock);
* such a lock of another host, or one whose holder cannot be read: held (it cannot be told from a running
  save), unless older than ``stale_after`` seconds.

This is the one function the manager and ``dcp-storage gc`` ask.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
from collections.abc import Iterable
from typing import Any

from dcp_storage.formats.paths import LOCK_RE
from dcp_storage.storage.lease import is_active
from dcp_storage.storage.lock_holder import stale_reason

__all__ = ["DEFAULT_STALE_AFTER", "held_by_live_save"]

DEFAULT_STALE_AFTER = 24 * 3600.0
_LOCK_LIMIT = 4096


def held_by_live_save(
    transport: Any,
    folder: str,
    names: Iterable[str],
    *,
    finished_pids: Iterable[int] = (),
    stale_after: float = DEFAULT_STALE_AFTER,
) -> bool:
    """Whether any lock among ``names`` (the listing of ``folder``) belongs to a save that may be running."""
    return any(
        _live(transport, transport.join(folder, n), set(finished_pids), stale_after) for n in names if LOCK_RE.match(n)
    )


def _live(transport: Any, path: str, finished: set[int], stale_after: float) -> bool:
    try:
        holder = json.loads(bytes(transport.read_file(path, max_bytes=_LOCK_LIMIT)))
    except Exception:  # noqa: BLE001 - gone meanwhile (the save committed), or unreadable
        return transport.exists(path) and not _older(None, stale_after)
    if not isinstance(holder, dict):
        return True
    if "lease_s" in holder and "renewed" in holder:  # the claim protocol's lock: its own rules decide
        return stale_reason(holder, is_active) is None
    since = holder.get("since")
    if holder.get("host") == socket.gethostname() and isinstance(holder.get("pid"), int):
        pid = holder["pid"]
        if pid in finished:
            return False
        return _alive(pid)
    return not _older(since, stale_after)


def _alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    try:  # a zombie (ended, not reaped by its parent) holds nothing
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def _older(since: Any, stale_after: float) -> bool:
    if not isinstance(since, str):
        return False
    try:
        start = datetime.datetime.strptime(since, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=datetime.timezone.utc)
    except ValueError:
        return False
    age = (datetime.datetime.now(datetime.timezone.utc) - start).total_seconds()
    return age > stale_after
